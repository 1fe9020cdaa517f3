"""``algorithm.placebo``: the control run's advantages are the batch's own, shuffled across its
episodes; and the GRPO defaults that keep a small model's groups informative."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from trainer.config import AlgorithmConfig, SamplerConfig, load_recipe
from trainer.objective import placebo_advantages
from trainer.runtime import learn_from_groups, make_batch
from twin.trajectory import Group, TokenTurn, Trajectory


def _groups(n: int, g: int, seed: int = 0) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        trajs = []
        for k in range(g):
            r = rng.choice([-1.0, 0.0, 0.5, 1.0])
            t = Trajectory(twin="Toy", case_id=f"toy/train/{i}", reward=r)
            t.token_turns = [
                TokenTurn(prompt_ids=[1, 2 + i], completion_ids=[7, 8 + k], logprobs=[-1.0, -2.0])
            ]
            t.info["shaped_reward"] = r
            trajs.append(t)
        out.append(Group(case_id=f"toy/train/{i}", trajectories=trajs))
    return out


def _corr(a: list[float], b: list[float]) -> float:
    return float(torch.corrcoef(torch.tensor([a, b]))[0, 1])


def test_placebo_shuffles_the_same_advantages_across_the_batch() -> None:
    groups = _groups(16, 8)
    rewards = [t.reward for g in groups for t in g.trajectories]
    real = make_batch(groups, "rloo")
    placebo = make_batch(groups, "rloo", placebo_seed=7)
    assert placebo.input_ids == real.input_ids and placebo.loss_mask == real.loss_mask
    assert sorted(placebo.advantages) == pytest.approx(sorted(real.advantages))
    assert placebo.advantages != real.advantages
    assert _corr(real.advantages, rewards) > 0.8  # the signal ...
    assert abs(_corr(placebo.advantages, rewards)) < 0.25  # ... is gone in the control
    assert make_batch(groups, "rloo", placebo_seed=7).advantages == placebo.advantages  # seeded
    assert make_batch(groups, "rloo", placebo_seed=8).advantages != placebo.advantages


def test_placebo_advantages_is_a_permutation_of_its_input() -> None:
    adv = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    out = placebo_advantages(adv, 3)
    assert out.shape == adv.shape
    assert sorted(out.flatten().tolist()) == adv.flatten().tolist()
    assert not torch.equal(out, adv)


class _Learner:
    def __init__(self) -> None:
        self.batches: list[Any] = []

    def step(self, batch: Any) -> dict[str, float]:
        self.batches.append(batch)
        return {"losses/loss": 0.0}


def test_the_step_body_trains_on_the_shuffled_advantages() -> None:
    groups = _groups(4, 8)
    learner = _Learner()
    learn_from_groups(learner, groups, groups, advantage="grpo", step=0, placebo_seed=11)
    assert learner.batches[0].advantages == make_batch(groups, "grpo", placebo_seed=11).advantages
    assert learner.batches[0].advantages != make_batch(groups, "grpo").advantages


def test_grpo_defaults_keep_small_model_groups_informative() -> None:
    """Groups of 4 at T=0.7 with dynamic sampling off mostly carried zero advantage on SmolLM2."""
    algo, sampler = AlgorithmConfig(), SamplerConfig()
    assert algo.group_size >= 8 and algo.dynamic_sampling and algo.max_refill_rounds >= 1
    assert algo.advantage in ("grpo", "rloo") and sampler.temperature == 1.0
    assert algo.placebo is False
    recipe = load_recipe("catalog-smollm2-expert-grpo-cpu")
    assert recipe.algorithm.group_size >= 8 and recipe.algorithm.dynamic_sampling
    assert recipe.sampler.temperature == 1.0 and recipe.algorithm.advantage in ("grpo", "rloo")
    control = load_recipe("catalog-smollm2-expert-grpo-cpu", ["algorithm.placebo=true"])
    assert control.algorithm.placebo

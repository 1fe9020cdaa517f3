"""The per-step learning body shared by the synchronous recipe and the async learner."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import pytest

from trainer import orchestrator, recipe
from trainer.recipe import learn_from_groups, make_batch
from twin.trajectory import Group, TokenTurn, Trajectory


def _group(rewards: list[float], prompt: list[int]) -> Group:
    trajs = []
    for k, r in enumerate(rewards):
        t = Trajectory(twin="Toy", case_id="toy/train/0", reward=r)
        t.token_turns = [TokenTurn(prompt_ids=prompt, completion_ids=[7, 8 + k], logprobs=[-1.0, -2.0])]
        t.info["shaped_reward"] = r
        trajs.append(t)
    return Group(case_id="toy/train/0", trajectories=trajs)


class _Learner:
    def __init__(self) -> None:
        self.batches: list[Any] = []

    def step(self, batch: Any) -> dict[str, float]:
        self.batches.append(batch)
        return {"losses/loss": float(len(self.batches))}


def test_make_batch_is_group_z_scored_rows() -> None:
    batch = make_batch([_group([0.0, 1.0, 1.0], [1, 2, 3]), _group([1.0, 1.0, 0.0], [4, 5])], "grpo")
    assert len(batch) == 6
    assert batch.input_ids[0] == [1, 2, 3, 7, 8] and batch.loss_mask[0] == [0, 0, 0, 1, 1]
    assert batch.sampler_logprobs[1] == [0.0, 0.0, 0.0, -1.0, -2.0]
    assert batch.advantages[0] < 0 < batch.advantages[1] == batch.advantages[2]
    assert batch.advantages[3:] == pytest.approx(batch.advantages[2::-1], abs=1e-6)  # the mirrored group
    assert sum(batch.advantages[3:]) == pytest.approx(0.0, abs=1e-6)


def test_learn_from_groups_updates_epochs_times_and_reports_every_group() -> None:
    kept = [_group([0.0, 1.0], [1, 2, 3])]
    every = kept + [_group([1.0, 1.0], [4, 5])]
    learner = _Learner()
    update = learn_from_groups(learner, kept, every, advantage="rloo", step=3, epochs=2)  # type: ignore[arg-type]
    assert len(learner.batches) == 2 and learner.batches[0] is learner.batches[1]
    assert update.learn == {"losses/loss": 2.0}  # the last update's metrics
    assert update.episodes["episodes/count"] == 4.0
    assert update.episodes["rewards/total"] == pytest.approx(0.75)
    assert update.learn_s >= 0.0


def test_nothing_kept_means_no_update_and_a_warning(caplog) -> None:
    learner = _Learner()
    with caplog.at_level(logging.WARNING, logger="twinrl.trainer"):
        update = learn_from_groups(learner, [], [_group([1.0, 1.0], [1, 2])], advantage="grpo", step=5)  # type: ignore[arg-type]
    assert learner.batches == [] and update.learn == {}
    assert "step 5: every group had equal rewards" in caplog.text


def test_both_loops_call_the_one_step_body() -> None:
    assert "learn_from_groups(" in inspect.getsource(recipe.GRPORecipe.train)
    assert "learn_from_groups(" in inspect.getsource(orchestrator.AsyncTrainer.train)
    for loop in (recipe.GRPORecipe.train, orchestrator.AsyncTrainer.train):
        assert "learner.step(" not in inspect.getsource(loop)

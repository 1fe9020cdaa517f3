"""The one-screen objective (trainer/objective.py) and the learner's scored micro-batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trainer.config import AlgorithmConfig, OptimConfig
from trainer.learner import Learner, TrainBatch
from trainer.models import load_model
from trainer.objective import (
    LossSettings,
    ScoredBatch,
    advantages,
    informative,
    objective,
    shaped_rewards,
)
from trainer.runtime import make_batch
from twin.errors import ConfigError


def _scored(entropy: torch.Tensor | None = None) -> ScoredBatch:
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.5, -4.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return ScoredBatch(
        lp, mask, torch.tensor([1.0, -0.5]), sampler_logprobs=lp.detach() - 0.1, entropy=entropy
    )


def test_the_entropy_bonus_is_part_of_the_objective() -> None:
    h = torch.tensor(
        [[9.0, 2.0, 1.0], [3.0, 5.0, 9.0]], requires_grad=True
    )  # the 9.0s are masked out
    base, _ = objective(_scored(), LossSettings())
    loss, stats = objective(_scored(h), LossSettings(entropy_coef=0.1), num_tokens=8)
    # loss - c_H * sum_t m_t H_t / n_tokens over the whole mini-batch's 8 tokens; the policy part
    # of base is a token mean over this micro-batch's 4, rescaled to 8
    assert float(loss.detach()) == pytest.approx(float(base) * 4 / 8 - 0.1 * (2 + 1 + 3 + 5) / 8)
    loss.backward()
    assert torch.allclose(h.grad, -0.1 / 8 * torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    assert float(stats.entropy) == pytest.approx(
        (2 + 1 + 3 + 5) / 4
    )  # logged over this call's mask
    assert float(stats.logprob_mismatch) == pytest.approx(0.1)


def test_the_objective_refuses_missing_inputs_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"entropy_coef > 0 needs the per-token entropy"):
        objective(_scored(), LossSettings(entropy_coef=0.1))
    with pytest.raises(ConfigError, match=r"kl_coef > 0 needs ref_logprobs"):
        objective(_scored(), LossSettings(kl_coef=0.1))


def test_loss_settings_of_a_recipe_carry_its_algorithm_section() -> None:
    b = _scored(torch.ones(2, 3))
    cfg = AlgorithmConfig(entropy_coef=0.05, is_correction="token_mask", tis_cap=1.05, eps_high=0.3)
    loss, stats = objective(b, LossSettings.of(cfg))  # how a run builds them (the learner)
    written = LossSettings(
        entropy_coef=0.05, is_correction="token_mask", tis_cap=1.05, eps_high=0.3
    )
    same, same_stats = objective(b, written)
    assert LossSettings.of(cfg) == written
    assert LossSettings.of(AlgorithmConfig()) == LossSettings()  # the same defaults (DAPO's)
    assert float(loss) == float(same) and same_stats.metrics() == stats.metrics()


def test_per_group_steps_name_their_setting_when_wrong() -> None:
    shaped = shaped_rewards(
        torch.tensor([[1.0, 1.0]]), torch.tensor([[3, 9]]), max_len=10, buffer=4, factor=1.0
    )
    assert shaped.tolist() == [[1.0, pytest.approx(0.25)]]
    assert informative(shaped).tolist() == [True]
    assert advantages(shaped, "rloo").tolist() == [[pytest.approx(0.75), pytest.approx(-0.75)]]
    traj = SimpleNamespace(token_turns=[], info={"shaped_reward": 1.0})
    with pytest.raises(
        ConfigError, match=r"algorithm.advantage: unknown 'ppo'; expected one of \['dr_grpo'"
    ):
        make_batch([SimpleNamespace(trajectories=[traj, traj])], "ppo")  # type: ignore[list-item]


def test_score_yields_the_learners_logprobs_in_budgeted_micro_batches() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, _ = load_model("tiny")
    for p in model.parameters():
        p.requires_grad_(True)
    prompt = list(range(5, 15))
    ids = [
        prompt + list(range(30 + k, 33 + k + k % 3)) for k in range(6)
    ]  # one group: a shared prompt
    masks = [[0] * len(prompt) + [1] * (len(row) - len(prompt)) for row in ids]
    batch = TrainBatch(
        ids, masks, [[0.0] * len(row) for row in ids], [1.0, -1.0, 0.5, -0.5, 0.0, 0.0]
    )
    learner = Learner(model, algorithm=AlgorithmConfig(), optim=OptimConfig(micro_batch_tokens=40))
    expected = learner.logprobs(batch)
    seen: list[float] = []
    parts = list(learner.score(batch, range(len(batch))))
    assert len(parts) > 1, "40 tokens hold fewer than 6 rows of 13-15"
    for part in parts:
        assert (
            part.logprobs.requires_grad
            and part.entropy is not None
            and not part.entropy.requires_grad
        )
        seen += part.logprobs[part.mask > 0].tolist()
    want = [lp for row, m in zip(expected, masks) for lp, on in zip(row, m) if on]
    assert sorted(seen) == pytest.approx(sorted(want), abs=1e-5)

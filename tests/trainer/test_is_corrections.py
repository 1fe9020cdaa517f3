"""Importance-sampling corrections (truncate / token mask / sequence mask), the learner-vs-sampler
KL metric, the overlong penalty on policy-written tokens, and top_p refused for training."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from trainer import algorithms as algo
from trainer import objective
from trainer.config import AlgorithmConfig, OptimConfig, load_recipe
from trainer.learner import Learner, TrainBatch, build_lora_model
from trainer.models import load_model
from twin.errors import ConfigError


def _lp(rhos: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.log(torch.tensor(rhos))
    return old, torch.zeros_like(old)


def test_token_mask_drops_tokens_outside_the_bounds_and_keeps_the_others_ratio() -> None:
    old, samp = _lp([[0.3, 1.0, 1.5, 2.5]])
    w = algo.token_mask_weights(old, samp, high=2.0, low=0.5)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 1.5, 0.0]]))
    w = algo.is_weights("truncate", old, samp, torch.ones_like(old), high=2.0)
    assert torch.allclose(w, torch.tensor([[0.3, 1.0, 1.5, 2.0]]))


def test_sequence_mask_drops_whole_sequences_by_geometric_mean_over_sampled_tokens() -> None:
    old, samp = _lp([[4.0, 1.0, 9.0], [1.2, 0.9, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the 9.0s are not sampled tokens
    w = algo.sequence_mask_weights(old, samp, mask, high=1.5)
    assert torch.all(w[0] == 0)  # geometric mean 2.0 > 1.5: the whole row goes
    assert torch.allclose(w[1, :2], torch.tensor([1.2, 0.9]))  # sqrt(1.08) ~ 1.04 kept
    with pytest.raises(ConfigError, match="is_correction"):
        algo.is_weights("clip", old, samp, mask, high=2.0)


def test_the_objective_uses_the_named_correction_and_reports_the_sampler_kl() -> None:
    lp = torch.zeros(1, 3, requires_grad=True)
    samp = torch.log(torch.tensor([[1 / 3.0, 1.0, 1.0]]))  # rho = 3 on the first token
    mask = torch.ones(1, 3)
    adv = torch.tensor([1.0])
    scored = objective.ScoredBatch(lp, mask, adv, sampler_logprobs=samp)
    loss_t, st_t = objective.objective(scored, objective.LossSettings(tis_cap=2.0))
    loss_m, st_m = objective.objective(
        scored, objective.LossSettings(tis_cap=2.0, is_correction="token_mask")
    )
    assert float(loss_t) == pytest.approx(-(2.0 + 1 + 1) / 3)
    assert float(loss_m) == pytest.approx(-(0.0 + 1 + 1) / 3)
    assert float(st_m.tis_capped_frac) == pytest.approx(1 / 3)
    assert float(st_t.sampler_kl) == pytest.approx((3 - 1 - math.log(3)) / 3)


def test_learner_logs_sampler_kl_and_masks_by_config() -> None:
    torch.set_num_threads(1)
    model, _ = load_model("tiny")
    model = build_lora_model(model, lora_rank=2, lora_alpha=4, target_modules=["q_proj"])
    ids = [list(range(5, 17)), list(range(20, 32))]
    mask = [[0] * 6 + [1] * 6 for _ in ids]
    lps = [[-3.0 if m else 0.0 for m in row] for row in mask]
    batch = TrainBatch(ids, mask, lps, [1.0, -1.0])
    metrics = Learner(model, algorithm=AlgorithmConfig(is_correction="sequence_mask", tis_cap=1.5),
                      optim=OptimConfig()).step(batch)  # fmt: skip
    assert metrics["policy/sampler_kl"] > 0
    # the tiny random model puts ~1/1024 on each token (logprob ~ -6.9), the sampler said -3:
    # rho ~ 0.02 in every row, inside [0, 1.5]; with a lower bound of 0.5 every row is dropped
    dropped = Learner(
        model,
        algorithm=AlgorithmConfig(is_correction="sequence_mask", is_mask_low=0.5),
        optim=OptimConfig(),
    ).step(batch)
    assert dropped["policy/tis_capped_frac"] == 1.0 and dropped["policy/tis_weight"] == 0.0


def test_overlong_penalty_counts_only_the_tokens_the_policy_wrote() -> None:
    cfg = load_recipe({"twin": {"name": "Toy"}, "sampler": {"max_episode_tokens": 100},
                       "algorithm": {"overlong_buffer": 20, "overlong_penalty": 1.0}})  # fmt: skip
    # both episodes hold 95 tokens (prompt and tool results included); one policy wrote 90, one 10
    trajs = [SimpleNamespace(completion_tokens=n, info={"episode_tokens": 95}) for n in (90, 10)]
    group = SimpleNamespace(rewards=[1.0, 1.0], trajectories=trajs)
    shaped = objective.group_rewards(group, cfg).tolist()
    assert shaped == pytest.approx([1.0 - 0.5, 1.0])


def test_top_p_below_one_is_refused_for_training() -> None:
    with pytest.raises(ConfigError, match=r"sampler.top_p 0.9 < 1 is not supported for training"):
        load_recipe({"twin": {"name": "Toy"}, "sampler": {"top_p": 0.9}})

"""Advantages and losses against values computed by hand on small tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.algorithms import (
    ADVANTAGES,
    LOSS_AGGREGATIONS,
    aggregation,
    clipped_surrogate,
    constant_normalizer,
    dr_grpo_advantages,
    entropy_from_logits,
    grpo_advantages,
    keep_informative_groups,
    kl_k3,
    overlong_penalty,
    rloo_advantages,
    seq_mean_token_mean,
    tis_weights,
    token_logprobs,
    token_mean,
)
from trainer.objective import LossSettings, ScoredBatch, objective
from twin.errors import ConfigError

T = torch.tensor


def close(a, b, tol: float = 1e-5) -> bool:
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32),
        torch.as_tensor(b, dtype=torch.float32),
        atol=tol,
        rtol=0,
    )


# ================================================================== advantages
def test_grpo_by_hand() -> None:
    # group 1: mean 0.5; sample std sqrt((4 * 0.25) / 3) = sqrt(1/3); A = +-0.5 / sqrt(1/3)
    a = 0.5 / math.sqrt(1 / 3)  # 0.8660
    adv = grpo_advantages(T([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    assert close(adv, [[a, -a, -a, a], [0.0, 0.0, 0.0, 0.0]])


def test_dr_grpo_by_hand() -> None:
    # mean 0.25: A = r - 0.25, no division
    adv = dr_grpo_advantages(T([[1.0, 0.0, 0.0, 0.0]]))
    assert close(adv, [[0.75, -0.25, -0.25, -0.25]])


def test_rloo_by_hand() -> None:
    # A_0 = 1 - (0 + 0 + 0) / 3 = 1;  A_k = 0 - (1 + 0 + 0) / 3 = -1/3
    adv = rloo_advantages(T([[1.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 2.0]]))
    # row 2: 3 - 5/3 = 4/3; 1 - 7/3 = -4/3; 2 - 6/3 = 0; 0
    assert close(adv, [[1.0, -1 / 3, -1 / 3, -1 / 3], [4 / 3, -4 / 3, 0.0, 0.0]])


def test_groups_of_one_and_bad_shapes() -> None:
    for fn in (grpo_advantages, rloo_advantages):
        assert close(fn(T([[0.7], [0.1]])), [[0.0], [0.0]])
    with pytest.raises(ConfigError, match="num_groups, group_size"):
        grpo_advantages(T([1.0, 0.0]))


group_rewards = st.integers(1, 6).flatmap(
    lambda g: st.lists(
        st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=g, max_size=g),
        min_size=1,
        max_size=5,
    )
)


@settings(max_examples=60, deadline=None)
@given(rewards=group_rewards, name=st.sampled_from(sorted(ADVANTAGES)))
def test_advantages_are_zero_mean_and_finite(rewards, name) -> None:
    r = T(rewards)
    adv = ADVANTAGES[name](r)
    assert adv.shape == r.shape
    assert torch.isfinite(adv).all()
    scale = max(1.0, float(adv.abs().max()))
    assert close(adv.mean(dim=-1), torch.zeros(r.shape[0]), tol=1e-4 * scale)


@settings(max_examples=30, deadline=None)
@given(
    value=st.floats(-5, 5, allow_nan=False),
    g=st.integers(1, 8),
    name=st.sampled_from(sorted(ADVANTAGES)),
)
def test_constant_groups_give_zero_advantage(value, g, name) -> None:
    adv = ADVANTAGES[name](torch.full((2, g), value))
    assert torch.isfinite(adv).all() and close(adv, torch.zeros(2, g))


# ================================================================== filters and shaping
def test_keep_informative_groups() -> None:
    keep = keep_informative_groups(T([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5]]))
    assert keep.tolist() == [False, True, False]


def test_overlong_penalty_by_hand() -> None:
    # max_len 10, buffer 4: free up to 6; 7 -> -(7-6)/4 = -0.25; 8 -> -0.5; 10 and beyond -> -1
    pen = overlong_penalty(T([5, 6, 7, 8, 10, 12]), max_len=10, buffer=4, factor=1.0)
    assert close(pen, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert close(overlong_penalty(T([8]), 10, 4, factor=0.5), [-0.25])
    # buffer 0: DAPO's formula keeps only its last case, a hard cut beyond max_len
    assert close(overlong_penalty(T([9, 10, 11, 50]), 10, 0), [0.0, 0.0, -1.0, -1.0])
    with pytest.raises(ConfigError, match="overlong_buffer"):
        overlong_penalty(T([5]), max_len=4, buffer=8)


@settings(max_examples=200, deadline=None)
@given(
    max_len=st.integers(1, 64),
    data=st.data(),
    factor=st.floats(0.0, 4.0),
)
def test_overlong_penalty_is_the_reward_librarys(max_len: int, data, factor: float) -> None:
    """One overlong formula: the trainer's shaping equals the reward library's term, buffer 0
    included."""
    from types import SimpleNamespace

    from rewards import overlong_penalty as overlong_term

    buffer = data.draw(st.integers(0, max_len), label="buffer")
    lengths = data.draw(
        st.lists(st.integers(0, 2 * max_len + 2), min_size=1, max_size=8), label="lengths"
    )
    term = overlong_term(max_len, buffer, penalty=factor)
    expected = [
        -term.amount(SimpleNamespace(completion_tokens=n, token_turns=[]), None) for n in lengths
    ]
    assert close(overlong_penalty(T(lengths), max_len, buffer, factor), expected)


def test_overlong_buffer_zero_leaves_training_rewards_alone() -> None:
    """The policy's tokens share the episode budget with the prompt, so they never pass it: the
    recipe's default ``overlong_buffer: 0`` changes no reward."""
    from types import SimpleNamespace

    from trainer.config import load_recipe
    from trainer.objective import group_rewards

    cfg = load_recipe({"twin": {"name": "Toy"}, "sampler": {"max_episode_tokens": 100}})
    assert cfg.algorithm.overlong_buffer == 0
    trajs = [
        SimpleNamespace(completion_tokens=n) for n in (0, 50, 99)
    ]  # at most 100 - 1 prompt token
    group = SimpleNamespace(rewards=[1.0, 0.0, 0.5], trajectories=trajs)
    assert group_rewards(group, cfg).tolist() == [1.0, 0.0, 0.5]


# ================================================================== per-token pieces
def test_token_logprobs_and_entropy() -> None:
    logits = T([[[0.0, 0.0, 0.0, 0.0], [10.0, 0.0, 0.0, 0.0]]])  # [1, 2, 4]
    # uniform: log(1/4); peaked: 10 - log(e^10 + 3)
    lp = token_logprobs(logits, T([[2, 0]]))
    assert close(lp, [[math.log(0.25), 10 - math.log(math.exp(10) + 3)]])
    ent = entropy_from_logits(logits)
    p = math.exp(10) / (math.exp(10) + 3)
    q = 1 / (math.exp(10) + 3)
    assert close(ent, [[math.log(4), -(p * math.log(p) + 3 * q * math.log(q))]])
    rnd = torch.randn(3, 5, 7)
    assert close(entropy_from_logits(rnd), torch.distributions.Categorical(logits=rnd).entropy())


def test_kl_k3_by_hand() -> None:
    # lp = log .5, ref = log .25: log r = log .5; k3 = .5 - log .5 - 1 = 0.19315
    k = kl_k3(T([[math.log(0.5), -1.0]]), T([[math.log(0.25), -1.0]]))
    assert close(k, [[0.5 - math.log(0.5) - 1.0, 0.0]])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-8, 0), st.floats(-8, 0)), min_size=1, max_size=20))
def test_kl_k3_is_never_negative(pairs) -> None:
    lp, ref = T([[p for p, _ in pairs]]), T([[r for _, r in pairs]])
    assert (kl_k3(lp, ref) >= -1e-6).all()


def test_tis_weights_by_hand() -> None:
    old = T([[-1.0, -2.0, -1.0]], requires_grad=True)
    sampler = T([[-2.0, -1.0, -1.0]])
    w = tis_weights(old, sampler, cap=2.0)
    # exp(1) = 2.718 -> capped at 2; exp(-1) = 0.3679; exp(0) = 1
    assert close(w, [[2.0, math.exp(-1.0), 1.0]])
    assert not w.requires_grad


def test_clipped_surrogate_by_hand() -> None:
    ratio = T([[1.5, 0.5, 1.1, 0.9], [1.5, 0.5, 1.1, 0.9]])
    old = torch.zeros(2, 4)
    out = clipped_surrogate(ratio.log(), old, T([1.0, -1.0]), eps_low=0.2, eps_high=0.28)
    # A=+1: -min(r, clip(r, .8, 1.28)) = -[1.28, .5, 1.1, .9]  (1.5 clipped high)
    # A=-1: -min(-r, -clip(r)) = [1.5, .8, 1.1, .9]             (0.5 clipped low)
    assert close(out.loss, [[-1.28, -0.5, -1.1, -0.9], [1.5, 0.8, 1.1, 0.9]])
    assert out.clipped_high.tolist() == [[True, False, False, False], [False] * 4]
    assert out.clipped_low.tolist() == [[False] * 4, [False, True, False, False]]
    assert close(out.ratio, ratio)


def test_clip_higher_is_asymmetric() -> None:
    # ratio 1.25, A > 0: inside 1 + 0.28 (gradient flows) but outside symmetric 1 + 0.2 (none)
    def grad(eps_high: float) -> float:
        lp = T([[math.log(1.25)]], requires_grad=True)
        clipped_surrogate(lp, T([[0.0]]), T([1.0]), 0.2, eps_high).loss.sum().backward()
        return float(lp.grad)

    assert close(grad(0.28), -1.25)  # d(-r)/d lp = -r
    assert grad(0.2) == 0.0
    # ratio 0.75 with A < 0 is clipped at 1 - eps_low whatever eps_high is
    lp = T([[math.log(0.75)]], requires_grad=True)
    out = clipped_surrogate(lp, T([[0.0]]), T([-1.0]), 0.2, 0.28)
    out.loss.sum().backward()
    assert lp.grad.item() == 0.0 and out.clipped_low.item()


# ================================================================== aggregations
VALUES = T([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
MASK = T([[1, 1, 1], [1, 0, 0]])


def test_aggregations_by_hand() -> None:
    # token mean (DAPO): (1 + 2 + 3 + 4) / 4 tokens = 2.5
    assert close(token_mean(VALUES, MASK), 2.5)
    # sequence mean of token means (GRPO): (6/3 + 4/1) / 2 = 3.0
    assert close(seq_mean_token_mean(VALUES, MASK), 3.0)
    # constant normaliser (Dr. GRPO): 10 / (2 seqs * L); L = T = 3 by default, or given
    assert close(constant_normalizer(VALUES, MASK), 10 / 6)
    assert close(constant_normalizer(VALUES, MASK, max_tokens=5), 1.0)
    assert close(aggregation("constant_normalizer", max_tokens=5)(VALUES, MASK), 1.0)


def test_aggregations_ignore_padding_even_when_not_finite() -> None:
    values = VALUES.clone()
    values[1, 1:] = float("inf")
    for agg in LOSS_AGGREGATIONS.values():
        assert torch.isfinite(agg(values, MASK))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.tuples(st.floats(-3, 3, width=32), st.booleans()), min_size=4, max_size=4),
        min_size=2,
        max_size=6,
    ),
    cut=st.integers(1, 5),
    name=st.sampled_from(sorted(LOSS_AGGREGATIONS)),
)
def test_micro_batches_sum_to_the_full_batch(rows, cut, name) -> None:
    values = T([[v for v, _ in r] for r in rows])
    mask = T([[float(m) for _, m in r] for r in rows])
    cut = min(cut, len(rows) - 1)
    agg = LOSS_AGGREGATIONS[name]
    full = agg(values, mask)
    n_seq, n_tok = len(rows), float(mask.sum())
    parts = agg(values[:cut], mask[:cut], num_seqs=n_seq, num_tokens=n_tok) + agg(
        values[cut:], mask[cut:], num_seqs=n_seq, num_tokens=n_tok
    )
    assert close(parts, full, tol=1e-4)


def test_config_names_map_to_functions() -> None:
    assert set(LOSS_AGGREGATIONS) == {"token_mean", "seq_mean_token_mean", "constant_normalizer"}
    assert set(ADVANTAGES) == {"grpo", "dr_grpo", "rloo"}
    assert aggregation("token_mean") is token_mean
    with pytest.raises(ConfigError, match="token_mean"):
        aggregation("sum")


# ================================================================== objective
ADV = T([1.0, -0.5])
LP_MASK = T([[1, 1, 0], [1, 0, 0]])


def lp_tensor() -> torch.Tensor:
    return T([[-1.0, -2.0, -3.0], [-0.5, -7.0, -7.0]], requires_grad=True)


def test_objective_on_policy_by_hand() -> None:
    # old = lp.detach(): ratio 1 everywhere, per-token loss -A: [-1, -1, .], [.5, ., .]
    lp = lp_tensor()
    loss, stats = objective(ScoredBatch(lp, LP_MASK, ADV), LossSettings(), aggregate=token_mean)
    assert close(loss, (-1 - 1 + 0.5) / 3)  # -0.5
    loss.backward()
    # d/d lp of -r*A / 3 tokens with r = 1: -A/3 on masked-in tokens only
    assert close(lp.grad, [[-1 / 3, -1 / 3, 0.0], [0.5 / 3, 0.0, 0.0]])
    assert close(stats.ratio_mean, 1.0) and close(stats.clip_frac, 0.0)
    assert close(stats.tis_mean, 1.0) and close(stats.num_tokens, 3.0)

    lp = lp_tensor()
    loss, _ = objective(
        ScoredBatch(lp, LP_MASK, ADV), LossSettings(), aggregate=seq_mean_token_mean
    )
    assert close(loss, ((-1 - 1) / 2 + 0.5 / 1) / 2)  # -0.25
    loss.backward()
    assert close(lp.grad, [[-1 / 4, -1 / 4, 0.0], [0.5 / 2, 0.0, 0.0]])


def test_gradient_flows_only_through_masked_tokens() -> None:
    lp = lp_tensor()
    old = T([[-1.2, -1.5, 50.0], [-0.4, -50.0, 3.0]])  # wild values at padded positions
    sampler = T([[-1.0, -1.0, 80.0], [-1.0, 9.0, -9.0]])
    ref = T([[-1.1, -2.2, 30.0], [-0.6, 5.0, -40.0]])
    for agg in LOSS_AGGREGATIONS.values():
        lp.grad = None
        scored = ScoredBatch(
            lp, LP_MASK, ADV, sampler_logprobs=sampler, old_logprobs=old, ref_logprobs=ref
        )
        loss, _ = objective(scored, LossSettings(kl_coef=0.1), aggregate=agg)
        loss.backward()
        assert torch.isfinite(loss)
        assert (lp.grad[LP_MASK == 0] == 0).all()
        assert (lp.grad[LP_MASK == 1] != 0).all()


def test_objective_with_tis_and_kl_by_hand() -> None:
    lp = lp_tensor()
    # sampler logprobs: weights exp(old - sampler) = exp(1) -> cap 2, exp(-.5), exp(0) = 1
    sampler = T([[-2.0, -1.5, 0.0], [-0.5, 0.0, 0.0]])
    ref = T([[-1.0, -2.0 + math.log(0.5), 0.0], [-0.5, 0.0, 0.0]])
    loss, stats = objective(
        ScoredBatch(lp, LP_MASK, ADV, sampler_logprobs=sampler, ref_logprobs=ref),
        LossSettings(kl_coef=0.1, tis_cap=2.0),
        aggregate=token_mean,
    )
    w = [2.0, math.exp(-0.5), 1.0]
    pg = (-1 * w[0] - 1 * w[1] + 0.5 * w[2]) / 3
    k3 = [0.0, 0.5 - math.log(0.5) - 1, 0.0]  # ref - lp = log .5 on the 2nd token only
    assert close(stats.policy_loss, pg)
    assert close(loss, pg + 0.1 * sum(k3) / 3)
    assert close(stats.kl, sum(k3) / 3)
    assert close(stats.tis_mean, sum(w) / 3)
    assert close(stats.tis_capped_frac, 1 / 3)
    assert set(stats.metrics()) >= {"losses/clip_frac", "losses/kl", "losses/tis_mean"}


def test_objective_clip_stats_by_hand() -> None:
    lp = torch.log(T([[1.5, 0.5, 1.0], [0.5, 1.0, 1.0]]))
    old = torch.zeros(2, 3)
    mask = T([[1, 1, 1], [1, 0, 0]])
    scored = ScoredBatch(lp, mask, T([1.0, -1.0]), old_logprobs=old)
    _, stats = objective(scored, LossSettings(eps_low=0.2, eps_high=0.28))
    # clipped high: (0,0) ratio 1.5 A>0; clipped low: (1,0) ratio .5 A<0; of 4 tokens
    assert close(stats.clip_frac_high, 0.25) and close(stats.clip_frac_low, 0.25)
    assert close(stats.clip_frac, 0.5)
    assert close(stats.ratio_mean, (1.5 + 0.5 + 1.0 + 0.5) / 4) and close(stats.ratio_max, 1.5)


def test_objective_errors() -> None:
    with pytest.raises(ConfigError, match="ref_logprobs"):
        objective(ScoredBatch(lp_tensor(), LP_MASK, ADV), LossSettings(kl_coef=0.1))
    with pytest.raises(ConfigError, match=r"\[B, T\]"):
        objective(ScoredBatch(lp_tensor(), T([[1, 1]]), ADV), LossSettings())

"""Shared-prefix training: each group's prompt runs once, its KV cache feeds the group's rows.

The shared pass must give the padded per-row pass's loss, metrics and gradients (fp32, tiny
model, to float rounding), whatever the micro-batch budget, with LoRA or full fine-tuning, with
multi-turn rows, rows that share nothing, several mini-batches and the KL reference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.config import AlgorithmConfig, OptimConfig
from trainer.learner import Learner, TrainBatch
from trainer.scoring import plan_micro_batches


def _run(model, state, *, shared: bool, algorithm: dict, optim: dict, batch: TrainBatch):
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    learner = Learner(
        model,
        algorithm=AlgorithmConfig(**algorithm),
        optim=OptimConfig(**{"lr": 1e-12, "grad_clip": None, **optim}),
        max_tokens=64,
        shared_prefix=shared,
    )
    metrics = learner.step(batch)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return metrics, grads


@pytest.mark.parametrize(
    ("lora", "algorithm", "optim"),
    [
        (
            False,
            {"loss_aggregation": "token_mean", "entropy_coef": 0.01},
            {"micro_batch_tokens": 100_000},
        ),
        (False, {"loss_aggregation": "seq_mean_token_mean"}, {"micro_batch_tokens": 60}),
        (True, {"loss_aggregation": "constant_normalizer"}, {"micro_batch_tokens": 90}),
        (True, {"kl_coef": 0.05}, {"micro_batch_tokens": 100_000, "mini_batches": 2}),
    ],
)
def test_shared_prefix_gives_the_padded_pass_loss_and_gradients(
    lora, algorithm, optim, trainable_tiny, grouped_batch
) -> None:
    model = trainable_tiny(lora)
    if lora:  # a non-zero adapter, so that the KL and its gradient are not trivially zero
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = grouped_batch()
    m0, g0 = _run(model, state, shared=False, algorithm=algorithm, optim=optim, batch=batch)
    m1, g1 = _run(model, state, shared=True, algorithm=algorithm, optim=optim, batch=batch)
    assert set(g0) == set(g1) and g0
    scale = max(float(g.abs().max()) for g in g0.values())
    assert scale > 0
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-5 * max(scale, 1.0), rtol=1e-4), n
    for k in m0:
        if not k.startswith("perf/"):
            assert m1[k] == pytest.approx(m0[k], abs=1e-5, rel=1e-4), k


def test_shared_prefix_is_used_and_runs_fewer_tokens(trainable_tiny, grouped_batch) -> None:
    model = trainable_tiny(lora=False)
    learner = Learner(
        model, algorithm=AlgorithmConfig(), optim=OptimConfig(micro_batch_tokens=100_000)
    )
    batch = grouped_batch()
    plan = list(learner.scorer.plan(range(len(batch)), batch))
    assert len(plan) == 1
    rows, units = plan[0]
    assert units is not None
    assert sorted(len(u) for _, u in units) == [1, 4, 4, 4]  # three groups and the solo row
    mb = learner.scorer.pad(rows, batch, units)
    shared = mb["prefix_ids"].numel() + mb["suffix_ids"].numel()
    assert shared < 0.6 * mb["input_ids"].numel()
    # the prefix ends just before the first loss token's predictor
    for r, i in enumerate(rows):
        first = batch.loss_mask[i].index(1)
        assert int(mb["prefix_len"][r]) == first - 1
    off = Learner(model, algorithm=AlgorithmConfig(), optim=OptimConfig(), shared_prefix=False)
    assert all(u is None for _, u in off.scorer.plan(range(len(batch)), batch))


def test_no_sharing_falls_back_to_the_padded_pass(trainable_tiny, grouped_batch) -> None:
    model = trainable_tiny(lora=False)
    learner = Learner(model, algorithm=AlgorithmConfig(), optim=OptimConfig())
    batch = grouped_batch(groups=3, group_size=1)  # every prompt distinct
    assert all(u is None for _, u in learner.scorer.plan(range(len(batch)), batch))
    one_token = TrainBatch(
        [[5, 6, 7], [5, 6, 8]], [[0, 1, 1], [0, 1, 1]], [[0.0] * 3] * 2, [1.0, -1.0]
    )
    assert all(u is None for _, u in learner.scorer.plan(range(2), one_token)), (
        "an empty prefix is never shared"
    )


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.integers(2, 30), min_size=1, max_size=4),
    sizes=st.lists(st.integers(1, 5), min_size=4, max_size=4),
    tails=st.lists(st.integers(1, 12), min_size=20, max_size=20),
    budget=st.integers(1, 200),
)
def test_plan_covers_every_row_once_unit_by_unit(prompts, sizes, tails, budget) -> None:
    ids, masks = [], []
    k = 0
    for p, (plen, size) in enumerate(zip(prompts, sizes)):
        for _ in range(size):
            tail = tails[k % len(tails)]
            k += 1
            ids.append([p + 1] * plen + [9] * tail)
            masks.append([0] * plen + [1] * tail)
    batch = TrainBatch(ids, masks, [[0.0] * len(r) for r in ids], [0.0] * len(ids))
    seen: list[int] = []
    # each row's copy of a prompt token costs a quarter token
    for rows, units in plan_micro_batches(range(len(batch)), batch, budget, prompt_weight=0.25):
        seen.extend(rows)
        if units is None:
            continue
        assert rows == [r for _, us in units for r in us]
        for length, urows in units:
            assert len({tuple(batch.input_ids[i][:length]) for i in urows}) == 1
        prefix = max(n for n, _ in units)
        cost = len(units) * prefix + len(rows) * (
            max(len(batch.input_ids[i]) - n for n, us in units for i in us) + 0.25 * prefix
        )
        assert cost <= budget or len(rows) == 1
    assert sorted(seen) == list(range(len(batch)))


def _sft_like_batch() -> TrainBatch:
    """Rows of different cases: a 24-token system prompt in common, then each its own task."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(5, 200, (24,), generator=g).tolist()
    ids, masks = [], []
    for task, turn in ((6, 9), (11, 4), (3, 12), (8, 7)):
        own = torch.randint(5, 200, (task,), generator=g).tolist()
        reply = torch.randint(5, 200, (turn,), generator=g).tolist()
        ids.append(system + own + reply)
        masks.append([0] * (24 + task) + [1] * turn)
    return TrainBatch(ids, masks, [[0.0] * len(r) for r in ids], [1.0] * 4)


def test_rows_of_different_cases_share_their_common_system_prompt(trainable_tiny) -> None:
    """An SFT batch: no whole prompt is shared, the system prompt is; it runs once and the loss
    and gradients are the padded pass's."""
    model = trainable_tiny(lora=True)
    batch = _sft_like_batch()
    learner = Learner(
        model, algorithm=AlgorithmConfig(), optim=OptimConfig(micro_batch_tokens=100_000)
    )
    ((rows, units),) = list(learner.scorer.plan(range(len(batch)), batch))
    assert units is not None and len(units) == 1
    length, urows = units[0]
    assert length >= 24 and sorted(urows) == [0, 1, 2, 3]
    assert all(batch.input_ids[i][:length] == batch.input_ids[0][:length] for i in urows)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    m0, g0 = _run(
        model, state, shared=False, algorithm={}, optim={"micro_batch_tokens": 100_000}, batch=batch
    )
    m1, g1 = _run(
        model, state, shared=True, algorithm={}, optim={"micro_batch_tokens": 100_000}, batch=batch
    )
    scale = max(float(g.abs().max()) for g in g0.values())
    assert scale > 0
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-5 * max(scale, 1.0), rtol=1e-4), n
    assert m1["losses/loss"] == pytest.approx(m0["losses/loss"], abs=1e-5, rel=1e-4)

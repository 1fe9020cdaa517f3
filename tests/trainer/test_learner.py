"""The learner: LoRA-only updates, loss mask, micro-batching, KL
reference without a copy, saving."""

from __future__ import annotations

import pytest
import torch

from trainer.config import AlgorithmConfig, OptimConfig
from trainer.learner import Learner, TrainBatch, build_lora_model
from trainer.models import load_model
from twin.errors import ConfigError


def _model(lora: bool = True):
    torch.set_num_threads(1)
    model, tok = load_model("tiny")
    if lora:
        model = build_lora_model(
            model, lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
        )
    return model, tok


def _batch(seed: int = 0, n: int = 4) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    ids, masks, lps, adv = [], [], [], []
    for i in range(n):
        length = 12 + 3 * i
        row = torch.randint(5, 700, (length,), generator=g).tolist()
        mask = (
            [0] * 6 + [1] * 3 + [0] * 2 + [1] * (length - 11)
        )  # two sampled turns, a tool result between
        ids.append(row)
        masks.append(mask)
        lps.append([-6.6 if m else 0.0 for m in mask])
        adv.append(1.0 if i % 2 else -1.0)
    return TrainBatch(ids, masks, lps, adv)


def _learner(model, **kw) -> Learner:
    algo = AlgorithmConfig(**kw.pop("algorithm", {}))
    optim = OptimConfig(**{"lr": 1e-2, **kw.pop("optim", {})})
    return Learner(model, algorithm=algo, optim=optim, max_tokens=64, **kw)


def test_step_changes_only_lora_params() -> None:
    model, _ = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = _learner(model).step(_batch())
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed, "a step must change something"
    assert all("lora_" in n for n in changed), sorted(changed)[:5]
    assert any("lora_B" in n for n in changed)
    for key in (
        "losses/loss",
        "losses/kl",
        "losses/clipfrac",
        "policy/entropy",
        "policy/grad_norm",
        "perf/learner_tokens_per_s",
        "policy/logprob_mismatch",
        "policy/tis_weight",
    ):
        assert key in metrics, key
    assert metrics["policy/entropy"] > 0


def test_full_finetune_changes_base_weights() -> None:
    model, _ = _model(lora=False)
    w = model.model.layers[0].self_attn.q_proj.weight
    before = w.detach().clone()
    _learner(model).step(_batch())
    assert not torch.equal(before, w.detach())


def _grads(model, batch: TrainBatch, **kw) -> dict[str, torch.Tensor]:
    learner = _learner(model, optim={"lr": 1e-12, **kw.pop("optim", {})}, **kw)
    learner.step(batch)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_loss_mask_excludes_unmasked_tokens() -> None:
    """Changing tokens that carry no loss and come after every loss token changes no gradient;
    changing a masked-in token does."""
    model, _ = _model(lora=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = _batch()
    for mask in batch.loss_mask:
        mask[-1] = 0  # the last token is now a tool-result token
    base = _grads(model, batch)
    model.load_state_dict(state)
    changed = _batch()
    for row, mask in zip(changed.input_ids, changed.loss_mask):
        mask[-1] = 0
        row[-1] = (row[-1] + 1) % 700
    other = _grads(model, changed)
    for n in base:
        assert torch.allclose(base[n], other[n], atol=1e-7), n
    model.load_state_dict(state)
    masked_in = _batch()
    for row, mask in zip(masked_in.input_ids, masked_in.loss_mask):
        mask[-1] = 0
        row[7] = (row[7] + 1) % 700  # inside the first sampled turn
    third = _grads(model, masked_in)
    assert any(not torch.allclose(base[n], third[n], atol=1e-7) for n in base)


def test_micro_batches_give_the_same_update() -> None:
    model, _ = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for agg in ("token_mean", "seq_mean_token_mean", "constant_normalizer"):
        model.load_state_dict(state)
        big = _grads(
            model,
            _batch(),
            algorithm={"loss_aggregation": agg},
            optim={"micro_batch_tokens": 10_000},
        )
        model.load_state_dict(state)
        small = _grads(
            model, _batch(), algorithm={"loss_aggregation": agg}, optim={"micro_batch_tokens": 21}
        )
        for n in big:
            assert torch.allclose(big[n], small[n], atol=1e-6, rtol=1e-4), (agg, n)


def test_logprobs_match_full_forward() -> None:
    model, _ = _model()
    batch = _batch()
    learner = _learner(model)
    got = learner.logprobs(batch)
    for row, lp in zip(batch.input_ids, got):
        with torch.no_grad():
            logits = model(torch.tensor([row])).logits[0, :-1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(row[1:])[:, None])[
            :, 0
        ]
        assert lp[0] == 0.0
        assert torch.allclose(torch.tensor(lp[1:]), expected, atol=1e-5)


def test_kl_reference_is_the_base_model_without_a_copy() -> None:
    model, _ = _model()
    learner = _learner(model, algorithm={"kl_coef": 0.1})
    batch = _batch()
    m0 = learner.step(batch)
    assert m0["losses/kl"] == pytest.approx(0.0, abs=1e-9), "LoRA B starts at zero: policy == base"
    m1 = learner.step(batch)
    assert m1["losses/kl"] > 0
    ref = learner.logprobs(batch, reference=True)
    cur = learner.logprobs(batch)
    assert any(abs(a - b) > 1e-6 for r, c in zip(ref, cur) for a, b in zip(r, c))
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 2 * sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)


def test_kl_without_lora_is_refused() -> None:
    model, _ = _model(lora=False)
    with pytest.raises(ConfigError, match="LoRA"):
        _learner(model, algorithm={"kl_coef": 0.1})


def test_clipping_bites_with_several_mini_batches() -> None:
    model, _ = _model(lora=False)
    learner = _learner(model, optim={"lr": 0.05, "mini_batches": 4})
    metrics = learner.step(_batch(n=8))
    assert learner.version == 4
    assert metrics["losses/clipfrac"] > 0


def test_save_adapter_and_state_round_trip(tmp_path) -> None:
    model, _ = _model()
    learner = _learner(model)
    learner.step(_batch())
    path = learner.save_adapter(tmp_path / "adapter")
    assert (path / "adapter_config.json").exists() and (path / "adapter_model.safetensors").exists()
    state = learner.state_dict()
    other_model, _ = _model()
    other = _learner(other_model)
    other.load_state_dict(state)
    assert other.version == learner.version
    for (n, a), (_, b) in zip(model.named_parameters(), other_model.named_parameters()):
        assert torch.equal(a, b), n
    a = learner.step(_batch(seed=1))
    b = other.step(_batch(seed=1))
    assert a["losses/loss"] == b["losses/loss"]


def test_batch_validation() -> None:
    with pytest.raises(ValueError, match="first token"):
        TrainBatch([[1, 2]], [[1, 1]], [[0.0, 0.0]], [1.0])
    with pytest.raises(ValueError, match="2 ids"):
        TrainBatch([[1, 2]], [[0, 1, 1]], [[0.0, 0.0]], [1.0])


def test_entropy_bonus_is_the_mean_token_entropy_over_the_loss_mask() -> None:
    """With zero advantages the only gradient is -entropy_coef x d(mean masked-token entropy)."""
    model, _ = _model(lora=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = _batch()
    batch.advantages[:] = [0.0] * len(batch)
    coef = 0.5
    got = _grads(
        model,
        batch,
        algorithm={"entropy_coef": coef},
        optim={"grad_clip": None, "micro_batch_tokens": 21},
    )
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    total, count = torch.zeros(()), 0
    for row, mask in zip(batch.input_ids, batch.loss_mask):
        logits = model(input_ids=torch.tensor([row])).logits[0, :-1].float()  # [T-1, V]
        logp = torch.log_softmax(logits, dim=-1)
        ent = -(logp.exp() * logp).sum(-1)  # [T-1]
        m = torch.tensor(mask[1:], dtype=torch.float32)
        total = total + (ent * m).sum()
        count += int(m.sum())
    (-coef * total / count).backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for n in want:
        assert torch.allclose(got[n], want[n], atol=1e-6, rtol=1e-3), n
    assert any(float(g.abs().max()) > 0 for g in got.values())


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_a_nan_batch_is_skipped_and_leaves_the_weights_bit_identical(mini_batches: int) -> None:
    model, _ = _model()
    learner = _learner(model, optim={"mini_batches": mini_batches})
    learner.step(_batch(seed=1))  # AdamW has moments now: a poisoned step would change them too
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {
        k: v.clone()
        for s in learner.optimizer.state.values()
        for k, v in s.items()
        if torch.is_tensor(v)
    }
    bad = _batch(seed=2)
    bad.advantages[0] = float("nan")
    if mini_batches > 1:
        bad.advantages[1] = float("nan")  # rows 0 and 1 land in different mini-batches: both skip
    metrics = learner.step(bad)
    assert all(torch.equal(weights[n], p.detach()) for n, p in model.named_parameters())
    after = {
        k: v for s in learner.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)
    }
    assert after.keys() == moments.keys() and all(
        torch.equal(moments[k], after[k]) for k in moments
    )
    assert learner.skipped_updates == mini_batches
    assert metrics["optim/skipped_nonfinite"] == mini_batches
    assert metrics["optim/skipped_nonfinite_total"] == mini_batches
    # the next finite batch updates as usual, and the counter survives a checkpoint
    good = learner.step(_batch(seed=3))
    assert (
        good["optim/skipped_nonfinite"] == 0
        and good["optim/skipped_nonfinite_total"] == mini_batches
    )
    assert any(not torch.equal(weights[n], p.detach()) for n, p in model.named_parameters())
    other = _learner(_model()[0])
    other.load_state_dict(learner.state_dict())
    assert other.skipped_updates == mini_batches

"""``model.autocast: bfloat16``: the learner's and the hf policy's forward run in bf16 while the
weights stay fp32; the logprobs stay within a bound of fp32's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from trainer.config import AlgorithmConfig, OptimConfig
from trainer.learner import Learner, TrainBatch, build_lora_model
from trainer.models import load_model


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    ids = [[1] + torch.randint(5, 200, (n,), generator=g).tolist() for n in (60, 45, 52)]
    mask = [[0] * 20 + [1] * (len(r) - 20) for r in ids]
    return TrainBatch(ids, mask, [[0.0] * len(r) for r in ids], [1.0, -0.5, 0.25])


def _learner(autocast: str | None) -> Learner:
    torch.manual_seed(0)
    model, _ = load_model("tiny", "float32")
    model = build_lora_model(model, lora_rank=4)
    return Learner(
        model, algorithm=AlgorithmConfig(), optim=OptimConfig(lr=1e-3), autocast=autocast
    )


def _linear_output_dtypes(model: torch.nn.Module) -> tuple[set[torch.dtype], list[object]]:
    seen: set[torch.dtype] = set()
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]  # fmt: skip
    return seen, hooks


def test_bf16_autocast_logprobs_are_within_a_bound_of_fp32() -> None:
    batch = _batch()
    fp32 = _learner(None).logprobs(batch)
    bf16_learner = _learner("bfloat16")
    seen, hooks = _linear_output_dtypes(bf16_learner.model)
    bf16 = bf16_learner.logprobs(batch)
    for h in hooks:
        h.remove()
    assert torch.bfloat16 in seen  # the matmuls ran in bf16
    diffs = torch.tensor([abs(a - b) for ra, rb in zip(fp32, bf16) for a, b in zip(ra[1:], rb[1:])])
    assert 0 < float(diffs.mean()) < 0.02
    assert float(diffs.max()) < 0.1


def test_a_bf16_autocast_step_keeps_fp32_weights_and_moves_them_like_fp32() -> None:
    batch = _batch()
    a, b = _learner(None), _learner("bfloat16")
    start = torch.cat([p.detach().flatten() for p in a.params])
    ma, mb = a.step(batch), b.step(batch)
    assert all(p.dtype == torch.float32 for p in b.params)
    assert mb["losses/loss"] == pytest.approx(ma["losses/loss"], rel=0.05, abs=1e-3)
    da = torch.cat([p.detach().flatten() for p in a.params]) - start
    db = torch.cat([p.detach().flatten() for p in b.params]) - start
    assert float(db.abs().max()) > 0  # the update was applied to the fp32 weights
    assert torch.nn.functional.cosine_similarity(da, db, dim=0) > 0.95


def test_hf_policy_samples_under_autocast() -> None:
    from trainer.hf_policy import HFPolicy

    model, tok = load_model("tiny", "float32")
    seen, hooks = _linear_output_dtypes(model)
    policy = HFPolicy(model, tok, temperature=0.0, max_new_tokens=4, autocast="bfloat16")
    asyncio.run(policy.act([{"role": "user", "content": "hello"}], []))
    for h in hooks:
        h.remove()
    assert seen == {torch.bfloat16}
    assert next(model.parameters()).dtype == torch.float32
    with pytest.raises(Exception, match="autocast"):
        HFPolicy(model, tok, autocast="float8")


@pytest.mark.parametrize(
    ("flags", "chosen"), [(["amx_bf16"], "bfloat16"), ([], None), (None, None)]
)
def test_auto_autocast_is_bf16_only_where_the_cpu_computes_it_natively(
    monkeypatch: pytest.MonkeyPatch, flags: list[str] | None, chosen: str | None
) -> None:
    """``autocast: auto`` reaches the learner, the recipe's learner and an ``hf:`` policy as
    bfloat16 on a CPU with bfloat16 instructions and as none where torch would emulate it (or
    where the flags cannot be read); explicit values are kept whatever the CPU."""
    from trainer.config import load_recipe
    from trainer.hf_policy import HFPolicy
    from trainer.models import resolve_autocast
    from trainer.runtime import build_learner

    monkeypatch.setattr("trainer.models.cpu_bf16_flags", lambda cpuinfo=None: flags)
    assert resolve_autocast("auto", "cpu") == chosen
    assert resolve_autocast("bfloat16", "cpu") == "bfloat16"
    assert resolve_autocast(None, "cpu") is None
    assert _learner("auto").scorer.autocast == chosen
    recipe = load_recipe(
        {"twin": {"name": "Toy"}, "model": {"path": "tiny", "dtype": "float32", "autocast": "auto"}}
    )
    learner, _ = build_learner(recipe, "tiny", temperature=1.0)
    assert learner.scorer.autocast == chosen
    frozen = {m.weight.dtype for m in learner.model.modules()
              if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad}  # fmt: skip
    assert frozen == {torch.bfloat16 if chosen else torch.float32}  # rounded once where bf16
    policy = HFPolicy.from_spec("hf:tiny,autocast=auto,temperature=0")
    assert policy.autocast == chosen and policy.sampler.autocast == chosen

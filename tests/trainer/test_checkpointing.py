"""Activation checkpointing (``optim.gradient_checkpointing``) and the micro-batch budget.

Checkpointing recomputes each decoder layer in backward: the loss, metrics and gradients must be
those of the plain pass (fp32, tiny model, to float rounding), with LoRA or full fine-tuning, on
the padded and the shared-prompt path, while the forward pass keeps fewer tensors for backward.
"""

from __future__ import annotations

import pytest
import torch

from trainer.config import AlgorithmConfig, OptimConfig, load_recipe
from trainer.learner import Learner, TrainBatch
from trainer.saved_tensors import saved_bytes
from twin.errors import ConfigError


def _run(model, state, *, ckpt: bool, shared: bool, batch: TrainBatch, optim: dict | None = None):
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    learner = Learner(
        model, algorithm=AlgorithmConfig(kl_coef=0.05 if hasattr(model, "peft_config") else 0.0),
        optim=OptimConfig(**{"lr": 1e-12, "grad_clip": None, "micro_batch_tokens": 100_000,
                             "gradient_checkpointing": ckpt, **(optim or {})}),
        max_tokens=64, shared_prefix=shared,
    )  # fmt: skip
    metrics = learner.step(batch)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return metrics, grads


@pytest.mark.parametrize("shared", [False, True], ids=["padded", "shared"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_checkpointing_gives_the_same_loss_and_gradients(
    lora: bool, shared: bool, trainable_tiny, grouped_batch
) -> None:
    model = trainable_tiny(lora)
    if lora:  # a non-zero adapter, so that LoRA's input gradients matter
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = grouped_batch()
    m0, g0 = _run(model, state, ckpt=False, shared=shared, batch=batch)
    m1, g1 = _run(model, state, ckpt=True, shared=shared, batch=batch)
    assert set(g0) == set(g1) and g0
    scale = max(float(g.abs().max()) for g in g0.values())
    assert scale > 0
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-6 * max(scale, 1.0), rtol=1e-5), n
    for k in m0:
        if not k.startswith("perf/"):
            assert m1[k] == pytest.approx(m0[k], abs=1e-6, rel=1e-5), k


@pytest.mark.parametrize("shared", [False, True], ids=["padded", "shared"])
def test_checkpointing_keeps_fewer_tensors_for_backward(
    shared: bool, trainable_tiny, grouped_batch
) -> None:
    model = trainable_tiny(lora=True)
    batch = grouped_batch()
    rows = list(range(len(batch)))
    figures = []
    for ckpt in (False, True):
        learner = Learner(
            model,
            algorithm=AlgorithmConfig(),
            optim=OptimConfig(micro_batch_tokens=100_000, gradient_checkpointing=ckpt),
            shared_prefix=shared,
        )
        ((mrows, units),) = list(learner.scorer.plan(rows, batch))
        assert (units is not None) == shared
        mb = learner.scorer.pad(mrows, batch, units)
        with saved_bytes(exclude=model.parameters()) as counted:
            logp, _ = learner.scorer.forward(mb)
        figures.append(counted.total)
        logp.sum().backward()  # the recompute runs without error
    plain, checkpointed = figures
    assert checkpointed < 0.6 * plain, figures


def test_an_episode_longer_than_the_micro_batch_is_refused_at_run_time(
    trainable_tiny, grouped_batch
) -> None:
    model = trainable_tiny(lora=True)
    batch = grouped_batch()
    longest = max(len(r) for r in batch.input_ids)
    learner = Learner(
        model, algorithm=AlgorithmConfig(), optim=OptimConfig(micro_batch_tokens=longest - 1)
    )
    with pytest.raises(
        ConfigError, match=rf"episode of {longest} tokens exceeds optim.micro_batch_tokens"
    ):
        learner.step(batch)


def test_an_episode_budget_over_the_micro_batch_is_refused_at_load() -> None:
    data = {
        "twin": {"name": "Toy"},
        "sampler": {"max_episode_tokens": 2048},
        "optim": {"micro_batch_tokens": 1024},
    }
    with pytest.raises(
        ConfigError, match=r"max_episode_tokens \(2048\) exceeds optim.micro_batch_tokens \(1024\)"
    ):
        load_recipe(data)
    assert load_recipe(data, ["optim.micro_batch_tokens=2048"]).optim.micro_batch_tokens == 2048

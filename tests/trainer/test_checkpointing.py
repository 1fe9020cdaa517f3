"""Activation checkpointing (``optim.gradient_checkpointing``) and the micro-batch budget.

Checkpointing recomputes each decoder layer in backward: the loss, metrics and gradients must be
those of the plain pass (fp32, tiny model, to float rounding), with LoRA or full fine-tuning, on
the padded and the shared-prompt path, while the forward pass keeps fewer tensors for backward.
"""

from __future__ import annotations

import pytest
import torch

from trainer.config import AlgorithmConfig, OptimConfig, load_recipe
from trainer.learner import Learner, TrainBatch, build_lora_model
from trainer.memory import saved_bytes
from trainer.models import load_model
from twin.errors import ConfigError


def _grouped_batch(seed: int = 1, groups: int = 3, group_size: int = 4) -> TrainBatch:
    """GRPO-shaped rows: a prompt per group, completions of varied length, some multi-turn."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(5, 700, (n,), generator=g).tolist()

    ids, masks, lps, adv = [], [], [], []
    for grp in range(groups):
        prompt = rand(20 + 7 * grp)
        for k in range(group_size):
            first = rand(3 + (5 * k + grp) % 9)
            tool, second = (rand(4), rand(2)) if k % 2 else ([], [])
            ids.append(prompt + first + tool + second)
            mask = [0] * len(prompt) + [1] * len(first) + [0] * len(tool) + [1] * len(second)
            masks.append(mask)
            lps.append([-6.0 if m else 0.0 for m in mask])
            adv.append(float(k) - 1.5)
    solo = list(range(10, 40))  # a row with a prompt of its own
    ids.append(solo)
    masks.append([0] * 25 + [1] * 5)
    lps.append([-6.0 if m else 0.0 for m in masks[-1]])
    adv.append(0.7)
    return TrainBatch(ids, masks, lps, adv)


def _model(lora: bool):
    torch.set_num_threads(1)
    model, _ = load_model("tiny")
    if lora:
        return build_lora_model(model, lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    for p in model.parameters():
        p.requires_grad_(True)
    return model


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
def test_checkpointing_gives_the_same_loss_and_gradients(lora: bool, shared: bool) -> None:
    model = _model(lora)
    if lora:  # a non-zero adapter, so that LoRA's input gradients matter
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch = _grouped_batch()
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
def test_checkpointing_keeps_fewer_tensors_for_backward(shared: bool) -> None:
    model = _model(lora=True)
    batch = _grouped_batch()
    rows = list(range(len(batch)))
    figures = []
    for ckpt in (False, True):
        learner = Learner(
            model, algorithm=AlgorithmConfig(),
            optim=OptimConfig(micro_batch_tokens=100_000, gradient_checkpointing=ckpt), shared_prefix=shared,
        )  # fmt: skip
        ((mrows, units),) = list(learner._plan(rows, batch))
        assert (units is not None) == shared
        mb = learner._pad(mrows, batch, units)
        with saved_bytes(exclude=model.parameters()) as counted:
            logp, _ = learner._forward(mb)
        figures.append(counted.total)
        logp.sum().backward()  # the recompute runs without error
    plain, checkpointed = figures
    assert checkpointed < 0.6 * plain, figures


def test_an_episode_longer_than_the_micro_batch_is_refused_at_run_time() -> None:
    model = _model(lora=True)
    batch = _grouped_batch()
    longest = max(len(r) for r in batch.input_ids)
    learner = Learner(model, algorithm=AlgorithmConfig(), optim=OptimConfig(micro_batch_tokens=longest - 1))
    with pytest.raises(ConfigError, match=rf"episode of {longest} tokens exceeds optim.micro_batch_tokens"):
        learner.step(batch)


def test_an_episode_budget_over_the_micro_batch_is_refused_at_load() -> None:
    data = {
        "twin": {"name": "Toy"},
        "sampler": {"max_episode_tokens": 2048},
        "optim": {"micro_batch_tokens": 1024},
    }
    with pytest.raises(ConfigError, match=r"max_episode_tokens \(2048\) exceeds optim.micro_batch_tokens \(1024\)"):
        load_recipe(data)
    assert load_recipe(data, ["optim.micro_batch_tokens=2048"]).optim.micro_batch_tokens == 2048

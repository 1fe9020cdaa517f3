"""Fixtures shared by the learner tests: GRPO-shaped batches and the tiny model made trainable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from trainer.learner import TrainBatch, build_lora_model
from trainer.models import load_model


def make_grouped_batch(seed: int = 1, groups: int = 3, group_size: int = 4) -> TrainBatch:
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


def make_trainable_tiny(lora: bool) -> Any:
    """The tiny model with a LoRA adapter on q/v, or with every weight trainable."""
    torch.set_num_threads(1)
    model, _ = load_model("tiny")
    if lora:
        return build_lora_model(model, lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    for p in model.parameters():
        p.requires_grad_(True)
    return model



@pytest.fixture(scope="session")
def grouped_batch() -> Callable[..., TrainBatch]:
    """:func:`make_grouped_batch`: ``grouped_batch(seed=1, groups=3, group_size=4)``."""
    return make_grouped_batch


@pytest.fixture(scope="session")
def trainable_tiny() -> Callable[[bool], Any]:
    """:func:`make_trainable_tiny`: ``trainable_tiny(lora)``, a fresh model each call."""
    return make_trainable_tiny

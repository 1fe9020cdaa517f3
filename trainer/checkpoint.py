"""Checkpoints: everything needed to continue a run exactly.

``<output_dir>/checkpoints/step-000010/`` holds:

- ``adapter/``: the peft adapter (or, for full fine-tuning, the whole model) as
  ``save_pretrained`` writes it, loadable by vLLM's ``/v1/load_lora_adapter`` or transformers;
- ``trainer_state.pt``: trainable weights, AdamW state, policy version, the step count, the data
  cursor, the RNG states of python, numpy and torch, the run-store run id and the metrics so far;
- ``recipe.yaml``: the recipe the run was started with.

``trainer_state.pt`` holds tensors and plain python values only and is read with
``torch.load(weights_only=True)``: resuming never unpickles arbitrary objects. A checkpoint
written before that (it holds a numpy array) is refused with an error that says so.

A checkpoint is written to a temporary folder and renamed into place, and ``latest`` names the
newest one only after the rename: a run killed mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from twin.errors import ConfigError

__all__ = [
    "capture_rng",
    "latest_checkpoint",
    "load_checkpoint",
    "prepare_output_dir",
    "restore_rng",
    "save_checkpoint",
]

STATE_FILE = "trainer_state.pt"


def capture_rng() -> dict[str, Any]:
    """The RNG states of python, numpy and torch (CPU, and CUDA when present).

    Tensors and plain values only (numpy's key array as an int64 tensor), so that
    :func:`load_checkpoint` can read them with ``weights_only=True``.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos), int(has_gauss),
                  float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore :func:`capture_rng` output."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    learner: Any,
    state: dict[str, Any],
    recipe_yaml: str,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` (the number of steps done) and point ``latest`` at it.

    Args:
        output_dir: The run's folder.
        step: Steps completed.
        learner: The :class:`trainer.learner.Learner` (weights, optimizer, version).
        state: Loop state: ``cursor``, ``metrics``, ``run_id`` and anything else picklable.
        recipe_yaml: The recipe as YAML.
        keep: How many checkpoints to keep (older ones are deleted).

    Returns:
        The checkpoint folder.
    """
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step-{step:06d}.", dir=root))
    try:
        learner.save_adapter(tmp / "adapter")
        torch.save(
            {"step": step, "learner": learner.state_dict(), "rng": capture_rng(), **state},
            tmp / STATE_FILE,
        )
        (tmp / "recipe.yaml").write_text(recipe_yaml)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    pointer = root / "latest"
    pointer_tmp = root / ".latest.tmp"
    pointer_tmp.write_text(final.name + "\n")
    os.replace(pointer_tmp, pointer)
    if keep > 0:
        done = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in done[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = Path(output_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.exists():
        candidate = root / pointer.read_text().strip()
        if (candidate / STATE_FILE).exists():
            return candidate
    done = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).exists())
    return done[-1] if done else None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The state saved by :func:`save_checkpoint` (``step``, ``learner``, ``rng``, ...).

    Read with ``weights_only=True``: tensors and plain python values, nothing else is unpickled.

    Raises:
        ConfigError: the file holds other objects (a checkpoint from an older twinrl, or not one
            of ours): it is not loaded, since that would need unsafe unpickling.
    """
    file = Path(path) / STATE_FILE
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"checkpoint {str(file)!r} holds objects that only unsafe (pickle) loading could read "
            f"({reason}); it was written by an older twinrl or is not a twinrl checkpoint. It is not "
            "loaded: start the run again without --resume (with --overwrite), or load it yourself "
            "with torch.load(weights_only=False) only if you trust the file"
        ) from None


def prepare_output_dir(output_dir: str | Path, *, resume: bool, overwrite: bool) -> Path | None:
    """Get a run's folder ready and return the checkpoint to resume from (None: a fresh run).

    A fresh run (no ``resume``, or ``resume`` with no checkpoint) clears ``checkpoints/`` so
    that a later ``--resume`` never continues an older run's state; when that folder holds a
    complete checkpoint, only ``overwrite`` allows it.

    Raises:
        ConfigError: ``output_dir`` is a file, or it holds checkpoints and neither ``resume`` nor
            ``overwrite`` was given.
    """
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.output_dir {str(out)!r} is a file; give a folder (it is created if missing)")
    found = latest_checkpoint(out) if out.is_dir() else None
    if resume and found is not None:
        return found
    if found is not None and not overwrite:
        raise ConfigError(
            f"{str(out)!r} already holds checkpoints (latest: {found.name}); continue that run with "
            "--resume, start over with --overwrite (deletes them), or set another train.output_dir"
        )
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return None

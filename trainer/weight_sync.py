"""Weight sync: the learner's new versions, and the sampler servers that receive them.

- :class:`AdapterSink`: where each new policy version goes. :class:`InProcessAdapters` when the
  sampler shares the learner's model (``sampler.kind: hf`` in the synchronous loop),
  :class:`AdapterClient` for a server (``twin serve``, vLLM: ``POST /v1/load_lora_adapter``), and
  ``trainer/ray_backend.py``'s client that ships adapters through Ray's object store.
- :class:`AdapterPublisher`: saves ``policy@<version>``, loads it through the sink, and retires old
  versions (both loops of :mod:`trainer.runtime` publish through it).
- :func:`make_sampler_server`: the sampler server a run starts (``twin serve`` or vLLM), guarded
  so that it dies with the trainer.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx

from trainer.config import Recipe
from trainer.protocols import PolicyLearner
from trainer.serving.http import auth_headers
from trainer.serving.process import ServerProcess
from trainer.vllm import VLLMServer
from trainer.workers import AdapterSyncError, adapter_name, guarded_command
from twin.errors import ConfigError
from twin.policies.http import tls_context

__all__ = [
    "VLLM_UTILIZATION_ENV",
    "AdapterClient",
    "AdapterPublisher",
    "AdapterSink",
    "GuardedServerProcess",
    "GuardedVLLMServer",
    "InProcessAdapters",
    "make_sampler_server",
    "require_lora_for_server",
]

log = logging.getLogger("twinrl.trainer")


# -- adapter publishing ----------------------------------------------------------------------------
@runtime_checkable
class AdapterSink(Protocol):
    """Where each new policy version goes (the sampler's side of weight sync).

    ``needs_files``: whether :meth:`load` reads a saved adapter folder (a server) or not (a sampler
    that shares the learner's model, which has the new weights already).
    """

    needs_files: bool

    def load(self, name: str, path: str | Path | None) -> float:
        """Make adapter ``name`` (saved at ``path``) sampleable; return the seconds it took.

        Raises:
            AdapterSyncError: it was refused or could not be delivered.
        """
        ...

    def unload(self, name: str) -> None:
        """Drop adapter ``name`` (a failure is logged only)."""
        ...


class InProcessAdapters:
    """The sink of a sampler that samples with the learner's own model (``sampler.kind: hf``).

    Nothing is saved or sent: the model the sampler runs is the one the learner just updated.
    ``versions`` lists the names published, in order (what a server would have loaded).
    """

    needs_files = False

    def __init__(self) -> None:
        self.versions: list[str] = []

    def load(self, name: str, path: str | Path | None) -> float:
        self.versions.append(name)
        return 0.0

    def unload(self, name: str) -> None:
        return None


class AdapterClient:
    """Loads and unloads named LoRA adapters in a vLLM-compatible server (``twin serve``, vLLM).

    Args:
        base_url: Server root or OpenAI base URL (``/v1`` is handled either way).
        transport: An httpx transport (tests pass ``httpx.MockTransport``).
        timeout: Seconds per request.
    """

    needs_files = True

    def __init__(
        self, base_url: str, *, transport: httpx.BaseTransport | None = None, timeout: float = 120.0
    ) -> None:
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.transport = transport
        self.timeout = timeout

    def _post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(transport=self.transport, timeout=self.timeout, verify=tls_context(),
                          headers=auth_headers()) as client:  # fmt: skip
            return client.post(f"{self.root}{route}", json=body)

    def load(self, name: str, path: str | Path | None) -> float:
        """Load the adapter folder ``path`` as ``name``; return the seconds it took.

        Raises:
            AdapterSyncError: the server refused it or could not be reached (never ignored: a
                sampler left on an older adapter would train on the wrong policy).
        """
        started = time.perf_counter()
        try:
            response = self._post(
                "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
            )
        except httpx.HTTPError as exc:
            raise AdapterSyncError(
                f"could not load adapter {name} from {path}: the sampler at {self.root} is "
                f"unreachable ({type(exc).__name__}: {exc})"
            ) from exc
        if response.status_code != 200:
            raise AdapterSyncError(
                f"the sampler at {self.root} refused adapter {name} from {path}: HTTP "
                f"{response.status_code} {response.text[:300]}. Is the server started with LoRA "
                "enabled (vLLM: --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) and a "
                "--max-lora-rank >= lora.rank?"
            )
        return time.perf_counter() - started

    def unload(self, name: str) -> None:
        """Unload ``name`` (a failure is logged only: an extra resident adapter is harmless)."""
        try:
            response = self._post("/v1/unload_lora_adapter", {"lora_name": name})
            if response.status_code != 200:
                log.debug("unload %s: HTTP %d %s", name, response.status_code, response.text[:200])
        except httpx.HTTPError as exc:
            log.debug("unload %s failed: %s", name, exc)


class AdapterPublisher:
    """Saves the learner's adapter as ``policy@<version>`` and loads it through an
    :class:`AdapterSink`.

    The newest ``keep`` versions stay loaded (a lot in progress may still ask for them); older
    ones are unloaded and deleted on a background thread (an unload waits for the server's batch
    in flight). :meth:`load` may run on another thread than :meth:`save` (the async trainer's
    load thread), never on two at once.

    Args:
        output_dir: The run folder (adapters go to ``<output_dir>/adapters/policy@<v>``).
        sink: Where versions go.
        keep: Versions kept loaded (the synchronous loop: 1; the async one: ``max_staleness + 2``).
        before_save: Called with the version before its adapter is written (the 9B rehearsal
            moves the weights there, ``bench/rehearsal.py``).
    """

    def __init__(
        self, output_dir: Path, sink: AdapterSink, *, keep: int = 1,
        before_save: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self.output_dir = Path(output_dir)
        self.sink = sink
        self.keep = max(1, keep)
        self.before_save = before_save
        self.loaded: list[int] = []  # versions resident in the sampler, oldest first
        self.last_save_s = 0.0
        self._retirer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twin-adapter-retire")

    def adapter_dir(self, version: int) -> Path:
        """Where version ``version`` is saved."""
        return (self.output_dir / "adapters" / adapter_name(version)).resolve()

    def save(self, learner: PolicyLearner, version: int) -> Path | None:
        """Write the learner's adapter as ``version`` (on the learner: the next update changes the
        weights).

        Returns None when the sink needs no files.
        """
        if not self.sink.needs_files:
            return None
        started = time.perf_counter()
        path = self.adapter_dir(version)
        if not (path / "adapter_config.json").exists():
            if self.before_save is not None:
                self.before_save(version)
            learner.save_adapter(path)
        self.last_save_s = time.perf_counter() - started
        return path

    def load(self, version: int, path: Path | None) -> float:
        """Load a saved version in the sampler; return the seconds it took (0
        when already there)."""
        if version in self.loaded:
            return 0.0
        seconds = self.sink.load(adapter_name(version), path)
        self.loaded.append(version)
        while len(self.loaded) > self.keep:
            self._retirer.submit(self._retire, self.loaded.pop(0))
        return seconds

    def push(self, learner: PolicyLearner, version: int) -> float:
        """:meth:`save` then :meth:`load`, here; return the seconds the load took."""
        if version in self.loaded:
            return 0.0
        return self.load(version, self.save(learner, version))

    def forget(self, keep_version: int) -> None:
        """After a sampler restart nothing is loaded: delete every saved version but
        ``keep_version``."""
        for old in self.loaded:
            if old != keep_version:
                shutil.rmtree(self.adapter_dir(old), ignore_errors=True)
        self.loaded.clear()

    def _retire(self, version: int) -> None:
        self.sink.unload(adapter_name(version))
        shutil.rmtree(self.adapter_dir(version), ignore_errors=True)

    def close(self) -> None:
        """Wait for the retirements in flight."""
        self._retirer.shutdown(wait=True)


def require_lora_for_server(cfg: Recipe, who: str) -> None:
    """Refuse a recipe whose new weights would have to reach a server without LoRA.

    Raises:
        ConfigError: ``lora.enabled`` is false.
    """
    if not cfg.lora.enabled:
        raise ConfigError(
            f"{who} sends new weights to the sampler as LoRA adapters; set lora.enabled: true "
            "(or use async.max_staleness: 0 with sampler.kind: hf for full fine-tuning)"
        )


# -- the sampler server a run starts ---------------------------------------------------------------
#: vLLM's ``--gpu-memory-utilization`` for the sampler the trainer starts (unset: vLLM's 0.9);
#: lower it when rollout and learner share a GPU (``twin plan --vllm-utilization`` sizes it).
VLLM_UTILIZATION_ENV = "TWINRL_VLLM_GPU_MEMORY_UTILIZATION"


class GuardedServerProcess(ServerProcess):
    """``twin serve`` as the trainer starts it: it gets SIGTERM when the trainer dies (Linux)."""

    def command(self) -> list[str]:
        return guarded_command(super().command())


class GuardedVLLMServer(VLLMServer):
    """vLLM as the trainer starts it: it gets SIGTERM when the trainer dies (Linux)."""

    def command(self) -> list[str]:
        return guarded_command(super().command())


def make_sampler_server(
    cfg: Recipe, output_dir: Path, model_path: str | None = None, *, max_loras: int = 2
) -> Any:
    """The sampler server a run starts (not started yet), or None for ``sampler.kind: server``
    (external).

    Args:
        cfg: The recipe (``sampler.kind``: ``hf`` starts ``twin serve``, ``vllm`` vLLM).
        output_dir: The run folder (server logs; every adapter is written under it).
        model_path: The base model the learner trains (``model.init_from``'s merged weights;
            default ``model.path``).
        max_loras: Adapters the server keeps resident at once.

    Raises:
        ConfigError: ``$TWINRL_VLLM_GPU_MEMORY_UTILIZATION`` is not a fraction.
    """
    model_path = model_path or cfg.model.path
    kind = cfg.sampler.kind
    device = cfg.devices.rollout
    dtype = (
        cfg.model.dtype
        if cfg.model.dtype != "auto"
        else ("float32" if device == "cpu" else "bfloat16")
    )
    if kind == "server":
        return None
    if kind == "hf":
        return GuardedServerProcess(
            model_path,
            dtype=dtype,
            max_loras=max_loras + 1,
            served_model_name="base",
            device=device,
            threads=cfg.devices.cpu_threads,
            seed=cfg.seed,
            log_path=output_dir / "sampler.log",
            adapter_root=output_dir,  # the learner writes every adapter under it
        )
    from trainer.models import resolve_model_path

    # rollout and learner sharing one GPU: vLLM must leave the learner room (its default takes 90 %)
    utilization = os.environ.get(VLLM_UTILIZATION_ENV)
    try:
        extra = {"gpu_memory_utilization": float(utilization)} if utilization else {}
    except ValueError:
        raise ConfigError(
            f"${VLLM_UTILIZATION_ENV} must be a fraction in (0, 1], got {utilization!r}"
        ) from None
    # from_recipe also passes the LoRA target modules (without them vLLM wraps lm_head and crashes
    # on prompt_logprobs beside generating requests: docs/serving.md)
    return GuardedVLLMServer.from_recipe(
        cfg,
        model=resolve_model_path(model_path),
        python=os.environ.get("TWINRL_VLLM_PYTHON", ".venv-vllm"),
        served_model_name="base",
        max_loras=max_loras,
        log_path=output_dir / "vllm.log",
        **extra,
    )

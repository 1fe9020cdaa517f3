"""The async trainer: rollout and learning in separate processes, bounded staleness, LoRA hot-swap.

::

    trainer = AsyncTrainer(load_recipe("toy-cpu", ["lora.enabled=true", "async.max_staleness=1"]))
    trainer.setup()           # learner here; sampler server + rollout worker started
    history = trainer.train() # one metrics dict per step
    trainer.cleanup()

Three processes (see ``docs/async.md``)::

     sampler server (twin serve | vLLM)         rollout worker (trainer.workers)
     rollout device, adapters policy@<v>  <---  envs + renderer + ServerSampler(policy@<v>)
              ^                                       |  Lot(version=v, groups)
              |  POST /v1/load_lora_adapter           v  bounded queue (async.queue_size)
     learner (this process, learner device): take lot -> drop if step - v > k -> Learner.step
              -> save adapter policy@<step+1> -> load it in the sampler -> publish step+1
              -> probe: learner vs sampler logprobs on the same tokens (async/logprob_mismatch)
              (k >= 1: the load, the publish and the probe's sampler side run on threads while
              the learner goes on with its next update)

One step of :meth:`AsyncTrainer.train`, the loop in plain view::

    lot       = next lot off the queue (learner idle while waiting; the sampler is watched)
    staleness = step - lot.version; > max_staleness -> drop it (counted), take the next
    metrics   = learner.step(batch(lot.kept groups))      # TIS against the sampler's logprobs
    sync      = save adapter policy@<step+1>; POST /v1/load_lora_adapter; publish step+1
                (k = 0: here, before the next lot; k >= 1: the load and the publish on the load
                thread -- the worker never sees a version before its adapter is loaded, and a
                failed load raises AdapterSyncError while the learner waits for its next lot)
    mismatch  = probe the new adapter: |learner logprob - sampler logprob| on the probe tokens
                (the learner's side here, the sampler's after the load, in the background;
                every async.check_every-th version, and always the last)
    log, store the episodes, checkpoint every N steps

``max_staleness: 0`` is the synchronous loop run by the same code: the worker samples a lot only
after the adapter of the step before it is loaded. With ``k >= 1`` the worker samples the next lot
with the newest published adapter while the learner trains on the previous one.

Faults: when the sampler server dies the learner says so, restarts it on the same port, reloads
the current adapter, and the worker samples its lot again; a killed learner (this process)
continues with ``twin train RECIPE --resume`` from the last checkpoint; an adapter that does not
load, or a response from another model than the one asked for, raises :class:`AdapterSyncError`.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from trainer.config import Recipe
from trainer.metrics import open_training_run
# at import, not in the probe / load threads: an import compiles, and CPython 3.11's compiler is not
# safe against a compile in another thread ("AST constructor recursion depth mismatch")
from trainer.samplers import SamplerError
from trainer.serving.http import auth_headers
from trainer.workers import (
    AdapterSyncError,
    Lot,
    SharedState,
    WorkerSpec,
    adapter_name,
    guarded_command,
    rollout_worker,
)
from twin.errors import ConfigError, TwinError
from twin.http import tls_context
from twin.trajectory import Group

__all__ = ["AdapterClient", "AdapterSyncError", "AsyncTrainer", "SamplerDiedError", "guarded_command"]

log = logging.getLogger("twinrl.trainer.async")

#: Positions of the probe sequence whose logprobs are compared after each sync (the mismatch metric).
PROBE_POSITIONS = 16
#: Longest probe sequence (the twin's first prompt, cut here).
PROBE_MAX_TOKENS = 512
#: vLLM's ``--gpu-memory-utilization`` for the sampler the trainer starts (unset: vLLM's 0.9);
#: lower it when rollout and learner share a GPU (``twin plan --vllm-utilization`` sizes it).
VLLM_UTILIZATION_ENV = "TWINRL_VLLM_GPU_MEMORY_UTILIZATION"
#: Sampler restarts allowed before one training step succeeds (a server that cannot serve the
#: recipe, e.g. an unsupported model, must fail the run, not restart forever).
MAX_RESTARTS_WITHOUT_PROGRESS = 2


class SamplerDiedError(TwinError):
    """The sampler server died and could not be restarted (or did not come back)."""


# -- adapter loading --------------------------------------------------------------------------------
class AdapterClient:
    """Loads and unloads named LoRA adapters in a vLLM-compatible server.

    Args:
        base_url: Server root or OpenAI base URL (``/v1`` is handled either way).
        transport: An httpx transport (tests pass ``httpx.MockTransport``).
        timeout: Seconds per request.
    """

    def __init__(self, base_url: str, *, transport: httpx.BaseTransport | None = None, timeout: float = 120.0) -> None:
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.transport = transport
        self.timeout = timeout

    def _post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(transport=self.transport, timeout=self.timeout, verify=tls_context(),
                          headers=auth_headers()) as client:  # fmt: skip
            return client.post(f"{self.root}{route}", json=body)

    def load(self, name: str, path: str | Path) -> float:
        """Load the adapter folder ``path`` as ``name``; return the seconds it took.

        Raises:
            AdapterSyncError: the server refused it or could not be reached (never ignored: a
                sampler left on an older adapter would train on the wrong policy).
        """
        started = time.perf_counter()
        try:
            response = self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        except httpx.HTTPError as exc:
            raise AdapterSyncError(
                f"could not load adapter {name} from {path}: the sampler at {self.root} is unreachable "
                f"({type(exc).__name__}: {exc})"
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


# -- starting the sampler -------------------------------------------------------------------------
def _make_server(cfg: Recipe, output_dir: Path, model_path: str | None = None) -> Any:
    """The managed sampler server of a recipe, or None for ``sampler.kind: server`` (external).

    ``model_path``: the base model the learner trains (``model.init_from``'s merged weights), default ``model.path``.
    """
    model_path = model_path or cfg.model.path
    kind = cfg.sampler.kind
    device = cfg.devices.rollout
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    if kind == "server":
        return None
    if kind == "hf":
        from trainer.serving.process import ServerProcess

        class _Server(ServerProcess):
            def command(self) -> list[str]:
                return guarded_command(super().command())

        return _Server(
            model_path, dtype=dtype, max_loras=cfg.async_.max_staleness + 3, served_model_name="base",
            device=device, threads=cfg.devices.cpu_threads, seed=cfg.seed, log_path=output_dir / "sampler.log",
            adapter_root=output_dir,  # the learner writes every adapter under it
        )  # fmt: skip
    from trainer.models import resolve_model_path
    from trainer.vllm import VLLMServer

    class _VLLM(VLLMServer):
        def command(self) -> list[str]:
            return guarded_command(super().command())

    # rollout and learner sharing one GPU: vLLM must leave the learner room (its default takes 90 %)
    utilization = os.environ.get(VLLM_UTILIZATION_ENV)
    try:
        extra = {"gpu_memory_utilization": float(utilization)} if utilization else {}
    except ValueError:
        raise ConfigError(f"${VLLM_UTILIZATION_ENV} must be a fraction in (0, 1], got {utilization!r}") from None
    return _VLLM.from_recipe(
        cfg, model=resolve_model_path(model_path), python=os.environ.get("TWINRL_VLLM_PYTHON", ".venv-vllm"),
        served_model_name="base", max_loras=cfg.async_.max_staleness + 2, log_path=output_dir / "vllm.log", **extra,
    )  # fmt: skip


# -- the trainer ------------------------------------------------------------------------------------
class AsyncTrainer:
    """GRPO with the rollout worker and the learner in separate processes.

    Same interface as :class:`trainer.recipe.GRPORecipe` (``setup`` / ``train`` / ``cleanup``),
    the same metrics plus ``async/*``, the same checkpoints and ``--resume``.

    Args:
        cfg: The validated recipe (``lora.enabled: true``: new weights travel as adapters).
        resume: Continue from the newest checkpoint of ``cfg.train.output_dir``.
        overwrite: Without ``resume``, delete the checkpoints an earlier run left in
            ``cfg.train.output_dir`` (without it, :meth:`setup` refuses to start over them).
        on_step: Called with each step's metrics record.
    """

    def __init__(
        self, cfg: Recipe, *, resume: bool = False, overwrite: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        if not cfg.lora.enabled:
            raise ConfigError(
                "the async trainer sends new weights to the sampler as LoRA adapters; set "
                "lora.enabled: true (or async.max_staleness: 0 with sampler.kind: hf for full fine-tuning)"
            )
        self.cfg = cfg
        self.resume = resume
        self.overwrite = overwrite
        self.on_step = on_step
        self.output_dir = Path(cfg.train.output_dir)
        self.k = cfg.async_.max_staleness
        self.step = 0
        self.cursor = 0
        self.lots_used = 0  # lots taken off the queue (used or dropped) over the whole run
        self.run_id: int | None = None
        self.store: Any = None
        self.server: Any = None
        self.worker: Any = None
        self.restarts = 0
        self.dropped = 0
        self.staleness_hist: Counter[int] = Counter()
        self._loaded: list[int] = []  # adapter versions resident in the sampler, oldest first
        self.last_save_s = self.last_load_s = 0.0
        self.last_wait_s = 0.0  # learner time spent waiting for the previous background load
        self._housekeeping = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twin-adapter-retire")
        # k >= 1: adapter loads run here, one at a time and in version order, off the learner's path
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twin-adapter-load")
        self._pending_load: tuple[int, Future[float]] | None = None  # (version, its load + publish)
        self.check_every = cfg.async_.check_every
        self._probe_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twin-sync-probe")
        self._probes: list[tuple[int, Future[float]]] = []  # (version, its sampler-side score), oldest first
        self._probe_ids: list[int] = []
        self._probe_transport: httpx.BaseTransport | None = None
        #: Update passes over each lot (1 = GRPO as configured). ``twin bench trainer`` raises it to
        #: make learning take as long as rollout on CPU, where the built-in server is slow.
        self.update_epochs = 1
        self._epoch = 0
        self._failures_since_step = 0
        # the recipe's length curriculum, run here and published to the worker
        start = getattr(cfg.sampler, "length_curriculum_start", 1)
        self.curriculum: dict[str, float | None] = {"limit": float(start), "reward": None}

    # ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Learner, checkpoint, metrics, store; then the worker process and the sampler server."""
        from trainer.checkpoint import load_checkpoint, prepare_output_dir, restore_rng
        from trainer.config import check_devices
        from trainer.learner import Learner, build_lora_model
        from trainer.metrics import MetricsLogger
        from trainer.models import load_model
        from trainer.recipe import seed_everything
        from twin.registry import make_twin

        cfg = self.cfg
        check_devices(cfg)
        # before the model loads: a refused output folder should cost nothing
        checkpoint = prepare_output_dir(self.output_dir, resume=self.resume, overwrite=self.overwrite)
        if self.resume and checkpoint is None:
            log.warning("--resume: no checkpoint in %s; starting a fresh run", self.output_dir)
        # TRY NOT TO MODIFY: seeding, threads, the twin
        seed_everything(cfg.seed)
        # threads, and with devices.cpu_affinity: auto this process's cores (before the children start)
        from trainer.placement import place_learner

        place_learner(cfg)
        self.twin = make_twin(cfg.twin.name, **cfg.twin.config)
        self.twin.num_cases(cfg.twin.split)

        # the learner, on its device
        from trainer.checkpoint import init_model_path

        self.model_path = init_model_path(cfg.model.path, cfg.model.init_from, self.output_dir, cfg.model.dtype)
        model, self.tokenizer = load_model(self.model_path, cfg.model.dtype, device=cfg.devices.learner)
        model = build_lora_model(
            model, lora_rank=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
        )  # fmt: skip
        self.learner = Learner(
            model, algorithm=cfg.algorithm, optim=cfg.optim, temperature=cfg.sampler.temperature,
            max_tokens=cfg.sampler.max_episode_tokens,
        )  # fmt: skip

        # Adapters are re-saved from the learner (a killed run may have left one half written).
        shutil.rmtree(self.output_dir / "adapters", ignore_errors=True)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "recipe.yaml").write_text(cfg.to_yaml())
        if checkpoint is not None:
            state = load_checkpoint(checkpoint)
            self.learner.load_state_dict(state["learner"])
            self.step = int(state["step"])
            self.cursor = int(state["cursor"])
            self.lots_used = int(state.get("lots_used", self.step))
            self.run_id = state.get("run_id")
            self.restarts = int(state.get("sampler_restarts", 0))
            self.dropped = int(state.get("dropped_stale", 0))
            self.staleness_hist = Counter({int(k): v for k, v in state.get("staleness_hist", {}).items()})
            self.curriculum = dict(state.get("curriculum", self.curriculum))
            restore_rng(state["rng"])
            log.info("resumed from %s (step %d)", checkpoint, self.step)
        self.metrics = MetricsLogger(
            self.output_dir, resume_step=self.step if checkpoint else None, sinks=self.cfg.train.log,
            config=self.cfg.model_dump(mode="json", by_alias=True),
        )
        self._setup_store()

        self._start_rollout()

        # the sampler, with the current policy loaded
        if self.server is not None:
            self.server.start()
        elif not self._healthy(self.adapters.root):
            raise ConfigError(f"sampler server {self.adapters.root} does not answer /health; is it running?")
        self._probe_ids = self._probe_sequence()
        self._push(self.step)
        self.shared.update(published=self.step)
        self._launch_probe(self.step)

    def _start_rollout(self) -> None:
        """The rollout side: shared counters, lot and event queues, the rollout worker process (started)
        and the sampler server (made, started by :meth:`setup`).

        The seam of the Ray backend (:class:`trainer.ray_backend.RayTrainer`), which puts the same
        objects behind Ray actors; everything else in this class runs unchanged on top of them.
        """
        import multiprocessing

        cfg = self.cfg
        # the rollout worker (spawned first: its imports overlap the server's start-up)
        ctx = multiprocessing.get_context("spawn")
        self.shared = SharedState(ctx)
        self.shared.update(published=-1, claimed=self.step, consumed=self.lots_used,
                           max_new_tokens=self.max_new_tokens(self.step))  # fmt: skip
        self.lots: Any = ctx.Queue(maxsize=cfg.async_.queue_size)
        self.events: Any = ctx.Queue()
        self.server = _make_server(cfg, self.output_dir, self.model_path)
        base_url = self.server.url if self.server is not None else str(cfg.sampler.base_url)
        self.adapters = AdapterClient(base_url)
        spec = WorkerSpec(
            recipe=cfg.model_dump(mode="json", by_alias=True), base_url=base_url,
            start_lot=self.lots_used, start_cursor=self.cursor, cpu_threads=1,
        )  # fmt: skip
        self.worker = ctx.Process(
            target=rollout_worker, args=(spec, self.shared, self.lots, self.events), name="twin-rollout", daemon=True
        )
        self.worker.start()

    def _probe_sequence(self) -> list[int]:
        """The token sequence both sides score after each sync: the split's first case prompt."""
        from trainer.renderer import Renderer
        from twin.env import TwinEnv

        env = TwinEnv(self.twin)
        obs, info = env.reset(options={"split": self.cfg.twin.split, "index": 0})
        renderer = Renderer(self.tokenizer, info["tools"], chat_template=self.cfg.model.chat_template,
                            template_kwargs=self.cfg.model.template_kwargs)  # fmt: skip
        return list(renderer.start(obs))[:PROBE_MAX_TOKENS]

    def _setup_store(self) -> None:
        self.store, self.run_id = open_training_run(self.cfg, self.twin.name, self.run_id)

    @staticmethod
    def _healthy(base_url: str) -> bool:
        root = base_url.rstrip("/").removesuffix("/v1")
        try:
            return httpx.get(f"{root}/health", timeout=5.0, verify=tls_context()).status_code == 200
        except httpx.HTTPError:
            return False

    # -- length curriculum (the synchronous recipe's rules, applied to each lot) -------------------
    def max_new_tokens(self, step: int) -> int:
        """The per-turn token limit for lots sampled from ``step`` on."""
        from trainer.recipe import GRPORecipe

        rule = getattr(GRPORecipe, "max_new_tokens", None)
        return int(rule(self, step)) if rule is not None else self.cfg.sampler.max_new_tokens

    def _grow_length(self, kept: list[Group], mean_reward: float) -> None:
        from trainer.recipe import GRPORecipe

        rule = getattr(GRPORecipe, "_grow_length", None)
        if rule is not None:
            rule(self, kept, mean_reward)

    # -- weight sync -----------------------------------------------------------------------------
    def _adapter_dir(self, version: int) -> Path:
        return (self.output_dir / "adapters" / adapter_name(version)).resolve()

    def _save(self, version: int) -> Path:
        """Write the learner's adapter as ``policy@<version>`` (on the learner: the next update
        changes the weights)."""
        started = time.perf_counter()
        path = self._adapter_dir(version)
        if not (path / "adapter_config.json").exists():
            self.learner.save_adapter(path)
        self.last_save_s = time.perf_counter() - started
        return path

    def _load(self, version: int, path: Path) -> float:
        """Load a saved adapter in the sampler; return the seconds it took (0 when already there).

        Runs on the learner (``k = 0``, set-up, restarts) or on the load thread (``k >= 1``), never
        on both at once: the learner settles the load in flight before it touches ``_loaded``.
        """
        if version in self._loaded:
            return 0.0  # already there (a restart reloaded it)
        seconds = self.adapters.load(adapter_name(version), path)
        self._loaded.append(version)
        # Keep the versions a lot in progress may still ask for (k + 1 of them); drop older ones
        # in the background (an unload waits for the server's batch in flight).
        while len(self._loaded) > self.k + 2:
            old = self._loaded.pop(0)
            self._housekeeping.submit(self._retire, old)
        return seconds

    def _push(self, version: int) -> float:
        """Save the learner's adapter as ``policy@<version>`` and load it in the sampler, here."""
        started = time.perf_counter()
        if version in self._loaded:
            return 0.0  # already there (a restart reloaded it)
        self.last_load_s = self._load(version, self._save(version))
        return time.perf_counter() - started

    def _sync(self, version: int) -> float:
        """Send the learner's new adapter ``version`` to the sampler and publish it once loaded.

        ``k = 0`` (the synchronous loop): save, load and publish here, before the next lot is
        sampled. ``k >= 1``: save here, then hand the load to the load thread, which publishes
        ``version`` only after the sampler took it -- the worker samples with published versions
        only, so a lot's version tag always names a loaded adapter -- and return at once. A failed
        load raises :class:`AdapterSyncError` from :meth:`_settle_load` (while the learner waits
        for its next lot, or before the next sync at the latest).

        Returns:
            Seconds this took on the learner (``k >= 1``: saving, and waiting for the previous
            version's load when it was still running; ``async/load_wait_s``).
        """
        max_new = self.max_new_tokens(version)
        if self.k == 0:
            synced = self._guarded(lambda: self._push(version))
            self.shared.update(published=version, max_new_tokens=max_new)
            self.last_wait_s = 0.0
            return synced
        started = time.perf_counter()
        self.last_wait_s = self._settle_load(wait=True)  # loads stay in version order, one at a time
        if version in self._loaded:  # a restart while settling reloaded it already
            self.shared.update(published=version, max_new_tokens=max_new)
            return time.perf_counter() - started
        path = self._save(version)
        self._pending_load = (version, self._loader.submit(self._load_and_publish, version, path, max_new))
        return time.perf_counter() - started

    def _load_and_publish(self, version: int, path: Path, max_new_tokens: int) -> float:
        """The load thread's job: load ``version``, then let the worker sample with it."""
        seconds = self._load(version, path)
        self.shared.update(published=version, max_new_tokens=max_new_tokens)
        return seconds

    def _settle_load(self, *, wait: bool) -> float:
        """Collect the background load when it is done (``wait``: wait for it); return seconds waited.

        Raises:
            AdapterSyncError: the load failed while the sampler is up (refused adapter, bad path).
                When the sampler died instead it is restarted with the current adapter, as a
                synchronous load would be (:meth:`_guarded`).
        """
        if self._pending_load is None:
            return 0.0
        version, future = self._pending_load
        if not wait and not future.done():
            return 0.0
        started = time.perf_counter()
        try:
            self.last_load_s = future.result()
        except AdapterSyncError as exc:
            self._pending_load = None
            dead = self.server is not None and not self.server.alive()
            if not dead and self._healthy(self.adapters.root):
                raise AdapterSyncError(
                    f"step {self.step}: loading {adapter_name(version)} in the background failed, and the sampler "
                    f"is up, so it will not take it (the worker still samples with the previous adapter and "
                    f"never with this one): {exc}"
                ) from exc
            self._restart_sampler(str(exc).splitlines()[0])
        else:
            self._pending_load = None
        return time.perf_counter() - started

    def _retire(self, version: int) -> None:
        self.adapters.unload(adapter_name(version))
        shutil.rmtree(self._adapter_dir(version), ignore_errors=True)

    # -- the sync check ---------------------------------------------------------------------------
    def _launch_probe(self, version: int) -> None:
        """Score the probe sequence with the learner now, and on the sampler in the background.

        The learner's side runs here, between updates, so it sees exactly the weights of
        ``version``; the sampler's side waits for the server's batch in flight without holding
        up the next update. Both are raw logprobs (temperature 1), as ``prompt_logprobs`` are.
        """
        from trainer.learner import TrainBatch

        ids = self._probe_ids
        if len(ids) < 2:
            return
        positions = list(range(max(1, len(ids) - PROBE_POSITIONS), len(ids)))
        batch = TrainBatch([ids], [[0] * len(ids)], [[0.0] * len(ids)], [0.0])
        temperature, self.learner.temperature = self.learner.temperature, 1.0
        try:
            row = self.learner.logprobs(batch)[0]
        finally:
            self.learner.temperature = temperature
        mine = [row[i] for i in positions]
        pending = self._pending_load
        load = pending[1] if pending is not None and pending[0] == version else None
        future = self._probe_pool.submit(self._score_after_load, load, version, ids, positions, mine)
        self._probes.append((version, future))

    def _score_after_load(
        self, load: Future[float] | None, version: int, ids: list[int], positions: list[int], mine: list[float]
    ) -> float:
        """:meth:`_score_on_sampler` once the background load of ``version`` is done (NaN when it
        failed: that failure is raised by :meth:`_settle_load`, not here)."""
        if load is not None:
            try:
                load.result()
            except Exception:  # noqa: BLE001 - reported once, by the learner's _settle_load
                return float("nan")
        return self._score_on_sampler(version, ids, positions, mine)

    def _score_on_sampler(self, version: int, ids: list[int], positions: list[int], mine: list[float]) -> float:
        """Mean |learner - sampler| logprob of ``ids`` at ``positions`` under adapter ``version``."""
        name = adapter_name(version)
        body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 1}
        try:
            with httpx.Client(transport=self._probe_transport, timeout=300, verify=tls_context(),
                              headers=auth_headers()) as client:  # fmt: skip
                response = client.post(f"{self.adapters.root}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise SamplerError(f"sync probe of {name}: sampler unreachable ({type(exc).__name__}: {exc})") from exc
        if response.status_code != 200:
            raise SamplerError(f"sync probe of {name}: HTTP {response.status_code} {response.text[:300]}")
        data = response.json()
        if data.get("model") != name:
            raise AdapterSyncError(
                f"the sampler answered a request for {name!r} with model {data.get('model')!r}: the adapter did "
                "not reach the sampler"
            )
        scored = data["choices"][0]["prompt_logprobs"]
        theirs = [float(scored[i][str(ids[i])]["logprob"]) for i in positions]
        return statistics.fmean(abs(a - b) for a, b in zip(mine, theirs))

    def _collect_probes(self, *, wait_below: int | None = None) -> tuple[float, int, int]:
        """The checks that completed since the last call, each reported once.

        Checks still running are left for a later step, except those of versions below
        ``wait_below``, which are waited for (None: wait for all). The train loop passes the
        step's own number, so a check is reported at most one step after its adapter's step and
        waits only when it took longer than a whole step.

        Returns:
            ``(worst mismatch, newest version checked, checks completed)``; ``(NaN, -1, 0)`` when
            none completed (a failed check counts, as NaN, and is logged).

        Raises:
            AdapterSyncError: the sampler answered a check with another model than the adapter.
        """
        done: list[tuple[int, float]] = []
        running: list[tuple[int, Future[float]]] = []
        for version, future in self._probes:
            if wait_below is None or version < wait_below or future.done():
                done.append((version, self._probe_value(version, future)))
            else:
                running.append((version, future))
        self._probes = running
        if not done:
            return float("nan"), -1, 0
        finite = [m for _, m in done if math.isfinite(m)]
        return (max(finite) if finite else float("nan")), max(v for v, _ in done), len(done)

    def _probe_result(self) -> tuple[float, int]:
        """``(worst mismatch, newest version)`` of every check launched and not yet reported (waits)."""
        mismatch, version, _ = self._collect_probes()
        return mismatch, version

    @staticmethod
    def _probe_value(version: int, future: Future[float]) -> float:
        try:
            return future.result(timeout=600)
        except AdapterSyncError:
            raise
        except (SamplerError, KeyError, IndexError, TypeError, ValueError, TimeoutError) as exc:
            log.warning("sync probe of %s failed: %s", adapter_name(version), exc)
            return float("nan")

    # -- faults ----------------------------------------------------------------------------------
    def _restart_sampler(self, why: str) -> None:
        """Bring the sampler back with the current adapter, then let the worker resample its lot."""
        where = self.server.url if self.server is not None else self.adapters.root
        self._failures_since_step += 1
        if self._failures_since_step > MAX_RESTARTS_WITHOUT_PROGRESS:
            tail = self.server.log_tail(30) if self.server is not None else "(external server)"
            raise SamplerDiedError(
                f"the sampler server {where} failed {self._failures_since_step} times without a training step "
                f"in between (last: {why}); it cannot serve this recipe. Its log "
                f"{getattr(self.server, 'log_path', '')}:\n{tail}"
            )
        log.error("step %d: the sampler server %s failed (%s); restarting it and reloading %s",
                  self.step, where, why, adapter_name(self.step))  # fmt: skip
        pending, self._pending_load = self._pending_load, None
        if pending is not None:  # let the load in flight end (it fails fast on a dead server): one
            try:  # load at a time, and _loaded is this thread's again
                pending[1].result()
            except Exception as exc:  # noqa: BLE001 - the current adapter is reloaded below
                log.warning("load of %s in flight failed with the sampler: %s", adapter_name(pending[0]), exc)
        if self.server is not None:
            self.server.stop()
            try:
                self.server.start()
            except TwinError as exc:
                raise SamplerDiedError(f"the sampler server died ({why}) and did not restart: {exc}") from exc
        else:
            deadline = time.monotonic() + 300
            while not self._healthy(where):
                if time.monotonic() > deadline:
                    raise SamplerDiedError(f"the sampler server {where} died ({why}) and did not come back in 300 s")
                time.sleep(1.0)
        for old in self._loaded:
            if old != self.step:
                shutil.rmtree(self._adapter_dir(old), ignore_errors=True)
        self._loaded.clear()
        self._push(self.step)
        # the reloaded adapter is the newest: publish it (a background load may have died unpublished)
        self.shared.update(published=self.step, max_new_tokens=self.max_new_tokens(self.step))
        self.restarts += 1
        self._epoch += 1
        self.shared.update(epoch=self._epoch)
        self._launch_probe(self.step)  # the one in flight may have died with the server
        log.warning("step %d: sampler back on %s with %s (restart %d)", self.step, where, adapter_name(self.step),
                    self.restarts)  # fmt: skip

    def _guarded(self, fn: Callable[[], float]) -> float:
        """Run a sampler call of the learner; when the sampler died meanwhile, restart it and retry once."""
        try:
            return fn()
        except (AdapterSyncError, SamplerError) as exc:
            dead = self.server is not None and not self.server.alive()
            if not dead and self._healthy(self.adapters.root):
                raise
            self._restart_sampler(str(exc).splitlines()[0])
            return fn()

    def _check_processes(self) -> None:
        if self.server is not None and not self.server.alive():
            code = self.server.process.returncode if self.server.process is not None else None
            self._restart_sampler(f"process exited with code {code}; log {self.server.log_path}")
        if self.worker is not None and not self.worker.is_alive():
            self._drain_events()
            raise TwinError(f"the rollout worker process exited with code {self.worker.exitcode}")

    def _drain_events(self) -> None:
        while True:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            kind = event[0]
            if kind == "fatal":
                raise TwinError(event[1])
            if kind == "sampler_error":
                epoch, message = event[1], event[2]
                if epoch != self._epoch:
                    continue  # an error from before the last restart; the worker already retries
                server_dead = self.server is not None and not self.server.alive()
                if server_dead or not self._healthy(self.adapters.root):
                    self._restart_sampler(message)
                else:
                    # The server is up and still refused: a real error (unknown adapter, bad
                    # request), never something to paper over with the base model.
                    raise AdapterSyncError(f"the rollout worker's sampler failed while the server is up: {message}")

    def _next_lot(self) -> tuple[Lot, float]:
        """The next lot off the queue, watching the sampler and the worker while waiting."""
        started = time.perf_counter()
        while True:
            self._drain_events()
            self._settle_load(wait=False)  # a failed background load surfaces here, not a step later
            try:
                lot = self.lots.get(timeout=0.05)
                return lot, time.perf_counter() - started
            except queue.Empty:
                self._check_processes()

    # -- the loop ----------------------------------------------------------------------------------
    def make_batch(self, groups: list[Group]) -> Any:
        """Advantages per group (on the shaped rewards), then one row per episode."""
        from trainer.recipe import make_batch

        return make_batch(groups, self.cfg.algorithm.advantage)

    def train(self) -> list[dict[str, Any]]:
        """Run the remaining steps; return the metrics history (earlier steps included)."""
        from trainer.recipe import learn_from_groups

        cfg = self.cfg
        started = time.perf_counter()
        learner_idle = 0.0
        t_last = started
        while self.step < cfg.train.steps:
            step = self.step

            # ROLLOUT: the worker's next lot; stale ones are dropped and counted
            lot, waited = self._next_lot()
            learner_idle += waited
            depth = self._qsize()
            self.lots_used += 1
            staleness = step - lot.version
            if staleness > self.k:
                self.dropped += 1
                self.shared.update(consumed=self.lots_used)
                log.warning("step %d: dropped lot %d sampled by version %d (%d versions old > max_staleness %d)",
                            step, lot.index, lot.version, staleness, self.k)  # fmt: skip
                continue
            self.shared.update(claimed=step + 1, consumed=self.lots_used)
            self.cursor = lot.cursor
            self.staleness_hist[staleness] += 1
            every = [Group.model_validate_json(g) for g in lot.groups]
            kept = [every[i] for i in lot.kept]

            # ALGO LOGIC: advantages and one update (TIS against the sampler's logprobs); the
            # synchronous recipe's step body
            update = learn_from_groups(
                self.learner, kept, every, advantage=cfg.algorithm.advantage, step=step, epochs=self.update_epochs
            )
            learn, learn_s, episodes = update.learn, update.learn_s, update.episodes
            self._grow_length(kept, episodes["rewards/total"])

            # SYNC: the new adapter to the sampler, then the worker may sample with it (k = 0: loaded
            # and published here; k >= 1: saved here, loaded and published by the load thread)
            self.step = step + 1
            sync_s = self._sync(self.step)
            # the checks completed meanwhile (waiting only for one older than this step's lot's
            # adapter), then the check of the new adapter: the learner's side here, the sampler's
            # after the load, in the background
            t_check = time.perf_counter()
            mismatch, probed, checks = self._collect_probes(wait_below=step)
            last = self.step == cfg.train.steps
            if last or self.step % self.check_every == 0:
                self._launch_probe(self.step)
            if last:  # nothing left to overlap with: the last load must have worked; report its check
                self._settle_load(wait=True)
                final, probed_last, more = self._collect_probes()
                if more:
                    mismatch = final if not math.isfinite(mismatch) else max(mismatch, final)
                    probed, checks = probed_last, checks + more
            check_s = time.perf_counter() - t_check

            self._failures_since_step = 0

            # TRY NOT TO MODIFY: record
            now = time.perf_counter()
            step_s, t_last = now - t_last, now
            wall = now - started
            tokens = lot.stats.get("sampled_tokens", 0.0)
            worker_wall = lot.stats.get("worker_wall_s", 0.0)
            record = {
                **episodes,
                **{k: v for k, v in lot.stats.items() if k.startswith("batch/")},
                **learn,
                "batch/skipped": float(not kept),
                "policy/version": float(self.step),
                "async/staleness": float(staleness),
                "async/staleness_hist": {str(s): n for s, n in sorted(self.staleness_hist.items())},
                "async/dropped_stale": float(self.dropped),
                "async/queue_depth": float(depth),
                "async/rollout_idle_frac": lot.stats.get("worker_idle_s", 0.0) / worker_wall if worker_wall else 0.0,
                "async/learner_idle_frac": learner_idle / wall if wall > 0 else 0.0,
                "async/learner_wait_s": waited,
                "async/learner_idle_s": learner_idle,
                "async/learner_wall_s": wall,
                "async/rollout_idle_s": lot.stats.get("worker_idle_s", 0.0),
                "async/rollout_wall_s": worker_wall,
                "async/sync_s": sync_s,
                "async/load_wait_s": self.last_wait_s,
                "async/save_s": self.last_save_s,
                "async/load_s": self.last_load_s,
                "async/logprob_mismatch": mismatch,
                "async/checks": float(checks),
                "async/check_s": check_s,
                "async/probe_version": float(probed),
                "async/sampler_restarts": float(self.restarts),
                "perf/rollout_s": lot.stats.get("rollout_s", 0.0),
                "perf/sample_tokens_per_s": tokens / lot.stats["rollout_s"] if lot.stats.get("rollout_s") else 0.0,
                "perf/learn_s": learn_s,
                "perf/sync_s": sync_s,
                "perf/sampled_tokens": tokens,
                "perf/step_s": step_s,
                "perf/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
                "data/cursor": float(self.cursor),
            }
            record = self.metrics.log(step, record, episodes=[t for g in every for t in g.trajectories])
            if self.store is not None and self.run_id is not None:
                try:
                    self.store.add_episodes(self.run_id, [t for g in every for t in g.trajectories], step=step)
                    self.store.log_metrics(
                        self.run_id, step, {k: v for k, v in record.items() if k != "step" and _finite(v)}
                    )
                except Exception as exc:  # noqa: BLE001 - keep training; say why episodes are missing
                    log.warning("run store write failed at step %d: %s", step, exc)
            if self.on_step is not None:
                self.on_step(record)
            every_n = cfg.train.checkpoint_every
            if (every_n and self.step % every_n == 0) or self.step == cfg.train.steps:
                self.save()
        return list(self.metrics.history)

    def _qsize(self) -> int:
        try:
            return int(self.lots.qsize())
        except NotImplementedError:  # macOS
            return -1

    def save(self) -> Path:
        """Write a checkpoint of the current state (the same layout as the sync recipe's)."""
        from trainer.checkpoint import save_checkpoint

        return save_checkpoint(
            self.output_dir,
            self.step,
            learner=self.learner,
            state={
                "cursor": self.cursor,
                "lots_used": self.lots_used,
                "run_id": self.run_id,
                "metrics": list(self.metrics.history),
                "sampler_restarts": self.restarts,
                "dropped_stale": self.dropped,
                "staleness_hist": dict(self.staleness_hist),
                "curriculum": dict(self.curriculum),
            },
            recipe_yaml=self.cfg.to_yaml(),
        )

    def stop_workers(self) -> None:
        """Stop the rollout worker and the sampler server (idempotent)."""
        self._loader.shutdown(wait=True)  # before housekeeping: a load may still retire an adapter
        self._housekeeping.shutdown(wait=True)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        if self.worker is not None:
            self.shared.update(stop=1)
            self.worker.join(timeout=10)
            if self.worker.is_alive():
                self.worker.terminate()
                self.worker.join(timeout=5)
            self.worker = None
            for q in (self.lots, self.events):
                q.cancel_join_thread()
                q.close()
        if self.server is not None:
            self.server.stop()

    def cleanup(self) -> Path | None:
        """Stop the processes, plot the reward curve, close the store; return the plot's path."""
        from trainer.metrics import plot_rewards

        plot = None
        metrics = getattr(self, "metrics", None)
        try:
            self.stop_workers()
            if metrics is not None:
                plot = plot_rewards(
                    metrics.history, self.output_dir / "rewards.png",
                    title=f"{self.cfg.twin.name}: {self.cfg.model.path} (async, k={self.k})",
                )  # fmt: skip
        finally:
            if metrics is not None:
                metrics.close()
            if self.store is not None:
                if self.run_id is not None and self.step >= self.cfg.train.steps:
                    last = metrics.history[-1] if metrics is not None and metrics.history else {}
                    try:
                        self.store.finish_run(self.run_id, metrics={k: v for k, v in last.items() if _finite(v)})
                    except Exception as exc:  # noqa: BLE001
                        log.warning("run store: could not finish run %s: %s", self.run_id, exc)
                self.store.close()
        return plot


def _finite(value: Any) -> bool:
    return not isinstance(value, float) or math.isfinite(value)

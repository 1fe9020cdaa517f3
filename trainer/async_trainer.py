# Over 500 lines on purpose: the async loop and its fault handling (sampler restarts, the load
# thread, stale lots) read as one unit.
"""The async loop: rollout and learning in separate processes, bounded staleness, LoRA hot-swap.

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
                (:class:`trainer.probe.SyncProbe`; every async.check_every-th version, and always
                the last)
    log, store the episodes, checkpoint every N steps

``max_staleness: 0`` is the synchronous order run by this code: the worker samples a lot only
after the adapter of the step before it is loaded. With ``k >= 1`` the worker samples the next lot
with the newest published adapter while the learner trains on the previous one. Set-up,
checkpoints, the store, the curriculum and the update are the runtime's
(:class:`trainer.runtime.TrainingRuntime`), shared with :class:`trainer.sync_trainer.SyncTrainer`.

Collaborators are constructor arguments: ``launcher`` starts the rollout side (default: the
sampler server and a spawned worker process, :func:`spawn_rollout_worker`), ``adapters`` loads
versions into the sampler, ``transport`` carries the health checks and probes (tests pass
``httpx.MockTransport``).

Faults: when the sampler server dies the learner says so, restarts it on the same port, reloads
the current adapter, and the worker samples its lot again; a killed learner (this process)
continues with ``twin train RECIPE --resume`` from the last checkpoint; an adapter that does not
load, or a response from another model than the one asked for, raises :class:`AdapterSyncError`.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from trainer.config import Recipe
from trainer.probe import SyncProbe, probe_sequence
from trainer.protocols import PolicyLearner, RunRecord
from trainer.runtime import TrainingRuntime, step_perf

# at import, not in the load thread: an import compiles, and CPython 3.11's compiler is not safe
# against a compile in another thread ("AST constructor recursion depth mismatch")
from trainer.samplers import SamplerError
from trainer.weight_sync import (
    AdapterClient,
    AdapterPublisher,
    AdapterSink,
    make_sampler_server,
    require_lora_for_server,
)
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
from twin.policies.http import tls_context
from twin.trajectory import Group

__all__ = [
    "AdapterSyncError",
    "AsyncTrainer",
    "RolloutLauncher",
    "RolloutSide",
    "SamplerDiedError",
    "guarded_command",
    "spawn_rollout_worker",
]

log = logging.getLogger("twinrl.trainer.async")

#: Sampler restarts allowed before one training step succeeds (a server that cannot serve the
#: recipe, e.g. an unsupported model, must fail the run, not restart forever).
MAX_RESTARTS_WITHOUT_PROGRESS = 2


class SamplerDiedError(TwinError):
    """The sampler server died and could not be restarted (or did not come back)."""


# -- the rollout side ------------------------------------------------------------------------------
@dataclass
class RolloutSide:
    """What a launcher started for the learner to talk to.

    Attributes:
        shared: The counters shared with the worker(s) (:class:`trainer.workers.SharedState`'s
            interface).
        lots: The queue the lots arrive on (``get(timeout=)``, ``qsize()``).
        events: The queue of the worker's events (``get_nowait()``; see
            :func:`trainer.workers.rollout_worker`).
        base_url: The sampler server's URL.
        server: The managed sampler server (``start`` / ``stop`` / ``alive`` / ``log_tail`` /
            ``log_path`` / ``process``; started by the trainer), or None for an external one.
        worker: The worker process handle (``is_alive`` / ``exitcode`` / ``join`` / ``terminate``),
            or None when the launcher watches its workers itself.
    """

    shared: Any
    lots: Any
    events: Any
    base_url: str
    server: Any = None
    worker: Any = None


class RolloutLauncher(Protocol):
    """Starts the rollout side of an async run (the worker started, the
    server made, not started)."""

    def __call__(self, trainer: AsyncTrainer) -> RolloutSide: ...


def spawn_rollout_worker(trainer: AsyncTrainer) -> RolloutSide:
    """The local rollout side: shared counters, lot and event queues, a spawned rollout worker
    process (started; its imports overlap the server's start-up) and the sampler server (made)."""
    import multiprocessing

    cfg = trainer.cfg
    ctx = multiprocessing.get_context("spawn")
    shared = SharedState(ctx)
    shared.update(published=-1, claimed=trainer.step, consumed=trainer.lots_used,
                  max_new_tokens=trainer.max_new_tokens(trainer.step))  # fmt: skip
    lots: Any = ctx.Queue(maxsize=cfg.async_.queue_size)
    events: Any = ctx.Queue()
    server = make_sampler_server(
        cfg, trainer.output_dir, trainer.model_path, max_loras=trainer.k + 2
    )
    base_url = server.url if server is not None else str(cfg.sampler.base_url)
    spec = WorkerSpec(
        recipe=cfg.model_dump(mode="json", by_alias=True), base_url=base_url,
        start_lot=trainer.lots_used, start_cursor=trainer.cursor, cpu_threads=1,
    )  # fmt: skip
    worker = ctx.Process(
        target=rollout_worker, args=(spec, shared, lots, events), name="twin-rollout", daemon=True
    )
    worker.start()
    return RolloutSide(
        shared=shared, lots=lots, events=events, base_url=base_url, server=server, worker=worker
    )


# -- the trainer -----------------------------------------------------------------------------------
class AsyncTrainer(TrainingRuntime):
    """GRPO with the rollout worker and the learner in separate processes.

    The interface of :class:`trainer.sync_trainer.SyncTrainer` (``setup`` / ``train`` /
    ``cleanup``), the same metrics plus ``async/*``, the same checkpoints (plus the counters of
    :meth:`extra_state`) and ``--resume``.

    Args:
        cfg: The validated recipe (``lora.enabled: true``: new weights travel as adapters).
        resume: Continue from the newest checkpoint of ``cfg.train.output_dir``.
        overwrite: Without ``resume``, delete the checkpoints an earlier run left there.
        on_step: Called with each step's metrics record.
        learner: The learner (default: built from the recipe).
        adapters: Loads versions into the sampler (default: an
            :class:`trainer.weight_sync.AdapterClient` of the launched server, over ``transport``).
        store: A run store (default: the recipe's ``train.store``).
        launcher: Starts the rollout side (default: :func:`spawn_rollout_worker`).
        transport: httpx transport of the health checks, probes and default adapter client.

    Raises:
        ConfigError: ``lora.enabled`` is false.
    """

    plot_label = " (async)"

    def __init__(
        self,
        cfg: Recipe,
        *,
        resume: bool = False,
        overwrite: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        learner: PolicyLearner | None = None,
        adapters: AdapterSink | None = None,
        store: RunRecord | None = None,
        launcher: RolloutLauncher | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        require_lora_for_server(cfg, "the async trainer")
        super().__init__(cfg, resume=resume, overwrite=overwrite, on_step=on_step, learner=learner,
                         adapters=adapters, store=store)  # fmt: skip
        self.plot_label = f" (async, k={cfg.async_.max_staleness})"
        self.launcher: RolloutLauncher = launcher or spawn_rollout_worker
        self.transport = transport
        self.k = cfg.async_.max_staleness
        self.lots_used = 0  # lots taken off the queue (used or dropped) over the whole run
        self.worker: Any = None
        self.restarts = 0
        self.dropped = 0
        self.staleness_hist: Counter[int] = Counter()
        self.last_load_s = 0.0
        self.last_wait_s = 0.0  # learner time spent waiting for the previous background load
        # k >= 1: adapter loads run here, one at a time and in version order, off the learner's path
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twin-adapter-load")
        self._pending_load: tuple[int, Future[float]] | None = None  # (version, its load + publish)
        self.check_every = cfg.async_.check_every
        self.probe: SyncProbe | None = None
        self._epoch = 0
        self._failures_since_step = 0

    # -- checkpoints: the async loop's counters ---------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            "lots_used": self.lots_used,
            "sampler_restarts": self.restarts,
            "dropped_stale": self.dropped,
            "staleness_hist": dict(self.staleness_hist),
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.lots_used = int(state.get("lots_used", state["step"]))
        self.restarts = int(state.get("sampler_restarts", 0))
        self.dropped = int(state.get("dropped_stale", 0))
        self.staleness_hist = Counter(
            {int(k): v for k, v in state.get("staleness_hist", {}).items()}
        )

    # -- set-up ----------------------------------------------------------------------------------
    def place_threads(self) -> None:
        # threads, and with devices.cpu_affinity: auto this process's cores (before the children
        # start)
        from trainer.placement import place_learner

        place_learner(self.cfg)

    def before_adapter_save(self, version: int) -> None:
        """Called before version ``version``'s adapter is written (override;
        the 9B rehearsal does)."""

    def setup(self) -> None:
        """The runtime's set-up; then the rollout side, the sampler with the current policy, the
        probe."""
        self.setup_runtime()
        side = self.start_rollout()
        self.shared, self.lots, self.events = side.shared, side.lots, side.events
        self.server, self.worker = side.server, side.worker
        if self.adapters is None:
            self.adapters = AdapterClient(side.base_url, transport=self.transport)
        self.sampler_url = side.base_url.rstrip("/").removesuffix("/v1")
        self.publisher = AdapterPublisher(self.output_dir, self.adapters, keep=self.k + 2,
                                          before_save=self.before_adapter_save)  # fmt: skip

        # the sampler, with the current policy loaded
        if self.server is not None:
            self.server.start()
        elif not self._healthy():
            raise ConfigError(
                f"sampler server {self.sampler_root} does not answer /health; is it running?"
            )
        self.probe = SyncProbe(self.learner, probe_sequence(self.twin, self.tokenizer, self.cfg),
                               lambda: self.sampler_root, transport=self.transport)  # fmt: skip
        self._push(self.step)
        self.shared.update(published=self.step)
        self.probe.launch(self.step)

    def start_rollout(self) -> RolloutSide:
        """The rollout side (:attr:`launcher`); the seam of the Ray backend
        (:class:`trainer.ray_backend.RayTrainer`)."""
        return self.launcher(self)

    @property
    def sampler_root(self) -> str:
        """The sampler's root URL (health checks and probes go there)."""
        return str(getattr(self.adapters, "root", None) or self.sampler_url)

    def _healthy(self) -> bool:
        try:
            with httpx.Client(
                transport=self.transport, timeout=5.0, verify=tls_context()
            ) as client:
                return client.get(f"{self.sampler_root}/health").status_code == 200
        except httpx.HTTPError:
            return False

    # -- weight sync -----------------------------------------------------------------------------
    def _push(self, version: int) -> float:
        """Save the learner's adapter as ``policy@<version>`` and load it in the sampler, here."""
        assert self.publisher is not None
        started = time.perf_counter()
        if version in self.publisher.loaded:
            return 0.0  # already there (a restart reloaded it)
        self.last_load_s = self.publisher.push(self.learner, version)
        return time.perf_counter() - started

    def _sync(self, version: int) -> float:
        """Send the learner's new adapter ``version`` to the sampler and publish it once loaded.

        ``k = 0`` (the synchronous order): save, load and publish here, before the next lot is
        sampled. ``k >= 1``: save here, then hand the load to the load thread, which publishes
        ``version`` only after the sampler took it -- the worker samples with published versions
        only, so a lot's version tag always names a loaded adapter -- and return at once. A failed
        load raises :class:`AdapterSyncError` from :meth:`_settle_load` (while the learner waits
        for its next lot, or before the next sync at the latest).

        Returns:
            Seconds this took on the learner (``k >= 1``: saving, and waiting for the previous
            version's load when it was still running; ``async/load_wait_s``).
        """
        assert self.publisher is not None
        max_new = self.max_new_tokens(version)
        if self.k == 0:
            synced = self._guarded(lambda: self._push(version))
            self.shared.update(published=version, max_new_tokens=max_new)
            self.last_wait_s = 0.0
            return synced
        started = time.perf_counter()
        self.last_wait_s = self._settle_load(
            wait=True
        )  # loads stay in version order, one at a time
        if version in self.publisher.loaded:  # a restart while settling reloaded it already
            self.shared.update(published=version, max_new_tokens=max_new)
            return time.perf_counter() - started
        path = self.publisher.save(self.learner, version)
        self._pending_load = (
            version,
            self._loader.submit(self._load_and_publish, version, path, max_new),
        )
        return time.perf_counter() - started

    def _load_and_publish(self, version: int, path: Path | None, max_new_tokens: int) -> float:
        """The load thread's job: load ``version``, then let the worker sample with it."""
        assert self.publisher is not None
        seconds = self.publisher.load(version, path)
        self.shared.update(published=version, max_new_tokens=max_new_tokens)
        return seconds

    def _settle_load(self, *, wait: bool) -> float:
        """Collect the background load when it is done (``wait``: wait for it); return seconds
        waited.

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
            if not self._sampler_dead():
                raise AdapterSyncError(
                    f"step {self.step}: loading {adapter_name(version)} in the background failed, "
                    "and the sampler is up, so it will not take it (the worker still samples with "
                    f"the previous adapter and never with this one): {exc}"
                ) from exc
            self._restart_sampler(str(exc).splitlines()[0])
        else:
            self._pending_load = None
        return time.perf_counter() - started

    def _pending_load_of(self, version: int) -> Future[float] | None:
        pending = self._pending_load
        return pending[1] if pending is not None and pending[0] == version else None

    # -- faults ----------------------------------------------------------------------------------
    def _sampler_dead(self) -> bool:
        return (self.server is not None and not self.server.alive()) or not self._healthy()

    def _restart_sampler(self, why: str) -> None:
        """Bring the sampler back with the current adapter, then let the worker resample its lot."""
        assert self.publisher is not None and self.probe is not None
        where = self.server.url if self.server is not None else self.sampler_root
        self._failures_since_step += 1
        if self._failures_since_step > MAX_RESTARTS_WITHOUT_PROGRESS:
            tail = self.server.log_tail(30) if self.server is not None else "(external server)"
            raise SamplerDiedError(
                f"the sampler server {where} failed {self._failures_since_step} times without a "
                f"training step in between (last: {why}); it cannot serve this recipe. Its log "
                f"{getattr(self.server, 'log_path', '')}:\n{tail}"
            )
        log.error("step %d: the sampler server %s failed (%s); restarting it and reloading %s",
                  self.step, where, why, adapter_name(self.step))  # fmt: skip
        pending, self._pending_load = self._pending_load, None
        if pending is not None:  # let the load in flight end (it fails fast on a dead server): one
            try:  # load at a time, and the publisher is this thread's again
                pending[1].result()
            except Exception as exc:  # noqa: BLE001 - the current adapter is reloaded below
                log.warning(
                    "load of %s in flight failed with the sampler: %s",
                    adapter_name(pending[0]),
                    exc,
                )
        if self.server is not None:
            self.server.stop()
            try:
                self.server.start()
            except TwinError as exc:
                raise SamplerDiedError(
                    f"the sampler server died ({why}) and did not restart: {exc}"
                ) from exc
        else:
            deadline = time.monotonic() + 300
            while not self._healthy():
                if time.monotonic() > deadline:
                    raise SamplerDiedError(
                        f"the sampler server {where} died ({why}) and did not come back in 300 s"
                    )
                time.sleep(1.0)
        self.publisher.forget(keep_version=self.step)
        self._push(self.step)
        # the reloaded adapter is the newest: publish it (a background load may have died
        # unpublished)
        self.shared.update(published=self.step, max_new_tokens=self.max_new_tokens(self.step))
        self.restarts += 1
        self._epoch += 1
        self.shared.update(epoch=self._epoch)
        self.probe.launch(self.step)  # the one in flight may have died with the server
        log.warning(
            "step %d: sampler back on %s with %s (restart %d)",
            self.step,
            where,
            adapter_name(self.step),
            self.restarts,
        )

    def _guarded(self, fn: Callable[[], float]) -> float:
        """Run a sampler call of the learner; when the sampler died meanwhile, restart it and retry
        once."""
        try:
            return fn()
        except (AdapterSyncError, SamplerError) as exc:
            if not self._sampler_dead():
                raise
            self._restart_sampler(str(exc).splitlines()[0])
            return fn()

    def check_processes(self) -> None:
        """Restart a dead sampler server; raise when the rollout worker died (override: Ray's
        actors)."""
        if self.server is not None and not self.server.alive():
            code = self.server.process.returncode if self.server.process is not None else None
            self._restart_sampler(f"process exited with code {code}; log {self.server.log_path}")
        if self.worker is not None and not self.worker.is_alive():
            self.drain_events()
            raise TwinError(f"the rollout worker process exited with code {self.worker.exitcode}")

    def drain_events(self) -> None:
        """Act on the worker's events: a fatal error is raised, a sampler failure restarts the
        sampler.

        Raises:
            TwinError: the worker failed.
            AdapterSyncError: the worker's sampler failed while the server is up (a real error,
                never papered over with the base model).
        """
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
                if self._sampler_dead():
                    self._restart_sampler(message)
                else:
                    raise AdapterSyncError(
                        f"the rollout worker's sampler failed while the server is up: {message}"
                    )

    def next_lot(self) -> tuple[Lot, float]:
        """The next lot off the queue, watching the sampler and the worker while waiting."""
        started = time.perf_counter()
        while True:
            self.drain_events()
            self._settle_load(
                wait=False
            )  # a failed background load surfaces here, not a step later
            try:
                lot = self.lots.get(timeout=0.05)
                return lot, time.perf_counter() - started
            except queue.Empty:
                self.check_processes()

    # -- the loop ----------------------------------------------------------------------------------
    def train(self) -> list[dict[str, Any]]:
        """Run the remaining steps; return the metrics history (earlier steps included)."""
        assert self.metrics is not None and self.probe is not None, "train() before setup()"
        started = time.perf_counter()
        learner_idle, t_last = 0.0, started
        while self.step < self.cfg.train.steps:
            step = self.step

            # ROLLOUT: the worker's next lot; stale ones are dropped and counted
            lot, waited = self.next_lot()
            learner_idle += waited
            depth = self._qsize()
            staleness = self._claim(step, lot)
            if staleness is None:
                continue
            every = [Group.model_validate_json(g) for g in lot.groups]
            kept = [every[i] for i in lot.kept]

            # ALGO LOGIC: advantages and one update (TIS against the sampler's logprobs); the
            # synchronous loop's update
            update = self.learn(kept, every, step)

            # SYNC: the new adapter to the sampler, then the worker may sample with it (k = 0:
            # loaded and published here; k >= 1: saved here, loaded and published by the load
            # thread)
            self.step = step + 1
            sync_s = self._sync(self.step)
            t_check = time.perf_counter()
            check = self._check_sync(step)
            check_s = time.perf_counter() - t_check

            self._failures_since_step = 0

            # TRY NOT TO MODIFY: record
            now = time.perf_counter()
            step_s, t_last = now - t_last, now
            times = {
                "async/learner_wait_s": waited,
                "async/learner_idle_s": learner_idle,
                "async/learner_wall_s": now - started,
                "async/sync_s": sync_s,
                "async/check_s": check_s,
            }
            record = {
                **update.episodes,
                **{k: v for k, v in lot.stats.items() if k.startswith("batch/")},
                **update.learn,
                "batch/skipped": float(not kept),
                "policy/version": float(self.step),
                **self._async_metrics(lot, staleness, depth, check, times),
                "perf/learn_s": update.learn_s,
                "perf/sampled_tokens": lot.stats.get("sampled_tokens", 0.0),
                **step_perf(
                    rollout_s=lot.stats.get("rollout_s", 0.0),
                    sampled_tokens=lot.stats.get("sampled_tokens", 0.0),
                    sync_s=sync_s,
                    step_s=step_s,
                    cursor=self.cursor,
                ),  # fmt: skip
            }
            self.record_step(step, record, every)
        return list(self.metrics.history)

    def _claim(self, step: int, lot: Lot) -> int | None:
        """Take ``lot`` for ``step``: its staleness, or None when it is too stale (dropped)."""
        self.lots_used += 1
        staleness = step - lot.version
        if staleness > self.k:
            self.dropped += 1
            self.shared.update(consumed=self.lots_used)
            log.warning(
                "step %d: dropped lot %d sampled by version %d "
                "(%d versions old > max_staleness %d)",
                step,
                lot.index,
                lot.version,
                staleness,
                self.k,
            )
            return None
        self.shared.update(claimed=step + 1, consumed=self.lots_used)
        self.cursor = lot.cursor
        self.staleness_hist[staleness] += 1
        return staleness

    def _check_sync(self, step: int) -> tuple[float, int, int]:
        """The sync checks after ``step``'s update: ``(mismatch, probed version, checks)``.

        Collects the checks completed meanwhile (waiting only for one older than this step's
        lot's adapter), then launches the check of the new adapter. After the last step nothing
        is left to overlap with: the last load must have worked, and its check is reported.
        """
        assert self.probe is not None
        mismatch, probed, checks = self.probe.collect(wait_below=step)
        last = self.step == self.cfg.train.steps
        if last or self.step % self.check_every == 0:
            self.probe.launch(self.step, self._pending_load_of(self.step))
        if last:
            self._settle_load(wait=True)
            final, probed_last, more = self.probe.collect()
            if more:
                mismatch = final if not math.isfinite(mismatch) else max(mismatch, final)
                probed, checks = probed_last, checks + more
        return mismatch, probed, checks

    def _async_metrics(
        self,
        lot: Lot,
        staleness: int,
        depth: int,
        check: tuple[float, int, int],
        times: dict[str, float],
    ) -> dict[str, Any]:
        """A step's ``async/*`` metrics: staleness, queue, idle fractions, sync and its check."""
        mismatch, probed, checks = check
        worker_wall = lot.stats.get("worker_wall_s", 0.0)
        worker_idle = lot.stats.get("worker_idle_s", 0.0)
        wall = times["async/learner_wall_s"]
        return {
            "async/staleness": float(staleness),
            "async/staleness_hist": {str(s): n for s, n in sorted(self.staleness_hist.items())},
            "async/dropped_stale": float(self.dropped),
            "async/queue_depth": float(depth),
            "async/rollout_idle_frac": worker_idle / worker_wall if worker_wall else 0.0,
            "async/learner_idle_frac": times["async/learner_idle_s"] / wall if wall > 0 else 0.0,
            "async/learner_wait_s": times["async/learner_wait_s"],
            "async/learner_idle_s": times["async/learner_idle_s"],
            "async/learner_wall_s": wall,
            "async/rollout_idle_s": worker_idle,
            "async/rollout_wall_s": worker_wall,
            "async/sync_s": times["async/sync_s"],
            "async/load_wait_s": self.last_wait_s,
            "async/save_s": self.publisher.last_save_s if self.publisher is not None else 0.0,
            "async/load_s": self.last_load_s,
            "async/logprob_mismatch": mismatch,
            "async/checks": float(checks),
            "async/check_s": times["async/check_s"],
            "async/probe_version": float(probed),
            "async/sampler_restarts": float(self.restarts),
        }

    def _qsize(self) -> int:
        try:
            return int(self.lots.qsize())
        except NotImplementedError:  # macOS
            return -1

    # -- the end ---------------------------------------------------------------------------------
    def stop_workers(self) -> None:
        """Stop the load thread, the probe, the rollout worker and the
        sampler server (idempotent)."""
        self._loader.shutdown(wait=True)  # before the publisher: a load may still retire an adapter
        if self.publisher is not None:
            self.publisher.close()
        if self.probe is not None:
            self.probe.close()
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

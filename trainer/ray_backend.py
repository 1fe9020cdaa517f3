# Over 500 lines on purpose: the Ray backend (coordinator, worker and engine actors, the trainer,
# the learner actor) is one optional feature behind one dependency.
"""``backend: ray``: the async trainer's rollout side as Ray actors, on one machine or a cluster.

::

    cfg = load_recipe("toy-lora-cpu", ["backend=ray", "ray.rollout_workers=2"])
    trainer = RayTrainer(cfg)   # = twin train RECIPE with `backend: ray`
    trainer.setup(); trainer.train(); trainer.cleanup()

What runs where (docs/scaling.md)::

    driver = learner (this process)            Ray actors
    ------------------------------------       -------------------------------------------------
    AsyncTrainer.train(): the same loop,        _Coordinator        counters, lot claims, cursor
    staleness checks, TIS, probes, faults  <->  ray.util.queue      lots, events (as mp queues)
    save policy@<v> -> ray.put(files)  ------>  EngineActor x E     `twin serve` / vLLM, one per
                                                                     placement-group bundle (GPU)
    lots.get()  <----------------------------  RolloutWorkerActor  the local worker's loop
                                                 x N                 (trainer.workers._RolloutLoop)

:class:`RayTrainer` is :class:`trainer.async_trainer.AsyncTrainer` with its one seam,
``start_rollout``, answered by Ray: the shared counters become a coordinator actor with the same
methods (:class:`RaySharedState`), the queues Ray queues (their ``Empty`` / ``Full`` are the
standard library's), the sampler server a group of engine actors with the server's interface
(:class:`EngineGroup`) and the adapter client one that ships each version through Ray's object
store (:class:`RayAdapterClient`): no shared filesystem between the learner and the engines.
Bounded staleness, ``policy@<v>`` names, the model check of every response, the logprob-mismatch
probe and sampler restarts are the local backend's code, unchanged.

N rollout workers share one lot sequence: a worker claims the next lot from the coordinator under
the local backend's rule (a lot sampled now is at most ``max_staleness`` versions old when trained)
and takes its cases from one shared data cursor. A claim and its cases are remembered until the lot
is queued, so a worker actor that dies (killed, OOM, node lost) is restarted by Ray and samples the
same lot again; an engine actor that dies is restarted by the learner's sampler-restart path (a new
epoch; the workers resample their lots). A dead learner (this process) continues with ``--resume``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainer.async_trainer import AsyncTrainer, RolloutSide
from trainer.config import Recipe
from trainer.placement import place_rollout_process
from trainer.weight_sync import AdapterClient, make_sampler_server
from trainer.workers import (
    Lot,
    ModelCheckTransport,
    WorkerSpec,
    _batched_sampler,
    _RolloutLoop,
    _Stopped,
    adapter_name,
)
from twin.errors import ConfigError, TwinError

__all__ = ["EngineGroup", "RayAdapterClient", "RaySharedState", "RayTrainer", "RemoteLearner"]

log = logging.getLogger("twinrl.trainer.ray")

#: Seconds a worker's claim waits in the coordinator (which checks every 2 ms, as the local worker
#: checks its shared counters) before the worker looks at the stop flag again.
CLAIM_WAIT_S = 0.25
#: Seconds between a waiting worker's checks of a new epoch (one call to the coordinator each).
POLL_S = 0.01
#: Seconds the engines' placement group may wait for free resources before the run is refused.
PLACEMENT_TIMEOUT_S = 120.0


# -- the coordinator: SharedState's counters, plus lot claims and the data cursor ------------------
class _Coordinator:
    """The counters of :class:`trainer.workers.SharedState` in one actor, for N workers.

    ``produced`` is global here (lots claimed by any worker), so the staleness rule is the local
    one. ``claims`` holds each worker's lot in progress (index and cases taken) until it is queued.
    """

    def __init__(
        self, published: int, claimed: int, consumed: int, max_new_tokens: int, cursor: int
    ) -> None:
        self.values = {
            "published": published,
            "claimed": claimed,
            "consumed": consumed,
            "epoch": 0,
            "stop": 0,
            "max_new_tokens": max_new_tokens,
        }
        self.produced = consumed
        self.cursor = cursor
        self.claims: dict[int, dict[str, Any]] = {}
        self.urls: dict[int, str] = {}
        self.starts: dict[int, int] = {}

    def hello(self, worker: int) -> None:
        """A worker actor (re)started: counted, so that the learner can tell restarts apart."""
        self.starts[worker] = self.starts.get(worker, 0) + 1

    def restarts(self) -> dict[int, int]:
        """Restarts per worker (starts after the first)."""
        return {w: n - 1 for w, n in self.starts.items()}

    async def claim_wait(
        self, worker: int, max_staleness: int, timeout: float
    ) -> tuple[int, list[tuple[int, int]]] | None:
        """:meth:`claim`, waiting here up to ``timeout`` seconds: one call per
        wait, not one per poll."""
        import asyncio

        deadline = time.monotonic() + timeout
        while True:
            claim = self.claim(worker, max_staleness)
            if claim is not None or self.values["stop"] or time.monotonic() >= deadline:
                return claim
            await asyncio.sleep(0.002)

    def get(self) -> tuple[int, int, int, int, int]:
        v = self.values
        return v["published"], v["claimed"], v["consumed"], v["epoch"], v["stop"]

    def max_new_tokens(self) -> int:
        return int(self.values["max_new_tokens"])

    def update(self, changes: dict[str, int]) -> None:
        for key, value in changes.items():
            if key not in self.values:
                raise KeyError(f"unknown shared counter {key!r}; known: {', '.join(self.values)}")
            self.values[key] = int(value)

    def claim(self, worker: int, max_staleness: int) -> tuple[int, list[tuple[int, int]]] | None:
        """The worker's lot in progress (after its restart), else a new lot
        when the rule allows it."""
        v = self.values
        if v["stop"] or v["published"] < 0:
            return None
        if worker in self.claims:
            held = self.claims[worker]
            return held["index"], list(held["cases"])
        if v["claimed"] + (self.produced - v["consumed"]) - v["published"] > max_staleness:
            return None
        self.claims[worker] = {"index": self.produced, "cases": []}
        self.produced += 1
        return self.claims[worker]["index"], []

    def take_cases(self, worker: int, n: int) -> int:
        """Reserve ``n`` positions of the data stream for the worker's lot; return the first."""
        start = self.cursor
        self.cursor += n
        self.claims[worker]["cases"].append((start, n))
        return start

    def cursor_now(self) -> int:
        return self.cursor

    def done(self, worker: int) -> int:
        """The worker queued its lot; return the data cursor (what a checkpoint resumes from)."""
        self.claims.pop(worker, None)
        return self.cursor

    def set_urls(self, urls: dict[int, str]) -> None:
        self.urls = dict(urls)

    def url_for(self, worker: int) -> str:
        return self.urls[worker % len(self.urls)]


class RaySharedState:
    """:class:`trainer.workers.SharedState`'s interface over the coordinator actor (picklable)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.handle, method).remote(*args))

    def get(self) -> tuple[int, int, int, int, int]:
        """``(published, claimed, consumed, epoch, stop)``."""
        return self._call("get")

    def max_new_tokens(self) -> int:
        """The per-turn token limit for new lots (0 = the recipe's)."""
        return self._call("max_new_tokens")

    def update(self, **changes: int) -> None:
        """Set several counters at once, as :meth:`SharedState.update`."""
        self._call("update", changes)

    def may_sample(self, produced: int, max_staleness: int) -> bool:
        """The local rule, with ``produced`` the caller's count (kept for the interface)."""
        published, claimed, consumed, _epoch, stop = self.get()
        return (
            not stop
            and published >= 0
            and claimed + (produced - consumed) - published <= max_staleness
        )


# -- rollout workers -------------------------------------------------------------------------------
class _RayRolloutLoop(_RolloutLoop):
    """The local worker's loop (sampling, dynamic sampling, lots) with lots claimed, not counted."""

    def __init__(
        self, spec: WorkerSpec, shared: RaySharedState, lots: Any, events: Any, worker: int
    ) -> None:
        super().__init__(spec, shared, lots, events)
        self.worker = worker
        self.base_url = spec.base_url
        self.redo: list[tuple[int, int]] = []  # (cursor, n) blocks of a lot sampled again

    def _cases(self, n: int) -> list[tuple[str, int]]:
        from trainer.episodes import training_cases

        if self.redo:  # the same cases as the try that failed, block by block (still claimed)
            start, n = self.redo.pop(0)
        else:
            start = self.shared._call("take_cases", self.worker, n)
        return training_cases(self.cfg, self.twin, start, n)

    def _follow_engine(self) -> None:
        """Sample on the engine the coordinator names (it moves when an engine actor restarts)."""
        url = self.shared._call("url_for", self.worker)
        if url != self.base_url:
            self.base_url = url
            if self.cfg.sampler.kind == "hf":
                self.sampler = _batched_sampler(url)
            else:
                from trainer.samplers import ServerSampler

                self.sampler = ServerSampler(url, adapter_name(0), transport=ModelCheckTransport())

    def run(self) -> None:
        import dataclasses

        from trainer.samplers import SamplerError
        from trainer.workers import sampler_context_length

        self.events.put(("ready", self.worker))
        claim = self._claim()
        self.started = time.perf_counter()
        self._follow_engine()
        self.settings = dataclasses.replace(
            self.settings, context_length=sampler_context_length(self.base_url)
        )
        while True:
            if claim is None:
                t0 = time.perf_counter()
                claim = self._claim()
                self.idle_s += time.perf_counter() - t0
            index, taken = claim
            self.produced = index  # the lot's number and its sampling seed, as in the local loop
            self.redo = list(taken)
            published, _claimed, _consumed, epoch, _stop = self.shared.get()
            self._follow_engine()
            try:
                lot = self._collect(published)
            except SamplerError as exc:
                self.events.put(("sampler_error", epoch, str(exc)))
                self._wait(lambda epoch=epoch: self.shared.get()[3] != epoch)
                claim = self.shared._call("claim", self.worker, self.k)  # the same lot, again
                continue
            lot.cursor = self.shared._call("cursor_now")  # past every case handed out so far
            lot.stats["worker_idle_s"] = self.idle_s
            lot.stats["worker_wall_s"] = time.perf_counter() - self.started
            lot.stats["ray/put_time"] = time.time()
            self._put(lot)
            self.shared._call("done", self.worker)
            claim = None

    def _claim(self) -> tuple[int, list[tuple[int, int]]]:
        """The next lot this worker may sample (its lot in progress after a restart)."""
        while True:
            claim = self.shared._call("claim_wait", self.worker, self.k, CLAIM_WAIT_S)
            if claim is not None:
                return claim
            if self.shared.get()[4]:
                raise _Stopped

    def _wait(self, ready: Any) -> None:
        t0 = time.perf_counter()
        try:
            while not ready():
                if self.shared.get()[4]:
                    raise _Stopped
                time.sleep(POLL_S)
        finally:
            self.idle_s += time.perf_counter() - t0


class RolloutWorkerActor:
    """One rollout worker (a Ray actor): the local worker's loop, on lots
    claimed from the coordinator."""

    def __init__(
        self, spec: WorkerSpec, shared: RaySharedState, lots: Any, events: Any, worker: int
    ) -> None:
        self.args = (spec, shared, lots, events, worker)
        shared._call("hello", worker)  # Ray runs this again on each restart

    def run(self) -> None:
        """Sample lots until told to stop; errors go to the events queue, as in the local worker."""
        spec, shared, lots, events, worker = self.args
        os.environ["CUDA_VISIBLE_DEVICES"] = (
            ""  # it renders and runs envs; the engines have the GPUs
        )
        try:
            place_rollout_process(max(1, spec.cpu_threads))
            _RayRolloutLoop(spec, shared, lots, events, worker).run()
        except _Stopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the learner
            events.put(("fatal", f"rollout worker {worker} failed: {type(exc).__name__}: {exc}\n"
                                 f"{traceback.format_exc()}"))  # fmt: skip


# -- engines ---------------------------------------------------------------------------------------
class EngineActor:
    """One sampler engine (a Ray actor): the recipe's managed server (``twin serve`` or vLLM) on
    this actor's node and device, with adapters written to a folder of its own."""

    def __init__(self, recipe: dict[str, Any], model_path: str, index: int, host: str) -> None:
        from trainer.config import load_recipe

        cfg = load_recipe(recipe)
        if cfg.devices.rollout.startswith(
            "cuda"
        ):  # Ray shows this actor its own GPU only, as cuda:0
            cfg = cfg.model_copy(
                update={"devices": cfg.devices.model_copy(update={"rollout": "cuda"})}
            )
        self.dir = Path(tempfile.mkdtemp(prefix=f"twinrl-engine{index}-"))
        self.server = make_sampler_server(
            cfg, self.dir, model_path, max_loras=cfg.async_.max_staleness + 2
        )
        if self.server is None:
            raise ConfigError(
                "backend: ray starts its own engines; sampler.kind must be 'hf' or 'vllm', not "
                "'server'"
            )
        self.server.host = host
        self.client: AdapterClient | None = None

    def start(self) -> str:
        """Start the server (a no-op when it runs); return its URL."""
        self.server.start()
        self.client = AdapterClient(self.server.url)
        return str(self.server.url)

    def stop(self) -> None:
        self.server.stop()

    def alive(self) -> bool:
        return bool(self.server.alive())

    def returncode(self) -> int | None:
        process = getattr(self.server, "process", None)
        return process.returncode if process is not None else None

    def log_tail(self, lines: int) -> str:
        return str(self.server.log_tail(lines))

    def log_path(self) -> str:
        return str(getattr(self.server, "log_path", ""))

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def load_adapter(self, name: str, files: dict[str, bytes]) -> float:
        """Write the adapter's files here and load them in the server; return the load's seconds."""
        path = self.dir / "adapters" / name
        for rel, data in files.items():
            target = path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        assert self.client is not None, "load_adapter before start"
        return self.client.load(name, path)

    def unload_adapter(self, name: str) -> None:
        if self.client is not None:
            self.client.unload(name)
        shutil.rmtree(self.dir / "adapters" / name, ignore_errors=True)


class EngineGroup:
    """The engine actors behind the managed-server interface the learner uses (``start``, ``stop``,
    ``alive``, ``url``, ``log_tail``, ``process.returncode``, ``log_path``): all of them restart
    together, so one sampler restart (one epoch) covers every engine."""

    def __init__(self, engines: list[Any], coordinator: RaySharedState, workers: int) -> None:
        self.engines = engines
        self.coordinator = coordinator
        self.workers = workers
        self.urls: list[str] = []

    def _each(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(e, method).remote(*args) for e in self.engines])

    @property
    def url(self) -> str:
        """The first engine's URL (the learner's probe and health checks use it)."""
        return self.urls[0] if self.urls else ""

    def start(self) -> EngineGroup:
        self.urls = [str(u) for u in self._each("start")]
        # worker i samples on engine i mod E
        self.coordinator._call(
            "set_urls", {w: self.urls[w % len(self.urls)] for w in range(self.workers)}
        )
        return self

    def stop(self) -> None:
        import ray

        for engine in self.engines:
            try:
                ray.get(engine.stop.remote(), timeout=60)
            except Exception as exc:  # noqa: BLE001 - a dead engine is stopped already
                log.info("engine stop: %s", exc)

    def alive(self) -> bool:
        try:
            return all(self._each("alive"))
        except Exception:  # noqa: BLE001 - a dead actor (RayActorError) is a dead engine
            return False

    @property
    def process(self) -> SimpleNamespace:
        try:
            codes = [c for c in self._each("returncode") if c is not None]
        except Exception:  # noqa: BLE001
            codes = ["actor died"]
        return SimpleNamespace(returncode=codes[0] if codes else None)

    @property
    def log_path(self) -> str:
        try:
            return ", ".join(self._each("log_path"))
        except Exception:  # noqa: BLE001
            return "(engine actor died)"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self._each("log_tail", lines))
        except Exception as exc:  # noqa: BLE001
            return f"(engine actor died: {exc})"


class RayAdapterClient:
    """:class:`trainer.weight_sync.AdapterClient`'s interface (an
    :class:`trainer.weight_sync.AdapterSink`) for the engine actors: an adapter folder travels as
    bytes through Ray's object store (``ray.put`` once, every engine reads it), so the learner
    and the engines need no shared filesystem."""

    needs_files = True

    def __init__(self, group: EngineGroup) -> None:
        self.group = group
        self.sent_bytes = 0

    @property
    def root(self) -> str:
        """The first engine's root URL (the probe and health checks go there)."""
        return self.group.url.rstrip("/").removesuffix("/v1")

    def load(self, name: str, path: str | Path | None) -> float:
        import ray

        from trainer.workers import AdapterSyncError

        folder = Path(str(path))
        files = {
            str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        self.sent_bytes += sum(len(b) for b in files.values())
        ref = ray.put(files)
        try:
            return max(self.group._each("load_adapter", name, ref))
        except AdapterSyncError:
            raise
        except Exception as exc:  # noqa: BLE001 - a dead engine: the learner's restart path takes over
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, AdapterSyncError):
                raise cause from exc
            raise AdapterSyncError(
                f"loading {name} on the engines failed: {type(exc).__name__}: {exc}"
            ) from exc

    def unload(self, name: str) -> None:
        try:
            self.group._each("unload_adapter", name)
        except Exception as exc:  # noqa: BLE001 - retiring an old version is housekeeping
            log.info("unload %s: %s", name, exc)


# -- the trainer -----------------------------------------------------------------------------------
class RayTrainer(AsyncTrainer):
    """:class:`trainer.async_trainer.AsyncTrainer` with its rollout side on Ray (``backend: ray``).

    The learner is this process (run it on the node with the learner GPU: the head node, or
    ``ray job submit`` with ``--entrypoint-num-gpus 1``). Extra attributes: ``workers`` (the
    rollout worker actors), ``server`` (:class:`EngineGroup`), :attr:`worker_restarts` and
    ``lot_transit_s`` (seconds from a worker's put to the learner's get, per lot: Ray's cost
    per lot on top of the local queue's).
    """

    def __init__(self, cfg: Recipe, **kwargs: Any) -> None:
        if cfg.sampler.kind == "server":
            raise ConfigError(
                "backend: ray starts its own sampler engines; set sampler.kind to 'hf' (twin "
                "serve) or 'vllm'"
            )
        super().__init__(cfg, **kwargs)
        self.workers: list[Any] = []
        self._runs: list[Any] = []
        self.lot_transit_s: list[float] = []
        self._actors: list[Any] = []
        self._pg: Any = None
        self._restarting: dict[int, int] = {}  # worker -> its restarts when it was found dead
        self._final_restarts: list[int] | None = None

    def start_rollout(self) -> RolloutSide:
        from twin.evaluation.ray_eval import ensure_ray

        ray = ensure_ray(self.cfg.ray.address)
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg, rc = self.cfg, self.cfg.ray
        coordinator = ray.remote(num_cpus=0)(_Coordinator).remote(
            -1, self.step, self.lots_used, self.max_new_tokens(self.step), self.cursor
        )
        self._actors.append(coordinator)
        shared = self.shared = RaySharedState(coordinator)
        lots = Queue(maxsize=cfg.async_.queue_size, actor_options={"num_cpus": 0})
        events = Queue(actor_options={"num_cpus": 0})

        # engines: one placement-group bundle each (a GPU when the rollout device is one)
        gpu = cfg.devices.rollout.startswith("cuda")
        bundle = {"CPU": 1.0, "GPU": 1.0} if gpu else {"CPU": rc.engine_cpus}
        self._place_engines(ray, bundle, gpu)
        multi_node = len([n for n in ray.nodes() if n.get("Alive")]) > 1
        recipe = cfg.model_dump(mode="json", by_alias=True)
        engines = []
        for i in range(rc.engines):
            actor = ray.remote(EngineActor).options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=rc.max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=i
                ),
            )
            # on a cluster the engine listens on its node's address (docs/security.md: put it behind
            # a private network), on one machine on loopback only
            host = "0.0.0.0" if multi_node else "127.0.0.1"  # noqa: S104
            engines.append(actor.remote(recipe, str(self.model_path), i, host))
        self._actors.extend(engines)
        server = self.server = EngineGroup(engines, shared, rc.rollout_workers)
        self.server.start()
        if multi_node:  # reachable addresses, not 0.0.0.0
            ips = ray.get([e.node_ip.remote() for e in engines])
            self.server.urls = [u.replace("0.0.0.0", ip) for u, ip in zip(self.server.urls, ips)]  # noqa: S104
            self.shared._call(
                "set_urls", {w: self.server.urls[w % rc.engines] for w in range(rc.rollout_workers)}
            )
        self.adapters = RayAdapterClient(self.server)

        spec = WorkerSpec(recipe=recipe, base_url=self.server.url, start_lot=self.lots_used,
                          start_cursor=self.cursor, cpu_threads=1)  # fmt: skip
        remote_worker = ray.remote(RolloutWorkerActor).options(
            num_cpus=rc.worker_cpus, max_restarts=rc.max_restarts, max_task_retries=0
        )
        self.workers = [
            remote_worker.remote(spec, shared, lots, events, i) for i in range(rc.rollout_workers)
        ]
        self._actors.extend(self.workers)
        self._runs = [w.run.remote() for w in self.workers]
        # no process handle: check_processes watches the actors
        return RolloutSide(
            shared=shared, lots=lots, events=events, base_url=server.url, server=server, worker=None
        )

    def _place_engines(self, ray: Any, bundle: dict[str, float], gpu: bool) -> None:
        """Make the engines' placement group (one bundle each; ``_pg``, removed at cleanup even
        when it never became ready) and wait until it is ready.

        Raises:
            ConfigError: the cluster cannot place them within ``PLACEMENT_TIMEOUT_S``.
        """
        from ray.util.placement_group import placement_group, remove_placement_group

        rc = self.cfg.ray
        # Named after the run: a learner actor that died left its group behind (a group is scoped to
        # the job, not to the actor that made it; its actors did die with it), and its successor
        # would wait for the resources that group still holds.
        name = (
            "twinrl-engines-"
            + hashlib.sha256(str(self.output_dir.resolve()).encode()).hexdigest()[:16]
        )
        try:
            remove_placement_group(ray.util.get_placement_group(name))
            log.warning("removed placement group %s left by an earlier learner of this run", name)
        except ValueError:  # none: the usual case
            pass
        self._pg = placement_group(
            [bundle] * rc.engines, strategy="SPREAD" if gpu else "PACK", name=name
        )
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ConfigError(
                f"the Ray cluster cannot place {rc.engines} engine(s) of {bundle} (it has "
                f"{ray.available_resources()}): lower ray.engines / ray.engine_cpus or add nodes"
            )

    def next_lot(self) -> tuple[Lot, float]:
        lot, waited = super().next_lot()
        put = lot.stats.pop("ray/put_time", None)
        if put is not None:
            self.lot_transit_s.append(max(0.0, time.time() - put))
        return lot, waited

    @property
    def worker_restarts(self) -> list[int]:
        """Restarts of each rollout worker actor so far (as they were at the end, after cleanup)."""
        if self._final_restarts is not None:
            return list(self._final_restarts)
        counts = self.shared._call("restarts")
        return [int(counts.get(i, 0)) for i in range(self.cfg.ray.rollout_workers)]

    def check_processes(self) -> None:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        if self.server is not None and not self.server.alive():
            self._restart_sampler(
                f"engine exited ({self.server.process.returncode}); logs {self.server.log_path}"
            )
        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        for ref in done:
            i = self._runs.index(ref)
            try:
                ray.get(ref)
            except ActorUnavailableError:
                # died and being restarted by Ray: ask again; the new instance samples the lot its
                # predecessor claimed (logged once per death)
                if i not in self._restarting:
                    log.warning(
                        "step %d: rollout worker actor %d died; Ray restarts it and it samples its "
                        "lot again",
                        self.step,
                        i,
                    )
                    self._restarting[i] = self.worker_restarts[i]
                self._runs[i] = self.workers[i].run.remote()
                continue
            except RayActorError as exc:  # dead for good: out of restarts
                self.drain_events()
                raise TwinError(
                    f"rollout worker actor {i} died and Ray will not restart it again "
                    f"(ray.max_restarts {self.cfg.ray.max_restarts}): {exc}"
                ) from exc
            self.drain_events()
            raise TwinError(f"rollout worker actor {i} stopped before the run ended")
        if self._restarting:  # a death is over once its new instance said hello
            now = self.worker_restarts
            self._restarting = {i: n for i, n in self._restarting.items() if now[i] <= n}

    def stop_workers(self) -> None:
        import ray

        if self._runs:
            try:
                self.shared.update(stop=1)
                ray.wait(self._runs, num_returns=len(self._runs), timeout=10)
            except Exception as exc:  # noqa: BLE001 - stopping: the actors are killed below anyway
                log.info("stopping the workers: %s", exc)
            self._runs = []
        super().stop_workers()  # the load / probe threads, then the engines' servers
        if self._actors and self._final_restarts is None:
            try:
                self._final_restarts = self.worker_restarts
            except Exception:  # noqa: BLE001 - the coordinator is gone: nothing to report
                self._final_restarts = []
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
        self._actors = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None


# -- the learner as an actor -----------------------------------------------------------------------
class _LearnerActor:
    """A :class:`RayTrainer` inside a Ray actor (``ray.learner: actor``); threaded, so that the
    driver can read the records of the steps done while :meth:`train` runs."""

    def __init__(self, recipe: dict[str, Any], resume: bool, overwrite: bool) -> None:
        from trainer.config import load_recipe

        cfg = load_recipe(recipe)
        if cfg.devices.learner.startswith(
            "cuda"
        ):  # Ray shows this actor its own GPU only, as cuda:0
            cfg = cfg.model_copy(
                update={"devices": cfg.devices.model_copy(update={"learner": "cuda"})}
            )
        self.records: list[dict[str, Any]] = []
        self.trainer = RayTrainer(
            cfg, resume=resume, overwrite=overwrite, on_step=self.records.append
        )

    def setup(self) -> int:
        self.trainer.setup()
        return int(self.trainer.step)

    def train(self) -> list[dict[str, Any]]:
        return self.trainer.train()

    def records_since(self, index: int) -> list[dict[str, Any]]:
        return self.records[index:]

    def cleanup(self) -> str | None:
        plot = self.trainer.cleanup()
        return str(plot) if plot is not None else None


class RemoteLearner:
    """``backend: ray`` with ``ray.learner: actor``: the whole trainer, learner included, in a Ray
    actor (one GPU when ``devices.learner`` is cuda), driven from here with the trainer interface
    (``setup`` / ``train`` / ``cleanup``, ``on_step`` per step).

    When the learner actor dies (its node lost, OOM, killed), its engines and workers go with it
    (Ray's ownership), and a new learner actor continues the run from the last checkpoint, as
    ``twin train RECIPE --resume`` would, up to ``ray.max_restarts`` times. Checkpoints are written
    on the learner's node: on a cluster, give ``train.output_dir`` a filesystem every GPU node
    mounts, or keep the learner on one node.

    Attributes:
        learner_restarts: Times a dead learner actor was replaced.
    """

    def __init__(self, cfg: Recipe, *, resume: bool = False, overwrite: bool = False,
                 on_step: Any = None) -> None:  # fmt: skip
        if cfg.sampler.kind == "server":
            raise ConfigError(
                "backend: ray starts its own sampler engines; set sampler.kind to 'hf' (twin "
                "serve) or 'vllm'"
            )
        self.cfg = cfg
        self.resume = resume
        self.overwrite = overwrite
        self.on_step = on_step
        self.output_dir = Path(cfg.train.output_dir)
        self.step = 0
        self.learner_restarts = 0
        self.actor: Any = None
        self._seen = 0

    def _start(self, resume: bool, overwrite: bool) -> None:
        from twin.evaluation.ray_eval import ensure_ray

        ray = ensure_ray(self.cfg.ray.address)
        gpu = self.cfg.devices.learner.startswith("cuda")
        options = (
            {"num_gpus": 1, "num_cpus": self.cfg.ray.learner_cpus}
            if gpu
            else {"num_cpus": self.cfg.ray.learner_cpus}
        )
        self.actor = (
            ray.remote(_LearnerActor)
            .options(max_concurrency=2, max_restarts=0, **options)
            .remote(self.cfg.model_dump(mode="json", by_alias=True), resume, overwrite)
        )
        self.step = int(ray.get(self.actor.setup.remote()))
        self._seen = 0

    def setup(self) -> None:
        """Start the learner actor and its set-up (engines, workers, the first adapter)."""
        self._start(self.resume, self.overwrite)

    def train(self) -> list[dict[str, Any]]:
        """Run the remaining steps in the actor; replace a dead learner from its last checkpoint."""
        import ray
        from ray.exceptions import RayActorError

        while True:
            ref = self.actor.train.remote()
            try:
                while True:
                    ready, _ = ray.wait([ref], timeout=1.0)
                    self._forward(ray.get(self.actor.records_since.remote(self._seen)))
                    if ready:
                        return ray.get(ref)
            except RayActorError as exc:
                self.learner_restarts += 1
                if self.learner_restarts > self.cfg.ray.max_restarts:
                    raise TwinError(
                        f"the learner actor died {self.learner_restarts} times (ray.max_restarts "
                        f"{self.cfg.ray.max_restarts}); continue with --resume: {exc}"
                    ) from exc
                log.warning(
                    "the learner actor died at step %d (%s); a new one resumes from the last "
                    "checkpoint (restart %d)",
                    self.step,
                    type(exc).__name__,
                    self.learner_restarts,
                )
                self._start(resume=True, overwrite=False)

    def _forward(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self._seen += 1
            self.step = int(record["step"]) + 1
            if self.on_step is not None:
                self.on_step(record)

    def cleanup(self) -> Path | None:
        """Stop the actor's engines and workers, plot, close the store; then end the actor."""
        import ray

        if self.actor is None:
            return None
        try:
            plot = ray.get(self.actor.cleanup.remote())
        except Exception as exc:  # noqa: BLE001 - a dead learner has nothing left to clean
            log.info("learner actor cleanup: %s", exc)
            plot = None
        ray.kill(self.actor, no_restart=True)
        self.actor = None
        return Path(plot) if plot else None

"""The rollout worker process and the queue protocol between it and the learner.

The async trainer (:mod:`trainer.async_trainer`) runs three processes::

    learner (the trainer's own process)     rollout worker (this module)       sampler server
    -----------------------------------     -----------------------------      -----------------
    Learner.step(lot) -> save adapter   --- POST /v1/load_lora_adapter ----->  policy@<v+1>
    publish v+1 in SharedState  ----------> reads v, asks for policy@<v>  ---> /v1/completions
    lots.get()  <------------------------- Lot(version=v, groups) <---------   ids + logprobs

The worker runs the twin's envs with :func:`trainer.episodes.collect_groups` through a
:class:`trainer.samplers.ServerSampler`, applies dynamic sampling, and puts one :class:`Lot`
(the groups of one learner step, tagged with the policy version that sampled them) on a bounded
queue. It starts a lot only when the lot cannot be more than ``max_staleness`` versions old when
the learner takes it (:meth:`SharedState.may_sample`); ``max_staleness: 0`` is the synchronous
loop. When the sampler fails it reports on the events queue and waits for the learner process to
restart the server (a new ``epoch``), then samples the same lot again.

Every response's ``model`` field is checked against the adapter name asked for
(:class:`ModelCheckTransport`): a server that answered with another model is an error, never a
silent fallback to the base model.

CPU placement of the worker and the learner lives in :mod:`trainer.placement`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import httpx

from trainer.placement import place_rollout_process
from twin.errors import TwinError
from twin.policies.http import tls_context

__all__ = [
    "AdapterSyncError",
    "Lot",
    "ModelCheckTransport",
    "SharedState",
    "WorkerSpec",
    "adapter_name",
    "guarded_command",
    "rollout_worker",
    "sampler_context_length",
]

log = logging.getLogger("twinrl.workers")

#: Adapter name of policy version ``v`` on the sampler server.
ADAPTER_PREFIX = "policy@"


def adapter_name(version: int) -> str:
    """The sampler-side name of policy version ``version`` (``policy@<version>``)."""
    return f"{ADAPTER_PREFIX}{int(version)}"


class AdapterSyncError(TwinError):
    """The sampler did not take an adapter, or answered with another model
    than the one asked for."""


# -- the sampler's context ----------------------------------------------------------------------
def sampler_context_length(
    base_url: str, *, transport: httpx.BaseTransport | None = None
) -> int | None:
    """The sampler server's context length (prompt + completion), from its ``/v1/models``.

    vLLM and ``twin serve`` list ``max_model_len`` on each model card; the smallest is returned
    (they agree in practice). None when the server lists none or cannot be asked: the episode
    budget (``sampler.max_episode_tokens``) is then the only limit, as before.

    Args:
        base_url: Server root or OpenAI base URL.
        transport: An httpx transport (tests pass ``httpx.MockTransport``).
    """
    from trainer.serving.http import auth_headers

    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        with httpx.Client(
            transport=transport, timeout=30.0, verify=tls_context(), headers=auth_headers()
        ) as client:
            response = client.get(f"{root}/v1/models")
        cards = response.json().get("data", []) if response.status_code == 200 else []
        lengths = [
            int(c["max_model_len"]) for c in cards if isinstance(c, dict) and c.get("max_model_len")
        ]
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
        log.warning("could not read the context length of the sampler at %s: %s", root, exc)
        return None
    return min(lengths) if lengths else None


# -- the model-name check ------------------------------------------------------------------------
class ModelCheckTransport(httpx.AsyncBaseTransport):
    """An httpx transport that checks ``model`` in every ``/completions`` answer.

    vLLM and ``twin serve`` echo the requested model (adapter) name in the response body. A
    different name means the request was served by another adapter or by the base model, which
    would train on samples of the wrong policy: :class:`AdapterSyncError` is raised.

    The inner connection pool is made per event loop (``ServerSampler.sample`` runs each call in
    its own ``asyncio.run``), so the transport can be reused across calls.
    """

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._given = inner
        self._inner: httpx.AsyncBaseTransport | None = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._inner is None:
            from trainer.samplers import DEFAULT_CONCURRENCY, connection_limits

            self._inner = httpx.AsyncHTTPTransport(
                verify=tls_context(), limits=connection_limits(DEFAULT_CONCURRENCY)
            )
        response = await self._inner.handle_async_request(request)
        if (
            request.method == "POST"
            and request.url.path.endswith("/completions")
            and response.status_code == 200
        ):
            body = await response.aread()
            try:
                wanted = json.loads(request.content or b"{}").get("model")
                got = json.loads(body).get("model")
            except (ValueError, AttributeError):
                return response  # a malformed body is the sampler's error to report
            if wanted is not None and got != wanted:
                raise AdapterSyncError(
                    f"the sampler at {request.url.host}:{request.url.port} answered a request for "
                    f"model {wanted!r} with model {got!r}: the adapter did not reach the sampler "
                    "(or it fell back to another model). Check the server log; reload the adapter."
                )
        return response

    async def aclose(self) -> None:
        if self._inner is not None:
            await self._inner.aclose()
        self._inner = self._given


# -- shared state ---------------------------------------------------------------------------------
_PUBLISHED, _CLAIMED, _CONSUMED, _EPOCH, _STOP, _LIMIT = range(6)
_INDEX = {
    "published": _PUBLISHED,
    "claimed": _CLAIMED,
    "consumed": _CONSUMED,
    "epoch": _EPOCH,
    "stop": _STOP,
    "max_new_tokens": _LIMIT,
}


class SharedState:
    """Counters shared by the learner and the rollout worker (one lock, six integers).

    - ``published``: the newest policy version loaded in the sampler (-1 before the first); set
      only once the sampler took the adapter (at ``k >= 1`` by the learner's load thread), so a
      lot sampled with it never names an adapter the sampler lacks.
    - ``claimed``: learner steps that took a fresh lot (the step a queued lot will train is
      ``claimed + its place in the queue``).
    - ``consumed``: lots the learner took off the queue, used or dropped as stale.
    - ``epoch``: bumped each time the sampler server was restarted and its adapter reloaded.
    - ``stop``: 1 asks the worker to finish.
    - ``max_new_tokens``: the per-turn token limit for new lots (the learner runs the recipe's
      length curriculum; 0 = the recipe's ``sampler.max_new_tokens``).

    Args:
        ctx: A multiprocessing context (``spawn``).
    """

    def __init__(self, ctx: Any) -> None:
        self._values = ctx.Array("q", [-1, 0, 0, 0, 0, 0])

    def get(self) -> tuple[int, int, int, int, int]:
        """``(published, claimed, consumed, epoch, stop)`` read under the lock."""
        with self._values.get_lock():
            return tuple(self._values[:5])  # type: ignore[return-value]

    def max_new_tokens(self) -> int:
        """The per-turn token limit for new lots (0 = the recipe's)."""
        with self._values.get_lock():
            return int(self._values[_LIMIT])

    def update(self, **changes: int) -> None:
        """Set several counters at once (``published=``, ``claimed=``, ``consumed=``, ``epoch=``,
        ``stop=``, ``max_new_tokens=``)."""
        with self._values.get_lock():
            for key, value in changes.items():
                self._values[_INDEX[key]] = int(value)

    def may_sample(self, produced: int, max_staleness: int) -> bool:
        """True when a lot sampled now is at most ``max_staleness`` versions old when trained.

        The next lot trains at step ``claimed + (produced - consumed)`` (the lots ahead of it in
        the queue each take a step) and is sampled by version ``published``.
        """
        published, claimed, consumed, _epoch, stop = self.get()
        if stop or published < 0:
            return False
        return claimed + (produced - consumed) - published <= max_staleness


# -- the protocol ---------------------------------------------------------------------------------
@dataclass
class Lot:
    """The groups of one learner step, as the rollout worker sends them.

    Attributes:
        index: Lot number, in the order the worker produced them (0-based over the run).
        version: The policy version that sampled every group of the lot.
        cursor: The data cursor after this lot's cases (the learner checkpoints it).
        groups: Every group sampled for the lot, as ``Group`` JSON (dynamic sampling included).
        kept: Indexes into ``groups`` of the groups to train on.
        stats: ``batch/*`` counts, ``rollout_s`` (time to sample the lot), ``sampled_tokens``,
            and the worker's cumulative ``worker_idle_s`` / ``worker_wall_s``.
    """

    index: int
    version: int
    cursor: int
    groups: list[str]
    kept: list[int]
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class WorkerSpec:
    """What the rollout worker needs to start (picklable: crosses the spawn boundary).

    Attributes:
        recipe: The recipe as a JSON dict (``Recipe.model_dump(mode="json", by_alias=True)``).
        base_url: The sampler server's URL.
        start_lot: Index of the first lot to produce (lots already used before a resume).
        start_cursor: Data cursor to continue from.
        cpu_threads: torch threads in the worker (it only renders and runs envs).
    """

    recipe: dict[str, Any]
    base_url: str
    start_lot: int = 0
    start_cursor: int = 0
    cpu_threads: int = 1


def guarded_command(argv: list[str]) -> list[str]:
    """``argv`` run so that it gets SIGTERM when this process dies (Linux ``PR_SET_PDEATHSIG``).

    A killed learner must not leave its sampler server running forever; on other systems the
    command is returned unchanged.
    """
    if not sys.platform.startswith("linux"):
        return argv
    code = (
        "import ctypes,os,signal,sys;"
        "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGTERM);"
        "os.getppid()!=int(sys.argv[1]) and sys.exit(1);"
        "os.execv(sys.argv[2],sys.argv[2:])"
    )
    exe = argv[0] if os.path.isabs(argv[0]) else (shutil.which(argv[0]) or argv[0])
    return [sys.executable, "-c", code, str(os.getpid()), exe, *argv[1:]]


def _batched_sampler(base_url: str) -> Any:
    """A :class:`trainer.samplers.ServerSampler` of ``twin serve`` at ``base_url`` (seeded lots go
    as one request: the server seeds each row) with the model check."""
    from trainer.samplers import ServerSampler

    return ServerSampler(
        base_url, adapter_name(0), transport=ModelCheckTransport(), per_row_seeds=True
    )


class _Stopped(Exception):
    pass


def _parent_alive() -> bool:
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def _own_session() -> None:
    """Run the worker in its own session, as the sampler server is (``start_new_session``).

    Linux's autogroup scheduler gives each session one CPU share: in the learner's session, a busy
    worker would halve the learner's share on a loaded machine even on another core (measured on
    two busy cores: two spinners of one session on different cores each ran 2x slower than one).
    The worker stops through the shared ``stop`` flag or when its parent dies, not by terminal
    signals, so leaving the learner's process group changes nothing else.
    """
    if hasattr(os, "setsid"):
        try:
            os.setsid()
        except OSError:  # already a session or group leader
            pass


def rollout_worker(spec: WorkerSpec, shared: SharedState, lots: Any, events: Any) -> None:
    """The rollout worker process: sample lots until told to stop (a ``multiprocessing`` target).

    Events it sends (tuples on ``events``): ``("ready",)`` after setup;
    ``("sampler_error", epoch, message)`` when the sampler failed (it then waits for a new epoch
    and samples the lot again); ``("fatal", message)`` on any other error (it then exits).

    Args:
        spec: Recipe, server URL, where to start.
        shared: The counters shared with the learner.
        lots: Bounded queue the :class:`Lot` objects go to.
        events: Queue for the messages above.
    """
    # The worker renders tokens and runs envs; it never needs a GPU (the sampler server has one).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    _own_session()
    try:
        # before torch loads: its threads, and the rollout side's cores (devices.cpu_affinity)
        place_rollout_process(max(1, spec.cpu_threads))
        _RolloutLoop(spec, shared, lots, events).run()
    except _Stopped:
        pass
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the learner
        events.put(
            (
                "fatal",
                f"rollout worker failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}",
            )
        )


class _RolloutLoop:
    """The worker's state and loop (kept in a class so that each piece reads on its own)."""

    def __init__(self, spec: WorkerSpec, shared: SharedState, lots: Any, events: Any) -> None:
        import torch

        from trainer.config import load_recipe
        from trainer.episodes import load_tokenizer, recipe_renderer_factory, rollout_settings
        from trainer.samplers import ServerSampler
        from twin.registry import make_twin

        torch.set_num_threads(max(1, spec.cpu_threads))
        self.spec, self.shared, self.lots, self.events = spec, shared, lots, events
        self.cfg = cfg = load_recipe(spec.recipe)
        self.k = cfg.async_.max_staleness
        self.twin = make_twin(cfg.twin.name, **cfg.twin.config)
        tokenizer = load_tokenizer(cfg.model.path)
        self.renderer_factory = recipe_renderer_factory(cfg, tokenizer)
        self.settings = rollout_settings(cfg)
        if cfg.sampler.kind == "hf":  # the trainer started `twin serve`
            self.sampler = _batched_sampler(spec.base_url)
        else:
            self.sampler = ServerSampler(
                spec.base_url, adapter_name(0), transport=ModelCheckTransport()
            )
        self.produced = spec.start_lot
        self.cursor = spec.start_cursor
        self.started = time.perf_counter()
        self.idle_s = 0.0

    # -- waiting ---------------------------------------------------------------------------------
    def _wait(self, ready: Any) -> None:
        """Sleep until ``ready()``; the time counts as idle. Raises _Stopped
        on stop/parent death."""
        t0 = time.perf_counter()
        try:
            while not ready():
                if self.shared.get()[_STOP] or not _parent_alive():
                    raise _Stopped
                time.sleep(0.002)
        finally:
            self.idle_s += time.perf_counter() - t0

    def _put(self, lot: Lot) -> None:
        import queue

        t0 = time.perf_counter()
        try:
            while True:
                if self.shared.get()[_STOP] or not _parent_alive():
                    raise _Stopped
                try:
                    self.lots.put(lot, timeout=0.2)
                    return
                except queue.Full:
                    continue
        finally:
            self.idle_s += time.perf_counter() - t0

    # -- sampling --------------------------------------------------------------------------------
    def _cases(self, n: int) -> list[tuple[str, int]]:
        from trainer.episodes import training_cases

        cases = training_cases(self.cfg, self.twin, self.cursor, n)
        self.cursor += n
        return cases

    def _collect(self, version: int) -> Lot:
        """One lot: ``groups_per_step`` informative groups
        (:func:`trainer.episodes.sample_step`)."""
        import dataclasses

        from trainer.episodes import sample_step

        cfg = self.cfg
        name = adapter_name(version)
        self.sampler.model_name = name
        # the per-turn limit the learner published (it runs the recipe's length curriculum)
        limit = self.shared.max_new_tokens() or cfg.sampler.max_new_tokens
        settings = dataclasses.replace(self.settings, policy_name=name, max_new_tokens=limit)
        start_cursor = self.cursor
        t0 = time.perf_counter()
        try:
            sample = sample_step(
                cfg, self.twin, self._cases, self.sampler, self.renderer_factory, settings,
                seed_key=("lot", cfg.seed, self.produced), policy_version=version,
            )  # fmt: skip
        except BaseException:
            self.cursor = start_cursor  # the same lot is sampled again after a sampler restart
            raise
        rollout_s = time.perf_counter() - t0
        tokens = sum(t.completion_tokens for g in sample.groups for t in g.trajectories)
        return Lot(
            index=self.produced,
            version=version,
            cursor=self.cursor,
            groups=[g.model_dump_json() for g in sample.groups],
            kept=sample.kept,
            stats={**sample.stats(), "rollout_s": rollout_s, "sampled_tokens": float(tokens)},
        )

    def run(self) -> None:
        import dataclasses

        from trainer.samplers import SamplerError

        self.events.put(("ready",))
        # Idle time counts from the first published adapter (not the server's start-up).
        while self.shared.get()[_PUBLISHED] < 0:
            if self.shared.get()[_STOP] or not _parent_alive():
                raise _Stopped
            time.sleep(0.01)
        self.started = time.perf_counter()
        # the server is up now: no request may ask for more than its context holds
        context = sampler_context_length(self.spec.base_url)
        self.settings = dataclasses.replace(self.settings, context_length=context)
        while True:
            self._wait(lambda: self.shared.may_sample(self.produced, self.k))
            published, _claimed, _consumed, epoch, _stop = self.shared.get()
            try:
                lot = self._collect(published)
            except SamplerError as exc:
                self.events.put(("sampler_error", epoch, str(exc)))
                self._wait(lambda epoch=epoch: self.shared.get()[_EPOCH] != epoch)
                continue
            wall = time.perf_counter() - self.started
            lot.stats["worker_idle_s"] = self.idle_s
            lot.stats["worker_wall_s"] = wall
            self._put(lot)
            self.produced += 1

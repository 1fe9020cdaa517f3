"""The run store: every evaluation and training run, its episodes and its metric curves.

A :class:`RunStore` wraps a SQLAlchemy engine. By default it is an embedded SQLite file,
``runs/twinrl.db`` (or the path or URL in ``$TWINRL_STORE``); any SQLAlchemy URL works when
runs span machines (``postgresql+psycopg://user@host/twinrl``)::

    store = RunStore()
    run_id = store.start_run("eval", twin="Returns", policy="random", config={"episodes": 50})
    store.add_episodes(run_id, trajectories)          # one transaction per call
    store.finish_run(run_id, metrics=summarize(groups))
    store.episodes(run_id)                            # -> list[Trajectory]

Tables: ``runs`` (one row per run), ``episodes`` (one row per trajectory, with the full
trajectory JSON, its reward and components, case id, split, policy, timings and the training
step) and ``metrics`` (one row per training step, a JSON dict of named values).

Every write is its own transaction, committed before the call returns: a run killed at any
point loses nothing that a returned call wrote. SQLite runs in WAL mode so that ``twin runs``
can read while a trainer writes.

PostgreSQL (``postgresql+psycopg://...``, ``pip install 'twinrl[postgres]'``) holds one store
for many machines: any number of processes may create the schema and write at once. Times are
stored with their time zone (``TIMESTAMP WITH TIME ZONE`` there) and read back as UTC; JSON
documents are text there as in SQLite, so NaN metrics are stored rather than refused.

Liveness: a run records the process that writes it (pid and host) and a heartbeat, refreshed by
a daemon thread of the writing :class:`RunStore` (every ``heartbeat_s`` seconds) and by each
write. A ``running`` run whose process is gone (same host) or whose heartbeat is older than
``stale_after_s`` reads back as ``interrupted``: a run killed with ``-9`` does not stay
``running`` forever. Writing to an interrupted run (a resumed trainer) takes it over again.
:meth:`RunStore.track_run` wraps a run's whole lifecycle::

    with store.track_run("eval", twin="Returns", policy="random") as run:
        run.add_episodes(trajectories)
        run.metrics = summarize(groups)     # finished with these; failed if the block raises
"""

from twin.store.run_store import (
    DEFAULT_STORE,
    RunHandle,
    RunStore,
    damaged_store_message,
    resolve_url,
)
from twin.store.runs import (
    HEARTBEAT_S,
    RUN_KINDS,
    RUN_STATUSES,
    STALE_AFTER_S,
    RunInfo,
    RunNotFoundError,
    writer_gone,
)
from twin.store.schema import EpisodeTable, MetricTable, RunTable

__all__ = [
    "DEFAULT_STORE",
    "EpisodeTable",
    "HEARTBEAT_S",
    "MetricTable",
    "RUN_KINDS",
    "RUN_STATUSES",
    "RunHandle",
    "RunInfo",
    "RunNotFoundError",
    "RunStore",
    "RunTable",
    "STALE_AFTER_S",
    "damaged_store_message",
    "resolve_url",
    "writer_gone",
]

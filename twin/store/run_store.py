"""The :class:`RunStore` class: runs, episodes and metric curves in a SQL database."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, func, select, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError
from sqlalchemy.orm import Session, sessionmaker

from twin.errors import ConfigError
from twin.store.runs import (
    HEARTBEAT_S,
    HOST,
    RUN_KINDS,
    RUN_STATUSES,
    STALE_AFTER_S,
    RunInfo,
    RunNotFoundError,
    run_info,
    writer_gone,
)
from twin.store.schema import (
    EpisodeTable,
    MetricTable,
    RunTable,
    create_schema,
    sqlite_pragmas,
    utc_now,
)
from twin.trajectory import Trajectory

__all__ = [
    "DEFAULT_STORE",
    "RunStore",
    "damaged_store_message",
    "resolve_url",
]

log = logging.getLogger(__name__)

#: Where the store lives unless ``url`` or ``$TWINRL_STORE`` says otherwise.
DEFAULT_STORE = "runs/twinrl.db"


@dataclass
class RunHandle:
    """The run of a :meth:`RunStore.track_run` block: write to it, set how it ends.

    Attributes:
        store: The store.
        id: The run id.
        metrics: Summary stored when the block ends (set it inside the block).
        status: Status stored when the block ends without an exception (default ``finished``).
    """

    store: RunStore
    id: int
    metrics: dict[str, Any] | None = None
    status: str = "finished"

    def add_episodes(self, trajectories: Iterable[Trajectory], step: int | None = None) -> int:
        """:meth:`RunStore.add_episodes` for this run."""
        return self.store.add_episodes(self.id, trajectories, step=step)

    def log_metrics(self, step: int, values: dict[str, Any]) -> None:
        """:meth:`RunStore.log_metrics` for this run."""
        self.store.log_metrics(self.id, step, values)

    def count_episodes(self) -> int:
        """Episodes stored so far."""
        return self.store.count_episodes(self.id)


def resolve_url(url: str | os.PathLike[str] | None = None) -> str:
    """The SQLAlchemy URL for ``url``: a URL as is, a file path as SQLite, None as the default.

    None means ``$TWINRL_STORE`` when set, else ``runs/twinrl.db`` under the working directory.
    """
    raw = os.fspath(url) if url is not None else os.environ.get("TWINRL_STORE") or DEFAULT_STORE
    if "://" in raw:
        return raw
    path = Path(raw).expanduser()
    return f"sqlite:///{path}"


def _jsonable(value: Any) -> Any:
    """Round-trip through json so that numpy scalars, tuples and the like become plain JSON."""
    return json.loads(json.dumps(value, default=_json_default))


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


class RunStore:
    """Runs, episodes and metric curves in a SQL database (SQLite file by default).

    Args:
        url: A SQLAlchemy URL (``sqlite:///runs/x.db``, ``postgresql+psycopg://...``) or a file
            path (opened as SQLite). None: ``$TWINRL_STORE`` or ``runs/twinrl.db``.
        echo: Log SQL statements (debugging).
        heartbeat_s: Seconds between heartbeats of the runs this store writes.
        stale_after_s: A running run silent for longer reads back as ``interrupted``.
        create: Create a missing SQLite file (and its folders); False: a missing file is an
            error (readers such as ``twin runs`` create nothing).

    Attributes:
        url: The store's URL, its password (if any) masked: safe to print.
        engine: The SQLAlchemy engine.

    Raises:
        ConfigError: the URL cannot be parsed, its driver is not installed, the file is not
            a database (or, with ``create=False``, does not exist), or the database server
            cannot be reached.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | None = None,
        *,
        echo: bool = False,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        create: bool = True,
    ) -> None:
        if not 0 < heartbeat_s < stale_after_s:
            raise ConfigError(
                f"need 0 < heartbeat_s < stale_after_s, got {heartbeat_s} and {stale_after_s}"
            )
        self.heartbeat_s = float(heartbeat_s)
        self.stale_after_s = float(stale_after_s)
        self._beating: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_pid = 0
        full_url = resolve_url(url)
        try:
            parsed = make_url(full_url)
        except ArgumentError as exc:
            raise ConfigError(
                f"run store URL {full_url!r} is not a SQLAlchemy URL ({exc}); use a file path or "
                "e.g. 'sqlite:///runs/twinrl.db' or 'postgresql+psycopg://user@host/db'"
            ) from None
        #: The store's URL as shown to people (``twin runs``, summaries): password masked.
        self.url = parsed.render_as_string(hide_password=True) if parsed.password else full_url
        backend = parsed.get_backend_name()
        if backend == "sqlite" and parsed.database not in (None, "", ":memory:"):
            if not create and not Path(parsed.database).is_file():
                raise ConfigError(
                    f"no run store at {self.url!r}: the file does not exist (twin eval and "
                    "twin train create it); check --store or $TWINRL_STORE"
                )
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.engine: Engine = create_engine(
                parsed,
                echo=echo,
                # A server may drop idle connections (restarts, timeouts): test before use.
                pool_pre_ping=backend != "sqlite",
            )
        except ModuleNotFoundError as exc:
            extra = " (pip install 'twinrl[postgres]')" if backend == "postgresql" else ""
            raise ConfigError(
                f"cannot open run store {self.url!r}: its driver {exc.name!r} is not "
                f"installed{extra}"
            ) from None
        except Exception as exc:  # bad options
            raise ConfigError(f"cannot open run store {self.url!r}: {exc}") from None
        if backend == "sqlite":
            event.listen(self.engine, "connect", sqlite_pragmas)
        try:
            create_schema(self.engine)
        except DatabaseError as exc:
            self.engine.dispose()
            reason = str(getattr(exc, "orig", exc) or exc).strip().splitlines()[0]
            hint = (
                "give a new or existing run-store file (e.g. runs/twinrl.db) or a database URL"
                if backend == "sqlite"
                else "check that the server is up and the URL's host, port, user and database"
            )
            raise ConfigError(f"cannot use {self.url!r} as a run store: {reason}; {hint}") from None
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        _OPEN_STORES.add(self)

    # -- runs ----------------------------------------------------------------------------------
    def start_run(
        self,
        kind: str,
        twin: str,
        policy: str,
        config: dict[str, Any] | None = None,
    ) -> int:
        """Record a new run (status ``running``) and return its id.

        Args:
            kind: One of :data:`RUN_KINDS`.
            twin: Twin name.
            policy: Policy spec or name.
            config: The run's configuration (JSON-able).

        Raises:
            ConfigError: an unknown ``kind``.
        """
        if kind not in RUN_KINDS:
            raise ConfigError(f"run kind must be one of {', '.join(RUN_KINDS)}, got {kind!r}")
        with self._session.begin() as session:
            row = RunTable(
                kind=kind,
                twin=twin,
                policy=policy,
                config=_jsonable(config or {}),
                status="running",
                pid=os.getpid(),
                host=HOST,
                heartbeat_at=utc_now(),
            )
            session.add(row)
            session.flush()
            run_id = row.id
        self._beat_for(run_id)
        return run_id

    def finish_run(
        self, run_id: int, metrics: dict[str, Any] | None = None, status: str = "finished"
    ) -> None:
        """Mark a run finished (or ``failed`` / ``interrupted``) and store its summary metrics.

        Raises:
            ConfigError: a status that is not one of :data:`RUN_STATUSES` (or is ``running``).
        """
        if status not in RUN_STATUSES or status == "running":
            allowed = ", ".join(s for s in RUN_STATUSES if s != "running")
            raise ConfigError(f"a run finishes as one of {allowed}; got {status!r}")
        with self._lock:
            self._beating.discard(run_id)
        with self._session.begin() as session:
            row = self._get_run(session, run_id)
            row.status = status
            row.finished_at = utc_now()
            row.heartbeat_at = row.finished_at
            if metrics is not None:
                row.metrics = _jsonable(metrics)

    @contextlib.contextmanager
    def track_run(
        self, kind: str, twin: str, policy: str, config: dict[str, Any] | None = None
    ) -> Iterator[RunHandle]:
        """Start a run, yield its :class:`RunHandle`, and finish it however the block ends.

        A block that returns finishes the run with ``handle.status`` (``finished``) and
        ``handle.metrics``; Ctrl-C (KeyboardInterrupt) stores ``interrupted``, any other
        exception ``failed``; the exception propagates. Episodes written before stay.
        """
        handle = RunHandle(self, self.start_run(kind, twin, policy, config))
        try:
            yield handle
        except BaseException as exc:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            try:
                self.finish_run(handle.id, handle.metrics, status=status)
            except Exception as store_exc:  # noqa: BLE001 - keep the block's own error
                log.warning("run store: could not mark run %s %s: %s", handle.id, status, store_exc)
            raise
        self.finish_run(handle.id, handle.metrics, status=handle.status)

    def claim_run(self, run_id: int) -> None:
        """Make this process the writer of a ``running`` (possibly interrupted) run, e.g. on
        resume: its heartbeat starts again. Writes to a run do this by themselves.

        Raises:
            RunNotFoundError: no such run.
        """
        with self._session.begin() as session:
            self._touch(self._get_run(session, run_id))
        self._beat_for(run_id)

    def run(self, run_id: int) -> RunInfo:
        """The run ``run_id`` with its episode count and mean reward.

        Raises:
            RunNotFoundError: no such run.
        """
        with self._session() as session:
            row = self._get_run(session, run_id)
            count, mean = session.execute(
                select(func.count(EpisodeTable.id), func.avg(EpisodeTable.reward)).where(
                    EpisodeTable.run_id == run_id
                )
            ).one()
            return self._info(row, count, mean)

    def runs(
        self, limit: int | None = 50, *, kind: str | None = None, twin: str | None = None
    ) -> list[RunInfo]:
        """The latest runs, newest first, optionally of one kind or twin."""
        with self._session() as session:
            stats = (
                select(
                    EpisodeTable.run_id.label("run_id"),
                    func.count(EpisodeTable.id).label("n"),
                    func.avg(EpisodeTable.reward).label("mean"),
                )
                .group_by(EpisodeTable.run_id)
                .subquery()
            )
            query = (
                select(RunTable, stats.c.n, stats.c.mean)
                .outerjoin(stats, stats.c.run_id == RunTable.id)
                .order_by(RunTable.id.desc())
            )
            if kind is not None:
                query = query.where(RunTable.kind == kind)
            if twin is not None:
                query = query.where(RunTable.twin == twin)
            if limit is not None:
                query = query.limit(limit)
            return [self._info(row, n or 0, mean) for row, n, mean in session.execute(query).all()]

    # -- episodes ------------------------------------------------------------------------------
    def add_episodes(
        self, run_id: int, trajectories: Iterable[Trajectory], step: int | None = None
    ) -> int:
        """Store trajectories of run ``run_id`` in one transaction; return how many.

        Args:
            run_id: The run they belong to.
            trajectories: Finished (scored or not) trajectories.
            step: The training step that produced them (None for evaluations).

        Raises:
            RunNotFoundError: no such run.
        """
        rows = [
            EpisodeTable(
                run_id=run_id,
                case_id=t.case_id,
                split=t.split,
                index=t.index,
                case_kind=t.case_kind,
                policy=t.policy,
                reward=t.reward,
                components=_jsonable(t.components),
                trajectory=t.model_dump_json(),
                timings=_jsonable(t.timings),
                step=step,
            )
            for t in trajectories
        ]
        with self._session.begin() as session:
            claimed = self._touch(self._get_run(session, run_id))
            session.add_all(rows)
        if claimed:
            self._beat_for(run_id)
        return len(rows)

    def episodes(
        self, run_id: int, *, step: int | None = None, limit: int | None = None
    ) -> list[Trajectory]:
        """The trajectories of run ``run_id`` in the order they were stored.

        Args:
            run_id: The run.
            step: Only the episodes of this training step.
            limit: At most this many.

        Raises:
            RunNotFoundError: no such run.
        """
        with self._session() as session:
            self._get_run(session, run_id)
            query = (
                select(EpisodeTable.trajectory)
                .where(EpisodeTable.run_id == run_id)
                .order_by(EpisodeTable.id)
            )
            if step is not None:
                query = query.where(EpisodeTable.step == step)
            if limit is not None:
                query = query.limit(limit)
            return [Trajectory.model_validate_json(text) for text in session.scalars(query)]

    def count_episodes(self, run_id: int) -> int:
        """How many episodes run ``run_id`` has stored."""
        with self._session() as session:
            return int(
                session.scalar(
                    select(func.count(EpisodeTable.id)).where(EpisodeTable.run_id == run_id)
                )
                or 0
            )

    # -- training curves -----------------------------------------------------------------------
    def log_metrics(self, run_id: int, step: int, values: dict[str, Any]) -> None:
        """Store the named metrics of one training step (e.g. ``{"rewards/total": 0.4}``)."""
        with self._session.begin() as session:
            claimed = self._touch(self._get_run(session, run_id))
            session.add(MetricTable(run_id=run_id, step=step, values=_jsonable(values)))
        if claimed:
            self._beat_for(run_id)

    def metrics(self, run_id: int) -> list[tuple[int, dict[str, Any]]]:
        """The logged ``(step, values)`` of run ``run_id``, in logging order."""
        with self._session() as session:
            query = (
                select(MetricTable.step, MetricTable.values)
                .where(MetricTable.run_id == run_id)
                .order_by(MetricTable.id)
            )
            return [(step, values) for step, values in session.execute(query).all()]

    # -- plumbing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the heartbeat and release the database connections."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        self._thread = None
        self.engine.dispose()

    def _touch(self, row: RunTable) -> bool:
        """A write's sign of life: refresh the heartbeat; take over a running run written by
        another (gone) process. True when the run is one this store should keep beating for."""
        if row.status != "running":
            return False
        row.heartbeat_at = utc_now()
        row.pid, row.host = os.getpid(), HOST
        return True

    def _beat_for(self, run_id: int) -> None:
        with self._lock:
            self._beating.add(run_id)
            alive = self._thread is not None and self._thread.is_alive()
            # A forked child inherits the object but not the thread.
            if alive and self._thread_pid == os.getpid():
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._heartbeat_loop,
                args=(self._stop,),
                name=f"twinrl-store-heartbeat-{id(self):x}",
                daemon=True,
            )
            self._thread_pid = os.getpid()
            self._thread.start()

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.heartbeat_s):
            with self._lock:
                ids = sorted(self._beating)
            if not ids:
                continue
            try:
                with self._session.begin() as session:
                    session.execute(
                        update(RunTable)
                        .where(RunTable.id.in_(ids), RunTable.status == "running")
                        .values(heartbeat_at=utc_now(), pid=os.getpid(), host=HOST)
                    )
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried next time
                log.warning("run store heartbeat failed (%s); retrying", exc)

    def _alive(self, row: RunTable) -> bool:
        """Whether the writer of a ``running`` row still lives."""
        if writer_gone(row.pid, row.host):
            return False
        last = row.heartbeat_at or row.started_at
        if last is None:
            return True
        return (utc_now() - last).total_seconds() <= self.stale_after_s

    def _info(self, row: RunTable, count: int, mean: float | None) -> RunInfo:
        info = run_info(row, count, mean)
        if info.status == "running" and not self._alive(row):
            info.status = "interrupted"
        return info

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RunStore({self.url!r})"

    @staticmethod
    def _get_run(session: Session, run_id: int) -> RunTable:
        row = session.get(RunTable, run_id)
        if row is None:
            raise RunNotFoundError(
                f"no run with id {run_id!r} in the store; `twin runs` lists them"
            )
        return row


def _forget_inherited_connections() -> None:
    """In a forked child: new pools for every store, without closing the parent's connections
    (two processes on one connection corrupt both sessions; closing would end the parent's)."""
    for store in list(_OPEN_STORES):
        store.engine.dispose(close=False)


_OPEN_STORES: weakref.WeakSet[RunStore] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_connections)


def damaged_store_message(url: str, exc: DatabaseError) -> str:
    """One line for a database error while reading a store (a SQLite file with corrupted pages,
    a table a foreign tool altered): what failed and what to do, without the SQL."""
    reason = (str(getattr(exc, "orig", exc) or exc).strip().splitlines() or [type(exc).__name__])[
        0
    ][:200]
    return (
        f"the run store {url!r} cannot be read: {reason}; it may be damaged (a SQLite file can "
        "be checked with `sqlite3 FILE 'PRAGMA integrity_check'`); give another --store to keep "
        "working"
    )

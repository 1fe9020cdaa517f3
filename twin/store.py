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

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import socket
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    create_engine,
    event,
    func,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker
from sqlalchemy.types import TypeDecorator

from twin.errors import ConfigError, TwinError
from twin.trajectory import Trajectory

__all__ = [
    "DEFAULT_STORE",
    "RUN_KINDS",
    "RUN_STATUSES",
    "RunHandle",
    "RunInfo",
    "RunNotFoundError",
    "RunStore",
    "damaged_store_message",
    "resolve_url",
]

log = logging.getLogger(__name__)

#: Where the store lives unless ``url`` or ``$TWINRL_STORE`` says otherwise.
DEFAULT_STORE = "runs/twinrl.db"
#: The kinds of run the store records.
RUN_KINDS = ("eval", "train", "demo", "bench")
#: Statuses a run reads back with (``interrupted``: ``running`` but its process is gone).
RUN_STATUSES = ("running", "finished", "failed", "interrupted")
#: Seconds between heartbeats of a running run.
HEARTBEAT_S = 20.0
#: A running run whose heartbeat is older than this reads back as ``interrupted``.
STALE_AFTER_S = 120.0
_HOST = socket.gethostname()


class RunNotFoundError(TwinError, KeyError):
    """A run id that the store does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class _UTCDateTime(TypeDecorator[dt.datetime]):
    """A point in time, stored with its zone where the database can (PostgreSQL's
    ``TIMESTAMP WITH TIME ZONE``) and as UTC text in SQLite; always read back aware, in UTC.

    A naive value is taken as UTC (stores written before times carried their zone hold those).
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)

    def process_result_value(
        self, value: dt.datetime | None, dialect: Dialect
    ) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:  # SQLite keeps no zone: what it holds was written as UTC
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)


class _JSONText(TypeDecorator[Any]):
    """JSON kept as text, as SQLite keeps its JSON: NaN and infinities (a diverged loss, a
    degenerate metric) round-trip, where PostgreSQL's ``json`` type refuses them."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        return None if value is None else json.dumps(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if isinstance(value, (str, bytes)):
            return json.loads(value)
        return value  # NULL, or a json column of an older store, which the driver decoded


#: JSON columns: SQLite's JSON; text on PostgreSQL (see _JSONText).
_JSONDoc = JSON().with_variant(_JSONText(), "postgresql")
#: Names, ids and specs: SQLite never enforces a VARCHAR length, so neither does PostgreSQL
#: (a long policy spec must not be storable on one back end only).
_Name = Text


class _Base(DeclarativeBase):
    pass


class _Run(_Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16), index=True)
    twin: Mapped[str] = mapped_column(_Name, index=True)
    policy: Mapped[str] = mapped_column(_Name)
    config: Mapped[dict[str, Any]] = mapped_column(_JSONDoc, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="running")
    started_at: Mapped[dt.datetime] = mapped_column(_UTCDateTime, default=_now)
    finished_at: Mapped[dt.datetime | None] = mapped_column(_UTCDateTime, nullable=True)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(_JSONDoc, nullable=True)
    # Liveness (added after the first release: _migrate adds them to older stores).
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    host: Mapped[str | None] = mapped_column(_Name, nullable=True)
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column(_UTCDateTime, nullable=True)


#: Columns of ``runs`` that older stores lack.
_ADDED_RUN_COLUMNS = ("pid", "host", "heartbeat_at")


class _Episode(_Base):
    __tablename__ = "episodes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    case_id: Mapped[str] = mapped_column(_Name, index=True)
    split: Mapped[str] = mapped_column(_Name)
    index: Mapped[int] = mapped_column(Integer)
    case_kind: Mapped[str] = mapped_column(_Name)
    policy: Mapped[str] = mapped_column(_Name)
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    components: Mapped[dict[str, Any]] = mapped_column(_JSONDoc, default=dict)
    # Text, not JSON: the pydantic dump round-trips exactly (floats, key order).
    trajectory: Mapped[str] = mapped_column(Text)
    timings: Mapped[dict[str, Any]] = mapped_column(_JSONDoc, default=dict)
    step: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    created_at: Mapped[dt.datetime] = mapped_column(_UTCDateTime, default=_now)


class _Metric(_Base):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    values: Mapped[dict[str, Any]] = mapped_column(_JSONDoc)
    created_at: Mapped[dt.datetime] = mapped_column(_UTCDateTime, default=_now)


@dataclass
class RunInfo:
    """One row of the ``runs`` table, with its episode count and mean reward.

    Attributes:
        id: Run id.
        kind: ``eval``, ``train``, ``demo`` or ``bench``.
        twin: Twin name.
        policy: Policy spec or name.
        config: The run's configuration (CLI options, recipe).
        status: ``running``, ``finished``, ``failed`` or ``interrupted`` (stored as
            ``running`` but its process is gone or its heartbeat is stale; or ended by Ctrl-C).
        started_at: Start time (timezone-aware, UTC).
        finished_at: End time (timezone-aware, UTC), None while running.
        metrics: The summary written by :meth:`RunStore.finish_run`.
        episodes: Episodes stored for the run.
        reward_mean: Mean reward over the stored, scored episodes (None when there are none).
        pid: Process id of the run's writer (None in stores older than liveness).
        host: Host name of the run's writer.
        heartbeat_at: Time of the writer's last sign of life (timezone-aware, UTC).
    """

    id: int
    kind: str
    twin: str
    policy: str
    config: dict[str, Any] = field(default_factory=dict)
    status: str = "running"
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    metrics: dict[str, Any] | None = None
    episodes: int = 0
    reward_mean: float | None = None
    pid: int | None = None
    host: str | None = None
    heartbeat_at: dt.datetime | None = None


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
                    f"no run store at {self.url!r}: the file does not exist (twin eval and twin train "
                    "create it); check --store or $TWINRL_STORE"
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
            event.listen(self.engine, "connect", _sqlite_pragmas)
        try:
            _create_schema(self.engine)
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
            row = _Run(
                kind=kind,
                twin=twin,
                policy=policy,
                config=_jsonable(config or {}),
                status="running",
                pid=os.getpid(),
                host=_HOST,
                heartbeat_at=_now(),
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
            row.finished_at = _now()
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
                select(func.count(_Episode.id), func.avg(_Episode.reward)).where(
                    _Episode.run_id == run_id
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
                    _Episode.run_id.label("run_id"),
                    func.count(_Episode.id).label("n"),
                    func.avg(_Episode.reward).label("mean"),
                )
                .group_by(_Episode.run_id)
                .subquery()
            )
            query = (
                select(_Run, stats.c.n, stats.c.mean)
                .outerjoin(stats, stats.c.run_id == _Run.id)
                .order_by(_Run.id.desc())
            )
            if kind is not None:
                query = query.where(_Run.kind == kind)
            if twin is not None:
                query = query.where(_Run.twin == twin)
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
            _Episode(
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
                select(_Episode.trajectory).where(_Episode.run_id == run_id).order_by(_Episode.id)
            )
            if step is not None:
                query = query.where(_Episode.step == step)
            if limit is not None:
                query = query.limit(limit)
            return [Trajectory.model_validate_json(text) for text in session.scalars(query)]

    def count_episodes(self, run_id: int) -> int:
        """How many episodes run ``run_id`` has stored."""
        with self._session() as session:
            return int(
                session.scalar(select(func.count(_Episode.id)).where(_Episode.run_id == run_id))
                or 0
            )

    # -- training curves -----------------------------------------------------------------------
    def log_metrics(self, run_id: int, step: int, values: dict[str, Any]) -> None:
        """Store the named metrics of one training step (e.g. ``{"rewards/total": 0.4}``)."""
        with self._session.begin() as session:
            claimed = self._touch(self._get_run(session, run_id))
            session.add(_Metric(run_id=run_id, step=step, values=_jsonable(values)))
        if claimed:
            self._beat_for(run_id)

    def metrics(self, run_id: int) -> list[tuple[int, dict[str, Any]]]:
        """The logged ``(step, values)`` of run ``run_id``, in logging order."""
        with self._session() as session:
            query = (
                select(_Metric.step, _Metric.values)
                .where(_Metric.run_id == run_id)
                .order_by(_Metric.id)
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

    def _touch(self, row: _Run) -> bool:
        """A write's sign of life: refresh the heartbeat; take over a running run written by
        another (gone) process. True when the run is one this store should keep beating for."""
        if row.status != "running":
            return False
        row.heartbeat_at = _now()
        row.pid, row.host = os.getpid(), _HOST
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
                        update(_Run)
                        .where(_Run.id.in_(ids), _Run.status == "running")
                        .values(heartbeat_at=_now(), pid=os.getpid(), host=_HOST)
                    )
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried next time
                log.warning("run store heartbeat failed (%s); retrying", exc)

    def _alive(self, row: _Run) -> bool:
        """Whether the writer of a ``running`` row still lives."""
        if row.pid is not None and row.host == _HOST and not _pid_alive(row.pid):
            return False
        last = row.heartbeat_at or row.started_at
        if last is None:
            return True
        return (_now() - last).total_seconds() <= self.stale_after_s

    def _info(self, row: _Run, count: int, mean: float | None) -> RunInfo:
        info = _info(row, count, mean)
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
    def _get_run(session: Any, run_id: int) -> _Run:
        row = session.get(_Run, run_id)
        if row is None:
            raise RunNotFoundError(
                f"no run with id {run_id!r} in the store; `twin runs` lists them"
            )
        return row


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # busy_timeout first: concurrent writers (and a concurrent switch to WAL) wait instead of
    # failing. WAL: readers (`twin runs`) never block the writer; a killed process loses only
    # uncommitted transactions.
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _forget_inherited_connections() -> None:
    """In a forked child: new pools for every store, without closing the parent's connections
    (two processes on one connection corrupt both sessions; closing would end the parent's)."""
    for store in list(_OPEN_STORES):
        store.engine.dispose(close=False)


_OPEN_STORES: weakref.WeakSet[RunStore] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_connections)


def _is_schema_race(exc: DatabaseError) -> bool:
    """A concurrent writer created the table, index or column first.

    SQLite says ``table ... already exists`` / ``duplicate column``. PostgreSQL says
    ``relation ... already exists`` or, when both CREATEs ran at the same moment, raises a unique
    violation on its catalog (``pg_type_typname_nsp_index``, ``pg_class_relname_nsp_index``).
    """
    text_ = str(getattr(exc, "orig", exc)).lower()
    return (
        "already exists" in text_
        or "duplicate column" in text_
        or ("unique constraint" in text_ and '"pg_' in text_)
    )


def _create_schema(engine: Engine, attempts: int = 5) -> None:
    """Create the tables and add missing columns; safe when several processes do it at once.

    ``create_all`` checks, then creates: two processes on a fresh store both see no table and
    the second fails with ``table ... already exists``. Losing that race just means the schema
    is there now, so check again (a few times: several objects are created one by one).
    """
    for attempt in range(attempts):
        try:
            _Base.metadata.create_all(engine)
            _migrate(engine)
            return
        except DatabaseError as exc:
            if not _is_schema_race(exc) or attempt == attempts - 1:
                raise


def _migrate(engine: Engine) -> None:
    """Add the ``runs`` columns that stores made before them lack."""
    have = {c["name"] for c in inspect(engine).get_columns("runs")}
    # PostgreSQL can skip a column that a concurrent migration just added; SQLite cannot (its
    # "duplicate column" is a schema race, retried by _create_schema).
    guard = "IF NOT EXISTS " if engine.dialect.name == "postgresql" else ""
    for name in _ADDED_RUN_COLUMNS:
        if name not in have:
            sql_type = _Run.__table__.c[name].type.compile(dialect=engine.dialect)
            with engine.begin() as conn:
                conn.execute(text(f"ALTER TABLE runs ADD COLUMN {guard}{name} {sql_type}"))


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0 checks without sending)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return True
    return True


def _info(row: _Run, count: int, mean: float | None) -> RunInfo:
    return RunInfo(
        id=row.id,
        kind=row.kind,
        twin=row.twin,
        policy=row.policy,
        config=dict(row.config or {}),
        status=row.status,
        started_at=row.started_at,
        finished_at=row.finished_at,
        metrics=row.metrics,
        episodes=int(count),
        reward_mean=None if mean is None else float(mean),
        pid=row.pid,
        host=row.host,
        heartbeat_at=row.heartbeat_at,
    )


def damaged_store_message(url: str, exc: DatabaseError) -> str:
    """One line for a database error while reading a store (a SQLite file with corrupted pages,
    a table a foreign tool altered): what failed and what to do, without the SQL."""
    reason = (str(getattr(exc, "orig", exc) or exc).strip().splitlines() or [type(exc).__name__])[
        0
    ][:200]
    return (
        f"the run store {url!r} cannot be read: {reason}; it may be damaged (a SQLite file can be "
        "checked with `sqlite3 FILE 'PRAGMA integrity_check'`); give another --store to keep working"
    )

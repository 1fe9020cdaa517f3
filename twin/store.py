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
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    create_engine,
    event,
    func,
    select,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from twin.errors import ConfigError, TwinError
from twin.trajectory import Trajectory

__all__ = ["DEFAULT_STORE", "RUN_KINDS", "RunInfo", "RunNotFoundError", "RunStore", "resolve_url"]

#: Where the store lives unless ``url`` or ``$TWINRL_STORE`` says otherwise.
DEFAULT_STORE = "runs/twinrl.db"
#: The kinds of run the store records.
RUN_KINDS = ("eval", "train", "demo", "bench")


class RunNotFoundError(TwinError, KeyError):
    """A run id that the store does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class _Base(DeclarativeBase):
    pass


class _Run(_Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16), index=True)
    twin: Mapped[str] = mapped_column(String(128), index=True)
    policy: Mapped[str] = mapped_column(String(256))
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="running")
    started_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class _Episode(_Base):
    __tablename__ = "episodes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    case_id: Mapped[str] = mapped_column(String(256), index=True)
    split: Mapped[str] = mapped_column(String(64))
    index: Mapped[int] = mapped_column(Integer)
    case_kind: Mapped[str] = mapped_column(String(128))
    policy: Mapped[str] = mapped_column(String(256))
    reward: Mapped[float | None] = mapped_column(Float, nullable=True)
    components: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Text, not JSON: the pydantic dump round-trips exactly (floats, key order).
    trajectory: Mapped[str] = mapped_column(Text)
    timings: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    step: Mapped[int | None] = mapped_column(Integer, nullable=True, index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)


class _Metric(_Base):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=_now)


@dataclass
class RunInfo:
    """One row of the ``runs`` table, with its episode count and mean reward.

    Attributes:
        id: Run id.
        kind: ``eval``, ``train``, ``demo`` or ``bench``.
        twin: Twin name.
        policy: Policy spec or name.
        config: The run's configuration (CLI options, recipe).
        status: ``running``, ``finished`` or ``failed`` (a killed run stays ``running``).
        started_at: UTC start time.
        finished_at: UTC end time, None while running.
        metrics: The summary written by :meth:`RunStore.finish_run`.
        episodes: Episodes stored for the run.
        reward_mean: Mean reward over the stored, scored episodes (None when there are none).
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

    Raises:
        ConfigError: the URL cannot be parsed or its driver is not installed.
    """

    def __init__(self, url: str | os.PathLike[str] | None = None, *, echo: bool = False) -> None:
        self.url = resolve_url(url)
        try:
            parsed = make_url(self.url)
        except ArgumentError as exc:
            raise ConfigError(
                f"run store URL {self.url!r} is not a SQLAlchemy URL ({exc}); use a file path or "
                "e.g. 'sqlite:///runs/twinrl.db' or 'postgresql+psycopg://user@host/db'"
            ) from None
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.engine: Engine = create_engine(self.url, echo=echo, future=True)
        except Exception as exc:  # missing DB driver, bad options
            raise ConfigError(f"cannot open run store {self.url!r}: {exc}") from None
        if parsed.get_backend_name() == "sqlite":
            event.listen(self.engine, "connect", _sqlite_pragmas)
        _Base.metadata.create_all(self.engine)
        self._session = sessionmaker(self.engine, expire_on_commit=False)

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
            )
            session.add(row)
            session.flush()
            return row.id

    def finish_run(
        self, run_id: int, metrics: dict[str, Any] | None = None, status: str = "finished"
    ) -> None:
        """Mark a run finished (or ``failed``) and store its summary metrics."""
        with self._session.begin() as session:
            row = self._get_run(session, run_id)
            row.status = status
            row.finished_at = _now()
            if metrics is not None:
                row.metrics = _jsonable(metrics)

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
            return _info(row, count, mean)

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
            return [_info(row, n or 0, mean) for row, n, mean in session.execute(query).all()]

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
            self._get_run(session, run_id)
            session.add_all(rows)
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
            self._get_run(session, run_id)
            session.add(_Metric(run_id=run_id, step=step, values=_jsonable(values)))

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
        """Release the database connections."""
        self.engine.dispose()

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
    # WAL: readers (`twin runs`) never block the writer; a killed process loses only
    # uncommitted transactions. busy_timeout: concurrent writers wait instead of failing.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


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
    )

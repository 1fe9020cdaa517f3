"""The run store's tables and column types, and creating or migrating them.

Tables: ``runs`` (:class:`RunTable`, one row per run), ``episodes`` (:class:`EpisodeTable`, one
row per trajectory) and ``metrics`` (:class:`MetricTable`, one row per training step). Readers
that query the database directly (``twin ui``) select from these classes.
"""

from __future__ import annotations

import datetime as dt
import json
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
    inspect,
    text,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DatabaseError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

__all__ = [
    "ADDED_RUN_COLUMNS",
    "Base",
    "EpisodeTable",
    "MetricTable",
    "RunTable",
    "create_schema",
    "sqlite_pragmas",
    "utc_now",
]


def utc_now() -> dt.datetime:
    """The current time, timezone-aware, in UTC."""
    return dt.datetime.now(dt.timezone.utc)


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
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)

    def process_result_value(
        self, value: dt.datetime | None, dialect: Dialect
    ) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:  # SQLite keeps no zone: what it holds was written as UTC
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


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


class Base(DeclarativeBase):
    pass


class RunTable(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16), index=True)
    twin: Mapped[str] = mapped_column(_Name, index=True)
    policy: Mapped[str] = mapped_column(_Name)
    config: Mapped[dict[str, Any]] = mapped_column(_JSONDoc, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="running")
    started_at: Mapped[dt.datetime] = mapped_column(_UTCDateTime, default=utc_now)
    finished_at: Mapped[dt.datetime | None] = mapped_column(_UTCDateTime, nullable=True)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(_JSONDoc, nullable=True)
    # Liveness (added after the first release: _migrate adds them to older stores).
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    host: Mapped[str | None] = mapped_column(_Name, nullable=True)
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column(_UTCDateTime, nullable=True)


#: Columns of ``runs`` that older stores lack.
ADDED_RUN_COLUMNS = ("pid", "host", "heartbeat_at")


class EpisodeTable(Base):
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
    created_at: Mapped[dt.datetime] = mapped_column(_UTCDateTime, default=utc_now)


class MetricTable(Base):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    values: Mapped[dict[str, Any]] = mapped_column(_JSONDoc)
    created_at: Mapped[dt.datetime] = mapped_column(_UTCDateTime, default=utc_now)


def sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # busy_timeout first: concurrent writers (and a concurrent switch to WAL) wait instead of
    # failing. WAL: readers (`twin runs`) never block the writer; a killed process loses only
    # uncommitted transactions.
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


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


def create_schema(engine: Engine, attempts: int = 5) -> None:
    """Create the tables and add missing columns; safe when several processes do it at once.

    ``create_all`` checks, then creates: two processes on a fresh store both see no table and
    the second fails with ``table ... already exists``. Losing that race just means the schema
    is there now, so check again (a few times: several objects are created one by one).
    """
    for attempt in range(attempts):
        try:
            Base.metadata.create_all(engine)
            _migrate(engine)
            return
        except DatabaseError as exc:
            if not _is_schema_race(exc) or attempt == attempts - 1:
                raise


def _migrate(engine: Engine) -> None:
    """Add the ``runs`` columns that stores made before them lack."""
    have = {c["name"] for c in inspect(engine).get_columns("runs")}
    # PostgreSQL can skip a column that a concurrent migration just added; SQLite cannot (its
    # "duplicate column" is a schema race, retried by create_schema).
    guard = "IF NOT EXISTS " if engine.dialect.name == "postgresql" else ""
    for name in ADDED_RUN_COLUMNS:
        if name not in have:
            sql_type = RunTable.__table__.c[name].type.compile(dialect=engine.dialect)
            with engine.begin() as conn:
                conn.execute(text(f"ALTER TABLE runs ADD COLUMN {guard}{name} {sql_type}"))

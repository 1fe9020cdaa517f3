"""The run store opened read-only for ``twin ui``: a connection that cannot write.

SQLite is opened through a ``file:...?mode=ro`` URI with ``PRAGMA query_only`` on top; PostgreSQL
sessions are made read-only (``SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY``) as each
connection opens, so every transaction they run refuses INSERT, UPDATE, DELETE and DDL. Nothing
here creates the schema or migrates it: a store that does not exist is an error, not a new file.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from twin.errors import ConfigError
from twin.store import resolve_url

__all__ = ["open_readonly"]

_TABLES = ("runs", "episodes", "metrics")


def open_readonly(url: str | os.PathLike[str] | None = None) -> tuple[Engine, str]:
    """A read-only engine on the run store at ``url`` and the URL to show (password masked).

    Args:
        url: SQLAlchemy URL or SQLite path; None: ``$TWINRL_STORE`` or ``runs/twinrl.db``.

    Raises:
        ConfigError: the URL cannot be parsed, the SQLite file does not exist, the driver is
            missing, the server cannot be reached, or the database holds no run store.
    """
    full = resolve_url(url)
    try:
        parsed = make_url(full)
    except ArgumentError as exc:
        raise ConfigError(
            f"run store URL {full!r} is not a SQLAlchemy URL ({exc}); use a file path or e.g. "
            "'sqlite:///runs/twinrl.db' or 'postgresql+psycopg://user@host/db'"
        ) from None
    shown = parsed.render_as_string(hide_password=True) if parsed.password else full
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        engine = _sqlite_readonly(parsed.database)
    else:
        try:
            engine = create_engine(parsed, pool_pre_ping=True)
        except ModuleNotFoundError as exc:
            extra = " (pip install 'twinrl[postgres]')" if backend == "postgresql" else ""
            raise ConfigError(
                f"cannot open run store {shown!r}: its driver {exc.name!r} is not installed{extra}"
            ) from None
        event.listen(engine, "connect", _session_read_only)
    try:
        have = set(inspect(engine).get_table_names())
    except DBAPIError as exc:
        engine.dispose()
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        raise ConfigError(f"cannot open run store {shown!r}: {reason}") from None
    if not set(_TABLES) <= have:
        engine.dispose()
        raise ConfigError(
            f"{shown!r} holds no run store (tables {', '.join(_TABLES)}); `twin eval` or "
            "`twin train` writes one"
        )
    return engine, shown


def _sqlite_readonly(database: str | None) -> Engine:
    if database in (None, "", ":memory:"):
        raise ConfigError("twin ui needs a run store file or server; an in-memory SQLite has none")
    path = Path(database).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(
            f"no run store at {path}; `twin eval` or `twin train` creates it, or pass --store"
        )
    uri = f"file:{quote(str(path))}?mode=ro"

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=30000")
        conn.execute("PRAGMA query_only=ON")  # a second lock, should a writable handle ever come
        return conn

    return create_engine("sqlite://", creator=connect)


def _session_read_only(dbapi_connection: Any, _record: Any) -> None:
    # psycopg opens a transaction on the first statement: end it so that the setting is the
    # session's, in force for every later transaction.
    autocommit = getattr(dbapi_connection, "autocommit", None)
    if autocommit is not None:
        dbapi_connection.autocommit = True
    cursor = dbapi_connection.cursor()
    cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    cursor.close()
    if autocommit is not None:
        dbapi_connection.autocommit = autocommit

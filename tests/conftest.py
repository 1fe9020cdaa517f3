"""Fixtures shared by every test folder: a throwaway PostgreSQL server for the run-store tests.

``postgres_url`` gives a test a new, empty database. The server is the one named by
``$TWINRL_TEST_POSTGRES_URL`` (its user needs CREATEDB), else one that ``tests/pg_server.py``
starts for the session when ``initdb`` / ``pg_ctl`` are installed (``make test`` installs them
on Debian), else the test skips and says how to get one.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

_DATABASES = itertools.count(1)


def _pg_server() -> ModuleType:
    """tests/pg_server.py (tests are imported with importlib: no package to import it from)."""
    name = "twinrl_tests_pg_server"
    if name not in sys.modules:
        path = Path(__file__).with_name("pg_server.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def postgres_admin_url() -> Iterator[str]:
    """The URL of a PostgreSQL database through which tests create their own databases."""
    pg = _pg_server()
    given = os.environ.get(pg.URL_ENV)
    if given:
        yield given
        return
    try:
        import psycopg  # noqa: F401 - the driver of postgresql+psycopg:// URLs
    except ImportError:
        pytest.skip("no PostgreSQL driver: pip install 'twinrl[postgres]' (psycopg)")
    if pg.find_bin_dir() is None:
        pytest.skip(pg.NO_SERVER)
    server = pg.PostgresServer()
    url = server.start()  # binaries that are there but fail to start are an error, not a skip
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture()
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """The SQLAlchemy URL of a new, empty database, dropped after the test."""
    from sqlalchemy.engine import make_url

    pg = _pg_server()
    name = f"twinrl_test_{os.getpid()}_{next(_DATABASES)}"
    pg.create_database(postgres_admin_url, name)
    try:
        yield make_url(postgres_admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        pg.drop_database(postgres_admin_url, name)

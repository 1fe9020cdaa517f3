"""Fixtures of the benchmark tests: the catalog twin on its generated world, in a tmp cache."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def catalog_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``$TWINRL_CACHE`` for the session: a tmp dir, so tests never touch ~/.cache."""
    path = tmp_path_factory.mktemp("twinrl-cache")
    old = os.environ.get("TWINRL_CACHE")
    os.environ["TWINRL_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TWINRL_CACHE", None)
    else:
        os.environ["TWINRL_CACHE"] = old


@pytest.fixture(scope="session")
def twin(catalog_cache: Path):
    """The catalog twin on the generated world (seed 0), world built once per session."""
    from envs.catalog import CatalogTwin

    t = CatalogTwin(seed=0)
    _ = t.world  # build now, inside the session cache
    return t

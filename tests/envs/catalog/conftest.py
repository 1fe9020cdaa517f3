"""Shared fixtures of the catalog twin's tests: one world per session, built in a tmp cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: Shopify's taxonomy, shipped beside the project for tests (absent on a bare clone).
SHOPIFY = (
    Path(__file__).resolve().parents[3].parent / "shared" / "data" / "shopify-product-taxonomy"
)


@pytest.fixture(scope="session")
def catalog_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
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


@pytest.fixture(scope="session")
def world(twin):
    """The generated world."""
    return twin.world


@pytest.fixture(scope="session")
def shopify_twin(catalog_cache: Path):
    """The catalog twin on Shopify's taxonomy; skipped when the shared data is absent."""
    if not (SHOPIFY / "data" / "categories").is_dir():
        pytest.skip(f"Shopify taxonomy not found at {SHOPIFY}")
    from envs.catalog import CatalogTwin

    t = CatalogTwin(seed=0, taxonomy_path=str(SHOPIFY))
    _ = t.world
    return t


@pytest.fixture(scope="session")
def twin_v1(twin):
    """The catalog v1 twin on the generated world (seed 0): v0's world plus v1's overlay."""
    from envs.catalog import CatalogTwinV1

    t = CatalogTwinV1(seed=0)
    _ = t.world
    return t


@pytest.fixture(scope="session")
def shopify_twin_v1(shopify_twin):
    """Catalog v1 on Shopify's taxonomy; skipped when the shared data is absent."""
    from envs.catalog import CatalogTwinV1

    t = CatalogTwinV1(seed=0, taxonomy_path=str(SHOPIFY))
    _ = t.world
    return t


@pytest.fixture(scope="session")
def v2_twin(twin_v1):
    """``v2_twin(max_turns)``: Catalog v2 on the generated world (seed 0, 400 test cases)."""
    from envs.catalog import CatalogTwinV2

    def make(max_turns: int):
        t = CatalogTwinV2(seed=0, taxonomy_path=None, max_turns=max_turns, test_size=400)
        _ = t.world
        return t

    return make


@pytest.fixture(scope="session")
def play():
    """``play(twin, baseline, n, split)``: the baseline's episodes of cases ``0 .. n - 1``."""
    from twin.rollout import run_episodes

    def run(twin, name: str, n: int, split: str = "test"):
        policy = twin.baselines()[name](twin)
        cases = [(split, i) for i in range(n)]
        groups = run_episodes(twin, policy, cases, group_size=1, progress=False)
        return [t for g in groups for t in g.trajectories]

    return run

"""The shipped rollouts and the reward properties against the real catalog twins (their worlds):
``Catalog`` (the latest, v1) and ``Catalog-v0``."""

from __future__ import annotations

from pathlib import Path

import pytest

from envs.catalog.reward_checks import check_catalog_reward
from rewards.testing import cli_main, rollout_twin

ROOT = Path(__file__).resolve().parents[3]


def _make(name: str):
    # A catalog twin that fails to build is a failure here, never a skip: it ships with twinrl.
    # Made as the rollout kit makes it (the registry's shared twin), so the kit reuses this one.
    twin = rollout_twin(name)
    twin.world  # noqa: B018 - build (or load the cached) world now
    return twin


@pytest.fixture(scope="module")
def catalog():
    return _make("Catalog")


@pytest.fixture(scope="module")
def catalog_v0():
    return _make("Catalog-v0")


def test_the_latest_catalog_is_v1(catalog):
    assert catalog.version == 1


def test_shipped_rollouts_pass_against_the_real_twin(catalog, catalog_v0, capsys):
    files = sorted(str(p) for p in (ROOT / "data" / "rollouts").glob("*.rollouts.yaml"))
    assert any("catalog-v1-" in f for f in files) and any("catalog-v0-" in f for f in files)
    assert cli_main(files) == 0, capsys.readouterr().out
    assert "rollouts pass" in capsys.readouterr().out
    assert rollout_twin("twin/Catalog-v1") is catalog and rollout_twin("Catalog-v0") is catalog_v0


@pytest.mark.parametrize("fixture", ["catalog", "catalog_v0"])
def test_reward_properties_on_the_twins_cases(fixture, request):
    twin = request.getfixturevalue(fixture)
    report = check_catalog_reward(twin.score, twin, max_examples=40)
    assert report.examples == 40
    assert all(r == pytest.approx(7.0) for r in report.ratios.values())

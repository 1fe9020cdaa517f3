"""The shipped rollouts and the reward properties against the real catalog twin (its world)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewards.testing import check_reward_properties, cli_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def catalog():
    try:
        from twin.registry import make_twin

        twin = make_twin("Catalog")
        twin.world  # noqa: B018 - build (or load the cached) world now
    except Exception as exc:  # the catalog twin is another area's; say why we skip
        pytest.skip(f"the catalog twin is not available: {type(exc).__name__}: {exc}")
    return twin


def test_shipped_rollouts_pass_against_the_real_twin(catalog, capsys):
    files = sorted(str(p) for p in (ROOT / "data" / "rollouts").glob("*.rollouts.yaml"))
    assert cli_main(files) == 0, capsys.readouterr().out
    assert "rollouts pass" in capsys.readouterr().out


def test_reward_properties_on_the_twins_cases(catalog):
    report = check_reward_properties(catalog.score, catalog, max_examples=40)
    assert report.examples == 40
    assert all(r == pytest.approx(7.0) for r in report.ratios.values())

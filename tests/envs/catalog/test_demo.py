"""``twin demo``: runs end to end on a few episodes, prints the per-type table, writes the
report."""

from __future__ import annotations

import time

import pytest

from envs.catalog.v0.listings import KINDS


def test_demo_small(twin, tmp_path, capsys):
    from envs.catalog.demo import main

    store = tmp_path / "runs.db"
    code = main(
        episodes=14,
        group_size=2,
        out=str(tmp_path / "report"),
        store=str(store),
        progress=False,
        version=0,
    )
    assert code == 0
    out = capsys.readouterr().out
    for kind in KINDS:
        assert kind in out, f"{kind} missing from the per-type table"
    for word in ("pass@2", "false alarms", "missed", "random", "heuristic", "oracle"):
        assert word in out
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| oracle | 1.000" in report
    for png in ("reward.png", "by_kind.png", "confusion_oracle.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000
    from twin.store import RunStore

    runs = RunStore(str(store)).runs()
    assert {r.policy for r in runs} == {"random", "heuristic", "oracle"}
    assert {r.status for r in runs} == {"finished"} and {r.episodes for r in runs} == {28}
    assert all("summary" in r.metrics and "catalog" in r.metrics for r in runs)


def test_demo_v1_runs_careful_and_the_degenerate_policies(twin_v1, tmp_path, capsys):
    from envs.catalog.demo import V1_POLICIES, main
    from envs.catalog.v1.listings import KINDS as V1_KINDS

    code = main(
        episodes=len(V1_KINDS),
        group_size=1,
        out=str(tmp_path / "report"),
        store="none",
        progress=False,
    )
    assert code == 0
    out = capsys.readouterr().out
    for kind in V1_KINDS:
        assert kind in out, f"{kind} missing from the per-type table"
    for name in V1_POLICIES:
        assert name in out
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| careful | 1.000" in report and "| oracle | 1.000" in report


def test_demo_writes_the_default_store(twin, tmp_path, monkeypatch):
    # `make demo` passes no --store: the episodes must still land in the default run store.
    from envs.catalog.demo import main
    from twin.store import RunStore

    monkeypatch.setenv("TWINRL_STORE", str(tmp_path / "default.db"))
    assert (
        main(episodes=2, group_size=1, policies="oracle", out=str(tmp_path / "r"), progress=False)
        == 0
    )
    (run,) = RunStore(str(tmp_path / "default.db")).runs()
    assert run.policy == "oracle"


def test_demo_rejects_unknown_policy(twin, tmp_path):
    from envs.catalog.demo import main

    assert (
        main(episodes=2, policies="random,wizard", store="none", out=str(tmp_path), progress=False)
        == 2
    )


@pytest.mark.slow
def test_demo_full_default(twin, tmp_path):
    from envs.catalog.demo import main

    started = time.perf_counter()
    assert main(out=str(tmp_path / "report"), store=str(tmp_path / "runs.db"), progress=False) == 0
    assert time.perf_counter() - started < 240

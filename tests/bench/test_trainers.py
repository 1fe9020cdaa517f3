"""``twin bench trainer`` (bench/trainers.py): the figures, the calibration, the fair baseline.

The runs themselves are replaced by synthetic metric histories here (a real bench takes minutes;
the slow async test runs the real loop), so what is checked is the arithmetic and the report.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import trainers


def _history(
    n: int, step_s: float, *, k: int, rollout_s: float = 1.0, learn_s: float = 1.0
) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        hist = {"0": i + 1} if k == 0 else {"0": 1, "1": i}
        rows.append(
            {
                "step": i,
                "perf/step_s": step_s,
                "perf/sampled_tokens": 100.0,
                "perf/rollout_s": rollout_s,
                "perf/learn_s": learn_s,
                "perf/learner_s": learn_s / 2,
                "async/sync_s": 0.1,
                "async/save_s": 0.03,
                "async/load_s": 0.07,
                "async/rollout_idle_s": 0.5 * i,
                "async/rollout_wall_s": 2.0 * i,
                "async/learner_idle_s": 0.0,
                "async/learner_wall_s": 2.0 * i,
                "async/queue_depth": float(i % 2),
                "async/staleness": float(min(i, k)),
                "async/staleness_hist": hist,
                "async/dropped_stale": 0.0,
                "async/logprob_mismatch": 1e-7,
                "rewards/total": 0.1,
            }
        )
    return rows


def test_summary_windows_the_cumulative_counters() -> None:
    s = trainers.summarize_run(_history(5, 2.0, k=1), warmup=2)
    assert (
        s["steps"] == 3
        and s["steps_per_s"] == pytest.approx(0.5)
        and s["tokens_per_s"] == pytest.approx(50.0)
    )
    assert s["rollout_idle_frac"] == pytest.approx(0.25) and s["learner_idle_frac"] == 0.0
    # cumulative {0: 1, 1: 4} at the end minus {0: 1, 1: 1} after the warm-up: 3 lots one version
    # old
    assert s["staleness_hist"] == {"1": 3}
    assert s["queue_depth_max"] == 1.0 and s["queue_depth"] == pytest.approx(1 / 3)
    assert s["save_s"] == pytest.approx(0.03) and s["load_s"] == pytest.approx(0.07)


def test_summary_mismatch_skips_steps_without_a_completed_check() -> None:
    rows = _history(5, 2.0, k=1)
    for i, r in enumerate(rows):  # k >= 1: NaN where no background check completed that step
        r["async/logprob_mismatch"] = float("nan") if i % 2 == 0 else 1e-7 * i
    assert trainers.summarize_run(rows, warmup=1)["logprob_mismatch"] == pytest.approx(3e-7)
    for r in rows:
        r["async/logprob_mismatch"] = float("nan")
    assert (
        trainers.summarize_run(rows, warmup=1)["logprob_mismatch"]
        != trainers.summarize_run(rows, warmup=1)["logprob_mismatch"]
    )


@given(
    rollout=st.floats(0.01, 100.0),
    other=st.floats(0.0, 1.0),
    pass_s=st.floats(0.001, 10.0),
)
def test_calibration_balances_the_learner_side_against_the_rollout_side(
    rollout: float, other: float, pass_s: float
) -> None:
    e = trainers.calibrated_epochs(rollout, other, pass_s)
    assert 1 <= e <= trainers.MAX_EPOCHS
    if 1 < e < trainers.MAX_EPOCHS:  # no other pass count is closer
        gap = abs(e * pass_s + other - rollout)
        assert gap <= abs((e - 1) * pass_s + other - rollout) + 1e-9
        assert gap <= abs((e + 1) * pass_s + other - rollout) + 1e-9


def test_calibration_without_a_measured_pass_keeps_one() -> None:
    assert trainers.calibrated_epochs(1.0, 0.1, 0.0) == 1


def test_balance_splits_a_synchronous_step_between_the_sides() -> None:
    # k=0: the learner waited 1.2 s for the lot, then was busy 0.8 s (2 passes of 0.25 s + 0.3 s)
    record = {
        "perf/step_s": 2.0,
        "async/learner_wait_s": 1.2,
        "async/load_s": 0.1,
        "perf/learner_s": 0.25,
        "perf/rollout_s": 1.0,
        "async/sync_s": 0.15,
    }
    b = trainers.balance_of(record, epochs=2)
    assert b["rollout_side_s"] == pytest.approx(1.3) and b["learner_side_s"] == pytest.approx(0.8)
    assert b["learner_other_s"] == pytest.approx(0.3)
    assert b["learner_other_k1_s"] == pytest.approx(0.2)  # the load leaves the learner at k >= 1
    # 4 passes: 4 * 0.25 + 0.3 = 1.3 s on each side
    assert trainers.calibrated_epochs(b["rollout_side_s"], b["learner_other_s"], b["pass_s"]) == 4


def test_calibration_uses_the_quickest_warm_up_step_after_the_first() -> None:
    def step(i: int, wait: float, load: float = 0.05) -> dict[str, Any]:
        return {"step": i, "async/learner_wait_s": wait, "async/load_s": load}

    # the first lots pay for start-up; a slow later step must not decide either
    records = [step(0, 0.1), step(1, 0.9), step(2, 0.3), step(3, 0.35)]
    assert trainers.quickest_warmup_step(records)["step"] == 2
    assert trainers.quickest_warmup_step([step(0, 0.4)])["step"] == 0  # one warm-up step: that one
    # the adapter load counts: 0.3 + 0.05 beats 0.2 + 0.2
    assert (
        trainers.quickest_warmup_step([step(0, 0.1), step(1, 0.3), step(2, 0.2, load=0.2)])["step"]
        == 1
    )
    with pytest.raises(ValueError, match="no warm-up steps"):
        trainers.quickest_warmup_step([])


def test_baseline_is_the_faster_synchronous_run() -> None:
    results = {
        "k0_pinned": {"steps_per_s": 0.4},
        "k1_pinned": {"steps_per_s": 0.9},
        "k0_shared": {"steps_per_s": 0.5},
    }
    assert trainers.pick_baseline(results) == "k0_shared"
    results["k0_shared"]["steps_per_s"] = 0.3
    assert trainers.pick_baseline(results) == "k0_pinned"
    with pytest.raises(ValueError, match="no k=0"):
        trainers.pick_baseline({"k1_pinned": {"steps_per_s": 1.0}})


def test_runs_give_k0_the_same_and_the_shared_resources() -> None:
    runs = trainers._runs("best", 2)
    assert [r.name for r in runs] == ["k0_pinned", "k1_pinned", "k0_shared"]
    pinned, overlap, shared = runs
    assert (
        pinned.overrides()
        == overlap.overrides()
        == ["devices.cpu_threads=1", "devices.cpu_affinity=auto"]
    )
    assert (pinned.k, overlap.k, shared.k) == (0, 1, 0)
    assert shared.overrides() == ["devices.cpu_threads=2", "devices.cpu_affinity=off"]
    assert [r.name for r in trainers._runs("1", 2)] == ["k0_pinned", "k1_pinned"]
    assert [r.name for r in trainers._runs("best", 1)] == [
        "k0_pinned",
        "k1_pinned",
    ]  # nothing to share
    with pytest.raises(ValueError, match="best, 1 or all"):
        trainers._runs("3", 2)


@pytest.mark.parametrize("cores", [1, 2])
def test_main_reports_the_ratio_against_the_faster_baseline(
    cores: int,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    step_s = {"k0_pinned": 2.5, "k1_pinned": 1.25, "k0_shared": 2.0}
    calls: list[tuple[str, int | None]] = []

    def fake_run(
        overrides: list[str],
        run: trainers.BenchRun,
        steps: int,
        output_dir: Path,
        *,
        epochs: int | None,
        warmup: int,
        on_calibrated: Any = None,
    ) -> tuple[list[dict[str, Any]], int]:
        calls.append((run.name, epochs))
        if epochs is None and on_calibrated is not None:
            on_calibrated(
                {
                    "rollout_s": 1.0,
                    "rollout_side_s": 1.2,
                    "learner_side_s": 0.8,
                    "learner_other_s": 0.3,
                    "pass_s": 0.3,
                    "sync_s": 0.1,
                    "load_s": 0.05,
                    "epochs": 3.0,
                }
            )
        return _history(steps, step_s[run.name], k=run.k), epochs or 3

    monkeypatch.setattr(trainers, "_run", fake_run)
    monkeypatch.setattr(trainers, "_allowed_cores", lambda: cores)
    out = tmp_path / "bench.json"
    assert trainers.main(steps=4, warmup=2, json=str(out), output_dir=str(tmp_path)) == 0
    text = capsys.readouterr().out
    # the first run calibrates; the others reuse its pass count
    assert calls[0] == ("k0_pinned", None) and all(e == 3 for _, e in calls[1:])
    figures = json.loads(out.read_text())
    if cores == 2:  # two cores: the shared k=0 run is measured too, and is the faster k=0
        assert [name for name, _ in calls] == ["k0_pinned", "k1_pinned", "k0_shared"]
        assert figures["baseline"] == "k0_shared" and figures["ratio"] == pytest.approx(1.6)
        assert "1.60x against the faster k=0 (k0_shared" in text and "2.00x vs k0_pinned" in text
    else:  # one core: nothing to share
        assert [name for name, _ in calls] == ["k0_pinned", "k1_pinned"]
        assert figures["baseline"] == "k0_pinned" and figures["ratio"] == pytest.approx(2.0)
    assert (
        "rollout side 1.20 s/step" in text
        and "pass 0.300 s + 0.30 s" in text
        and "-> 3 passes" in text
    )
    assert "staleness histogram" in text and "{'1': 4}" in text and "load average" in text
    assert figures["runs"]["k0_pinned"]["calibration"]["epochs"] == 3.0
    assert figures["update_epochs"] == 3 and figures["cores"] == cores
    # _history gives both runs the same per-step times: no slowdown, and the bound is the plain one
    assert "sampling x1.00, learner updates x1.00" in text
    assert figures["slowdown"]["bound"] == pytest.approx(figures["bound"])


def test_overlap_slowdown_lowers_the_bound() -> None:
    k0 = {"rollout_s": 1.0, "learner_s": 1.0, "learner_wait_s": 1.0, "load_s": 0.1, "step_s": 2.2}
    same = trainers.overlap_slowdown(k0, {"rollout_s": 1.0, "learner_s": 1.0})
    assert same == pytest.approx((1.0, 1.0, 2.2 / 1.1))  # (W + B) / max(W + l, B - l), B = 1.2
    roll, learn, bound = trainers.overlap_slowdown(k0, {"rollout_s": 1.5, "learner_s": 1.3})
    assert (roll, learn) == pytest.approx((1.5, 1.3))
    assert bound == pytest.approx(2.2 / max(1.5 + 0.1, 1.1 + 0.3))
    assert trainers.overlap_slowdown({"rollout_s": 0.0}, {"rollout_s": 1.0}) == (0.0, 0.0, 0.0)


def test_runs_leave_the_process_as_they_found_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from trainer.placement import ROLLOUT_CPUS_ENV

    monkeypatch.delenv(ROLLOUT_CPUS_ENV, raising=False)
    threads = torch.get_num_threads()
    with trainers._restored_process():
        os.environ[ROLLOUT_CPUS_ENV] = "0"
        torch.set_num_threads(threads + 1)
    assert ROLLOUT_CPUS_ENV not in os.environ and torch.get_num_threads() == threads

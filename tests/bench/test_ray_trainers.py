"""``twin bench trainer --backend ray``: the local report plus Ray's overhead per lot (runs
faked)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import trainers
from twin.errors import ConfigError


def _history(n: int, step_s: float, k: int) -> list[dict[str, Any]]:
    return [
        {
            "step": i,
            "perf/step_s": step_s,
            "perf/sampled_tokens": 100.0,
            "perf/rollout_s": 1.0,
            "perf/learn_s": 1.0,
            "perf/learner_s": 0.5,
            "async/sync_s": 0.1,
            "async/save_s": 0.03,
            "async/load_s": 0.07,
            "async/rollout_idle_s": 0.5 * i,
            "async/rollout_wall_s": 2.0 * i,
            "async/learner_idle_s": 0.0,
            "async/learner_wall_s": 2.0 * i,
            "async/queue_depth": 0.0,
            "async/staleness": float(min(i, k)),
            "async/staleness_hist": {"0": i + 1},
            "async/dropped_stale": 0.0,
            "async/logprob_mismatch": 1e-7,
            "rewards/total": 0.1,
        }
        for i in range(n)
    ]


def test_ray_backend_prints_the_ratios_and_the_overhead_per_lot(
    monkeypatch, tmp_path: Path, capsys
) -> None:
    seen: list[tuple[str, str]] = []

    def fake_run(
        overrides: list[str],
        run: trainers.BenchRun,
        steps: int,
        output_dir: Path,
        *,
        epochs: Any,
        warmup: int,
        on_calibrated: Any = None,
        backend: str = "local",
        transit: list[float] | None = None,
    ) -> tuple[list[dict[str, Any]], int]:
        seen.append((run.name, backend))
        assert transit is not None
        transit.extend([0.010, 0.020, 0.030])
        return _history(steps, 2.0 if run.k == 0 else 1.0, run.k), epochs or 2

    monkeypatch.setattr(trainers, "_run", fake_run)
    out = tmp_path / "bench.json"
    assert trainers.main(steps=3, warmup=1, json=str(out), k0_threads="1", backend="ray") == 0
    text = capsys.readouterr().out
    assert seen == [("k0_pinned", "ray"), ("k1_pinned", "ray")]
    assert "on Ray (engine and rollout worker actors)" in text
    assert "throughput ratio k=1 / k=0: 2.00x" in text
    assert (
        "Ray overhead per lot" in text
        and "6 measured lots): mean 20.0 ms, median 20.0 ms, max 30.0 ms" in text
    )
    figures = json.loads(out.read_text())
    assert figures["backend"] == "ray" and figures["ray_overhead"]["mean_s"] == pytest.approx(0.02)


def test_an_unknown_bench_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match="--backend must be local or ray, got 'k8s'"):
        trainers.main(backend="k8s")


def test_overhead_of_no_lots_is_none() -> None:
    assert trainers.ray_overhead([]) is None
    assert trainers.ray_overhead([0.5])["median_s"] == 0.5

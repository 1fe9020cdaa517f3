"""``twin bench openenv``: a twin served by OpenEnv against OpenEnv's echo environment."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip(
    "openenv.core", reason="openenv-core is not installed: pip install 'twinrl[openenv]'"
)

from bench.openenv_latency import step_latency


def test_bench_reports_twin_and_echo_for_both_transports(catalog_cache: Path) -> None:
    lines: list[str] = []
    # 12 steps > max_turns: one untimed re-reset on the way
    result = step_latency("Catalog", steps=12, out=lines.append)
    assert set(result) == {"ws", "http"}
    for row in result.values():
        assert row["twin"]["n"] == row["echo"]["n"] == 12
        assert row["ratio"] == pytest.approx(row["twin"]["median_ms"] / row["echo"]["median_ms"])
    assert len(lines) == 2 and all("echo median" in line and "ratio" in line for line in lines)
    with pytest.raises(ValueError, match="unknown transports"):
        step_latency("Catalog", steps=1, transports=("grpc",))

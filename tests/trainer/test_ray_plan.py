"""``twin plan RECIPE --nodes N --gpus-per-node G``: rollout/learner placement on a Ray cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.cluster_plan import plan_cluster, sides_from_bench
from trainer.plan import main
from twin.errors import ConfigError


def test_engines_stop_where_the_learner_would_wait():
    plan = plan_cluster(2, 8, rollout_s=3.0, learner_s=0.5)
    assert (plan.engines, plan.rollout_workers, plan.spare_gpus, plan.bound) == (
        6,
        12,
        9,
        "learner",
    )
    assert plan.steps_per_s == pytest.approx(2.0)
    assert plan.placement[0].startswith("node 0: learner (driver, 1 GPU), 6 engine(s)")


def test_too_few_gpus_leave_the_rollout_side_the_bound():
    plan = plan_cluster(2, 2, rollout_s=10.0, learner_s=1.0)
    assert (plan.engines, plan.spare_gpus, plan.bound) == (3, 0, "rollout")
    assert plan.steps_per_s == pytest.approx(0.3)
    assert plan.placement == ["node 0: learner (driver, 1 GPU), 1 engine(s), 0 GPU(s) free",
                              "node 1: 2 engine(s), 0 GPU(s) free"]  # fmt: skip


@pytest.mark.parametrize(("nodes", "gpus", "roll", "learn", "message"), [
    (1, 1, 1.0, 1.0, "needs >= 2 GPUs in all"),
    (0, 8, 1.0, 1.0, "needs >= 2 GPUs in all"),
    (1, 2, 0.0, 1.0, "per-step seconds must be > 0"),
])  # fmt: skip
def test_impossible_clusters_are_refused(nodes, gpus, roll, learn, message):
    with pytest.raises(ConfigError, match=message):
        plan_cluster(nodes, gpus, roll, learn)


def test_the_sides_come_from_the_bench_report(tmp_path: Path, capsys):
    report = tmp_path / "bench.json"
    report.write_text(
        json.dumps(
            {"baseline": "k0_pinned", "runs": {"k0_pinned": {"learner_wait_s": 1.5, "step_s": 2.0}}}
        )
    )
    assert sides_from_bench(report) == (1.5, 0.5)
    with pytest.raises(ConfigError, match="not a `twin bench trainer --json` report"):
        sides_from_bench(tmp_path / "missing.json")
    assert main("toy-cpu", nodes=2, gpus_per_node=4, bench=str(report)) == 0
    out = capsys.readouterr().out
    assert "cluster: 2 node(s) x 4 GPU(s)" in out and "3 engine(s), 6 rollout worker(s)" in out
    assert (
        "the learner bounds throughput" in out
        and "backend: ray; ray: {engines: 3, rollout_workers: 6}" in out
    )
    with pytest.raises(ConfigError, match="needs measured per-side times"):
        main("toy-cpu", nodes=2, gpus_per_node=4)

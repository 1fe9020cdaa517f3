"""Metric sinks beside JSONL: Weights & Biases (offline) and trackio (local), with real libraries."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.metrics import EPISODE_COLUMNS, MetricsLogger, episode_rows
from twin.evaluation import evaluate
from twin.policies import ReplayPolicy
from twin.registry import make_twin

ROOT = Path(__file__).resolve().parents[2]
TURNS = [{"name": "lookup_order", "arguments": {"order_id": "R-10273"}},
         {"name": "decide", "arguments": {"order_id": "R-10273", "decision": "refund",
                                          "amount": 50.0, "reason": "unopened"}}]


def _episodes():
    result = evaluate(make_twin("returns"), ReplayPolicy(TURNS), [("test", 0), ("test", 1)],
                      progress=False)
    return [t for g in result.groups for t in g.trajectories]


def test_episode_rows_hold_prompt_calls_results_and_breakdown():
    rows = episode_rows(_episodes())
    assert len(rows) == 2 and len(rows[0]) == len(EPISODE_COLUMNS)
    case_id, prompt, calls, results, reward, breakdown = rows[0]
    assert case_id == "Returns/test/0"
    assert "R-10273" in prompt and "[system]" in prompt and "[user]" in prompt
    assert calls.splitlines()[0].startswith('lookup_order({"order_id": "R-10273"})')
    assert "R-10273" in results
    assert json.loads(breakdown) and reward == pytest.approx(sum(json.loads(breakdown).values()))


def test_unknown_sink_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown log sink.*'mlflow'.*allowed: jsonl, tensorboard, wandb, trackio"):
        MetricsLogger(tmp_path, sinks=["jsonl", "mlflow"])


def _run_sink(sink: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # a child process: both libraries read their settings (mode, folders) at import/init
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "tests" / "trainer")!r})
        from test_metrics_sinks import _episodes
        from trainer.metrics import MetricsLogger
        logger = MetricsLogger({str(tmp_path / "run")!r}, sinks=["jsonl", {sink!r}],
                               project="twinrl-test", run_name="sinks", config={{"seed": 0}})
        episodes = _episodes()
        for step in range(2):
            logger.log(step, {{"rewards/total": 0.5 + step, "rewards/correct_decision": 1.0,
                              "async/staleness_hist": {{"0": 2}}}}, episodes=episodes)
        logger.close()
        print("DONE")
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)


def test_wandb_offline_gets_scalars_per_component_and_an_episode_table(tmp_path):
    pytest.importorskip("wandb", reason="wandb not installed: pip install 'twinrl[integrations]'")
    import os

    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_DIR": str(tmp_path), "WANDB_CACHE_DIR": str(tmp_path / "cache"),
           "WANDB_CONFIG_DIR": str(tmp_path / "config")}
    proc = _run_sink("wandb", tmp_path, env)
    assert "DONE" in proc.stdout, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    # offline runs keep their history in the run's binary log (read by `wandb sync`)
    (log_file,) = run_dir.glob("run-*.wandb")
    history = log_file.read_bytes()
    for key in (b"rewards/total", b"rewards/correct_decision", b"episodes", b"table-file"):
        assert key in history, key
    (table,) = (run_dir / "files" / "media" / "table").glob("episodes_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"] == EPISODE_COLUMNS and data["data"][0][0] == "Returns/test/0"


def test_trackio_local_gets_scalars_per_component_and_an_episode_table(tmp_path):
    pytest.importorskip("trackio", reason="trackio not installed: pip install 'twinrl[integrations]'")
    import os

    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    proc = _run_sink("trackio", tmp_path, env)
    assert "DONE" in proc.stdout, proc.stderr[-3000:]
    read = textwrap.dedent("""
        import json
        from trackio.sqlite_storage import SQLiteStorage
        logs = SQLiteStorage.get_logs("twinrl-test", "sinks")
        print(json.dumps(logs, default=str))
    """)
    out = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=env)
    logs = json.loads(out.stdout.strip().splitlines()[-1])
    assert [row["step"] for row in logs] == [0, 1]
    assert logs[1]["rewards/total"] == 1.5 and logs[0]["rewards/correct_decision"] == 1.0
    table = logs[1]["episodes"]
    assert table["_type"] == "trackio.table"
    assert "Returns/test/0" in json.dumps(table)

"""Metric sinks beside JSONL: Weights & Biases (offline) and trackio
(local), with real libraries."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.metrics import EPISODE_COLUMNS, MetricsLogger, episode_table, sample_episodes
from twin.evaluation import evaluate
from twin.policies import ReplayPolicy
from twin.registry import make_twin

ROOT = Path(__file__).resolve().parents[2]
TURNS = [
    {"name": "lookup_order", "arguments": {"order_id": "R-10273"}},
    {
        "name": "decide",
        "arguments": {
            "order_id": "R-10273",
            "decision": "refund",
            "amount": 50.0,
            "reason": "unopened",
        },
    },
]


#: A turn whose text-format call does not parse: the table must still show what was written.
GARBLED = 'Checking the order. <tool_call>{"name": "lookup_order", "arguments": {oops</tool_call>'


def _episodes():
    result = evaluate(
        make_twin("returns"), ReplayPolicy(TURNS), [("test", 0), ("test", 1)], progress=False
    )
    garbled = evaluate(make_twin("returns"), ReplayPolicy([GARBLED]), [("dev", 0)], progress=False)
    return [t for r in (result, garbled) for g in r.groups for t in g.trajectories]


def test_the_episode_table_holds_raw_text_and_one_column_per_reward_term():
    episodes = _episodes()
    columns, rows = episode_table(episodes)
    assert columns[: len(EPISODE_COLUMNS)] == EPISODE_COLUMNS
    terms = [c for c in columns if c.startswith("term/")]
    assert terms and len(columns) == len(EPISODE_COLUMNS) + len(terms)
    row = dict(zip(columns, rows[0]))
    assert row["case_id"] == "Returns/test/0"
    assert "R-10273" in row["prompt"] and "[system]" in row["prompt"] and "[user]" in row["prompt"]
    assert row["calls"].splitlines()[0].startswith('lookup_order({"order_id": "R-10273"})')
    assert "R-10273" in row["tool_results"]
    assert row["reward"] == pytest.approx(sum(v for k, v in row.items() if k.startswith("term/")))
    assert row["reward"] == pytest.approx(episodes[0].reward)
    garbled = dict(zip(columns, rows[2]))  # Returns/dev/0
    assert "Checking the order." not in garbled["calls"]  # the parser kept only the call
    assert GARBLED in garbled["text"]  # the model's words, as written


def test_tables_sample_across_the_reward_range():
    episodes = _episodes()
    picked = sample_episodes(episodes, 2)
    rewards = sorted(t.reward for t in episodes)
    assert [t.reward for t in picked] == [rewards[0], rewards[-1]]
    assert sample_episodes(episodes, 10) == sorted(episodes, key=lambda t: (t.reward, t.case_id))


def test_unknown_sink_is_a_clear_error(tmp_path):
    with pytest.raises(
        ValueError, match="unknown log sink.*'mlflow'.*allowed: jsonl, tensorboard, wandb, trackio"
    ):
        MetricsLogger(tmp_path, sinks=["jsonl", "mlflow"])


def _run_sink(sink: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # a child process: both libraries read their settings (mode, folders) at import/init
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT / "tests" / "trainer")!r})
        from test_metrics_sinks import _episodes
        from trainer.metrics import MetricsLogger
        logger = MetricsLogger({str(tmp_path / "run")!r}, sinks=["jsonl", {sink!r}],
                               project="twinrl-test", run_name="sinks", config={{"seed": 0}},
                               table_every=2, table_rows=2)
        episodes = _episodes()
        for step in range(3):  # a table every 2 steps: steps 0 and 2
            logger.log(step, {{"rewards/total": 0.5 + step, "rewards/correct_decision": 1.0,
                              "async/staleness_hist": {{"0": 2}}}}, episodes=episodes)
        logger.close()
        print("DONE")
    """)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )


def test_wandb_offline_honours_its_variables_and_tables_hold_text_and_terms(tmp_path):
    pytest.importorskip("wandb", reason="wandb not installed: pip install 'twinrl[trackers]'")
    import os

    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path / "wb"),
        "WANDB_PROJECT": "from-the-variable",
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
    }
    proc = _run_sink("wandb", tmp_path, env)
    assert "DONE" in proc.stdout, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "wandb").exists()  # WANDB_DIR wins over the output folder
    (run_dir,) = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    # offline runs keep their history in the run's binary log (read by `wandb sync`)
    (log_file,) = run_dir.glob("run-*.wandb")
    history = log_file.read_bytes()
    for key in (
        b"rewards/total",
        b"rewards/correct_decision",
        b"episodes",
        b"table-file",
        b"from-the-variable",
    ):
        assert key in history, key
    assert b"twinrl-test" not in history  # the code's project did not override WANDB_PROJECT
    tables = sorted((run_dir / "files" / "media" / "table").glob("episodes_*.table.json"))
    assert len(tables) == 2  # steps 0 and 2 of 0..2 (table_every=2)
    data = json.loads(tables[0].read_text())
    assert data["columns"][: len(EPISODE_COLUMNS)] == EPISODE_COLUMNS
    assert any(c.startswith("term/") for c in data["columns"])
    assert len(data["data"]) == 2  # table_rows=2 of 3 episodes
    text = data["columns"].index("text")
    assert any("Checking the order." in row[text] for row in data["data"])  # raw text


def test_trackio_local_honours_its_folder_and_tables_hold_text_and_terms(tmp_path):
    pytest.importorskip("trackio", reason="trackio not installed: pip install 'twinrl[trackers]'")
    import os

    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    proc = _run_sink("trackio", tmp_path, env)
    assert "DONE" in proc.stdout, proc.stderr[-3000:]
    assert list((tmp_path / "trackio").iterdir())  # the database is where TRACKIO_DIR says
    read = textwrap.dedent("""
        import json
        from trackio.sqlite_storage import SQLiteStorage
        logs = SQLiteStorage.get_logs("twinrl-test", "sinks")
        print(json.dumps(logs, default=str))
    """)
    out = subprocess.run(
        [sys.executable, "-c", read], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    logs = json.loads(out.stdout.strip().splitlines()[-1])
    assert [row["step"] for row in logs] == [0, 1, 2]
    assert logs[1]["rewards/total"] == 1.5 and logs[0]["rewards/correct_decision"] == 1.0
    assert "episodes" not in logs[1]  # table_every=2
    table = json.dumps(logs[2]["episodes"])
    assert logs[2]["episodes"]["_type"] == "trackio.table"
    assert "term/" in table and '"text"' in table and "Checking the order." in table

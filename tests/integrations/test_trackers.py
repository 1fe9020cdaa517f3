"""`twin eval --tracker wandb|trackio`: the evaluation reaches W&B (offline) and trackio (local)
where their own variables say, with summary scalars and an episode table holding the model's
raw text and one column per reward term (the files are read back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPLAY = [
    (
        'I will look it up. <tool_call>{"name": "lookup_order", "arguments": {"order_id": '
        '"R-10273"}}'
        "</tool_call>"
    ),
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


def _eval(tmp_path: Path, tracker: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    replay = tmp_path / "turns.json"
    replay.write_text(json.dumps(REPLAY))
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "TWINRL_CACHE": str(tmp_path / "cache")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "twinrl_cli",
            "eval",
            "Returns",
            "--policy",
            f"replay:{replay}",
            "-n",
            "3",
            "--no-store",
            "--no-progress",
            "--json",
            "--tracker",
            tracker,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _check_table(columns: list[str], rows: list[list]) -> None:
    assert columns[:6] == ["case_id", "prompt", "text", "calls", "tool_results", "reward"]
    terms = [c for c in columns if c.startswith("term/")]
    assert terms and len(rows) == 3
    text = columns.index("text")
    assert all("I will look it up. <tool_call>" in row[text] for row in rows)
    for row in rows:
        values = dict(zip(columns, row))
        assert values["reward"] == pytest.approx(sum(values[t] or 0.0 for t in terms))


def test_eval_tracker_wandb_offline_honours_wandb_variables(tmp_path):
    pytest.importorskip("wandb", reason="wandb not installed: pip install 'twinrl[trackers]'")
    proc = _eval(
        tmp_path,
        "wandb",
        {
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_DIR": str(tmp_path / "wb"),
            "WANDB_PROJECT": "eval-project",
            "WANDB_CACHE_DIR": str(tmp_path / "c"),
            "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    (run_dir,) = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    (log_file,) = run_dir.glob("run-*.wandb")
    history = log_file.read_bytes()
    assert b"eval-project" in history and b"eval/reward_mean" in history
    assert b"eval/components/" in history
    (table,) = (run_dir / "files" / "media" / "table").glob("episodes_*.table.json")
    data = json.loads(table.read_text())
    _check_table(data["columns"], data["data"])
    rewards = [r[data["columns"].index("reward")] for r in data["data"]]
    assert sum(rewards) / 3 == pytest.approx(summary["reward_mean"])  # the same episodes


def test_eval_tracker_trackio_honours_trackio_dir(tmp_path):
    pytest.importorskip("trackio", reason="trackio not installed: pip install 'twinrl[trackers]'")
    env = {"TRACKIO_DIR": str(tmp_path / "trackio")}
    proc = _eval(tmp_path, "trackio", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    read = textwrap.dedent("""
        import json
        from trackio.sqlite_storage import SQLiteStorage
        print(json.dumps(SQLiteStorage.get_logs("twinrl", "eval-Returns-replay:turns.json"),
                         default=str))
    """)
    out = subprocess.run(
        [sys.executable, "-c", read],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, **env},
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (logged,) = json.loads(out.stdout.strip().splitlines()[-1])
    assert logged["eval/reward_mean"] == pytest.approx(summary["reward_mean"])
    table = logged["episodes"]
    assert table["_type"] == "trackio.table"
    records = table["_value"]  # one dict per row
    columns = list(records[0])
    _check_table(columns, [[r[c] for c in columns] for r in records])


def test_an_unknown_tracker_is_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "twinrl_cli",
            "eval",
            "Returns",
            "-n",
            "1",
            "--no-store",
            "--tracker",
            "mlflow",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "--tracker must be wandb or trackio" in proc.stderr

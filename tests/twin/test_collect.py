"""Trajectory datasets (twin/evaluation/collect.py, `twin collect`): rows, both formats, the store,
filters."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from twin.errors import ConfigError
from twin.evaluation.collect import HF_HINT, collect, export_run, read_dataset, write_dataset
from twin.policies import make_policy
from twin.registry import make_twin
from twin.store import RunStore
from twinrl_cli import app

runner = CliRunner()

# fmt: off
ROW_KEYS = {
    "messages", "tools", "reward", "components", "twin", "case_id", "split", "index", "case_kind",
    "policy", "run_id", "num_turns", "terminated", "truncated", "invalid_calls",
}
# fmt: on


@pytest.fixture()
def store(tmp_path: Path) -> RunStore:
    s = RunStore(tmp_path / "runs.db")
    yield s
    s.close()


def test_collect_writes_rows_in_both_formats_and_stores_the_run(
    tmp_path: Path, store: RunStore
) -> None:
    twin = make_twin("returns")
    cases = [("train", i) for i in range(6)]
    result = collect(
        twin, make_policy("oracle", twin), cases, out=tmp_path / "ds", store=store, progress=False
    )
    assert (
        result.rows == 6 and result.episodes == 6 and result.hf is not None and result.note is None
    )
    rows = read_dataset(tmp_path / "ds")
    assert [r["case_id"] for r in rows] == [f"Returns/train/{i}" for i in range(6)]
    for row in rows:
        assert set(row) == ROW_KEYS
        assert (
            row["run_id"] == result.run_id and row["policy"] == "oracle" and row["split"] == "train"
        )
        assert row["tools"] == twin.tool_schemas
        assert row["reward"] == 1.0 and row["components"]
        roles = [m["role"] for m in row["messages"]]
        assert roles[:2] == ["system", "user"] and "tool" in roles
        assert any(m.get("tool_calls") for m in row["messages"] if m["role"] == "assistant")
    # the Hugging Face copy reads back into exactly the same rows (dicts are JSON text in Arrow)
    assert read_dataset(result.hf) == rows
    # ... and it is an ordinary datasets folder
    import datasets

    hf = datasets.load_from_disk(str(result.hf))
    assert len(hf) == 6 and json.loads(hf[0]["messages"]) == rows[0]["messages"]
    # the episodes are in the run store too, as an eval run of that policy
    info = store.run(result.run_id)
    assert info.kind == "eval" and info.policy == "oracle" and info.episodes == 6
    meta = json.loads((tmp_path / "ds" / "dataset.json").read_text())
    assert meta["rows"] == 6 and meta["run_id"] == result.run_id and meta["twin"] == "Returns"


def test_min_reward_keeps_only_good_episodes(tmp_path: Path) -> None:
    twin = make_twin("returns")
    cases = [("train", i) for i in range(8)]
    every = collect(
        twin, make_policy("random:3", twin), cases, out=tmp_path / "all", progress=False
    )
    rewards = [r["reward"] for r in read_dataset(every.out)]
    cut = sorted(rewards)[len(rewards) // 2]
    kept = collect(
        twin,
        make_policy("random:3", twin),
        cases,
        out=tmp_path / "kept",
        min_reward=cut,
        progress=False,
    )
    assert (
        kept.rows == sum(r >= cut for r in rewards)
        and kept.dropped_reward == len(rewards) - kept.rows
    )
    assert all(r["reward"] >= cut for r in read_dataset(kept.out))
    # the filter works on reading too
    assert len(read_dataset(every.out, min_reward=cut)) == kept.rows


def test_export_run_writes_the_stored_episodes(tmp_path: Path, store: RunStore) -> None:
    twin = make_twin("returns")
    first = collect(
        twin,
        make_policy("oracle", twin),
        [("dev", i) for i in range(3)],
        out=tmp_path / "a",
        store=store,
        progress=False,
    )
    exported = export_run(store, first.run_id, out=tmp_path / "b")
    assert exported.rows == 3 and exported.run_id == first.run_id
    assert read_dataset(exported.out) == read_dataset(first.out)


def test_without_datasets_jsonl_is_written_and_the_hint_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    jsonl, hf, note = write_dataset(
        [{"messages": [{"role": "user", "content": "hi"}]}], tmp_path / "ds"
    )
    assert hf is None and note == HF_HINT and "twinrl[integrations]" in note
    assert read_dataset(jsonl) == [{"messages": [{"role": "user", "content": "hi"}]}]


def test_read_dataset_errors_say_what_is_allowed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="twin collect"):
        read_dataset(tmp_path / "nothing")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"reward": 1.0}\n')
    with pytest.raises(ConfigError, match="no 'messages'"):
        read_dataset(bad)


def test_cli_collect_and_from_run(tmp_path: Path) -> None:
    db = str(tmp_path / "cli.db")
    out = runner.invoke(
        app,
        [
            "collect",
            "returns",
            "--policy",
            "oracle",
            "--episodes",
            "3",
            "--split",
            "dev",
            "--out",
            str(tmp_path / "ds"),
            "--store",
            db,
            "--no-progress",
            "--json",
        ],
    )
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["rows"] == 3 and report["hf"] and Path(report["jsonl"]).is_file()
    again = runner.invoke(
        app,
        [
            "collect",
            "--from-run",
            str(report["run_id"]),
            "--out",
            str(tmp_path / "re"),
            "--store",
            db,
            "--json",
        ],
    )
    assert again.exit_code == 0, again.output
    assert read_dataset(tmp_path / "re") == read_dataset(tmp_path / "ds")
    neither = runner.invoke(app, ["collect", "--store", db])
    assert neither.exit_code == 2 and "--from-run" in neither.output
    too_many = runner.invoke(
        app,
        [
            "collect",
            "returns",
            "--policy",
            "oracle",
            "--split",
            "dev",
            "--episodes",
            "1000",
            "--store",
            db,
        ],
    )
    assert too_many.exit_code == 2 and "--episodes" in too_many.output

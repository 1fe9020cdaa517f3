"""The run store: round trips, listings, metrics, and nothing committed is lost to a SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from twin.errors import ConfigError
from twin.store import RunNotFoundError, RunStore, resolve_url
from twin.trajectory import TokenTurn, ToolCallRecord, Trajectory


def _traj(i: int, reward: float | None = 0.5) -> Trajectory:
    return Trajectory(
        twin="Returns",
        case_id=f"Returns/test/{i}",
        split="test",
        index=i,
        case_kind="refund" if i % 2 else "deny",
        policy="random",
        messages=[
            {"role": "user", "content": "héllo ✓"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
        ],
        calls=[
            ToolCallRecord(
                id="c",
                name="f",
                arguments={"a": [1, 2.5]},
                ok=True,
                result={"x": None},
                latency_s=1e-5,
            )
        ],
        submission={"decision": "refund"},
        invalid_calls=1,
        num_turns=2,
        terminated=True,
        token_turns=[
            TokenTurn(prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.123456789012345])
        ],
        reward=reward,
        components={"decision": 1.0, "penalty": -0.01},
        weighted={"decision": 0.7},
        reward_notes=["ok"],
        timings={"policy": 0.1, "env": 0.01, "total": 0.11},
        info={"outcome": {"truth": "refund"}},
    )


@pytest.fixture()
def store(tmp_path) -> RunStore:
    s = RunStore(tmp_path / "runs.db")
    yield s
    s.close()


def test_trajectory_round_trip(store):
    run = store.start_run(
        "eval", "Returns", "random", {"episodes": 2, "twin_config": {"max_turns": 4}}
    )
    trajs = [_traj(0), _traj(1, None)]
    assert store.add_episodes(run, trajs) == 2
    assert store.episodes(run) == trajs
    assert store.count_episodes(run) == 2


def test_runs_listing_and_finish(store):
    a = store.start_run("eval", "Returns", "random", {"x": 1})
    b = store.start_run("train", "Catalog", "hf:tiny")
    store.add_episodes(a, [_traj(0, 1.0), _traj(1, 0.0)])
    store.add_episodes(b, [_traj(2, 0.25)], step=3)
    store.add_episodes(b, [_traj(3, 0.75)], step=4)
    store.finish_run(a, {"reward_mean": 0.5, "pass@k": {"1": 0.5}})
    runs = store.runs()
    assert [r.id for r in runs] == [b, a]  # newest first
    ra = store.run(a)
    assert (
        ra.status == "finished"
        and ra.finished_at is not None
        and ra.metrics == {"reward_mean": 0.5, "pass@k": {"1": 0.5}}
    )
    assert ra.episodes == 2 and ra.reward_mean == 0.5 and ra.config == {"x": 1}
    rb = store.run(b)
    assert rb.status == "running" and rb.finished_at is None and rb.episodes == 2
    assert [r.id for r in store.runs(kind="train")] == [b]
    assert [r.id for r in store.runs(twin="Returns")] == [a]
    assert len(store.runs(limit=1)) == 1
    assert [t.case_id for t in store.episodes(b, step=4)] == ["Returns/test/3"]
    assert len(store.episodes(b, limit=1)) == 1
    store.finish_run(b, status="failed")
    assert store.run(b).status == "failed"


def test_metrics_curve(store):
    run = store.start_run("train", "Toy", "hf:tiny")
    for step in range(3):
        store.log_metrics(run, step, {"rewards/total": step / 10, "losses/kl": 0.0})
    assert store.metrics(run) == [
        (s, {"rewards/total": s / 10, "losses/kl": 0.0}) for s in range(3)
    ]


def test_errors(store):
    with pytest.raises(RunNotFoundError, match="no run with id 99"):
        store.add_episodes(99, [_traj(0)])
    with pytest.raises(RunNotFoundError):
        store.run(99)
    with pytest.raises(RunNotFoundError):
        store.episodes(99)
    with pytest.raises(ConfigError, match="run kind must be one of"):
        store.start_run("party", "x", "y")
    with pytest.raises(ConfigError):
        RunStore("nosuchdriver+foo://user@host/db")


def test_url_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("TWINRL_STORE", raising=False)
    assert resolve_url() == "sqlite:///runs/twinrl.db"
    assert resolve_url("sqlite:///:memory:") == "sqlite:///:memory:"
    assert resolve_url(tmp_path / "a.db") == f"sqlite:///{tmp_path}/a.db"
    monkeypatch.setenv("TWINRL_STORE", str(tmp_path / "env.db"))
    s = RunStore()
    s.start_run("eval", "x", "y")
    s.close()
    assert (tmp_path / "env.db").exists()
    nested = RunStore(f"sqlite:///{tmp_path}/deep/er/x.db")  # parent folders are created
    nested.close()
    assert (tmp_path / "deep" / "er" / "x.db").exists()


def test_numpy_like_values_are_stored_as_json(store):
    class Scalar:
        def __init__(self, v):
            self.v = v

        def item(self):
            return self.v

    run = store.start_run("eval", "x", "y", {"lr": Scalar(0.5), "tags": ("a", "b")})
    store.finish_run(run, {"m": Scalar(3)})
    info = store.run(run)
    assert info.config == {"lr": 0.5, "tags": ["a", "b"]} and info.metrics == {"m": 3}


WRITER = textwrap.dedent(
    """
    import sys
    from twin.store import RunStore
    from twin.trajectory import Trajectory
    store = RunStore(sys.argv[1])
    run = store.start_run("eval", "Kill", "random")
    batch = 0
    while True:
        store.add_episodes(run, [Trajectory(twin="Kill", case_id=f"Kill/test/{batch}-{i}", reward=0.1 * i)
                                 for i in range(10)])
        batch += 1
        print(batch, flush=True)
    """
)


def test_sigkill_loses_nothing_committed(tmp_path):
    db = tmp_path / "kill.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    committed = 0
    deadline = time.monotonic() + 60
    try:
        while committed < 5 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            committed = int(line)
        assert committed >= 5, "the writer did not commit 5 batches"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    store = RunStore(db)
    (run,) = store.runs()
    assert run.status == "running"  # killed: never finished
    trajs = store.episodes(run.id)
    # every batch the writer reported is there, whole (batches are transactions: multiples of 10)
    assert len(trajs) >= committed * 10 and len(trajs) % 10 == 0
    assert trajs[0].case_id == "Kill/test/0-0"
    store.close()


def test_threads_share_one_store(store):
    import threading

    run = store.start_run("train", "x", "y")
    errors: list[str] = []

    def writer(i: int) -> None:
        try:
            for j in range(10):
                store.add_episodes(run, [_traj(i * 100 + j)], step=i)
                store.log_metrics(run, i, {"j": j})
                store.runs()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.count_episodes(run) == 60 and len(store.metrics(run)) == 60


@pytest.mark.parametrize("module", ["twin.store", "twin.rollout", "twin.policies", "twin.cli"])
def test_public_names(module):
    import importlib

    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == list(mod.__all__)
    for name in mod.__all__:
        assert hasattr(mod, name), name

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
        assert RunStore(db).runs()[0].status == "running"  # its writer is alive
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    store = RunStore(db)
    (run,) = store.runs()
    # killed: never finished, and its process is gone
    assert run.status == "interrupted" and run.pid == proc.pid
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


def _set_run(store: RunStore, run_id: int, **values) -> None:
    """Rewrite a run's liveness columns, as another process (or host) would have left them."""
    from sqlalchemy import update

    from twin.store import _Run

    with store.engine.begin() as conn:
        conn.execute(update(_Run).where(_Run.id == run_id).values(**values))


def test_stale_heartbeat_reads_interrupted_and_a_write_takes_the_run_over(tmp_path):
    import datetime as dt

    store = RunStore(tmp_path / "hb.db")
    run = store.start_run("train", "x", "y")
    info = store.run(run)
    assert info.status == "running" and info.pid == os.getpid() and info.heartbeat_at is not None
    long_ago = info.heartbeat_at - dt.timedelta(hours=1)
    # a writer on another host that went silent an hour ago
    _set_run(store, run, host="elsewhere", pid=1, heartbeat_at=long_ago)
    assert store.run(run).status == "interrupted"
    assert [r.status for r in store.runs()] == ["interrupted"]
    # ... one that beat recently is still running
    _set_run(store, run, heartbeat_at=info.heartbeat_at)
    assert store.run(run).status == "running"
    # a resumed trainer writes to it: the run is this process's again
    _set_run(store, run, heartbeat_at=long_ago)
    store.log_metrics(run, 0, {"a": 1.0})
    again = store.run(run)
    assert again.status == "running" and again.pid == os.getpid() and again.host != "elsewhere"
    store.finish_run(run)
    _set_run(store, run, heartbeat_at=long_ago)
    assert store.run(run).status == "finished"  # only running runs can be interrupted
    with pytest.raises(ConfigError, match="finishes as one of"):
        store.finish_run(run, status="running")
    store.close()


def test_the_heartbeat_thread_keeps_a_quiet_run_alive(tmp_path):
    import datetime as dt

    store = RunStore(tmp_path / "beat.db", heartbeat_s=0.05, stale_after_s=60)
    run = store.start_run("train", "x", "y")
    old = store.run(run).heartbeat_at - dt.timedelta(hours=1)
    _set_run(store, run, heartbeat_at=old)
    deadline = time.monotonic() + 30
    while store.run(run).heartbeat_at == old and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.run(run).heartbeat_at > old and store.run(run).status == "running"
    store.close()


def test_track_run_finishes_fails_or_interrupts(store):
    with store.track_run("eval", "x", "y", {"n": 1}) as run:
        run.add_episodes([_traj(0)])
        run.metrics = {"reward_mean": 0.5}
    done = store.run(run.id)
    assert done.status == "finished" and done.metrics == {"reward_mean": 0.5}
    assert done.episodes == 1
    with pytest.raises(ValueError), store.track_run("eval", "x", "y") as broken:
        broken.add_episodes([_traj(1)])
        raise ValueError("boom")
    assert store.run(broken.id).status == "failed" and store.run(broken.id).episodes == 1
    with pytest.raises(KeyboardInterrupt), store.track_run("eval", "x", "y") as stopped:
        raise KeyboardInterrupt
    assert store.run(stopped.id).status == "interrupted"


def test_a_store_made_before_liveness_columns_is_upgraded(tmp_path):
    import sqlite3

    db = tmp_path / "old.db"
    RunStore(db).close()
    with sqlite3.connect(db) as conn:
        for column in ("pid", "host", "heartbeat_at"):
            conn.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    store = RunStore(db)
    run = store.start_run("eval", "x", "y")
    assert store.run(run).status == "running"
    store.close()


SCHEMA_RACER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from twin.store import RunStore
    Path(sys.argv[2], str(os.getpid())).touch()  # imported: ready
    go = Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.001)
    store = RunStore(sys.argv[1])
    store.start_run("eval", "race", "p")
    store.close()
    """
)


def test_concurrent_writers_on_a_fresh_store_all_create_the_schema(tmp_path):
    """Nine processes open one new SQLite store at once: none dies in create_all."""
    db, ready, go = tmp_path / "race.db", tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCHEMA_RACER, str(db), str(ready), str(go)],
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        for _ in range(9)
    ]
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < 9 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a racer died before the start"
            time.sleep(0.01)
        go.touch()  # all at once
        failures = []
        for p in procs:
            _, err = p.communicate(timeout=120)
            if p.returncode != 0:
                failures.append(err.strip().splitlines()[-1] if err.strip() else p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert failures == []
    store = RunStore(db)
    assert len(store.runs()) == 9
    store.close()


def test_a_file_that_is_not_a_database_is_a_one_line_error(tmp_path):
    text_file = tmp_path / "notes.txt"
    text_file.write_text("root:x:0:0:root:/root:/bin/bash\n" * 50)
    with pytest.raises(ConfigError, match="not a database") as err:
        RunStore(text_file)
    assert "\n" not in str(err.value) and "run-store file" in str(err.value)
    if Path("/etc/passwd").is_file():
        with pytest.raises(ConfigError, match="not a database"):
            RunStore("/etc/passwd")


@pytest.mark.parametrize(
    "module", ["twin.store", "twin.rollout", "twin.policies", "twin.cli", "twin.evaluation"]
)
def test_public_names(module):
    import importlib

    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == list(mod.__all__)
    for name in mod.__all__:
        assert hasattr(mod, name), name

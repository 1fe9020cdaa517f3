"""The run store: round trips, listings, metrics, and nothing committed is lost to a SIGKILL.

Most tests run twice, on SQLite and on PostgreSQL (``store_url``); the PostgreSQL variants use a
throwaway server (tests/conftest.py) and skip, saying why, where there is none.
"""

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


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path) -> str:
    """A new, empty store's URL: an SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/runs.db"
    return request.getfixturevalue("postgres_url")


@pytest.fixture()
def store(store_url) -> RunStore:
    s = RunStore(store_url)
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
        store.add_episodes(
            run,
            [
                Trajectory(twin="Kill", case_id=f"Kill/test/{batch}-{i}", reward=0.1 * i)
                for i in range(10)
            ],
        )
        batch += 1
        print(batch, flush=True)
    """
)


def test_sigkill_loses_nothing_committed(store_url):
    db = store_url
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
        with RunStore(db) as reader:
            assert reader.runs()[0].status == "running"  # its writer is alive
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

    from twin.store import RunTable

    with store.engine.begin() as conn:
        conn.execute(update(RunTable).where(RunTable.id == run_id).values(**values))


def test_stale_heartbeat_reads_interrupted_and_a_write_takes_the_run_over(store_url):
    import datetime as dt

    store = RunStore(store_url)
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


def test_the_heartbeat_thread_keeps_a_quiet_run_alive(store_url):
    import datetime as dt

    store = RunStore(store_url, heartbeat_s=0.05, stale_after_s=60)
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


def test_a_store_made_before_liveness_columns_is_upgraded(store_url):
    from sqlalchemy import create_engine, inspect, text

    RunStore(store_url).close()
    engine = create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (kind, twin, policy, config, status, started_at) "
                "VALUES ('eval', 'old', 'p', '{}', 'finished', '2025-01-02 03:04:05')"
            )
        )
        for column in ("pid", "host", "heartbeat_at"):
            conn.execute(text(f"ALTER TABLE runs DROP COLUMN {column}"))
    store = RunStore(store_url)
    run = store.start_run("eval", "x", "y")
    info = store.run(run)
    assert info.status == "running" and info.pid == os.getpid() and info.heartbeat_at is not None
    old = store.runs()[-1]
    assert old.twin == "old" and old.pid is None and old.started_at.year == 2025
    if engine.dialect.name == "postgresql":  # the added column keeps its time zone
        (beat,) = [c for c in inspect(engine).get_columns("runs") if c["name"] == "heartbeat_at"]
        assert beat["type"].timezone
    engine.dispose()
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


def test_times_are_utc_whatever_the_session_time_zone(store_url):
    """Times carry their zone: a server (or session) far from UTC shifts nothing."""
    import datetime as dt

    if store_url.startswith("postgresql"):
        store_url += "?options=-c%20timezone%3DPacific%2FChatham"  # UTC+12:45 / +13:45
    store = RunStore(store_url)
    before = dt.datetime.now(dt.timezone.utc)
    run = store.start_run("train", "x", "y")
    store.finish_run(run)
    info = store.run(run)
    after = dt.datetime.now(dt.timezone.utc)
    for moment in (info.started_at, info.finished_at, info.heartbeat_at):
        assert moment.utcoffset() == dt.timedelta(0)
        assert before - dt.timedelta(seconds=1) <= moment <= after + dt.timedelta(seconds=1)
    running = store.start_run("train", "x", "y")
    assert store.run(running).status == "running"  # not 13 hours stale
    store.close()


def test_what_sqlite_stores_postgresql_stores_too(store):
    """NaN and infinite metrics (a diverged loss), long names and odd text: no back end refuses
    what the other accepts."""
    import math

    policy = "openai:" + "m" * 300 + "@http://localhost:8000/v1"  # longer than any VARCHAR(256)
    twin = "Tw" * 100 + " ✓ héllo"
    run = store.start_run("train", twin, policy, {"lr": float("inf"), "text": "a'b\"c"})
    store.log_metrics(run, 0, {"losses/kl": float("nan"), "grad/norm": float("-inf"), "ok": 1.5})
    traj = _traj(0).model_copy(update={"case_id": "Returns/test/" + "9" * 400})
    store.add_episodes(run, [traj])
    store.finish_run(run, {"reward_mean": float("nan")})
    info = store.run(run)
    assert (info.twin, info.policy) == (twin, policy)
    assert info.config == {"lr": float("inf"), "text": "a'b\"c"}
    assert math.isnan(info.metrics["reward_mean"])
    ((step, values),) = store.metrics(run)
    assert step == 0 and math.isnan(values["losses/kl"])
    assert values["grad/norm"] == float("-inf") and values["ok"] == 1.5
    assert store.episodes(run) == [traj]


MANY_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from twin.store import RunStore
    from twin.trajectory import Trajectory
    url, ready, go, worker, runs = sys.argv[1:5] + [int(sys.argv[5])]
    Path(ready, worker).touch()
    while not Path(go).exists():
        time.sleep(0.001)
    store = RunStore(url)  # the schema is created here, by all of them at once
    for r in range(runs):
        with store.track_run("train", f"w{worker}", "p", {"worker": worker, "run": r}) as run:
            for batch in range(2):
                run.add_episodes(
                    [Trajectory(twin="W", case_id=f"{worker}/{r}/{batch}/{i}", reward=0.5)
                     for i in range(5)],
                    step=batch,
                )
                run.log_metrics(batch, {"worker": int(worker), "run": r, "batch": batch})
            run.metrics = {"episodes": run.count_episodes()}
    store.close()
    """
)


def test_many_processes_write_one_store_at_once(tmp_path, store_url):
    """Eight processes create the schema of one fresh store and write to it at the same time:
    every run, episode and metric row arrives, and no writer fails."""
    workers, runs = 8, 4
    ready, go = tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", MANY_WRITER, store_url, str(ready), str(go), str(w), str(runs)],
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        for w in range(workers)
    ]
    try:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < workers and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a writer died before the start"
            time.sleep(0.01)
        go.touch()
        failures = []
        for p in procs:
            _, err = p.communicate(timeout=300)
            if p.returncode != 0:
                failures.append(err.strip().splitlines()[-1] if err.strip() else p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert failures == []
    store = RunStore(store_url)
    listed = store.runs(limit=None)
    assert len(listed) == workers * runs
    assert {(r.twin, r.config["run"]) for r in listed} == {
        (f"w{w}", r) for w in range(workers) for r in range(runs)
    }
    for info in listed:
        assert info.status == "finished" and info.episodes == 10
        assert info.metrics == {"episodes": 10}
        worker, run = info.twin[1:], info.config["run"]
        assert sorted(t.case_id for t in store.episodes(info.id)) == sorted(
            f"{worker}/{run}/{b}/{i}" for b in range(2) for i in range(5)
        )
        assert store.metrics(info.id) == [
            (b, {"worker": int(worker), "run": run, "batch": b}) for b in range(2)
        ]
    store.close()


def test_a_forked_worker_gets_its_own_connections(store):
    """A worker forked from a process that holds a store writes through new connections, while
    its parent keeps writing through its own: both sessions stay intact."""
    run = store.start_run("train", "x", "y")
    store.add_episodes(run, [_traj(0)])  # the parent's pool now holds a connection
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            for j in range(20):
                store.add_episodes(run, [_traj(1000 + j)])
            code = 0
        finally:
            os._exit(code)
    for j in range(20):
        store.add_episodes(run, [_traj(2000 + j)])
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store.count_episodes(run) == 41


def test_postgres_without_its_driver_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if psycopg were not installed
    with pytest.raises(ConfigError, match=r"driver 'psycopg' is not installed") as err:
        RunStore("postgresql+psycopg://me:secret@localhost:1/db")
    assert "twinrl[postgres]" in str(err.value) and "secret" not in str(err.value)
    assert "\n" not in str(err.value)


def test_twin_runs_reads_a_postgres_store_and_hides_its_password(postgres_url):
    import json

    from sqlalchemy.engine import make_url
    from typer.testing import CliRunner

    from twinrl_cli import app

    # the throwaway server trusts loopback: any password is accepted, and must not be shown
    url = make_url(postgres_url).set(password="s3cret-pw").render_as_string(hide_password=False)
    with RunStore(url) as store:
        assert "s3cret-pw" not in store.url and "s3cret-pw" not in repr(store)
        run = store.start_run("eval", "Returns", "random", {"episodes": 2})
        store.add_episodes(run, [_traj(0, 1.0), _traj(1, 0.0)])
        store.finish_run(run, {"reward_mean": 0.5})
    runner = CliRunner()
    listing = runner.invoke(app, ["runs", "--store", url, "--json"])
    assert listing.exit_code == 0, listing.output
    (row,) = json.loads(listing.stdout)
    assert (row["id"], row["status"], row["episodes"], row["reward_mean"]) == (
        run,
        "finished",
        2,
        0.5,
    )
    table = runner.invoke(app, ["runs", "--store", url])
    assert table.exit_code == 0 and "Returns" in table.output
    assert "s3cret-pw" not in table.output
    shown = runner.invoke(app, ["runs", "show", str(run), "--store", url, "--json"])
    assert shown.exit_code == 0 and len(json.loads(shown.stdout)["episodes"]) == 2
    down = make_url(url).set(port=1).render_as_string(hide_password=False)  # nothing listens
    bad = runner.invoke(app, ["runs", "--store", down])
    assert bad.exit_code == 2 and "cannot use" in bad.output and "s3cret-pw" not in bad.output
    assert len(bad.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "module",
    [
        "twin.store",
        "twin.rollout",
        "twin.policies",
        "twin.evaluation",
        "twin.doctor",
        "twin.protocols",
        "twinrl_cli",
        "twinrl_cli.app",
        "twinrl_cli.bench",
        "twinrl_cli.eval",
        "twinrl_cli.serve",
    ],
)
def test_public_names(module):
    import importlib

    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == list(mod.__all__)
    for name in mod.__all__:
        assert hasattr(mod, name), name


def test_twin_runs_on_a_damaged_or_missing_store_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from twinrl_cli import app

    db = tmp_path / "runs.db"
    with RunStore(db) as store:
        for i in range(40):  # several pages of runs
            store.finish_run(
                store.start_run("eval", f"Twin{i}", "policy" * 40, config={"pad": "x" * 2000})
            )
    data = bytearray(db.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[2 * page : len(data) - page] = b"\xa5" * (
        len(data) - 3 * page
    )  # corrupted pages, header intact
    db.write_bytes(bytes(data))
    runner = CliRunner()
    for args in (["runs"], ["runs", "show", "1"]):
        result = runner.invoke(app, [*args, "--store", str(db)])
        assert result.exit_code == 2, result.output
        assert not isinstance(result.exception, Exception) or isinstance(
            result.exception, SystemExit
        ), result.exception
        assert "cannot be read" in result.output and "damaged" in result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 3
    # a store that does not exist is an error, and reading creates no folder or file
    missing = tmp_path / "no" / "such" / "dir" / "runs.db"
    result = runner.invoke(app, ["runs", "--store", str(missing)])
    assert result.exit_code == 2 and "no run store" in result.output, result.output
    assert not (tmp_path / "no").exists()

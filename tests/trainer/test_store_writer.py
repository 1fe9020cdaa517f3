"""A training run's store writes: token record off by default, off the step's path, size printed."""

from __future__ import annotations

import io
import threading
from pathlib import Path

from rich.console import Console

from trainer.cli import train
from trainer.config import load_recipe
from trainer.store_writer import StoreWriter
from twin.store import RunStore
from twin.trajectory import TokenTurn, Trajectory


def _episode(i: int) -> Trajectory:
    turn = TokenTurn(
        prompt_ids=list(range(300)), completion_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3]
    )
    return Trajectory(twin="Toy", case_id=f"Toy/train/{i}", token_turns=[turn])


def test_training_runs_keep_no_token_record_by_default() -> None:
    assert load_recipe("toy-cpu").train.store_tokens == "off"


def test_off_drops_the_token_record_and_full_keeps_it(tmp_path: Path) -> None:
    sizes = {}
    for tokens in ("off", "full"):
        with RunStore(tmp_path / f"{tokens}.db") as store:
            run = store.start_run("train", twin="Toy", policy="tiny")
            writer = StoreWriter(store, run, tokens=tokens)
            writer.submit(0, [_episode(0), _episode(1)], {"rewards/total": 0.5})
            writer.close()
            (first, _second) = store.episodes(run, step=0)
            assert bool(first.token_turns) == (tokens == "full")
            assert store.metrics(run) == [(0, {"rewards/total": 0.5})]
            sizes[tokens] = writer.mean_bytes_per_step()
    assert sizes["off"] < sizes["full"] / 3  # the ids are most of an episode's size
    assert writer.describe().startswith("run store: ") and writer.describe().endswith(
        "per step (tokens full)"
    )


def test_submit_does_not_wait_for_the_store() -> None:
    release = threading.Event()
    written: list[int] = []

    class SlowStore:
        def add_episodes(self, run_id, episodes, step=None):
            assert release.wait(10)
            written.append(step)

        def log_metrics(self, run_id, step, values):
            pass

    writer = StoreWriter(SlowStore(), 1)
    writer.submit(0, [_episode(0)], {})
    writer.submit(1, [_episode(1)], {})  # the first write is still blocked: this returned anyway
    assert written == []
    release.set()
    writer.flush()
    assert written == [0, 1]
    writer.close()


def test_a_failing_store_warns_and_training_goes_on(caplog) -> None:
    class Broken:
        def add_episodes(self, *args, **kwargs):
            raise OSError("disk full")

    writer = StoreWriter(Broken(), 1)
    writer.submit(0, [_episode(0)], {})
    writer.close()
    assert "run store write failed at step 0: disk full" in caplog.text
    assert writer.mean_bytes_per_step() is None


def test_twin_train_prints_the_store_size_per_step(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TWINRL_STORE", str(tmp_path / "runs.db"))
    out = io.StringIO()
    code = train(
        "toy-cpu",
        [
            f"train.output_dir={tmp_path / 'run'}",
            "train.steps=1",
            "train.store=true",
            "train.log=[jsonl]",
        ],
        console=Console(file=out, width=200),
    )
    assert code == 0, out.getvalue()
    assert "per step (tokens off)" in out.getvalue()
    with RunStore(tmp_path / "runs.db") as store:
        (run,) = store.runs()
        episodes = store.episodes(run.id)
        assert episodes and all(not t.token_turns for t in episodes)
        assert store.run(run.id).metrics["store/bytes_per_step"] > 0

"""A training run's life in the run store: opened (or continued), then finished only when done."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer.metrics import close_training_run, open_training_run
from twin.store import RunStore


def _cfg(store: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        train=SimpleNamespace(store=store), model=SimpleNamespace(path="tiny"),
        model_dump=lambda **_: {"seed": 0},
    )  # fmt: skip


def test_a_done_run_is_finished_and_an_unfinished_one_stays_resumable(tmp_path) -> None:
    url = tmp_path / "runs.db"
    store, run_id = open_training_run(_cfg(), "Toy", None, store=RunStore(url))
    close_training_run(store, run_id, done=False, summary={"reward/mean": 0.5})
    again = RunStore(url)
    assert again.run(run_id).status == "running"  # --resume continues it
    store, same = open_training_run(_cfg(), "Toy", run_id, store=again)
    assert same == run_id
    close_training_run(store, run_id, done=True, summary={"reward/mean": 0.75})
    info = RunStore(url).run(run_id)
    assert info.status == "finished" and info.metrics == {"reward/mean": 0.75}


def test_a_run_resumed_from_another_checkouts_checkpoint_is_recorded_as_a_new_run(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint carried to a fresh checkout names a run its empty store does not hold: the
    steps from there on are recorded as a new run instead of failing at every write."""
    store = RunStore(tmp_path / "fresh.db")
    store, run_id = open_training_run(_cfg(), "Toy", 7, store=store)
    assert run_id is not None and run_id != 7 and store.run(run_id).status == "running"
    assert "run 7 of the resumed checkpoint is not in this run store" in caplog.text
    store.log_metrics(run_id, 8, {"losses/loss": 0.5})  # writes go to the new run


def test_a_failing_store_warns_and_is_closed_anyway(caplog: pytest.LogCaptureFixture) -> None:
    closed: list[bool] = []

    def finish_run(*_: object, **__: object) -> None:
        raise OSError("disk full")

    store = SimpleNamespace(finish_run=finish_run, close=lambda: closed.append(True))
    close_training_run(store, 3, done=True, summary={})
    assert closed == [True]
    assert "could not finish run 3" in caplog.text and "disk full" in caplog.text


def test_store_off_in_the_recipe_opens_nothing() -> None:
    assert open_training_run(_cfg(store=False), "Toy", None) == (None, None)

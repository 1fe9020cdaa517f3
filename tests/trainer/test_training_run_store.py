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

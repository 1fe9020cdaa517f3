"""The per-step learning body shared by the synchronous recipe and the async learner."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest

from trainer import orchestrator, recipe
from trainer.config import load_recipe
from trainer.recipe import learn_from_groups, make_batch
from twin.trajectory import Group, TokenTurn, Trajectory


def _group(rewards: list[float], prompt: list[int]) -> Group:
    trajs = []
    for k, r in enumerate(rewards):
        t = Trajectory(twin="Toy", case_id="toy/train/0", reward=r)
        t.token_turns = [TokenTurn(prompt_ids=prompt, completion_ids=[7, 8 + k], logprobs=[-1.0, -2.0])]
        t.info["shaped_reward"] = r
        trajs.append(t)
    return Group(case_id="toy/train/0", trajectories=trajs)


class _Learner:
    def __init__(self) -> None:
        self.batches: list[Any] = []

    def step(self, batch: Any) -> dict[str, float]:
        self.batches.append(batch)
        return {"losses/loss": float(len(self.batches))}


def test_make_batch_is_group_z_scored_rows() -> None:
    batch = make_batch([_group([0.0, 1.0, 1.0], [1, 2, 3]), _group([1.0, 1.0, 0.0], [4, 5])], "grpo")
    assert len(batch) == 6
    assert batch.input_ids[0] == [1, 2, 3, 7, 8] and batch.loss_mask[0] == [0, 0, 0, 1, 1]
    assert batch.sampler_logprobs[1] == [0.0, 0.0, 0.0, -1.0, -2.0]
    assert batch.advantages[0] < 0 < batch.advantages[1] == batch.advantages[2]
    assert batch.advantages[3:] == pytest.approx(batch.advantages[2::-1], abs=1e-6)  # the mirrored group
    assert sum(batch.advantages[3:]) == pytest.approx(0.0, abs=1e-6)


def test_learn_from_groups_updates_epochs_times_and_reports_every_group() -> None:
    kept = [_group([0.0, 1.0], [1, 2, 3])]
    every = kept + [_group([1.0, 1.0], [4, 5])]
    learner = _Learner()
    update = learn_from_groups(learner, kept, every, advantage="rloo", step=3, epochs=2)  # type: ignore[arg-type]
    assert len(learner.batches) == 2 and learner.batches[0] is learner.batches[1]
    assert update.learn == {"losses/loss": 2.0}  # the last update's metrics
    assert update.episodes["episodes/count"] == 4.0
    assert update.episodes["rewards/total"] == pytest.approx(0.75)
    assert update.learn_s >= 0.0


def test_nothing_kept_means_no_update_and_a_warning(caplog) -> None:
    learner = _Learner()
    with caplog.at_level(logging.WARNING, logger="twinrl.trainer"):
        update = learn_from_groups(learner, [], [_group([1.0, 1.0], [1, 2])], advantage="grpo", step=5)  # type: ignore[arg-type]
    assert learner.batches == [] and update.learn == {}
    assert "step 5: every group had equal rewards" in caplog.text


class _Recorded:
    """A learner that notes whether each update ran inside the shared step body."""

    def __init__(self) -> None:
        self.version = 0
        self.in_body = False
        self.updates: list[tuple[Any, bool]] = []  # (batch, inside learn_from_groups)

    def step(self, batch: Any) -> dict[str, float]:
        self.updates.append((batch, self.in_body))
        self.version += 1
        return {"losses/loss": 0.5}


class _Metrics:
    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []

    def log(self, step: int, record: dict[str, Any], episodes: Any = None) -> dict[str, Any]:
        self.history.append({"step": step, **record})
        return record


def _spy_on_the_body(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of ``trainer.recipe.learn_from_groups``, flagging the learner while inside."""
    real, calls = recipe.learn_from_groups, []

    def body(learner: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["step"])
        learner.in_body = True
        try:
            return real(learner, *args, **kwargs)
        finally:
            learner.in_body = False

    monkeypatch.setattr(recipe, "learn_from_groups", body)
    return calls


def _check_updates(learner: _Recorded, kept: list[Group]) -> None:
    expected = make_batch(kept, "grpo")
    assert [inside for _, inside in learner.updates] == [True, True], "every update goes through the body"
    for batch, _ in learner.updates:
        assert (batch.input_ids, batch.advantages) == (expected.input_ids, expected.advantages)


def test_the_sync_loop_updates_only_through_the_step_body(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    calls = _spy_on_the_body(monkeypatch)
    cfg = load_recipe({"twin": {"name": "Toy"}, "train": {"steps": 2, "output_dir": str(tmp_path)}})
    loop = recipe.GRPORecipe(cfg)
    kept = [_group([0.0, 1.0, 1.0], [1, 2, 3])]
    every = kept + [_group([1.0, 1.0, 1.0], [4, 5])]
    loop.learner, loop.metrics = _Recorded(), _Metrics()  # type: ignore[assignment]
    monkeypatch.setattr(loop, "collect", lambda step: (kept, every, {}))
    monkeypatch.setattr(loop, "save", lambda: tmp_path)
    history = loop.train()
    assert calls == [0, 1]
    _check_updates(loop.learner, kept)  # type: ignore[arg-type]
    assert [r["episodes/count"] for r in history] == [6.0, 6.0]  # every sampled group is reported


def test_the_async_loop_updates_only_through_the_step_body(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from trainer.workers import Lot

    calls = _spy_on_the_body(monkeypatch)
    cfg = load_recipe({"twin": {"name": "Toy"}, "train": {"steps": 2, "output_dir": str(tmp_path)}})
    loop = orchestrator.AsyncTrainer(cfg)
    kept = [_group([0.0, 1.0, 1.0], [1, 2, 3])]
    every = kept + [_group([1.0, 1.0, 1.0], [4, 5])]
    lots = iter(Lot(i, i, i + 1, [g.model_dump_json() for g in every], [0]) for i in range(2))
    loop.learner, loop.metrics = _Recorded(), _Metrics()  # type: ignore[assignment]
    loop.shared = SimpleNamespace(update=lambda **kwargs: None)  # type: ignore[attr-defined]
    for name, fake in {
        "_next_lot": lambda: (next(lots), 0.0), "_qsize": lambda: 0, "_sync": lambda version: 0.0,
        "_collect_probes": lambda wait_below=None: (math.nan, 0, 0), "_launch_probe": lambda version: None,
        "_settle_load": lambda wait: 0.0, "save": lambda: tmp_path,
    }.items():  # fmt: skip
        monkeypatch.setattr(loop, name, fake)
    history = loop.train()
    assert calls == [0, 1]
    _check_updates(loop.learner, kept)  # type: ignore[arg-type]
    assert [r["episodes/count"] for r in history] == [6.0, 6.0]

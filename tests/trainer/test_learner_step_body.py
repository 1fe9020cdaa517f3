"""The per-step learning body shared by the synchronous loop and the async learner
(trainer/runtime.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from trainer import runtime
from trainer.config import load_recipe
from trainer.runtime import learn_from_groups, make_batch
from trainer.samplers import Sample
from trainer.workers import Lot
from twin.trajectory import Group, TokenTurn, Trajectory


def _group(rewards: list[float], prompt: list[int]) -> Group:
    trajs = []
    for k, r in enumerate(rewards):
        t = Trajectory(twin="Toy", case_id="toy/train/0", reward=r)
        t.token_turns = [
            TokenTurn(prompt_ids=prompt, completion_ids=[7, 8 + k], logprobs=[-1.0, -2.0])
        ]
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
    batch = make_batch(
        [_group([0.0, 1.0, 1.0], [1, 2, 3]), _group([1.0, 1.0, 0.0], [4, 5])], "grpo"
    )
    assert len(batch) == 6
    assert batch.input_ids[0] == [1, 2, 3, 7, 8] and batch.loss_mask[0] == [0, 0, 0, 1, 1]
    assert batch.sampler_logprobs[1] == [0.0, 0.0, 0.0, -1.0, -2.0]
    assert batch.advantages[0] < 0 < batch.advantages[1] == batch.advantages[2]
    assert batch.advantages[3:] == pytest.approx(
        batch.advantages[2::-1], abs=1e-6
    )  # the mirrored group
    assert sum(batch.advantages[3:]) == pytest.approx(0.0, abs=1e-6)


def test_an_episode_cut_before_its_first_turn_counts_in_its_group_and_leaves_the_batch() -> None:
    group = _group([0.0, 1.0, 1.0], [1, 2, 3])
    group.trajectories[0].token_turns = []  # its prompt alone was over max_episode_tokens
    batch = make_batch([group], "grpo")
    assert len(batch) == 2
    assert batch.advantages[0] == batch.advantages[1] > 0  # scored against the cut episode's 0.0


def test_a_step_whose_kept_episodes_sampled_nothing_makes_no_update(caplog) -> None:
    group = _group([0.0, 1.0], [1, 2, 3])
    for t in group.trajectories:
        t.token_turns = []
    learner = _Learner()
    with caplog.at_level(logging.WARNING):
        update = learn_from_groups(learner, [group], [group], advantage="grpo", step=5)  # type: ignore[arg-type]
    assert learner.batches == [] and update.learn == {}
    assert "step 5: no kept episode sampled a token" in caplog.text


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
        update = learn_from_groups(
            learner, [], [_group([1.0, 1.0], [1, 2])], advantage="grpo", step=5
        )  # type: ignore[arg-type]
    assert learner.batches == [] and update.learn == {}
    assert "step 5: every group had equal rewards" in caplog.text


class _Recorded:
    """A learner that notes whether each update ran inside the shared step body."""

    temperature = 1.0

    def __init__(self) -> None:
        self.version = 0
        self.in_body = False
        self.updates: list[tuple[Any, bool]] = []  # (batch, inside learn_from_groups)

    def step(self, batch: Any) -> dict[str, float]:
        self.updates.append((batch, self.in_body))
        self.version += 1
        return {"losses/loss": 0.5}

    def save_adapter(self, path: Any) -> Any:
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_config.json").write_text("{}")
        return path

    def logprobs(self, batch: Any) -> list[list[float]]:
        return [[0.0] + [-0.5] * (len(batch.input_ids[0]) - 1)]

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}


class _AlternatingSampler:
    """Samples one token per prompt: a toy answer call or a plain word, in turn (rewards 1.0 / 0 /
    0.1)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.calls = 0

    def sample(self, prompts: list[list[int]], **kwargs: Any) -> list[Sample]:
        self.calls += 1
        return [
            Sample([self.tokens[(i + self.calls) % len(self.tokens)]], [-1.0], "stop")
            for i in range(len(prompts))
        ]


def _spy_on_the_body(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of ``trainer.runtime.learn_from_groups``, flagging the learner while inside."""
    real, calls = runtime.learn_from_groups, []

    def body(learner: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["step"])
        learner.in_body = True
        try:
            return real(learner, *args, **kwargs)
        finally:
            learner.in_body = False

    monkeypatch.setattr(runtime, "learn_from_groups", body)
    return calls


def test_the_sync_loop_updates_through_the_step_body_and_publishes_each_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from trainer.episodes import load_tokenizer
    from trainer.sync_trainer import SyncTrainer
    from trainer.tiny import WHOLE_CALL_TOKENS
    from trainer.weight_sync import InProcessAdapters

    calls = _spy_on_the_body(monkeypatch)
    cfg = load_recipe("toy-cpu", [
        "train.steps=2", f"train.output_dir={tmp_path}", "train.store=false", "train.log=[jsonl]",
        "algorithm.group_size=4", "algorithm.groups_per_step=2",
    ])  # fmt: skip
    tokenizer = load_tokenizer("tiny")
    sampler = _AlternatingSampler(
        [
            tokenizer.convert_tokens_to_ids(WHOLE_CALL_TOKENS[0]),
            tokenizer.convert_tokens_to_ids("red"),
        ]
    )
    sink = InProcessAdapters()
    loop = SyncTrainer(cfg, learner=_Recorded(), sampler=sampler, adapters=sink)
    loop.setup()
    try:
        history = loop.train()
    finally:
        loop.cleanup()
    assert calls == [0, 1]
    assert [inside for _, inside in loop.learner.updates] == [True, True], (
        "every update goes through the body"
    )
    assert sink.versions == [
        "policy@0",
        "policy@1",
        "policy@2",
    ]  # each version reaches the sampler, in order
    assert [r["episodes/count"] for r in history] == [
        r["batch/groups_sampled"] * 4 for r in history
    ]
    assert all(r["batch/groups"] == 2.0 for r in history)  # the alternating answers differ: kept
    assert all(r["rewards/std"] > 0 and r["policy/version"] == r["step"] + 1 for r in history)


def test_the_async_loop_updates_through_the_step_body(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, async_fakes: Any
) -> None:
    calls = _spy_on_the_body(monkeypatch)
    kept = [_group([0.0, 1.0, 1.0], [1, 2, 3])]
    every = kept + [_group([1.0, 1.0, 1.0], [4, 5])]
    lots = [Lot(i, i, i + 1, [g.model_dump_json() for g in every], [0]) for i in range(2)]
    trainer, _, _ = async_fakes.trainer(tmp_path, 0, lots, steps=2, learner=_Recorded())
    history = trainer.train()
    assert calls == [0, 1]
    expected = make_batch(kept, trainer.cfg.algorithm.advantage)  # the toy recipe's dr_grpo
    assert [inside for _, inside in trainer.learner.updates] == [True, True], (
        "every update goes through the body"
    )
    for batch, _ in trainer.learner.updates:
        assert (batch.input_ids, batch.advantages) == (expected.input_ids, expected.advantages)
    assert [r["episodes/count"] for r in history] == [6.0, 6.0]  # every sampled group is reported

"""The training runtime both loops share (trainer/runtime.py): one checkpoint format, one
curriculum, one way to publish versions, one way to pick a runner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainer.config import load_recipe
from trainer.episodes import load_tokenizer
from trainer.samplers import Sample
from trainer.sync_trainer import SyncTrainer
from trainer.tiny import WHOLE_CALL_TOKENS
from trainer.weight_sync import AdapterPublisher, InProcessAdapters
from twin.errors import ConfigError

COMMON = [
    "lora.enabled=true", "train.store=false", "train.log=[jsonl]", "train.checkpoint_every=1",
    "algorithm.group_size=2", "algorithm.groups_per_step=1",
    "sampler.length_curriculum=plateau", "sampler.max_new_tokens=4",
]  # fmt: skip


class _TwoAnswers:
    """Samples one token per prompt: a toy answer call and a plain word in turn (their rewards
    differ)."""

    def __init__(self) -> None:
        tokenizer = load_tokenizer("tiny")
        self.tokens = [
            tokenizer.convert_tokens_to_ids(WHOLE_CALL_TOKENS[0]),
            tokenizer.convert_tokens_to_ids("red"),
        ]
        self.limits: list[Any] = []

    def sample(self, prompts: list[list[int]], **kwargs: Any) -> list[Sample]:
        self.limits.append(kwargs["max_new_tokens"])
        return [Sample([self.tokens[i % 2]], [-1.0], "stop") for i in range(len(prompts))]


def _sync(tmp_path: Path, steps: int, learner: Any, **kwargs: Any) -> SyncTrainer:
    cfg = load_recipe("toy-cpu", [*COMMON, f"train.steps={steps}", f"train.output_dir={tmp_path}"])
    return SyncTrainer(
        cfg, learner=learner, sampler=_TwoAnswers(), adapters=InProcessAdapters(), **kwargs
    )


def test_a_sync_checkpoint_continues_in_the_async_loop(tmp_path: Path, async_fakes: Any) -> None:
    sync = _sync(tmp_path, 2, async_fakes.Learner())
    sync.setup()
    sync.train()
    sync.curriculum.limit = 3.0  # a grown 'plateau' length: the checkpoint must carry it
    sync.save()
    sync.cleanup()

    lots = [async_fakes.lot(2, 2)]
    trainer, _, _ = async_fakes.trainer(tmp_path, 1, lots, steps=3, overrides=COMMON, setup=False)
    trainer.resume = True
    trainer.setup()
    assert (trainer.step, trainer.cursor, trainer.learner.steps) == (2, sync.cursor, 2)
    assert trainer.lots_used == 2 and trainer.dropped == 0  # the async counters start from the step
    assert trainer.curriculum.state_dict() == sync.curriculum.state_dict()
    history = trainer.train()
    assert [r["step"] for r in history] == [0, 1, 2]  # the sync steps' records are kept
    assert trainer.shared.max_new_tokens() == 3  # the restored curriculum reaches the worker


def test_an_async_checkpoint_continues_in_the_sync_loop(tmp_path: Path, async_fakes: Any) -> None:
    lot = async_fakes.lot
    trainer, _, _ = async_fakes.trainer(
        tmp_path, 1, [lot(0, 0), lot(1, 0)], steps=2, overrides=COMMON
    )
    trainer.train()
    trainer.cleanup()
    sync = _sync(tmp_path, 3, async_fakes.Learner(), resume=True)
    sync.setup()
    assert (sync.step, sync.cursor, sync.learner.steps) == (2, 2, 2)
    history = sync.train()
    sync.cleanup()
    assert [r["step"] for r in history] == [0, 1, 2]
    assert history[-1]["data/cursor"] == 3.0  # one more case after the async lots' cursor


def test_the_sync_loop_samples_at_the_curriculum_limit_and_publishes_each_version(
    tmp_path: Path, async_fakes: Any
) -> None:
    sink = InProcessAdapters()
    cfg = load_recipe("toy-cpu", [*COMMON, "train.steps=3", f"train.output_dir={tmp_path}"])
    sampler = _TwoAnswers()
    sync = SyncTrainer(cfg, learner=async_fakes.Learner(), sampler=sampler, adapters=sink)
    sync.setup()
    history = sync.train()
    sync.cleanup()
    assert sink.versions == ["policy@0", "policy@1", "policy@2", "policy@3"]
    assert [r["batch/max_new_tokens"] for r in history] == [1.0, 1.0, 1.0]  # 'plateau' starts at 1
    assert all(limit == 1 or limit == [1, 1] for limit in sampler.limits)


def test_a_server_sampler_without_lora_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # refused when the recipe loads (so `twin plan` says it too), before a trainer exists
    with pytest.raises(
        ConfigError, match=r"needs the in-process sampler .*got 'vllm'.* set lora.enabled: true"
    ):
        load_recipe("toy-cpu", ["sampler.kind=vllm", f"train.output_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())


def test_the_publisher_keeps_the_newest_versions_and_retires_the_rest(
    tmp_path: Path, async_fakes: Any
) -> None:
    class _Sink:
        needs_files = True

        def __init__(self) -> None:
            self.events: list[tuple[str, str]] = []

        def load(self, name: str, path: Any) -> float:
            assert (Path(path) / "adapter_config.json").exists()  # saved before it is loaded
            self.events.append(("load", name))
            return 0.0

        def unload(self, name: str) -> None:
            self.events.append(("unload", name))

    sink = _Sink()
    publisher = AdapterPublisher(tmp_path, sink, keep=2)
    learner = async_fakes.Learner()
    for version in range(4):
        publisher.push(learner, version)
    publisher.push(learner, 3)  # already loaded: nothing happens
    publisher.close()
    assert [e for e in sink.events if e[0] == "load"] == [("load", f"policy@{v}") for v in range(4)]
    assert [e for e in sink.events if e[0] == "unload"] == [
        ("unload", "policy@0"),
        ("unload", "policy@1"),
    ]
    assert publisher.loaded == [2, 3]
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["policy@2", "policy@3"]


@pytest.mark.parametrize(
    ("overrides", "runner"),
    [
        ([], "SyncTrainer"),
        (["lora.enabled=true", "async.max_staleness=1"], "AsyncTrainer"),
        (["lora.enabled=true", "devices.rollout=cuda:0"], "AsyncTrainer"),
        (["backend=ray", "lora.enabled=true", "async.max_staleness=1"], "RayTrainer"),
    ],
)
def test_make_runner_picks_the_loop_the_recipe_asks_for(
    tmp_path: Path, overrides: list[str], runner: str
) -> None:
    from trainer.cli import make_runner

    cfg = load_recipe("toy-cpu", [*overrides, f"train.output_dir={tmp_path}"])
    made = make_runner(cfg)
    assert type(made).__name__ == runner
    assert made.step == 0 and made.output_dir == tmp_path  # nothing ran: set-up starts the work


def _toy_with_overlong_penalty(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy twin, its reward also charging length (``rewards.overlong_penalty``)."""
    import importlib

    from envs.toy.twin import no_repeat
    from rewards import Reward, overlong_penalty

    registry = importlib.import_module("twin.registry")  # the package's `twin.registry` is a dict
    make = registry.make_twin

    def make_twin(name: str, **config: Any) -> Any:
        made = make(name, **config)
        made.reward = Reward(
            {no_repeat: 1.0}, penalties=[overlong_penalty(512, 64, name="too_long")]
        )
        return made

    monkeypatch.setattr(registry, "make_twin", make_twin)


def test_a_reward_overlong_penalty_and_the_recipe_shaping_never_both_charge(
    tmp_path: Path, async_fakes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _toy_with_overlong_penalty(monkeypatch)
    cfg = load_recipe(
        "toy-cpu", [*COMMON, "algorithm.overlong_buffer=64", f"train.output_dir={tmp_path}"]
    )
    sync = SyncTrainer(
        cfg, learner=async_fakes.Learner(), sampler=_TwoAnswers(), adapters=InProcessAdapters()
    )
    with pytest.raises(
        ConfigError, match=r"overlong penalty \['too_long'\].*overlong_buffer=64.*charged twice"
    ):
        sync.setup()
    from trainer.plan import check_runnable  # twin plan says it too, before any memory is used

    with pytest.raises(ConfigError, match=r"overlong penalty \['too_long'\].*charged twice"):
        check_runnable(cfg, gpus=1)


def test_a_reward_overlong_penalty_alone_is_kept_when_the_recipe_shaping_is_off(
    tmp_path: Path, async_fakes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _toy_with_overlong_penalty(monkeypatch)
    cfg = load_recipe("toy-cpu", [*COMMON, "train.steps=1", f"train.output_dir={tmp_path}"])
    assert cfg.algorithm.overlong_buffer == 0
    sync = SyncTrainer(
        cfg, learner=async_fakes.Learner(), sampler=_TwoAnswers(), adapters=InProcessAdapters()
    )
    sync.setup()
    history = sync.train()
    sync.cleanup()
    assert [r["step"] for r in history] == [0]
    assert [p.name for p in sync.twin.reward.penalties] == ["too_long"]

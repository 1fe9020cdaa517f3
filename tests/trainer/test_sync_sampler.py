"""The sync loop's in-process sampler: keys/values kept across turns and a group's shared prompt,
forgotten at every published version, and sampling in the recipe's autocast dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import trainer.samplers
from trainer.config import load_recipe
from trainer.samplers import HFSampler, Sample
from trainer.sync_trainer import SyncTrainer

RECIPE = [
    "train.store=false", "train.log=[jsonl]", "train.checkpoint_every=100", "train.steps=3",
    "algorithm.group_size=2", "algorithm.groups_per_step=2", "algorithm.dynamic_sampling=false",
    "sampler.max_new_tokens=3", "optim.lr=0.05",
]  # fmt: skip


class _Recording(HFSampler):
    """An HFSampler that records what it sampled and how often its cache was cleared; its
    ``prefix_cache`` is the test's choice, whatever the trainer asks for."""

    cache = True
    made: list[_Recording] = []

    def __init__(self, *args: Any, prefix_cache: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, prefix_cache=self.cache, **kwargs)
        self.samples: list[Sample] = []
        self.clears = 0
        _Recording.made.append(self)

    def clear_cache(self) -> None:
        self.clears += 1
        super().clear_cache()

    def sample(self, prompts: list[list[int]], **kwargs: Any) -> list[Sample]:
        out = super().sample(prompts, **kwargs)
        self.samples.extend(out)
        return out


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, cache: bool, extra: list[str]) -> Any:
    monkeypatch.setattr(_Recording, "cache", cache)
    monkeypatch.setattr(_Recording, "made", [])
    monkeypatch.setattr(trainer.samplers, "HFSampler", _Recording)
    cfg = load_recipe("toy-cpu", [*RECIPE, *extra, f"train.output_dir={tmp_path}"])
    sync = SyncTrainer(cfg)
    sync.setup()
    sync.train()
    sync.cleanup()
    (sampler,) = _Recording.made
    return sync, sampler


def test_the_cached_sampler_samples_what_an_uncached_one_does_across_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, cached = _run(tmp_path / "cached", monkeypatch, cache=True, extra=[])
    _, plain = _run(tmp_path / "plain", monkeypatch, cache=False, extra=[])
    assert cached.store is not None and plain.store is None
    # the first publish (version 0) and one per optimizer step
    assert cached.clears == 4
    assert cached.store.hits > 0  # the group's shared prompt came from the cache
    assert [s.ids for s in cached.samples] == [s.ids for s in plain.samples]
    got = torch.tensor([lp for s in cached.samples for lp in s.logprobs])
    want = torch.tensor([lp for s in plain.samples for lp in s.logprobs])
    # keys/values kept from before an update would move these by far more (lr 0.05)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_the_sampler_runs_in_the_recipe_autocast_dtype_on_bf16_base_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = ["lora.enabled=true", "lora.rank=4", "model.autocast=bfloat16", "train.steps=1"]
    seen: set[torch.dtype] = set()
    original = _Recording.sample

    def watch(self: _Recording, prompts: list[list[int]], **kwargs: Any) -> list[Sample]:
        hooks = [
            m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
            for m in self.model.modules()
            if type(m) is torch.nn.Linear
        ]
        try:
            return original(self, prompts, **kwargs)
        finally:
            for h in hooks:
                h.remove()

    monkeypatch.setattr(_Recording, "sample", watch)
    sync, sampler = _run(tmp_path, monkeypatch, cache=True, extra=extra)
    assert sampler.autocast == "bfloat16" and seen == {torch.bfloat16}
    frozen = {p.dtype for n, p in sync.learner.model.named_parameters() if "base_layer" in n}
    trained = {p.dtype for p in sync.learner.model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16}  # rounded once, not on every sampled token
    assert trained == {torch.float32}  # the adapters keep their fp32 master weights
    assert len(sampler.samples) > 0

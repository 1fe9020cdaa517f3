"""Kill after a checkpoint, --resume: the next steps' metrics match an uninterrupted run."""

from __future__ import annotations

import json

import pytest

from envs.toy import ToyTwin
from envs.toy.twin import closeness, prefix
from rewards import Reward
from trainer.checkpoint import latest_checkpoint
from trainer.config import load_recipe
from trainer.metrics import read_metrics
from trainer.recipe import GRPORecipe
from twin.registry import register, registry


class DenseToyTwin(ToyTwin):
    """The toy with a dense reward: random text already gets varied rewards, so every step updates."""

    name = "DenseToy"
    reward = Reward({closeness: 0.8, prefix: 0.2}, name="dense_toy")


if "twin/DenseToy-v0" not in registry:
    register(DenseToyTwin)

# Timings differ run to run; everything else must match.
VOLATILE = ("perf/",)


def _cfg(out, steps: int, lora: bool):
    return load_recipe(
        "toy-cpu",
        [
            f"train.output_dir={out}",
            "twin.name=DenseToy",
            "sampler.length_curriculum=none",
            f"train.steps={steps}",
            "train.checkpoint_every=2",
            "train.store=false",
            "algorithm.group_size=4",
            "algorithm.groups_per_step=2",
            "sampler.max_new_tokens=6",
            f"lora.enabled={str(lora).lower()}",
            "optim.lr=1e-2",
            "optim.mini_batches=2",  # optimizer state and clipping both matter
        ],
    )


def _run(cfg, resume: bool = False) -> list[dict]:
    recipe = GRPORecipe(cfg, resume=resume)
    recipe.setup()
    try:
        return recipe.train()
    finally:
        recipe.cleanup()


def _stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_matches_uninterrupted(tmp_path, lora: bool) -> None:
    full = _run(_cfg(tmp_path / "a", 4, lora))
    assert len(full) == 4

    _run(_cfg(tmp_path / "b", 2, lora))  # "killed" right after the step-2 checkpoint
    assert latest_checkpoint(tmp_path / "b").name == "step-000002"
    # the killed run had also logged a step after its checkpoint: resume must drop it
    with open(tmp_path / "b" / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"step": 2, "rewards/total": -1.0}) + "\n")
    resumed = _run(_cfg(tmp_path / "b", 4, lora), resume=True)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [0, 1, 2, 3]
    for a, b in zip(full, resumed):
        a, b = _stable(a), _stable(b)
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], abs=1e-6, rel=1e-6), (a["step"], k, a[k], b[k])
    # every step updated the policy (so optimizer state and weights were really restored)
    assert all(r["policy/grad_norm"] > 0 for r in full)


def test_fresh_run_clears_old_checkpoints(tmp_path) -> None:
    _run(_cfg(tmp_path / "c", 2, False))
    assert latest_checkpoint(tmp_path / "c") is not None
    recipe = GRPORecipe(_cfg(tmp_path / "c", 1, False), resume=False)
    recipe.setup()
    recipe.cleanup()
    assert latest_checkpoint(tmp_path / "c") is None

"""SFT's held-out loss, early stopping and episode-level metrics (trainer/sft.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainer.checkpoint import latest_checkpoint, load_checkpoint
from trainer.config import load_recipe
from trainer.sft import SFTTrainer
from twin.errors import ConfigError
from twin.evaluation.collect import collect
from twin.registry import make_twin

TOY = {"num_words": 2, "repeat": 16}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("sft-holdout")
    old = os.environ.get("TWINRL_STORE")
    os.environ["TWINRL_STORE"] = str(root / "runs.db")
    try:
        twin = make_twin("Toy", **TOY)
        collect(
            twin,
            twin.oracle_policy(),
            [("train", i) for i in range(48)],
            out=root / "ds",
            progress=False,
        )
        yield root
    finally:
        if old is None:
            os.environ.pop("TWINRL_STORE", None)
        else:
            os.environ["TWINRL_STORE"] = old


def _recipe(root: Path, out: str, **data: Any) -> Any:
    return load_recipe(
        {
            "seed": 0,
            "twin": {"name": "Toy", "config": TOY},
            "model": {"path": "tiny", "dtype": "float32"},
            "lora": {"enabled": False},
            "sampler": {"max_new_tokens": 4, "max_episode_tokens": 512},
            "algorithm": "sft",
            "data": {"paths": [str(root / "ds")], "epochs": 3, "batch_size": 8, **data},
            "eval": {"split": "dev", "cases": 4, "every": 0},
            "optim": {"lr": 3e-3, "micro_batch_tokens": 8192},
            "train": {"output_dir": str(root / out), "checkpoint_every": 1},
            "devices": {"cpu_threads": 1},
        }
    )


def _run(recipe: Any, **kw: Any) -> tuple[SFTTrainer, list[dict[str, Any]]]:
    run = SFTTrainer(recipe, **kw)
    run.setup()
    history = run.train()
    run.cleanup()
    return run, history


def test_held_out_episodes_are_not_trained_on_and_their_loss_falls(dataset: Path) -> None:
    run, history = _run(_recipe(dataset, "a", holdout=16))
    assert len(run.held_out) == 16 and len(run.episodes) == 32
    assert not {id(e) for e in run.held_out} & {id(e) for e in run.episodes}
    assert run.total_steps == 12  # 3 epochs x 32 / 8
    losses = [(r["step"], r["sft/holdout_loss"]) for r in history if "sft/holdout_loss" in r]
    assert [s for s, _ in losses] == [3, 7, 11]  # the records of steps 4, 8, 12: each epoch's end
    assert losses[-1][1] < losses[0][1]
    final = next(r for r in reversed(history) if "eval/submit_rate" in r)
    assert 0.0 <= final["eval/submit_rate"] <= 1.0 and "eval/parse_rate" in final


def test_early_stopping_ends_the_run_and_a_resume_does_not_continue_it(dataset: Path) -> None:
    # a learning rate that diverges: the held-out loss rises from the second evaluation on
    recipe = _recipe(dataset, "b", holdout=16, holdout_every=1, patience=2)
    recipe.optim.lr = 0.5
    run, history = _run(recipe)
    assert run.stopped_early and run.step < 12
    assert [r["step"] for r in history if r.get("sft/stopped_early") == 1.0] == [run.step - 1]
    state = load_checkpoint(latest_checkpoint(run.output_dir))
    assert state["stopped_early"] and state["total_steps"] == run.step
    again, _ = _run(recipe, resume=True)
    assert again.step == run.step and again.learner.version == run.learner.version


def test_patience_needs_a_holdout(dataset: Path) -> None:
    with pytest.raises(ConfigError, match="data.patience needs data.holdout"):
        _recipe(dataset, "c", patience=2)

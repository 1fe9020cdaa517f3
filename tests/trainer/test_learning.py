"""The proof that the trainer learns: the toy recipe lifts a random tiny model's reward on CPU.

Runs ``data/recipes/toy-cpu.yaml`` exactly as ``twin train`` does (through ``trainer.cli.train``)
and checks the printed, logged and plotted results.
"""

from __future__ import annotations

import io
import statistics

import pytest
from rich.console import Console

from trainer.cli import train
from trainer.metrics import read_metrics

START_MAX = 0.2  # a random model scores about 0.1
RISE_MIN = 0.1  # the reward must clearly rise
END_MIN = 0.8  # the target: the trained model makes the right call


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_toy_recipe_learns(seed, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TWINRL_STORE", str(tmp_path / "store.db"))
    out = tmp_path / "run"
    buffer = io.StringIO()
    code = train(
        "data/recipes/toy-cpu.yaml",
        [f"train.output_dir={out}", f"seed={seed}"],
        False,
        console=Console(file=buffer, width=120),
    )
    text = buffer.getvalue()
    assert code == 0, text
    history = read_metrics(out / "metrics.jsonl")
    rewards = [r["rewards/total"] for r in history]
    start = statistics.fmean(rewards[:3])
    end = statistics.fmean(rewards[-5:])
    curve = " ".join(f"{r:.2f}" for r in rewards[:: max(1, len(rewards) // 20)])
    print(f"seed {seed}: toy reward {start:.3f} -> {end:.3f} in {len(rewards)} steps: {curve}")
    assert start < START_MAX, rewards[:5]
    assert end > start + RISE_MIN, curve
    assert "reward" in text and "step" in text  # the per-step lines the CLI prints
    assert (out / "rewards.png").stat().st_size > 1000
    assert end > END_MIN, f"seed {seed}: toy reward {start:.3f} -> {end:.3f}: {curve}"
    # a policy that always writes one call scores ~0.5 (wrong calls earn 0): > 0.6 correct at the
    # last step means it reads the word the prompt names, not only the call's format
    assert history[-1]["rewards/correct"] > 0.6, curve


def test_cli_reports_bad_recipe(capsys) -> None:
    buffer = io.StringIO()
    code = train("toy-cpu", ["optim.lrr=1"], False, console=Console(file=buffer, width=120))
    assert code == 2 and "Did you mean 'optim.lr'" in buffer.getvalue()


def test_learner_follows_the_lr_schedule() -> None:
    import torch

    from trainer.config import AlgorithmConfig, OptimConfig
    from trainer.learner import Learner, TrainBatch
    from trainer.models import load_model

    torch.set_num_threads(1)
    model, _ = load_model("tiny")
    learner = Learner(
        model,
        algorithm=AlgorithmConfig(),
        optim=OptimConfig(lr=4e-3, lr_end=1e-3, lr_decay_steps=3),
        max_tokens=64,
    )
    batch = TrainBatch(
        [[5, 6, 7, 8, 9, 10]] * 2, [[0, 0, 0, 1, 1, 1]] * 2, [[-6.6] * 6] * 2, [1.0, -1.0]
    )
    lrs = [learner.step(batch)["optim/lr"] for _ in range(5)]
    assert [round(x, 6) for x in lrs] == [0.004, 0.003, 0.002, 0.001, 0.001]

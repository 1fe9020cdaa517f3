"""SFT's ``data.emphasis``: the decision's tokens found in each demonstration, weighted in the
loss, and their NLL logged on their own (trainer/sft.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainer.config import load_recipe
from trainer.sft import SFTTrainer, holdout_scores, sft_step
from twin.errors import ConfigError
from twin.evaluation import evaluate
from twin.evaluation.collect import trajectory_row, write_dataset
from twin.policies import make_policy
from twin.registry import make_twin

DECISIONS = ["refund", "partial", "deny"]
EMPHASIS = {"tool": "decide", "argument": "decision", "values": DECISIONS}


@pytest.fixture(scope="module")
def returns_data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Twelve oracle episodes of the returns twin as a ``twin collect`` dataset; a run store of
    the module's own."""
    root = tmp_path_factory.mktemp("sft-emphasis")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TWINRL_STORE", str(root / "runs.db"))
        twin = make_twin("returns")
        result = evaluate(
            twin, make_policy("oracle", twin), [("train", i) for i in range(12)], progress=False
        )
        rows = [trajectory_row(t, twin.tool_schemas, run_id=None) for g in result.groups
                for t in g.trajectories]  # fmt: skip
        write_dataset(rows, root / "ds")
        yield root


def _trainer(root: Path, out: str, lr: float = 3e-3, **data: Any) -> SFTTrainer:
    recipe = load_recipe(
        {
            "seed": 0,
            "twin": {"name": "returns"},
            "model": {"path": "tiny", "dtype": "float32"},
            "lora": {"enabled": False},
            "sampler": {"max_new_tokens": 4, "max_episode_tokens": 4096},
            "algorithm": "sft",
            "data": {"paths": [str(root / "ds")], "epochs": 1, "batch_size": 4, **data},
            "eval": {"cases": 0},
            "optim": {"lr": lr, "micro_batch_tokens": 16384},
            "train": {"output_dir": str(root / out), "checkpoint_every": 0},
            "devices": {"cpu_threads": 1},
        }
    )
    run = SFTTrainer(recipe)
    run.setup()
    return run


def test_each_demonstrations_span_is_its_decisions_tokens(returns_data: Path) -> None:
    run = _trainer(returns_data, "spans", emphasis=EMPHASIS)
    try:
        assert len(run.episodes) == 12
        for episode in run.episodes:
            start, end = episode.emphasis
            assert 0 < start < end <= len(episode.input_ids)
            assert all(episode.loss_mask[start:end])  # the model's own tokens
            text = run.tokenizer.decode(episode.input_ids[start - 2 : end + 2])
            assert [v for v in DECISIONS if v in text] == [episode.decision]
    finally:
        run.cleanup()


def test_the_weight_counts_the_decisions_tokens_that_many_times(returns_data: Path) -> None:
    """With a learning rate too small to move the weights, a step weighted w scores the same
    NLL as an unweighted one, and its loss is the NLL with the decision counted w times; the
    decision's NLL is the one the held-out scoring finds on the same episodes."""
    run = _trainer(returns_data, "weights", lr=1e-12, emphasis=EMPHASIS)
    try:
        episodes = run.episodes[:4]
        held = holdout_scores(run.learner, episodes)
        plain = sft_step(run.learner, episodes)
        weighted = sft_step(run.learner, episodes, emphasis_weight=5.0)
        assert weighted["losses/nll"] == pytest.approx(plain["losses/nll"], rel=1e-5)
        assert plain["losses/loss"] == pytest.approx(plain["losses/nll"], rel=1e-6)
        decision = plain["sft/emphasis_nll"]
        assert weighted["sft/emphasis_nll"] == pytest.approx(decision, rel=1e-4)
        assert held["emphasis_nll"] == pytest.approx(decision, rel=1e-4)
        assert held["loss"] == pytest.approx(plain["losses/nll"], rel=1e-4)
        tokens = plain["sft/tokens"]
        span_tokens = sum(e.emphasis[1] - e.emphasis[0] for e in episodes)
        expected = (plain["losses/nll"] * tokens + 4 * decision * len(episodes)) / (
            tokens + 4 * span_tokens
        )
        assert weighted["losses/loss"] == pytest.approx(expected, rel=1e-4)
        assert weighted["losses/loss"] != pytest.approx(plain["losses/loss"], rel=1e-3)
    finally:
        run.cleanup()


def test_a_run_logs_the_decisions_held_out_nll_and_weighting_lowers_it_faster(
    returns_data: Path,
) -> None:
    runs = {}
    for weight in (1.0, 20.0):
        run = _trainer(
            returns_data, f"run-{weight}", holdout=4, emphasis={**EMPHASIS, "weight": weight}
        )
        try:
            history = run.train()
        finally:
            run.cleanup()
        held = [r["sft/holdout_emphasis_nll"] for r in history if "sft/holdout_emphasis_nll" in r]
        assert len(held) == 1 and all("sft/emphasis_nll" in r for r in history)
        for record in history:  # per decision value: pooled, they give the step's mean
            prefix = "sft/holdout_emphasis_nll" if "sft/holdout_loss" in record else None
            for key in ("sft/emphasis_nll", *([prefix] if prefix else [])):
                counts = {k.rsplit("/", 1)[1]: v for k, v in record.items()
                          if k.startswith(f"{key}_count/")}  # fmt: skip
                assert set(counts) <= set(DECISIONS) and sum(counts.values()) == 4
                pooled = sum(record[f"{key}/{v}"] * n for v, n in counts.items()) / 4
                assert pooled == pytest.approx(record[key])
        runs[weight] = history
    trained = {w: h[-1]["sft/emphasis_nll"] for w, h in runs.items()}
    assert trained[20.0] < trained[1.0]  # the same two steps, the decision weighted 20 times


def test_an_emphasis_no_demonstration_has_is_refused_with_what_to_check(
    returns_data: Path,
) -> None:
    with pytest.raises(ConfigError, match=r"12 of 12 demonstrations have no 'submit' call"):
        _trainer(returns_data, "none", emphasis={**EMPHASIS, "tool": "submit"})
    with pytest.raises(ConfigError, match="values"):
        load_recipe(
            {
                "twin": {"name": "returns"},
                "model": {"path": "tiny"},
                "algorithm": "sft",
                "data": {"paths": ["x"], "emphasis": {**EMPHASIS, "values": ["refund"]}},
            }
        )


@pytest.mark.parametrize("watched", ["loss", "emphasis_nll"])
def test_early_stopping_watches_the_figure_patience_on_names(
    returns_data: Path, monkeypatch: pytest.MonkeyPatch, watched: str
) -> None:
    """The held-out loss keeps falling while the decision's NLL rises after the first
    evaluation: watching the decision stops the run after ``patience`` evaluations, watching the
    loss does not; sft/holdout_best is the best of the watched figure."""
    scripted = iter([{"loss": 2.0 - 0.1 * k, "emphasis_nll": 1.0 + 0.1 * k} for k in range(9)])
    monkeypatch.setattr("trainer.sft.holdout_scores", lambda learner, episodes: next(scripted))
    data = {"holdout": 4, "holdout_every": 1, "patience": 2, "epochs": 3, "emphasis": EMPHASIS}
    run = _trainer(returns_data, f"patience-{watched}", patience_on=watched, **data)
    try:
        history = run.train()
    finally:
        run.cleanup()
    best = [r["sft/holdout_best"] for r in history if "sft/holdout_best" in r]
    if watched == "emphasis_nll":
        assert run.stopped_early and run.step == 3 and best == [1.0, 1.0, 1.0]
    else:
        assert not run.stopped_early and run.step == 6 and best[-1] == pytest.approx(1.5)


def test_watching_the_decision_needs_an_emphasis(returns_data: Path) -> None:
    with pytest.raises(ConfigError, match="patience_on: emphasis_nll needs data.emphasis"):
        _trainer(returns_data, "no-emphasis", holdout=4, patience=2, patience_on="emphasis_nll")


def test_an_sft_step_line_shows_the_decisions_nll_where_the_step_has_it() -> None:
    from rich.console import Console
    from rich.progress import Progress

    from trainer.cli import _step_printer

    console = Console(record=True, width=200)
    with Progress(console=console, disable=True) as progress:
        on_step = _step_printer(progress, progress.add_task("sft", total=3), {}, sft=True)
        on_step({"step": 0, "losses/loss": 0.5, "sft/emphasis_nll": 1.2345})
        on_step({"step": 1, "losses/loss": 0.4, "sft/holdout_loss": 0.25,
                 "sft/holdout_emphasis_nll": 0.75})  # fmt: skip
        on_step({"step": 2, "losses/loss": 0.3})
    first, second, third = console.export_text().splitlines()
    assert "decision 1.234" in first and "held-out" not in first
    assert "held-out 0.250" in second and "held-out decision 0.750" in second
    assert "decision" not in third

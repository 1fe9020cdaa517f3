"""SFT warm start (trainer/sft.py): token-exact rows, the loss on the assistant tokens only,
learning on the Toy twin, GRPO from the SFT weights (model.init_from), and `twin eval --policy
hf:<checkpoint>`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from trainer.checkpoint import latest_checkpoint, load_checkpoint_model
from trainer.config import load_recipe
from trainer.learner import Learner, TrainBatch
from trainer.models import load_model
from trainer.renderer import Renderer
from trainer.sft import SFTTrainer, render_row, sft_step
from twin.errors import ConfigError
from twin.evaluation import evaluate
from twin.evaluation.collect import collect, read_dataset
from twin.policies import make_policy
from twin.registry import make_twin
from twin.store import RunStore
from twinrl_cli import app

runner = CliRunner()
TOY = {"num_words": 2, "repeat": 16}


def _sft_recipe(root: Path, **over: Any) -> dict[str, Any]:
    recipe: dict[str, Any] = {
        "seed": 0,
        "twin": {"name": "Toy", "config": TOY},
        "model": {"path": "tiny", "dtype": "float32"},
        "lora": {"enabled": False},
        "sampler": {"max_new_tokens": 4, "max_episode_tokens": 512},
        "algorithm": "sft",
        "data": {"paths": [str(root / "ds")], "epochs": 3, "batch_size": 8},
        "eval": {"split": "dev", "cases": 16, "every": 12},
        "optim": {"lr": 3e-3, "micro_batch_tokens": 8192},
        "train": {"output_dir": str(root / "sft"), "checkpoint_every": 0},
        "devices": {"cpu_threads": 1},
    }
    recipe.update(over)
    return recipe


@pytest.fixture(scope="module")
def toy_sft(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    """Collect 64 Toy oracle episodes, then SFT the tiny model on them (24 steps)."""
    root = tmp_path_factory.mktemp("sft")
    old = os.environ.get("TWINRL_STORE")
    os.environ["TWINRL_STORE"] = str(root / "runs.db")
    try:
        twin = make_twin("Toy", **TOY)
        collect(
            twin,
            twin.oracle_policy(),
            [("train", i) for i in range(64)],
            out=root / "ds",
            progress=False,
        )
        run = SFTTrainer(load_recipe(_sft_recipe(root)))
        run.setup()
        history = run.train()
        run.cleanup()
        yield root, history
    finally:
        if old is None:
            os.environ.pop("TWINRL_STORE", None)
        else:
            os.environ["TWINRL_STORE"] = old


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return load_model("tiny", "float32")


@pytest.fixture(scope="module")
def returns_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[Any], Path]:
    """Returns episodes of the oracle (tool calls, tool results) as
    trajectories and as a dataset."""
    root = tmp_path_factory.mktemp("returns")
    twin = make_twin("returns")
    result = evaluate(
        twin, make_policy("oracle", twin), [("train", i) for i in range(4)], progress=False
    )
    trajectories = [t for g in result.groups for t in g.trajectories]
    from twin.evaluation.collect import trajectory_row, write_dataset

    write_dataset(
        [trajectory_row(t, twin.tool_schemas, run_id=None) for t in trajectories], root / "ds"
    )
    return twin, trajectories, root / "ds"


# -- rows -> tokens --------------------------------------------------------------------------------
def test_a_dataset_row_renders_to_the_trajectorys_exact_tokens(
    tiny: tuple[Any, Any], returns_rows: Any
) -> None:
    _, tokenizer = tiny
    twin, trajectories, ds = returns_rows
    renderer = Renderer(tokenizer, twin.tool_schemas)
    jsonl_rows = read_dataset(ds / "episodes.jsonl")
    hf_rows = read_dataset(ds / "hf")
    for t, row, hf_row in zip(trajectories, jsonl_rows, hf_rows, strict=True):
        expected = render_row(renderer, t.messages)
        assert renderer.check_prefix().ok  # the ids decode to the template's own rendering
        assert renderer.stats["unparsed_turns"] == renderer.stats["prefix_breaks"] == 0
        # ...and are the template's text of the whole conversation, tokenized in one piece
        last = max(i for i, m in enumerate(t.messages) if m["role"] == "assistant")
        whole = renderer.render(t.messages[: last + 1], add_generation_prompt=False)
        assert expected.input_ids == tokenizer.encode(whole.rstrip("\n"), add_special_tokens=False)
        for read_back in (row, hf_row):
            got = render_row(Renderer(tokenizer, read_back["tools"]), read_back["messages"])
            assert got.input_ids == expected.input_ids
            assert got.loss_mask == expected.loss_mask


def test_the_loss_mask_covers_exactly_the_assistant_turns(
    tiny: tuple[Any, Any], returns_rows: Any
) -> None:
    _, tokenizer = tiny
    twin, trajectories, _ = returns_rows
    renderer = Renderer(tokenizer, twin.tool_schemas)
    for t in trajectories:
        episode = render_row(renderer, t.messages)
        assistants = [i for i, m in enumerate(t.messages) if m["role"] == "assistant"]
        assert len(episode.turn_spans) == len(assistants) == 2  # lookup_order, then decide
        ones = [i for i, m in enumerate(episode.loss_mask) if m]
        assert ones == [i for s, e in episode.turn_spans for i in range(s, e)]
        for (s, e), at in zip(episode.turn_spans, assistants):
            before = renderer.render(t.messages[:at], add_generation_prompt=True)
            after = renderer.render(t.messages[: at + 1], add_generation_prompt=False)
            turn = after[len(before) :].rstrip("\n")  # the assistant turn, through <|im_end|>
            assert tokenizer.decode(episode.input_ids[s:e], skip_special_tokens=False) == turn
            assert turn.endswith("<|im_end|>") and "<tool_call>" in turn
        # nothing of the prompt or the tool results is trained on
        text_off = tokenizer.decode(
            [i for i, m in zip(episode.input_ids, episode.loss_mask) if not m]
        )
        assert "days_since_delivery" in text_off  # a tool result
        assert '"name": "lookup_order", "arguments"' not in text_off  # the agent's call


def test_a_weight_0_turn_is_context_with_the_same_ids_and_no_loss(
    tiny: tuple[Any, Any], returns_rows: Any
) -> None:
    """OpenAI's fine-tuning ``weight``: a turn marked 0 keeps its ids (the next turn is rendered
    after the same text) but loses its loss and its span; a weight other than 0 or 1, or a row
    with no turn to learn, is refused with what is allowed."""
    _, tokenizer = tiny
    twin, trajectories, _ = returns_rows
    renderer = Renderer(tokenizer, twin.tool_schemas)
    t = trajectories[0]
    full = render_row(renderer, t.messages)
    first = next(i for i, m in enumerate(t.messages) if m["role"] == "assistant")
    marked = [dict(m) for m in t.messages]
    marked[first]["weight"] = 0
    got = render_row(renderer, marked)
    assert got.input_ids == full.input_ids
    (kept,) = got.turn_spans
    assert kept == full.turn_spans[1]
    s, e = full.turn_spans[0]
    assert got.loss_mask[s:e] == [0] * (e - s) and sum(full.loss_mask[s:e]) == e - s
    assert got.loss_mask[kept[0] : kept[1]] == full.loss_mask[kept[0] : kept[1]]
    marked[first]["weight"] = 1  # explicit 1 is the default
    assert render_row(renderer, marked).loss_mask == full.loss_mask
    for bad in (0.5, 2, True, "0"):
        marked[first]["weight"] = bad
        with pytest.raises(ConfigError, match=r"weight .* is 0 \(context, no loss\) or 1"):
            render_row(renderer, marked)
    for m in marked:
        if m["role"] == "assistant":
            m["weight"] = 0
    with pytest.raises(ConfigError, match="every assistant turn has weight 0"):
        render_row(renderer, marked)


def test_sft_loss_is_the_mean_nll_of_the_masked_tokens(
    tiny: tuple[Any, Any], returns_rows: Any
) -> None:
    model, tokenizer = tiny
    twin, trajectories, _ = returns_rows
    renderer = Renderer(tokenizer, twin.tool_schemas)
    episodes = [render_row(renderer, t.messages) for t in trajectories]
    cfg = load_recipe(
        _sft_recipe(
            Path("unused"), optim={"lr": 1e-3, "micro_batch_tokens": 2 * max(map(len, episodes))}
        )
    )
    torch.manual_seed(0)
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    learner = Learner(copy.train(), algorithm=cfg.algorithm, optim=cfg.optim)
    batch = TrainBatch(
        [e.input_ids for e in episodes],
        [e.loss_mask for e in episodes],
        [[0.0] * len(e) for e in episodes],
        [1.0] * len(episodes),
    )
    lps = learner.logprobs(batch)
    tokens = sum(sum(e.loss_mask) for e in episodes)
    expected = (
        -sum(lp * m for row, e in zip(lps, episodes) for lp, m in zip(row, e.loss_mask)) / tokens
    )
    metrics = sft_step(learner, episodes)  # two micro-batches: the budget holds two episodes
    assert metrics["losses/loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["sft/tokens"] == tokens and learner.version == 1
    after = (
        -sum(
            lp * m
            for row, e in zip(learner.logprobs(batch), episodes)
            for lp, m in zip(row, e.loss_mask)
        )
        / tokens
    )
    assert after < expected  # one step of gradient descent on the NLL lowers it


# -- learning --------------------------------------------------------------------------------------
def test_sft_on_toy_lowers_the_loss_and_raises_held_out_reward_and_parse_rate(toy_sft: Any) -> None:
    root, history = toy_sft
    evals = [r for r in history if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 12, 24]  # before, every 12 steps, after the last
    first, last = evals[0], evals[-1]
    losses = [r["losses/loss"] for r in history if "losses/loss" in r]
    assert len(losses) == 24 and losses[-1] < 0.25 * losses[0]
    # a random tiny model writes no call; after SFT every turn is a parseable call ...
    assert first["eval/parse_rate"] == 0.0 and last["eval/parse_rate"] == 1.0
    # ... submitting the word the prompt names: it reads the word (both kinds right)
    assert first["rewards/correct"] == 0.0 and last["rewards/correct"] == 1.0
    assert last["eval/kind/red"] == last["eval/kind/blue"]
    assert last["eval/reward"] > first["eval/reward"] + 0.3
    # the same records, plots, checkpoints and run store as GRPO
    assert (root / "sft" / "metrics.jsonl").is_file() and (root / "sft" / "rewards.png").is_file()
    assert latest_checkpoint(root / "sft") is not None
    store = RunStore(root / "runs.db")
    try:
        run = next(r for r in store.runs(kind="train") if r.policy == "sft:tiny")
        assert (
            run.status == "finished"
            and run.episodes == 3 * 16
            and run.config["algorithm"]["name"] == "sft"
        )
        assert [step for step, _ in store.metrics(run.id)] == list(range(25))
    finally:
        store.close()
    shown = runner.invoke(app, ["runs", "--store", str(root / "runs.db"), "--json"])
    assert shown.exit_code == 0 and "sft:tiny" in shown.stdout


def test_grpo_init_from_starts_from_the_sft_weights(toy_sft: Any, tiny: tuple[Any, Any]) -> None:
    from trainer.sync_trainer import SyncTrainer

    root, _ = toy_sft
    cfg = load_recipe(
        {
            "seed": 0,
            "twin": {"name": "Toy", "config": TOY},
            "model": {"path": "tiny", "dtype": "float32", "init_from": str(root / "sft")},
            "lora": {"enabled": True, "rank": 4},
            "sampler": {"max_new_tokens": 2, "max_episode_tokens": 512},
            "algorithm": {"group_size": 2, "groups_per_step": 2, "dynamic_sampling": False},
            "optim": {"lr": 1e-3, "micro_batch_tokens": 4096},
            "train": {
                "steps": 1,
                "output_dir": str(root / "grpo"),
                "store": False,
                "checkpoint_every": 0,
            },
            "devices": {"cpu_threads": 1},
        }
    )
    grpo = SyncTrainer(cfg)
    grpo.setup()
    rows = read_dataset(root / "ds")[:3]
    episodes = [render_row(grpo.renderer_factory(r["tools"]), r["messages"]) for r in rows]
    batch = TrainBatch(
        [e.input_ids for e in episodes],
        [e.loss_mask for e in episodes],
        [[0.0] * len(e) for e in episodes],
        [1.0] * len(episodes),
    )

    def logprobs_of(model: Any) -> torch.Tensor:
        learner = Learner(model, algorithm=cfg.algorithm, optim=cfg.optim)
        return torch.tensor([x for row in learner.logprobs(batch) for x in row])

    start = torch.tensor([x for row in grpo.learner.logprobs(batch) for x in row])
    sft_model, _ = load_checkpoint_model(root / "sft")
    torch.testing.assert_close(start, logprobs_of(sft_model), rtol=0, atol=1e-5)
    assert (start - logprobs_of(tiny[0])).abs().max() > 0.5  # not the untrained tiny model
    history = grpo.train()  # and the run trains from there
    grpo.cleanup()
    assert len(history) == 1 and history[0]["policy/logprob_mismatch"] < 1e-4


def test_twin_eval_scores_an_sft_checkpoint_folder(toy_sft: Any) -> None:
    root, history = toy_sft
    checkpoint = latest_checkpoint(root / "sft")
    result = runner.invoke(
        app,
        [
            "eval",
            "toy",
            "--policy",
            f"hf:{checkpoint},temperature=0,max_new_tokens=4",
            "--split",
            "dev",
            "--episodes",
            "16",
            "--set",
            "num_words=2",
            "--set",
            "repeat=16",
            "--no-store",
            "--no-progress",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    final = history[-1]
    assert summary["reward_mean"] == pytest.approx(final["eval/reward"])
    assert summary["components"]["correct"] == pytest.approx(1.0)


def test_a_lora_sft_checkpoint_loads_with_its_adapter_merged(
    toy_sft: Any, tiny: tuple[Any, Any]
) -> None:
    root, _ = toy_sft
    cfg = load_recipe(_sft_recipe(
        root, lora={"enabled": True, "rank": 4, "alpha": 8.0}, eval={"cases": 0},
        data={"paths": [str(root / "ds")], "epochs": 1, "batch_size": 16},
        train={"output_dir": str(root / "lora"), "store": False, "checkpoint_every": 0},
    ))  # fmt: skip
    run = SFTTrainer(cfg)
    run.setup()
    history = run.train()
    run.cleanup()
    assert len(history) == 4 and run.learner.is_peft
    batch = TrainBatch(
        [e.input_ids for e in run.episodes[:3]],
        [e.loss_mask for e in run.episodes[:3]],
        [[0.0] * len(e) for e in run.episodes[:3]],
        [1.0] * 3,
    )
    trained = torch.tensor([x for row in run.learner.logprobs(batch) for x in row])
    merged, _ = load_checkpoint_model(root / "lora")
    assert not any("lora" in name for name, _ in merged.named_parameters())  # a plain model
    merged.requires_grad_(True)  # a Learner only to score it
    loaded = Learner(merged, algorithm=cfg.algorithm, optim=cfg.optim)
    torch.testing.assert_close(
        torch.tensor([x for row in loaded.logprobs(batch) for x in row]), trained, rtol=0, atol=1e-5
    )
    base = Learner(tiny[0], algorithm=cfg.algorithm, optim=cfg.optim)
    assert (
        torch.tensor([x for row in base.logprobs(batch) for x in row]) - trained
    ).abs().max() > 1e-2


# -- recipes and the CLI ---------------------------------------------------------------------------
def test_algorithm_sft_recipes_and_their_errors(tmp_path: Path) -> None:
    cfg = load_recipe(_sft_recipe(tmp_path))
    assert cfg.algorithm.name == "sft" and cfg.data.paths == [str(tmp_path / "ds")]
    assert load_recipe("toy-cpu").algorithm.name == "grpo"
    with pytest.raises(ConfigError, match="data.paths"):
        load_recipe("toy-cpu", ["algorithm.name=sft"])
    with pytest.raises(ConfigError, match="'grpo' or 'sft'"):
        load_recipe("toy-cpu", ["algorithm.name=dpo"])
    # `twin sft` is `twin train` with algorithm.name=sft: a recipe without data is refused in
    # one line
    refused = runner.invoke(app, ["sft", "toy-cpu"])
    assert refused.exit_code == 2 and "data.paths" in refused.output
    missing = runner.invoke(
        app,
        [
            "sft",
            "toy-cpu",
            "--set",
            f"data.paths={tmp_path / 'none'}",
            "--set",
            f"train.output_dir={tmp_path / 'out'}",
        ],
    )
    assert missing.exit_code == 2 and "not found" in missing.output
    with pytest.raises(ConfigError, match="not a twinrl checkpoint"):
        from trainer.checkpoint import resolve_checkpoint

        resolve_checkpoint(tmp_path)

"""A CI-sized proof of multi-turn learning on the catalog twin: SFT warm start, then GRPO.

A tiny model is built here (:func:`trainer.tiny.build_tiny`, its BPE trained on rendered catalog
episodes: prompts, tool schemas, tool results) and taught the tools by SFT on a demonstrator's
episodes (:func:`twin.evaluation.collect.collect`, train split), then trained by GRPO from that
checkpoint (``model.init_from``) on the catalog twin (v1, compact prompt, at most three turns).
Both stages run as ``twin train`` runs them (:func:`trainer.cli.train`). Both checkpoints are
then scored on the same held-out ``dev`` cases (v1's held-out world, never seen by either stage)
with the same sampling seeds, at the sampling temperature GRPO trains with (1.0).

The demonstrator (:class:`FormatTeacher`) calls ``search_taxonomy`` with the listing's item type
and ``get_attribute_schema`` on a top-level category in its first turn, and ``submit`` in its
second, with a verdict it draws without looking at the evidence (ok 3/5, counterfeit 1/5,
prohibited 1/5). SFT teaches the calls; the verdicts it teaches are noise. The reward knows what
the demonstrator does not: a missed counterfeit costs 7x a false alarm (envs/catalog/README.md),
and an episode without a valid submission scores -1. GRPO has to beat its demonstrator.

The tiny tokenizer holds the fixed JSON around each call's arguments as added tokens
(``EXTRA_TOKENS``, as ``trainer.tiny.CALL_TOKENS`` do for the toy): a call is an opening token, its
argument values as ordinary tokens (the query's words, the category id, the verdict) and a closing
token. docs/training.md ("A CI-sized proof on the catalog") has the measured figures.
"""

from __future__ import annotations

import io
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from envs.catalog.baselines import parse_prompt
from trainer.cli import train
from trainer.tiny import build_tiny, chat_template, chat_text
from twin.errors import ConfigError
from twin.evaluation.collect import collect, read_dataset
from twin.registry import make_twin

#: The twin: catalog v1 with the compact prompt. The demonstrator takes two turns (search and
#: look-up, then submit); the third leaves room for a second try.
TWIN: dict[str, Any] = {"prompt_style": "compact", "max_turns": 3}
#: The fixed text around the arguments of the demonstrator's calls, exactly as the chat template
#: (``trainer/templates/chatml_tools.jinja``) writes them; ``'"}}\n</tool_call>'`` closes every
#: call (it is ``trainer.tiny.CALL_TOKENS[1]`` already): the search names its ``limit`` first.
EXTRA_TOKENS: tuple[str, ...] = (
    '<tool_call>\n{"name": "search_taxonomy", "arguments": {"limit": 1, "query": "',
    '<tool_call>\n{"name": "get_attribute_schema", "arguments": {"category_id": "',
    '<tool_call>\n{"name": "submit", "arguments": {"category_id": "',
    '", "attributes": {}, "verdict": "',
)
#: The demonstrator's verdicts, drawn without evidence.
NOISY_VERDICTS: tuple[str, ...] = ("ok", "ok", "ok", "counterfeit", "prohibited")
#: Model shape over trainer.tiny.TINY_SHAPE: an output layer of its own (see build_tiny).
SHAPE: dict[str, Any] = {"tie_word_embeddings": False}


def listing_only_template() -> str:
    """The tiny model's chat template (``trainer/templates/chatml_tools.jinja``) without the system
    turn and the tool list: the listing, the calls and their results.

    A randomly initialised model cannot read instructions, and its attention starts out spread
    evenly over the whole context: the ~850 tokens of the compact system prompt and tool schemas
    dilute what its calls depend on (the listing, the tool results) and make every step longer.
    Measured on seed 0 (48 SFT steps): with them 46 s and no held-out episode submitted; without
    them 29 s and 8% submitted. The twin, its tools and its reward are unchanged.
    """
    text = chat_template()
    start, end = text.index("{%- if tools %}"), text.index("{%- for message in messages %}")
    return text[:start] + text[end:]


DEMOS = 96  # demonstrator episodes (train split)
#: Six epochs, not four: with four, seed 1 on an AVX2-only CPU ended SFT submitting in 5% of
#: held-out episodes (it closed the submit call before its verdict), and GRPO had little to start
#: from; with six, eight seeds started at 33-68% (docs/training.md).
SFT = {"epochs": 6, "batch_size": 4, "lr": 1.0e-2}
GRPO = {"steps": 12, "group_size": 8, "groups_per_step": 4, "lr": 1.0e-3}
EVAL_CASES = 96  # held-out dev cases
EVAL_SAMPLES = 2  # episodes per held-out case
#: The paired bootstrap of GRPO's rises over its SFT start (reward, and the share of episodes
#: that end in a valid submission): resamples of the held-out cases, and the generator's seed (an
#: interval does not depend on the order tests run in).
BOOT_RESAMPLES, BOOT_SEED = 10_000, 0


class FormatTeacher:
    """The demonstrator: a search and a look-up in one turn, then a submit with a verdict drawn
    without evidence.

    Turn 1 searches the taxonomy for the listing's item type and, in the same turn, looks up the
    schema of the top-level category that search finds first (it runs the search itself to know
    it); turn 2 submits that category, no attributes, and a seeded verdict.

    Args:
        twin: The catalog twin (its ``search_taxonomy`` picks the category to look up).
        seed: Seeds the verdict draws (with the listing).
    """

    name = "format-teacher"

    def __init__(self, twin: Any, seed: int) -> None:
        self.twin = twin
        self.seed = seed

    async def act(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The next turn (see the class docstring)."""
        listing = parse_prompt(messages)
        query = listing["specifics"].get("item type") or listing["title"]
        hits = self.twin.search_taxonomy(query=query, limit=1).get("results") or [{"id": "aa"}]
        top = hits[0]["id"].split("-")[0]
        if not any(m.get("role") == "assistant" for m in messages):
            return _turn(
                [
                    ("search_taxonomy", {"limit": 1, "query": query}),
                    ("get_attribute_schema", {"category_id": top}),
                ]
            )
        rng = random.Random(f"{self.seed}:{messages[1]['content']}")
        return _turn(
            [
                (
                    "submit",
                    {"category_id": top, "attributes": {}, "verdict": rng.choice(NOISY_VERDICTS)},
                )
            ]
        )


def _turn(calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {
            "id": f"c{i}_{name}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        for i, (name, args) in enumerate(calls)
    ]}  # fmt: skip


def _recipe(root: Path, name: str, body: dict[str, Any]) -> str:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return str(path)


def _common(seed: int, model: Path, out: Path) -> dict[str, Any]:
    return {
        "seed": seed,
        "twin": {"name": "Catalog", "config": TWIN, "split": "train"},
        "model": {"path": str(model), "dtype": "float32", "chat_template": listing_only_template()},
        "lora": {"enabled": False},
        "sampler": {
            "kind": "hf",
            "temperature": 1.0,
            "top_p": 1.0,
            "max_new_tokens": 16,
            "max_episode_tokens": 2400,
        },
        "train": {"output_dir": str(out), "checkpoint_every": 0, "store": False},
        "devices": {"rollout": "cpu", "learner": "cpu", "cpu_threads": 1},
    }


def held_out(checkpoint: Path, seed: int) -> dict[str, Any]:
    """Score a checkpoint on the first ``EVAL_CASES`` dev cases, ``EVAL_SAMPLES`` episodes each,
    as ``twin eval catalog --policy hf:<checkpoint>,temperature=1,...`` does."""
    from twin.evaluation import evaluate
    from twin.policies import make_policy

    twin = make_twin("Catalog", **TWIN)
    policy = make_policy(
        f"hf:{checkpoint},temperature=1.0,max_new_tokens=16,dtype=float32,seed={seed}", twin
    )
    tokenizer = policy.tokenizer
    result = evaluate(
        twin,
        policy,
        [("dev", i) for i in range(EVAL_CASES)],
        group_size=EVAL_SAMPLES,
        progress=False,
    )
    episodes = [t for g in result.groups for t in g.trajectories]
    calls = [
        c
        for t in episodes
        for m in t.messages
        if m.get("role") == "assistant"
        for c in m.get("tool_calls") or []
    ]
    queries = []
    for c in calls:
        if c["function"]["name"] == "search_taxonomy":
            try:
                queries.append(str(json.loads(c["function"]["arguments"]).get("query", "")))
            except (ValueError, AttributeError):
                pass
    verdicts = [str(t.submission.get("verdict")) for t in episodes if t.submission]
    submitted = [t for t in episodes if t.submission]
    return {
        "reward": statistics.fmean(t.reward or 0.0 for t in episodes),
        # per case (in case order), the mean over its episodes: what the paired interval resamples
        "case_rewards": [
            statistics.fmean(t.reward or 0.0 for t in g.trajectories) for g in result.groups
        ],
        "submitted": sum(bool(t.submission) for t in episodes) / len(episodes),
        "case_submitted": [
            statistics.fmean(bool(t.submission) for t in g.trajectories) for g in result.groups
        ],
        "calls": len(calls) / len(episodes),
        "turns": statistics.fmean(t.num_turns for t in episodes),
        # of the episodes that submit: the share that searched in an earlier turn first
        "searched_first": sum(_searched_before_submit(t.messages) for t in submitted)
        / len(submitted)
        if submitted
        else 0.0,
        "query_tokens": statistics.fmean(
            len(tokenizer.encode(q, add_special_tokens=False)) for q in queries
        )
        if queries
        else 0.0,
        "verdicts": {v: verdicts.count(v) / len(episodes) for v in sorted(set(verdicts))},
        "components": {
            k: statistics.fmean(t.components.get(k, 0.0) for t in episodes)
            for k in ("category", "attributes", "policy")
        },
        "episodes": len(episodes),
    }


def paired_rise(before: list[float], after: list[float]) -> tuple[float, float, float]:
    """Mean of ``after - before`` over the cases and its paired 95% bootstrap interval (both
    checkpoints played the same cases with the same sampling seeds)."""
    import numpy as np

    diff = np.asarray(after, dtype=float) - np.asarray(before, dtype=float)
    rng = np.random.default_rng(BOOT_SEED)
    means = diff[rng.integers(0, len(diff), size=(BOOT_RESAMPLES, len(diff)))].mean(axis=1)
    return float(diff.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def _searched_before_submit(messages: list[dict[str, Any]]) -> bool:
    """A ``search_taxonomy`` call in an assistant turn before the one that holds ``submit``."""
    searched = False
    for m in messages:
        names = (
            [c["function"]["name"] for c in m.get("tool_calls") or []]
            if m.get("role") == "assistant"
            else []
        )
        if "submit" in names:
            return searched
        searched = searched or "search_taxonomy" in names
    return False


def run_proof(seed: int, root: Path, *, sft_only: bool = False) -> dict[str, Any]:
    """Demonstrations -> tiny model -> SFT -> GRPO; the held-out figures of both checkpoints."""
    started = time.perf_counter()
    twin = make_twin("Catalog", **TWIN)
    demos = collect(
        twin,
        FormatTeacher(twin, seed),
        [("train", i) for i in range(DEMOS)],
        out=root / "demos",
        progress=False,
    )
    rows = read_dataset(demos.out)
    model = build_tiny(
        root / "model",
        seed=seed,
        extra_corpus=[chat_text(r["messages"], r["tools"]) for r in rows[:48]],
        vocab_size=2048,
        shape=SHAPE,
        extra_tokens=EXTRA_TOKENS,
    )
    console = Console(file=io.StringIO(), width=120)
    sft = {
        **_common(seed, model, root / "sft"),
        "algorithm": {"name": "sft"},
        "data": {
            "paths": [str(demos.out)],
            "epochs": SFT["epochs"],
            "batch_size": SFT["batch_size"],
        },
        "eval": {"split": "dev", "cases": 0},
        "optim": {"lr": SFT["lr"], "grad_clip": 1.0, "micro_batch_tokens": 16384},
    }
    assert train(_recipe(root, "sft", sft), [], console=console) == 0, console.file.getvalue()
    t_sft = time.perf_counter()
    if sft_only:
        before = held_out(root / "sft", seed)
        before.pop("case_rewards")
        before.pop("case_submitted")
        return {"seed": seed, "sft": before, "sft_s": t_sft - started}
    grpo = {
        **_common(seed, model, root / "grpo"),
        "algorithm": {
            "name": "grpo",
            "advantage": "dr_grpo",
            "loss_aggregation": "token_mean",
            "kl_coef": 0.0,
            "entropy_coef": 0.0,
            "dynamic_sampling": True,
            "max_refill_rounds": 1,
            "overlong_buffer": 0,
            "group_size": GRPO["group_size"],
            "groups_per_step": GRPO["groups_per_step"],
        },
        "optim": {"lr": GRPO["lr"], "grad_clip": 1.0, "micro_batch_tokens": 16384},
    }
    grpo["model"]["init_from"] = str(root / "sft")
    grpo["train"]["steps"] = GRPO["steps"]
    assert train(_recipe(root, "grpo", grpo), [], console=console) == 0, console.file.getvalue()
    t_grpo = time.perf_counter()
    before, after = held_out(root / "sft", seed), held_out(root / "grpo", seed)
    rise, low, high = paired_rise(before.pop("case_rewards"), after.pop("case_rewards"))
    more, more_low, more_high = paired_rise(
        before.pop("case_submitted"), after.pop("case_submitted")
    )
    return {
        "seed": seed,
        "sft": before,
        "grpo": after,
        "rise": {"mean": rise, "ci95": [low, high]},
        "submit_rise": {"mean": more, "ci95": [more_low, more_high]},
        "demo_reward": demos.summary.get("reward_mean"),
        "sft_s": t_sft - started,
        "grpo_s": t_grpo - t_sft,
        "total_s": time.perf_counter() - started,
    }


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_lifts_the_held_out_catalog_reward_over_its_sft_start(
    seed: int, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("TWINRL_STORE", str(tmp_path / "store.db"))
    figures = run_proof(seed, tmp_path)
    print(json.dumps(figures, indent=1))
    sft, grpo = figures["sft"], figures["grpo"]
    # SFT learns the demonstrator's multi-turn, multi-token tool use: search and look-up, then
    # submit
    assert sft["calls"] >= 2.0 and sft["turns"] >= 2.0 and sft["query_tokens"] >= 2.0, sft
    # GRPO keeps episodes multi-turn. It may trade the search for an earlier submit, and its
    # queries for shorter ones: the tiny model never copies the found category, so the search
    # earns no reward (seed 2 once fell to 1.76 calls an episode while its reward rose +0.38;
    # seed 5 wrote one-token queries while its reward rose +0.57)
    assert grpo["turns"] >= 2.0, grpo
    # More of GRPO's episodes end in a valid submission, beyond sampling noise: the paired
    # interval of the share excludes zero (a fixed rise of 0.10 failed seed 2 on an AVX-512 EPYC
    # by one episode in 192, its SFT start already submitting in 72% of them; docs/training.md)
    assert figures["submit_rise"]["ci95"][0] > 0.0, (sft, grpo, figures["submit_rise"])
    # GRPO's held-out reward is above its SFT start beyond sampling noise: the paired interval
    # over the held-out cases excludes zero
    assert figures["rise"]["ci95"][0] > 0.0, figures["rise"]


# -- the product options this proof needs (fast) -------------------------------------------------
def test_extra_tokens_hold_the_call_text_whole_and_shape_changes_the_model(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = build_tiny(
        tmp_path / "m",
        shape={"tie_word_embeddings": False, "hidden_size": 32},
        extra_tokens=EXTRA_TOKENS,
    )
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    assert config.hidden_size == 32 and config.tie_word_embeddings is False
    text = EXTRA_TOKENS[2] + "red" + EXTRA_TOKENS[3] + "ok" + '"}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == [
        EXTRA_TOKENS[2],
        "red",
        EXTRA_TOKENS[3],
        "ok",
        '"}}\n</tool_call>',
    ]
    plain = AutoTokenizer.from_pretrained(build_tiny(tmp_path / "plain"), local_files_only=True)
    assert len(plain.encode(text, add_special_tokens=False)) > 2 * len(ids)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shape": {"hidden": 32}}, "unknown shape field"),
        ({"shape": {"hidden_size": 0}}, "positive integers"),
        ({"shape": {"hidden_size": 30}}, "multiple of num_attention_heads"),
        ({"shape": {"tie_word_embeddings": "no"}}, "true or false"),
        ({"extra_tokens": "<tool_call>"}, "sequence of non-empty strings"),
        ({"extra_tokens": [""]}, "sequence of non-empty strings"),
    ],
)
def test_build_tiny_refuses_bad_shapes_and_tokens(
    tmp_path: Path, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        build_tiny(tmp_path / "m", **kwargs)


def test_the_demonstrator_searches_and_looks_up_then_submits_and_its_calls_are_few_tokens(
    tmp_path: Path,
) -> None:
    from transformers import AutoTokenizer

    twin = make_twin("Catalog", **TWIN)
    result = collect(
        twin,
        FormatTeacher(twin, 0),
        [("train", i) for i in range(4)],
        out=tmp_path / "d",
        progress=False,
    )
    rows = read_dataset(result.out)
    assert result.rows == len(rows) == 4
    corpus = [chat_text(r["messages"], r["tools"]) for r in rows]
    path = build_tiny(
        tmp_path / "m", extra_corpus=corpus, vocab_size=2048, extra_tokens=EXTRA_TOKENS
    )
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    for row in rows:
        turns = [
            [c["function"]["name"] for c in m["tool_calls"]]
            for m in row["messages"]
            if m["role"] == "assistant"
        ]
        assert turns == [["search_taxonomy", "get_attribute_schema"], ["submit"]]
        assert row["components"]["submitted"] == 1.0 and row["invalid_calls"] == 0
        submit = json.loads(row["messages"][-2]["tool_calls"][0]["function"]["arguments"])
        assert submit["verdict"] in NOISY_VERDICTS and submit["attributes"] == {}
        # the submit call is: opening token, the category id, one token, the verdict, closing token
        text = chat_text([row["messages"][-2]])
        call = text[text.index("<tool_call>") : text.index("</tool_call>") + len("</tool_call>")]
        pieces = [tok.decode([i]) for i in tok.encode(call, add_special_tokens=False)]
        assert (
            pieces[0] == EXTRA_TOKENS[2]
            and EXTRA_TOKENS[3] in pieces
            and pieces[-1] == '"}}\n</tool_call>'
        )
        assert "".join(pieces) == call and len(pieces) <= 8
    # the tokenizer's corpus holds the twin's prompt and tool schemas; the model's template neither
    assert rows[0]["messages"][0]["content"] in corpus[0] and '"name": "lookup_brand"' in corpus[0]
    from jinja2 import Environment

    seen = (
        Environment()
        .from_string(listing_only_template())
        .render(messages=rows[0]["messages"], tools=rows[0]["tools"], add_generation_prompt=False)
    )
    assert rows[0]["messages"][0]["content"] not in seen and "lookup_brand" not in seen
    assert rows[0]["messages"][1]["content"] in seen and seen.startswith("<|im_start|>user\n")


def test_paired_rise_excludes_zero_only_for_a_rise_beyond_the_case_noise() -> None:
    rng = random.Random(0)
    before = [rng.uniform(-1.0, 1.0) for _ in range(EVAL_CASES)]
    noise = [rng.gauss(0.0, 0.5) for _ in before]
    rise, low, high = paired_rise(before, [b + 0.3 + n for b, n in zip(before, noise)])
    assert low > 0.0 and low < rise < high
    # the same noise without the rise: the interval holds zero
    _, low, high = paired_rise(
        before, [b + n - statistics.fmean(noise) for b, n in zip(before, noise)]
    )
    assert low < 0.0 < high
    # pairing: a shift by the same amount on every case is certain however spread the cases are
    assert paired_rise(before, [b + 0.05 for b in before])[1] > 0.04

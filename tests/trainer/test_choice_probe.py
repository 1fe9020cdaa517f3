"""The choice probe: teacher-forced scores of each value of a deciding argument, and the warning
for bfloat16 on a CPU that only emulates it."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer import models
from trainer.choice_probe import (
    ChoiceScore,
    candidate_ids,
    choice_logprobs,
    score_row,
    summarize,
    truth_of,
)
from trainer.models import cpu_bf16_flags, load_model, warn_emulated_bf16
from trainer.renderer import Renderer
from trainer.sft import render_row
from twin.errors import ConfigError
from twin.evaluation import evaluate
from twin.evaluation.collect import read_dataset, trajectory_row, write_dataset
from twin.policies import make_policy
from twin.registry import make_twin

ROOT = Path(__file__).resolve().parents[2]
DECISIONS = ["refund", "partial", "deny"]


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    torch.manual_seed(0)
    return load_model("tiny", "float32")


@pytest.fixture(scope="module")
def returns_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """Six oracle episodes of the returns twin, as a ``twin collect`` dataset."""
    twin = make_twin("returns")
    result = evaluate(
        twin, make_policy("oracle", twin), [("train", i) for i in range(6)], progress=False
    )
    rows = [
        trajectory_row(t, twin.tool_schemas, run_id=None)
        for g in result.groups
        for t in g.trajectories
    ]
    out = tmp_path_factory.mktemp("probe") / "ds"
    write_dataset(rows, out)
    return twin, out


def _full_pass_logprob(model: Any, prefix: list[int], ids: list[int]) -> float:
    """The continuation's summed logprob from one uncached pass over prefix + continuation."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prefix + ids])).logits[0].float()
    logp = logits.log_softmax(-1)
    return sum(float(logp[len(prefix) - 1 + k, t]) for k, t in enumerate(ids))


def test_cached_scores_equal_a_full_pass_for_every_candidate_in_any_order(
    tiny: tuple[Any, Any], returns_data: Any
) -> None:
    model, tokenizer = tiny
    twin, ds = returns_data
    row = read_dataset(ds / "episodes.jsonl")[0]
    renderer = Renderer(tokenizer, row["tools"])
    prefix, conts = candidate_ids(renderer, row["messages"], "decide", "decision", DECISIONS)
    assert any(len(ids) > 1 for ids in conts.values())  # the cached second pass is exercised
    scores = choice_logprobs(model, prefix, conts)
    backwards = choice_logprobs(model, prefix, dict(reversed(list(conts.items()))))
    for value, ids in conts.items():
        full = _full_pass_logprob(model, prefix, ids)
        assert scores[value] == pytest.approx(full, abs=1e-4)
        assert backwards[value] == pytest.approx(full, abs=1e-4)  # the cache went back each time


def test_each_candidate_is_its_whole_rendering_and_differs_only_where_its_value_is(
    tiny: tuple[Any, Any], returns_data: Any
) -> None:
    _, tokenizer = tiny
    _, ds = returns_data
    for row in read_dataset(ds / "episodes.jsonl"):
        renderer = Renderer(tokenizer, row["tools"])
        prefix, conts = candidate_ids(renderer, row["messages"], "decide", "decision", DECISIONS)
        whole = {}
        for value in DECISIONS:
            msgs = json.loads(json.dumps(row["messages"]))
            call = next(
                c
                for m in msgs
                for c in m.get("tool_calls") or ()
                if c["function"]["name"] == "decide"
            )
            args = json.loads(call["function"]["arguments"])
            call["function"]["arguments"] = json.dumps({**args, "decision": value})
            whole[value] = render_row(Renderer(tokenizer, row["tools"]), msgs).input_ids
        suffix_len = len(whole[DECISIONS[0]]) - len(prefix) - len(conts[DECISIONS[0]])
        for value in DECISIONS:
            ids = whole[value]
            assert ids[: len(prefix)] == prefix
            assert ids[len(prefix) : len(ids) - suffix_len] == conts[value]
            assert value in tokenizer.decode(prefix[-3:] + conts[value])
        assert len({tuple(c) for c in conts.values()}) == len(DECISIONS)
        assert truth_of(row["messages"], "decide", "decision") in DECISIONS


def test_score_row_names_the_truth_and_picks_the_highest_candidate(
    tiny: tuple[Any, Any], returns_data: Any
) -> None:
    model, tokenizer = tiny
    _, ds = returns_data
    row = read_dataset(ds / "episodes.jsonl")[1]
    score = score_row(
        model,
        Renderer(tokenizer, row["tools"]),
        row,
        tool="decide",
        argument="decision",
        values=DECISIONS,
    )
    assert score.truth == truth_of(row["messages"], "decide", "decision")
    assert score.index == row["index"]
    assert score.logprobs[score.choice] == max(score.logprobs.values())
    assert sorted(score.logprobs) == sorted(DECISIONS)


def test_the_summary_counts_accuracy_by_truth_and_kind_and_the_confusion() -> None:
    scores = [
        ChoiceScore(0, "a", "ok", {"ok": -0.1, "deny": -2.0}),  # right
        ChoiceScore(1, "a", "deny", {"ok": -0.5, "deny": -1.0}),  # wrong: chose ok
        ChoiceScore(2, "b", "deny", {"ok": -3.0, "deny": -0.2}),  # right
        ChoiceScore(3, None, "ok", {"ok": -1.0, "deny": -1.0 + 1e-9}),  # wrong by a hair
    ]
    out = summarize(scores, ["ok", "deny"])
    assert out["rows"] == 4
    assert out["accuracy"] == 0.5
    assert out["by_truth"] == {
        "ok": {"rows": 2, "accuracy": 0.5},
        "deny": {"rows": 2, "accuracy": 0.5},
    }
    assert out["by_kind"]["a"] == {"rows": 2, "accuracy": 0.5}
    assert out["by_kind"]["?"] == {"rows": 1, "accuracy": 0.0}
    assert out["confusion"] == {"ok": {"ok": 1, "deny": 1}, "deny": {"ok": 1, "deny": 1}}
    assert out["chosen"] == {"ok": 2, "deny": 2}
    # softmax of the two sums: 1 / (1 + e^-1.9), e^-0.5 / (e^-0.5 + e^-1) ...
    assert scores[0].truth_prob == pytest.approx(1 / (1 + torch.tensor(-1.9).exp().item()))
    assert scores[3].truth_prob == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="no rows"):
        summarize([], ["ok"])


def test_rows_that_cannot_be_probed_say_why(tiny: tuple[Any, Any], returns_data: Any) -> None:
    _, tokenizer = tiny
    _, ds = returns_data
    row = read_dataset(ds / "episodes.jsonl")[0]
    renderer = Renderer(tokenizer, row["tools"])
    with pytest.raises(ConfigError, match="no assistant turn calls 'submit'"):
        candidate_ids(renderer, row["messages"], "submit", "decision", DECISIONS)
    with pytest.raises(ConfigError, match="no argument 'verdict'.*'decision'"):
        candidate_ids(renderer, row["messages"], "decide", "verdict", DECISIONS)
    with pytest.raises(ConfigError, match="at least two different values"):
        candidate_ids(renderer, row["messages"], "decide", "decision", ["deny", "deny"])
    truth = truth_of(row["messages"], "decide", "decision")
    others = [v for v in DECISIONS if v != truth]
    with pytest.raises(ConfigError, match=f"chose '{truth}', which is not among the candidates"):
        score_row(tiny[0], renderer, row, tool="decide", argument="decision", values=others)


def test_the_script_writes_every_row_and_the_summary(returns_data: Any, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "choice_probe_script", ROOT / "scripts" / "choice_probe.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # type: ignore[union-attr]
    _, ds = returns_data
    out = tmp_path / "probe.json"
    argv = [
        "--policy",
        "hf:tiny",
        "--data",
        str(ds),
        "--tool",
        "decide",
        "--values",
        ",".join(DECISIONS),
        "--start",
        "1",
        "--rows",
        "4",
        "--out",
        str(out),
    ]
    assert script.main(argv) == 0
    got = json.loads(out.read_text())
    rows = read_dataset(ds / "episodes.jsonl")[1:5]
    assert [s["index"] for s in got["scores"]] == [r["index"] for r in rows]
    assert got["rows"] == 4
    assert got["accuracy"] == sum(s["choice"] == s["truth"] for s in got["scores"]) / 4
    assert all(s["choice"] in DECISIONS for s in got["scores"])
    assert script.main(["--policy", "openai:gpt", "--data", str(ds)]) == 2


# -- bfloat16 on a CPU without bfloat16 instructions -----------------------------------------------
X86_AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"
X86_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_the_cpu_flags_name_only_native_bfloat16_instructions() -> None:
    assert cpu_bf16_flags(X86_AVX2) == []
    assert cpu_bf16_flags(X86_BF16) == ["amx_bf16", "avx512_bf16"]
    assert cpu_bf16_flags(ARM_BF16) == ["bf16"]
    assert cpu_bf16_flags("model name\t: bf16 in a name is not a flag\n") == []


@pytest.mark.parametrize(("flags", "warns"), [([], True), (["avx512_bf16"], False), (None, False)])
def test_bfloat16_on_a_cpu_that_emulates_it_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, flags: Any, warns: bool
) -> None:
    from trainer.scoring import autocast_context

    monkeypatch.setattr(models, "cpu_bf16_flags", lambda: flags)
    warn_emulated_bf16.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="twinrl.trainer"):
            for _ in range(3):
                with autocast_context("bfloat16", "cpu"):
                    pass
        said = [r.message for r in caplog.records if "bfloat16 instructions" in r.message]
        assert len(said) == (1 if warns else 0)
        if warns:
            assert "leave model.autocast" in said[0] and "float32" in said[0]
    finally:
        warn_emulated_bf16.cache_clear()

"""``twin bench trl``: both trainers run; both figures and their ratio are printed (offline)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from bench import trl_ratio
from twinrl_cli import app


@given(
    steps=st.lists(st.floats(0.01, 10.0), min_size=2, max_size=8),
    tokens=st.floats(0.0, 1000.0),
    warmup=st.integers(1, 3),
)
def test_summary_counts_only_the_measured_steps(steps, tokens, warmup):
    if len(steps) <= warmup:
        with pytest.raises(RuntimeError):
            trl_ratio._summary([0.0], [tokens], warmup)
        return
    stamps, t = [], 0.0
    for dt in steps:  # step-end time stamps
        t += dt
        stamps.append(t)
    out = trl_ratio._summary(stamps, [tokens] * len(stamps), warmup)
    measured = len(steps) - warmup
    wall = sum(steps[warmup:])
    assert out["steps"] == measured
    assert out["steps_per_s"] == pytest.approx(measured / wall)
    assert out["tokens_per_s"] == pytest.approx(tokens * measured / wall)
    assert out["tokens_per_step"] == pytest.approx(tokens)


def test_bench_prints_both_figures_and_ratio(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out_json = tmp_path / "trl.json"
    rc = trl_ratio.main(
        steps=1,
        warmup=1,
        prompts=2,
        group=2,
        max_tokens=4,
        json=str(out_json),
        output_dir=str(tmp_path / "runs"),
    )
    text = capsys.readouterr().out
    assert rc == 0
    number = r"(\d+\.\d+)"
    trl_row = re.search(rf"TRL GRPOTrainer\s*│\s*{number}", text)
    ours_row = re.search(rf"ours \(SyncTrainer\)\s*│\s*{number}", text)
    ratio = re.search(rf"ratio ours / TRL \(steps/s\): {number}x", text)
    assert trl_row and ours_row and ratio, text
    trl_sps, ours_sps, printed_ratio = (float(m.group(1)) for m in (trl_row, ours_row, ratio))
    assert trl_sps > 0 and ours_sps > 0
    assert printed_ratio == pytest.approx(ours_sps / trl_sps, rel=0.05, abs=0.01)
    assert "2 prompts x 2 completions = 4 per step" in text and "max 4 completion tokens" in text
    figures = json.loads(out_json.read_text())
    assert figures["settings"]["group"] == 2 and figures["target"] == trl_ratio.TARGET_RATIO
    for side in ("trl", "ours"):
        # the completion limit holds on both sides
        assert 0 < figures["runs"][side]["tokens_per_step"] <= 2 * 2 * 4
    runs = figures["runs"]
    assert figures["ratio"] == pytest.approx(
        runs["ours"]["steps_per_s"] / runs["trl"]["steps_per_s"]
    )


def test_cli_passes_options_to_main(monkeypatch):
    seen = {}

    def fake_main(**opts):
        seen.update(opts)
        return 0

    monkeypatch.setattr(trl_ratio, "main", fake_main)
    result = CliRunner().invoke(app, ["bench", "trl", "--steps", "3", "--max-tokens", "8"])
    assert result.exit_code == 0, result.output
    # the typed options: the given ones parsed, the others at main()'s own defaults
    assert (seen["steps"], seen["max_tokens"], seen["prompts"], seen["lr"], seen["json"]) == (
        3,
        8,
        4,
        5e-3,
        None,
    )


def test_pool_weights_runs_by_their_time():
    fast = {"steps": 5.0, "wall_s": 5.0, "tokens_per_step": 100.0}
    slow = {"steps": 5.0, "wall_s": 15.0, "tokens_per_step": 300.0}
    out = trl_ratio._pool([fast, slow])
    assert out["steps_per_s"] == pytest.approx(10 / 20)  # not the mean of 1.0 and 0.33
    assert out["tokens_per_step"] == pytest.approx(200.0)
    assert out["tokens_per_s"] == pytest.approx(2000 / 20)

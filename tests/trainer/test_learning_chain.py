"""scripts/learning_smollm2.py picks up where it stopped: a finished stage is skipped, a stopped
SFT or GRPO run continues from its newest checkpoint, and --chain expert points every stage at
the compact teacher's recipes and folders."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def chain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(
        "learning_smollm2", ROOT / "scripts" / "learning_smollm2.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    module.use_chain("expert")
    monkeypatch.setattr(module, "RUN_DIR", tmp_path)
    # a CPU with bfloat16 instructions, whatever this machine's are (--autocast auto reads them)
    monkeypatch.setattr("trainer.models.cpu_bf16_flags", lambda cpuinfo=None: ["amx_bf16"])
    ran: list[list[str]] = []
    monkeypatch.setattr(module, "run", lambda cmd, stdout_path=None: ran.append(cmd))
    module.ran = ran
    return module


def _save(out: Path, step: int, state: dict[str, Any]) -> None:
    import torch

    from trainer.checkpoint import save_checkpoint

    class _Learner:
        def save_adapter(self, path: Path) -> None:
            path.mkdir(parents=True)

        def state_dict(self) -> dict[str, Any]:
            return {"weights": {"w": torch.zeros(1)}}

    save_checkpoint(out, step, learner=_Learner(), state=state, recipe_yaml="seed: 0\n")


ARGS = SimpleNamespace(sft_epochs=1, sft_batch_size=8, sft_eval_cases=0, store=Path("store.db"))


def test_expert_chain_uses_the_compact_teacher_and_its_recipes(chain: Any) -> None:
    assert chain.TEACHER["policy"] == "compact" and chain.MAX_NEW_TOKENS == 192
    assert chain.SFT_RECIPE.endswith("catalog-smollm2-expert-sft-cpu.yaml")
    assert chain.data_dir().name == "data-compact"
    chain.train("sft", ARGS)
    (cmd,) = chain.ran
    assert cmd[1:3] == ["sft", chain.SFT_RECIPE] and "--resume" not in cmd
    assert f"data.paths=[{chain.RUN_DIR / 'data-compact'}]" in cmd


def test_a_stopped_sft_run_resumes_and_a_finished_one_is_skipped(chain: Any) -> None:
    out = chain.RUN_DIR / "sft"
    _save(out, 10, {"total_steps": 45})
    assert not chain.sft_finished(out)
    chain.train("sft", ARGS)
    assert chain.ran[-1][-1] != "--resume" and "--resume" in chain.ran[-1]
    _save(out, 45, {"total_steps": 45})
    assert chain.sft_finished(out)
    assert chain.train("sft", ARGS) is False and len(chain.ran) == 1  # skipped
    _save(out, 50, {"total_steps": 50, "stopped_early": False})
    _save(out, 51, {"total_steps": 60, "stopped_early": True})
    assert chain.sft_finished(out)  # early stopping ends the stage


def test_a_stopped_grpo_run_continues_to_its_length(chain: Any) -> None:
    _save(chain.RUN_DIR / "grpo", 3, {})
    args = SimpleNamespace(**vars(ARGS), grpo_eval_at=[], grpo_steps=8)
    assert chain.train_grpo(args) is True
    (cmd,) = chain.ran
    assert "--resume" in cmd and "train.steps=8" in cmd


@pytest.fixture()
def v2(chain: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The module with --chain v2 selected, its run folder in tmp_path and every evaluation
    recorded instead of run."""
    monkeypatch.setitem(chain.CHAINS["v2"], "run_dir", tmp_path)
    monkeypatch.setitem(chain.CHAINS["v2"], "docs_dir", tmp_path / "docs")
    chain.evaluated = []

    def evaluate(name: str, policy: str, args: Any, sets: tuple[str, ...] = ()) -> None:
        chain.evaluated.append((name, policy, sets))

    monkeypatch.setattr(chain, "evaluate", evaluate)
    return chain


def test_v2_chain_plans_its_stages_and_commands(v2: Any) -> None:
    args = v2.parse_args(["--chain", "v2"])
    assert (v2.TWIN, v2.TWIN_SETS, v2.TEACHER["policy"]) == (
        "Catalog-v2",
        ["max_turns=4"],
        "ceiling",
    )
    assert (args.test_cases, args.natural_cases, args.grpo_steps) == (500, 500, 16)
    assert v2.chain_stages("v2") == v2.V2_STAGES and set(v2.actions(args)) == set(v2.V2_STAGES)
    v2.main(["--chain", "v2", "--only", "refs", "--only", "collect", "--only", "zeroshot"])
    assert [e[0] for e in v2.evaluated] == [*v2.V2_REFS, "zeroshot"]
    assert v2.evaluated[-1][1].startswith("hf:smollm2,temperature=0,max_new_tokens=192")
    assert "autocast=bfloat16" in v2.evaluated[-1][1]
    (collect,) = v2.ran
    assert collect[1:5] == ["collect", "Catalog-v2", "--policy", "ceiling"]
    assert collect[collect.index("--episodes") + 1] == "280"
    assert collect[collect.index("--out") + 1] == str(v2.RUN_DIR / "data-ceiling")


def test_a_later_call_with_other_sizes_is_refused_and_changes_nothing(v2: Any) -> None:
    v2.main(["--chain", "v2", "--only", "refs", "--test-cases", "300", "--threads", "1"])
    recorded = (v2.RUN_DIR / "sizes.json").read_text()
    assert json.loads(recorded)["test_cases"] == 300
    scored = len(v2.evaluated)
    with pytest.raises(SystemExit, match=r"--test-cases 500 \(ran with 300\)"):
        v2.main(["--chain", "v2", "--only", "refs"])  # the size forgotten
    assert (v2.RUN_DIR / "sizes.json").read_text() == recorded and len(v2.evaluated) == scored
    v2.main(["--chain", "v2", "--only", "refs", "--test-cases", "300", "--threads", "2"])
    assert json.loads((v2.RUN_DIR / "sizes.json").read_text())["threads"] == 2


def test_v2_grpo_runs_share_the_sft_start_and_differ_by_seed_or_placebo(v2: Any) -> None:
    args = v2.parse_args(["--chain", "v2", "--grpo-steps", "4"])
    v2.actions(args)["sft"]()
    _save(v2.RUN_DIR / "sft", 120, {"total_steps": 120})  # what that command would leave
    for stage in ("grpo", "placebo", "grpo_s1", "placebo_s1"):
        v2.actions(args)[stage]()
    sft, *grpo = v2.ran
    assert sft[1:3] == ["sft", "data/recipes/catalog-v2-smollm2-sft-cpu.yaml"]
    assert "twin.config.max_turns=4" in sft
    for cmd, name, extra in zip(
        grpo,
        ("grpo", "placebo", "grpo-s1", "placebo-s1"),
        ((), ("algorithm.placebo=true",), ("seed=1",), ("algorithm.placebo=true", "seed=1")),
        strict=True,
    ):
        assert cmd[1:3] == ["train", "data/recipes/catalog-v2-smollm2-grpo-cpu.yaml"]
        assert f"train.output_dir={v2.RUN_DIR / name}" in cmd
        assert f"model.init_from={v2.model_dir('sft')}" in cmd and "train.steps=4" in cmd
        assert [s for s in ("algorithm.placebo=true", "seed=1") if s in cmd] == list(extra)
    assert v2.kept_info("sft")["step"] == 120  # kept before the first run started from it


def test_v2_a_fresh_checkout_continues_from_the_kept_models(
    v2: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished run is copied to kept/<run> (tracked in git); a checkout without the run
    folders skips the finished runs and loads their models and metrics from the kept copies."""
    import shutil

    from trainer.checkpoint import resolve_checkpoint

    args = v2.parse_args(["--chain", "v2", "--grpo-steps", "4"])
    for name, step, total in (("sft", 9, 9), ("grpo", 4, None)):
        _save(v2.RUN_DIR / name, step, {"total_steps": total} if total else {})
        (v2.RUN_DIR / name / "metrics.jsonl").write_text(f'{{"step": {step}, "losses/loss": 1}}\n')
    _save(v2.RUN_DIR / "placebo", 2, {})  # stopped part-way: not kept
    acts = v2.actions(args)
    acts["sft"]()
    acts["grpo"]()
    acts["placebo"]()
    assert len(v2.ran) == 1 and "--resume" in v2.ran[0]  # only placebo trains on
    assert v2.kept_info("placebo") is None
    kept = v2.kept_info("grpo")
    assert kept["step"] == 4 and kept["checkpoint"].endswith("grpo/checkpoints/step-000004")
    assert resolve_checkpoint(v2.kept_dir("grpo")) == v2.kept_dir("grpo")
    for name in ("sft", "grpo", "placebo"):  # what a fresh checkout lacks
        shutil.rmtree(v2.RUN_DIR / name)
    v2.ran.clear()
    acts["sft"]()
    acts["grpo"]()
    acts["grpo_eval"]()
    assert v2.ran == [] and v2.sft_finished(v2.RUN_DIR / "sft")
    ((name, policy, _),) = v2.evaluated
    assert name == "grpo" and policy.startswith(f"hf:{v2.model_dir('grpo')},temperature=0")
    assert [r["step"] for r in v2.read_metrics("grpo")] == [4]
    acts["placebo"]()  # starts again, from the kept SFT model
    (cmd,) = v2.ran
    assert "--resume" not in cmd and f"model.init_from={v2.model_dir('sft')}" in cmd


def test_v2_stopped_runs_resume_and_only_finished_models_are_scored(v2: Any) -> None:
    args = v2.parse_args(
        ["--chain", "v2", "--grpo-steps", "4", "--natural-cases", "300", "--natural-models"]
    )
    _save(v2.RUN_DIR / "sft", 9, {"total_steps": 9})
    _save(v2.RUN_DIR / "grpo", 4, {})
    _save(v2.RUN_DIR / "placebo", 2, {})
    acts = v2.actions(args)
    acts["grpo"]()
    acts["placebo"]()
    (cmd,) = v2.ran  # grpo reached its length: skipped; placebo continues from step 2
    assert "--resume" in cmd and f"train.output_dir={v2.RUN_DIR / 'placebo'}" in cmd
    for stage in ("grpo_eval", "placebo_eval", "grpo_s1_eval", "natural"):
        acts[stage]()
    names = [e[0] for e in v2.evaluated]
    assert names == ["grpo", *(f"nat-{r}" for r in v2.V2_REFS), "nat-grpo"]
    assert all(e[2] == ("mix=natural",) for e in v2.evaluated[1:])


def test_v2_flag_figures_count_misses_and_false_alarms_per_1000(chain: Any) -> None:
    rows = [
        {"verdict": "ok", "true_verdict": "counterfeit"},  # a miss: cost 6
        {"verdict": "none", "true_verdict": "escalate", "true_request": "invoice"},  # a miss: 5.5
        {"verdict": "counterfeit", "true_verdict": "ok"},  # a false alarm: 2
        {"verdict": "escalate", "true_verdict": "escalate", "true_request": "invoice",
         "request": "invoice"},  # right: 1.5
    ]  # fmt: skip
    f = chain.flag_figures(rows)
    assert (f["misses_per_1000"], f["false_alarms_per_1000"]) == (500, 250)
    assert f["cost_per_1000"] == pytest.approx(1000 * (6 + 5.5 + 2 + 1.5) / 4)
    assert (f["precision"], f["recall"]) == (0.5, pytest.approx(1 / 3))


def test_v2_natural_figures_reweight_the_kinds_of_the_evaluation_mix(chain: Any) -> None:
    def row(kind: str, verdict: str, truth: str, reward: float) -> dict[str, Any]:
        return {"kind": kind, "verdict": verdict, "true_verdict": truth, "reward": reward,
                "submitted": True}  # fmt: skip

    rows = [
        row("clean", "ok", "ok", 1.0),  # natural share 0.30
        row("clean", "counterfeit", "ok", -0.5),  # a false alarm
        *[row("counterfeit_discount", "ok", "counterfeit", -1.0)] * 3,  # 0.006: misses
        row("not_a_natural_kind", "ok", "ok", 1.0),  # no natural share: left out
    ]
    f = chain.reweighted_figures(rows)
    w_clean, w_fake = 0.30 / 0.306, 0.006 / 0.306
    assert f["coverage"] == pytest.approx(0.306)
    assert f["reward_mean"] == pytest.approx(w_clean * 0.25 - w_fake)
    assert f["misses_per_1000"] == pytest.approx(1000 * w_fake)
    assert f["false_alarms_per_1000"] == pytest.approx(1000 * w_clean / 2)
    assert f["verdict_accuracy"] == pytest.approx(w_clean / 2)
    assert (f["precision"], f["recall"]) == (0.0, 0.0)
    lo, hi = f["reward_ci95"]
    assert lo < f["reward_mean"] < hi  # the clean kind's two rewards differ


def test_v2_episode_rows_read_the_decision_and_the_document(chain: Any) -> None:
    from twin.trajectory import Trajectory

    t = Trajectory(twin="Catalog", case_id="Catalog/test/3", split="test", index=3)
    t.submission = {"decision": " Escalate", "request": "invoice", "verdict": "ok"}
    truth = {"verdict": "escalate", "decision": "escalate", "request": "safety_certificate"}
    row = chain.episode_row(t, truth)
    assert (row["verdict"], row["true_verdict"]) == ("escalate", "escalate")
    assert (row["request"], row["true_request"]) == ("invoice", "safety_certificate")
    v1 = chain.episode_row(t, {"verdict": "ok"})
    assert (v1["verdict"], v1["true_verdict"]) == ("ok", "ok") and "request" not in v1


def test_a_run_another_process_trains_is_left_to_it(v2: Any) -> None:
    import fcntl

    args = v2.parse_args(["--chain", "v2", "--grpo-steps", "4"])
    acts = v2.actions(args)
    acts["grpo_s1"]()
    assert v2.ran == []  # SFT has not finished: nothing starts from it
    _save(v2.RUN_DIR / "sft", 9, {"total_steps": 9})
    out = v2.RUN_DIR / "grpo-s1"
    out.mkdir()
    with open(out / ".twin-train.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert v2.trained_elsewhere(out)
        acts["grpo_s1"]()
        assert v2.ran == []
    assert not v2.trained_elsewhere(out)
    acts["grpo_s1"]()
    assert len(v2.ran) == 1 and f"train.output_dir={out}" in v2.ran[0]


def test_v2_acceptance_reads_the_paired_intervals(chain: Any) -> None:
    def d(lo: float, hi: float) -> dict[str, Any]:
        return {"ci95": [lo, hi]}

    diffs = {
        "grpo - always_escalate": d(0.01, 0.2),
        "grpo-s1 - always_escalate": d(-0.01, 0.2),
        "grpo - sft": d(0.05, 0.3),
        "placebo - sft": d(-0.1, 0.02),
        "placebo-s1 - sft": d(0.01, 0.1),
        "grpo - placebo": d(0.02, 0.2),
        "grpo-s1 - placebo-s1": d(-0.02, 0.2),
    }
    got = chain.acceptance(diffs, "always_escalate")
    assert got["grpo_beats_best_cheap"] == {
        "best_cheap": "always_escalate",
        "seed 0": True,
        "seed 1": False,
    }
    assert got["grpo_minus_sft_above_zero"] == {"seed 0": True, "seed 1": None}
    assert got["placebo_minus_sft_around_zero"] == {"seed 0": True, "seed 1": False}
    assert got["grpo_minus_placebo_above_zero"] == {"seed 0": True, "seed 1": False}
    none = chain.acceptance({}, None)
    assert none["placebo_minus_sft_around_zero"] == {"seed 0": None, "seed 1": None}
    # fewer cases than planned: not judged yet
    short = {"grpo - placebo": {"ci95": [0.1, 0.2], "cases": 300}}
    assert chain.acceptance(short, None, planned=500)["grpo_minus_placebo_above_zero"] == {
        "seed 0": None,
        "seed 1": None,
    }


def _fake_chunk_play(chain: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``twin eval`` and the episode export replaced: a chunk starting at case K gets run id K
    and one episode of case K (reward 0.5); each command is kept in ``chain.ran``."""

    def fake_run(cmd: list[str], stdout_path: Path | None = None) -> None:
        chain.ran.append(cmd)
        start = int(cmd[cmd.index("--start") + 1])
        stdout_path.write_text(json.dumps({"run_id": start}))

    def fake_export(run_id: int, out: Path, store: Path, sets: tuple[str, ...] = ()) -> None:
        out.write_text(f'{{"case": {run_id}, "index": {run_id}, "reward": 0.5}}\n')

    monkeypatch.setattr(chain, "run", fake_run)
    monkeypatch.setattr(chain, "export_episodes", fake_export)


def test_a_v2_evaluation_runs_in_chunks_and_continues_from_the_first_missing_one(
    chain: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import json

    monkeypatch.setitem(chain.CHAINS["v2"], "run_dir", tmp_path)
    args = chain.parse_args(["--chain", "v2", "--test-cases", "250"])
    assert args.eval_chunk == 100

    _fake_chunk_play(chain, monkeypatch)
    (tmp_path / "eval-sft.0100.json").write_text(json.dumps({"run_id": 100}))  # done before a stop
    (tmp_path / "episodes-sft.0100.jsonl").write_text('{"case": 100, "index": 100, "reward": 1}\n')
    chain.evaluate("sft", "hf:x", args)
    spans = [(c[c.index("--start") + 1], c[c.index("--episodes") + 1]) for c in chain.ran]
    assert spans == [("0", "100"), ("200", "50")]
    assert chain.ran[-1][chain.ran[-1].index("-c") + 1] == "16"
    lines = (tmp_path / "episodes-sft.jsonl").read_text().splitlines()
    assert [json.loads(x)["case"] for x in lines] == [0, 100, 200]
    assert len(json.loads((tmp_path / "eval-sft.json").read_text())["chunks"]) == 3
    chain.evaluate("sft", "hf:x", args)  # finished: skipped
    assert len(chain.ran) == 2


def test_a_chunk_another_process_plays_is_left_to_it_and_the_last_one_to_finish_joins(
    chain: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two processes of one evaluation split its chunks: each takes the next free one, and the
    process that finds every chunk finished joins them (once)."""
    import os

    monkeypatch.setitem(chain.CHAINS["v2"], "run_dir", tmp_path)
    args = chain.parse_args(["--chain", "v2", "--test-cases", "250"])

    _fake_chunk_play(chain, monkeypatch)
    other = tmp_path / "eval-sft.0100.lock"
    other.write_text(str(os.getpid()))  # a live process plays cases 100..199
    chain.evaluate("sft", "hf:x", args)
    starts = [c[c.index("--start") + 1] for c in chain.ran]
    assert starts == ["0", "200"]
    assert not (tmp_path / "eval-sft.json").exists()  # not joined while a chunk is being played
    assert (tmp_path / "episodes-sft.0000.jsonl").exists()

    # the other process finishes its chunk, frees it, and finds every chunk finished
    (tmp_path / "eval-sft.0100.json").write_text(json.dumps({"run_id": 100}))
    (tmp_path / "episodes-sft.0100.jsonl").write_text('{"case": 100, "index": 100, "reward": 1}\n')
    other.unlink()
    chain.evaluate("sft", "hf:x", args)
    assert len(chain.ran) == 2  # nothing played twice
    lines = (tmp_path / "episodes-sft.jsonl").read_text().splitlines()
    assert [json.loads(x)["case"] for x in lines] == [0, 100, 200]
    chunks = json.loads((tmp_path / "eval-sft.json").read_text())["chunks"]
    assert [c["run_id"] for c in chunks] == [0, 100, 200]
    assert not list(tmp_path.glob("eval-sft.0*")) and not list(tmp_path.glob("*.lock"))


def test_the_worked_chain_is_the_v2_chain_taught_by_the_worked_ceiling(
    chain: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--chain v2-worked: v2's stages and recipes, ``ceiling_worked`` demonstrations in its own run
    folder, and a rerun command that names it."""
    chain.use_chain("v2-worked")
    assert chain.TEACHER["policy"] == "ceiling_worked" and chain.TWIN == "Catalog-v2"
    assert chain.chain_stages("v2-worked") == chain.chain_stages("v2") == chain.V2_STAGES
    assert chain.RUN_DIR.name == "learning-smollm2-v2-worked"
    assert chain.SFT_RECIPE == chain.CHAINS["v2"]["sft_recipe"]
    assert chain.DOCS_DIR != chain.CHAINS["v2"]["docs_dir"]  # docs/learning stays the v2 report
    cmd = chain.rerun_command({"test_cases": 500}, "v2-worked")
    assert "--chain v2-worked --test-cases 500 " in cmd
    assert "> runs/learning-smollm2-v2-worked/log.txt" in cmd
    monkeypatch.setattr(chain, "RUN_DIR", tmp_path)  # a fresh run folder: nothing collected
    chain.collect(SimpleNamespace(collect_episodes=280, store=Path("store.db")))
    (cmd,) = chain.ran
    assert cmd[cmd.index("--policy") + 1] == "ceiling_worked"
    assert cmd[cmd.index("--out") + 1] == str(tmp_path / "data-ceiling_worked")


def test_the_recovering_chain_is_the_1k_chain_taught_by_the_recovering_ceiling(
    chain: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--chain v2-1k-recover: the v2-1k sizes and recipes, ``ceiling_recovering`` demonstrations
    (a slipped episode scores 0.99, which ``min_reward`` keeps) in its own folder, compared with
    v2-1k."""
    chain.use_chain("v2-1k-recover")
    assert chain.TEACHER["policy"] == "ceiling_recovering"
    assert chain.RUN_DIR.name == "learning-smollm2-v2-1k-recover"
    assert chain.SFT_RECIPE == chain.CHAINS["v2-1k"]["sft_recipe"]
    assert chain.compared_dir("v2-1k-recover") == chain.CHAINS["v2-1k"]["run_dir"]
    monkeypatch.setattr(chain, "RUN_DIR", tmp_path)
    chain.collect(SimpleNamespace(collect_episodes=1040, store=Path("store.db")))
    (cmd,) = chain.ran
    assert cmd[cmd.index("--policy") + 1] == "ceiling_recovering"
    assert float(cmd[cmd.index("--min-reward") + 1]) <= 0.99


def test_the_worked_chain_reports_its_models_against_the_plain_chains(
    chain: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sft - sft of v2``: paired over the case ids both chains evaluated."""
    plain = tmp_path / "plain"
    plain.mkdir()
    rows = [{"case_id": f"c{i}", "reward": r} for i, r in enumerate([0.0, 0.5, -1.0])]
    (plain / "episodes-sft.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setitem(chain.CHAINS["v2"], "run_dir", plain)
    worked = [{"case_id": f"c{i}", "reward": r} for i, r in enumerate([1.0, 0.5, 0.0, 1.0])]
    diffs = chain.chain_differences("v2-worked", {"sft": worked, "grpo": worked})
    assert list(diffs) == ["sft - sft of v2"]  # the plain chain has no GRPO episodes here
    assert diffs["sft - sft of v2"]["cases"] == 3
    assert diffs["sft - sft of v2"]["mean_diff"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)
    assert chain.chain_differences("v2", {"sft": worked}) == {}


def test_a_models_working_is_compared_with_its_teachers_line_by_line(chain: Any) -> None:
    """The first line that differs names where the model went wrong: the seller's figures, a
    point item, the total or the decision; a working cut short departs at the first line only
    the teacher has."""
    teacher = {
        0: "policy ok\nbrand A registered\nseller 10 days, 5 sales, rating 4.2, 0 counterfeit "
        "takedowns\naccount 10 days +1\n5 sales +1\npoints 2\n-> ok",
        1: "policy prohibited\n-> prohibited",
    }
    lines = teacher[0].splitlines()
    rows = [
        {"index": 0, "working": teacher[0]},
        {"index": 0, "working": "\n".join([*lines[:2], "seller 10 days, 50 sales", *lines[3:]])},
        {"index": 0, "working": "\n".join([*lines[:4], "points 1", "-> ok"])},
        {"index": 0, "working": "\n".join([*lines[:6], "-> escalate (invoice)"])},
        {"index": 0, "working": "\n".join(lines[:2])},
        {"index": 1, "working": "policy ok\n-> ok"},
        {"index": 1},
    ]
    got = chain.working_departures(rows, teacher)
    assert {k: v for k, v in got.items() if v} == {
        "same as the teacher": 1,
        "seller's figures": 2,  # one changed, one cut short before it
        "point item": 1,
        "decision": 1,
        "category policy": 1,
        "no working": 1,
    }
    assert list(got) == list(chain.WORKING_ORDER)


def test_the_teachers_working_is_read_back_from_its_episodes(chain: Any) -> None:
    """teacher_workings plays ``ceiling_worked`` on the chain's twin: its last line is the
    decision it submitted."""
    chain.use_chain("v2-worked")
    got = chain.teacher_workings([0, 2])
    assert sorted(got) == [0, 2]
    assert got[2].splitlines() == ["policy prohibited", "-> prohibited"]
    assert got[0].splitlines()[-1].startswith("-> ")


def test_failed_episodes_are_played_again_in_place_and_the_rest_are_left_alone(
    chain: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An episode whose policy raised (reward null) is not the model's score: a finished
    evaluation plays those cases again, in runs of consecutive cases, and keeps the others."""
    monkeypatch.setitem(chain.CHAINS["v2"], "run_dir", tmp_path)
    args = chain.parse_args(["--chain", "v2", "--test-cases", "250"])

    def row(i: int, reward: float | None) -> str:
        return json.dumps({"case_id": f"c{i}", "index": i, "reward": reward}) + "\n"

    played: list[tuple[int, int]] = []

    def fake_run(cmd: list[str], stdout_path: Path | None = None) -> None:
        start, n = int(cmd[cmd.index("--start") + 1]), int(cmd[cmd.index("--episodes") + 1])
        played.append((start, n))
        stdout_path.write_text(json.dumps({"run_id": start * 1000 + n, "by_kind": {}}))

    def fake_export(run_id: int, out: Path, store: Path, sets: tuple[str, ...] = ()) -> None:
        start, n = divmod(run_id, 1000)
        out.write_text("".join(row(i, 0.5) for i in range(start, start + n)))

    monkeypatch.setattr(chain, "run", fake_run)
    monkeypatch.setattr(chain, "export_episodes", fake_export)
    rewards = [1.0, None, None, -1.0, None, 0.25]
    (tmp_path / "episodes-grpo.jsonl").write_text("".join(row(i, r) for i, r in enumerate(rewards)))
    (tmp_path / "eval-grpo.json").write_text(json.dumps({"chunks": [{"errors": 3}]}))
    chain.evaluate("grpo", "hf:x", args)
    assert played == [(1, 2), (4, 1)]
    lines = (tmp_path / "episodes-grpo.jsonl").read_text().splitlines()
    assert [json.loads(x)["reward"] for x in lines] == [1.0, 0.5, 0.5, -1.0, 0.5, 0.25]
    summary = json.loads((tmp_path / "eval-grpo.json").read_text())
    assert [r["run_id"] for r in summary["rerun"]] == [1002, 4001]
    assert {r["precision"] for r in summary["rerun"]} == {chain.PRECISION["run"]}
    assert sorted(p.name for p in tmp_path.iterdir() if "rerun" in p.name) == []
    chain.evaluate("grpo", "hf:x", args)  # nothing failed now: skipped
    assert len(played) == 2
    # one still failing is reported as such, not silently as a score of 0
    failed = [{"reward": None, "turns": 1, "parsed_turns": 0, "submitted": False,
               "verdict": "none", "true_verdict": "ok", "kind": "clean"}]  # fmt: skip
    assert chain.summarize(failed, chain.V2_DECISIONS)["failed"] == 1


def test_a_partial_evaluation_is_reported_on_its_finished_chunks_and_judged_on_none(
    chain: Any, tmp_path: Path
) -> None:
    """While an evaluation runs (or after a stop) the report reads the chunks it has finished,
    in case order, and the acceptance claims wait for the full test size."""
    for start, rewards in ((100, [0.5, 1.0]), (0, [1.0, -1.0])):
        rows = [{"case_id": f"c{start + i}", "reward": r} for i, r in enumerate(rewards)]
        text = "\n".join(json.dumps(r) for r in rows) + "\n"
        (tmp_path / f"episodes-grpo.{start:04d}.jsonl").write_text(text)
    (tmp_path / "episodes-grpo-s1.0000.jsonl").write_text('{"case_id": "x", "reward": 0}\n')
    got = chain.read_episodes("grpo")
    assert [r["case_id"] for r in got] == ["c0", "c1", "c100", "c101"]
    assert chain.read_episodes("placebo") is None
    (tmp_path / "episodes-grpo.jsonl").write_text('{"case_id": "all", "reward": 1}\n')
    assert [r["case_id"] for r in chain.read_episodes("grpo")] == ["all"]  # the joined file wins

    diffs = {"grpo - sft": {"ci95": [0.01, 0.2], "cases": 200}}
    assert chain.acceptance(diffs, None, 500)["grpo_minus_sft_above_zero"]["seed 0"] is None
    assert chain.acceptance(diffs, None, 200)["grpo_minus_sft_above_zero"]["seed 0"] is True


def test_the_t07_chain_runs_only_grpo_at_0_7_from_the_v2_chains_sft(
    v2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--chain v2-t07: the three GRPO runs and their evaluations in its own folder, each sampled at
    temperature 0.7 and started from the v2 chain's kept SFT model; the references and the SFT
    evaluation are read from the v2 chain's folder, its own GRPO evaluations from its own."""
    v2.parse_args(["--chain", "v2"])
    _save(tmp_path / "sft", 9, {"total_steps": 9})
    v2.keep_run("sft")  # what the v2 chain left: its kept SFT model
    own = tmp_path / "t07"
    monkeypatch.setitem(v2.CHAINS["v2-t07"], "run_dir", own)
    args = v2.parse_args(["--chain", "v2-t07", "--grpo-steps", "4"])
    assert v2.chain_stages("v2-t07") == (
        "probe", "grpo", "grpo_eval", "placebo", "placebo_eval", "grpo_s1", "grpo_s1_eval",
        "placebo_s1", "placebo_s1_eval", "report", "carry",
    )  # fmt: skip
    assert v2.RUN_DIR == own and v2.BASE_DIR == tmp_path
    own.mkdir()
    acts = v2.actions(args)
    for stage in ("grpo", "placebo", "grpo_s1"):
        acts[stage]()
    assert len(v2.ran) == 3 and not (own / "sft").exists()
    for cmd, name in zip(v2.ran, ("grpo", "placebo", "grpo-s1"), strict=True):
        assert f"train.output_dir={own / name}" in cmd and "sampler.temperature=0.7" in cmd
        assert f"model.init_from={v2.model_dir('sft')}" in cmd
    assert Path(v2.ROOT, v2.model_dir("sft")).resolve() == (tmp_path / "kept" / "sft").resolve()

    def write(folder: Path, name: str, rewards: list[float]) -> None:
        rows = [{"case_id": f"c{i}", "reward": r} for i, r in enumerate(rewards)]
        (folder / f"episodes-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write(tmp_path, "sft", [0.0, 0.0])
    write(tmp_path, "grpo", [1.0, 1.0])  # the v2 chain's GRPO, sampled at 1.0
    write(tmp_path, "nat-ceiling", [1.0])
    write(own, "grpo", [0.5, 0.5])
    assert [r["reward"] for r in v2.read_episodes("sft")] == [0.0, 0.0]
    assert [r["reward"] for r in v2.read_episodes("grpo")] == [0.5, 0.5]
    assert v2.read_episodes("nat-ceiling") is not None and v2.read_episodes("placebo") is None
    episodes = {n: v2.read_episodes(n) for n in ("sft", "grpo")}
    diffs = v2.chain_differences("v2-t07", episodes)
    assert list(diffs) == ["grpo - grpo of v2"]  # SFT is the same episodes in both
    assert diffs["grpo - grpo of v2"]["mean_diff"] == pytest.approx(-0.5)
    assert v2.v2_differences(episodes, None)["grpo - sft"]["mean_diff"] == pytest.approx(0.5)


def test_the_t07_report_draws_only_its_grpo_curve_and_labels_its_temperature(
    v2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SFT curve is the base chain's (drawn in its report), and the GRPO curve's axis names
    the temperature the chain samples at, 0.7 here and the recipe's 1.0 in the v2 chain."""
    v2.parse_args(["--chain", "v2"])
    assert v2.grpo_temperature() == 1.0
    for run in ("sft", "grpo"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "metrics.jsonl").write_text(
            '{"step": 1, "losses/loss": 1.0, "rewards/total": -0.5}\n'
        )
    monkeypatch.setitem(v2.CHAINS["v2-t07"], "run_dir", tmp_path)
    monkeypatch.setitem(v2.CHAINS["v2-t07"], "docs_dir", tmp_path / "report")
    v2.parse_args(["--chain", "v2-t07"])
    (tmp_path / "report").mkdir()
    labels: list[str] = []
    monkeypatch.setattr("matplotlib.axes.Axes.set_ylabel", lambda ax, label: labels.append(label))
    assert v2.grpo_temperature() == 0.7
    assert v2.plot_v2_curves() == ["v2-grpo-curve.png"]
    assert labels == ["mean sampled reward (T=0.7)"]
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["v2-grpo-curve.png"]


def _stage_state(out: Path) -> tuple[int, str]:
    """A run folder's newest checkpoint step and its metrics file's text."""
    from trainer.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(out)
    step = int(ckpt.name.removeprefix("step-")) if ckpt else 0
    return step, (out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""


def test_an_unfinished_run_is_carried_to_a_fresh_checkout_and_resumed_there(v2: Any) -> None:
    """The carry stage copies an unfinished run's newest checkpoint (optimizer and RNG included)
    and metrics into carry/<run>/; a checkout without the run folder gets them back before
    --resume; a run that finishes is kept and its carried copy deleted."""
    import shutil

    import torch

    args = v2.parse_args(["--chain", "v2", "--grpo-steps", "4"])
    out = v2.RUN_DIR / "sft"
    _save(out, 3, {"total_steps": 9})
    _save(out, 4, {"total_steps": 9})
    (out / "metrics.jsonl").write_text('{"step": 3}\n{"step": 4}\n')
    acts = v2.actions(args)
    acts["carry"]()
    assert v2.carried_step("sft") == 4 and v2.carried_step("grpo") == 0
    carried = v2.carry_dir("sft") / "checkpoints" / "step-000004"
    assert sorted(p.name for p in carried.iterdir()) == [
        "adapter",
        "recipe.yaml",
        "trainer_state.pt",
    ]
    state = torch.load(carried / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4 and "rng" in state and state["total_steps"] == 9
    before = _stage_state(out)
    shutil.rmtree(out)  # a fresh checkout has only what git tracks
    acts["sft"]()
    (cmd,) = v2.ran
    assert "--resume" in cmd and _stage_state(out) == before
    assert not list((out / "checkpoints").glob(".*"))  # no half copy left behind
    v2.ran.clear()
    acts["sft"]()  # the run folder has the carried step already: nothing copied over it
    assert "--resume" in v2.ran[-1] and _stage_state(out) == before
    _save(out, 9, {"total_steps": 9})  # the run finishes: kept, the carried copy deleted
    v2.keep_sft()
    assert v2.kept_info("sft")["step"] == 9 and not v2.carry_dir("sft").exists()
    assert v2.carry_run("sft") == 0  # a kept run is not carried


def test_a_carried_checkpoint_never_replaces_a_newer_one(v2: Any) -> None:
    v2.parse_args(["--chain", "v2", "--grpo-steps", "4"])
    out = v2.RUN_DIR / "placebo"
    _save(out, 2, {})
    assert v2.carry_run("placebo") == 2 and v2.restore_carried("placebo") == 0
    _save(out, 3, {})
    assert v2.restore_carried("placebo") == 0 and _stage_state(out)[0] == 3
    assert v2.carry_run("placebo") == 3 and v2.carried_step("placebo") == 3
    carried = sorted(p.name for p in (v2.carry_dir("placebo") / "checkpoints").iterdir())
    assert carried == ["latest", "step-000003"]  # the older carried step replaced


def test_the_1k_chain_trains_its_own_sft_on_its_demonstrations_over_their_length(
    v2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--chain v2-1k collects 1,040 demonstrations and fits the learning-rate decay and the
    held-out scoring to the steps they make; the references and zero-shot are the v2 chain's."""
    own = tmp_path / "1k"
    monkeypatch.setitem(v2.CHAINS["v2-1k"], "run_dir", own)
    args = v2.parse_args(["--chain", "v2-1k"])
    assert args.collect_episodes == 1040 and v2.BASE_DIR == tmp_path
    stages = v2.chain_stages("v2-1k")
    assert {"collect", "sft", "probe", "sft_eval", "grpo"} <= set(stages)
    assert not {"refs", "zeroshot", "natural"} & set(stages)
    assert v2.from_base("always_escalate") and v2.from_base("zeroshot")
    assert not v2.from_base("sft") and v2.kept_dir("sft") == own / "kept" / "sft"
    (v2.data_dir()).mkdir(parents=True)
    (v2.data_dir() / "dataset.json").write_text('{"rows": 1038}')
    v2.train("sft", args)
    (cmd,) = v2.ran
    # (1038 - 16 held out) / 4 a step = 256 steps; the held-out loss after each third
    assert "optim.lr_decay_steps=256" in cmd and "data.holdout_every=86" in cmd
    v2.parse_args(["--chain", "v2"])
    assert v2.sft_length_sets(args) == []  # the v2 chain's recipe is sized for its 280


def test_the_probe_stage_probes_each_kept_model_once(v2: Any) -> None:
    args = v2.parse_args(["--chain", "v2", "--grpo-steps", "4"])
    acts = v2.actions(args)
    acts["probe"]()
    assert v2.ran == []  # nothing kept yet
    _save(v2.RUN_DIR / "sft", 9, {"total_steps": 9})
    v2.keep_sft()
    acts["probe"]()
    collect, probe = v2.ran
    assert collect[1:9] == [
        "collect",
        "Catalog-v2",
        "--policy",
        "ceiling",
        "--split",
        "test",
        "--episodes",
        "100",
    ]
    assert probe[1].endswith("choice_probe.py")
    assert probe[probe.index("--policy") + 1] == f"hf:{v2.model_dir('sft')}"
    assert probe[probe.index("--out") + 1] == str(v2.probe_path("sft"))
    v2.probe_path("sft").write_text("{}")
    (v2.probe_data()).mkdir()
    (v2.probe_data() / "dataset.json").write_text("{}")
    v2.ran.clear()
    acts["probe"]()
    assert v2.ran == []  # probed already


def test_the_report_pairs_a_probe_with_the_compared_chains_on_the_same_rows(
    v2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """probe_results: each probed model's summary, and its accuracy minus the compare_with
    chain's same model over the rows both probed."""

    def write(run_dir: Path, choices: list[str]) -> None:
        truths = ["ok", "escalate", "counterfeit", "ok"]
        scores = [
            {"index": i, "truth": t, "choice": c, "logprobs": {d: -float(d != c) for d in DECS}}
            for i, (t, c) in enumerate(zip(truths, choices))
        ]
        right = sum(c == t for c, t in zip(choices, truths))
        summary = {"rows": 4, "accuracy": right / 4, "truth_prob": 0.5, "chosen": {"ok": 2}}
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "probe-sft.json").write_text(json.dumps({**summary, "scores": scores}))

    own = tmp_path / "1k"
    monkeypatch.setitem(v2.CHAINS["v2-1k"], "run_dir", own)
    write(tmp_path, ["escalate", "escalate", "escalate", "escalate"])  # the v2 chain's: 1 of 4
    write(own, ["ok", "escalate", "counterfeit", "escalate"])  # 3 of 4
    v2.parse_args(["--chain", "v2-1k"])
    probes = v2.probe_results("v2-1k")
    assert list(probes) == ["sft"] and probes["sft"]["summary"]["accuracy"] == 0.75
    diff = probes["sft"]["minus_v2"]
    assert diff["rows"] == 4 and diff["mean_diff"] == pytest.approx(0.5)
    assert diff["ci95"][0] <= 0.5 <= diff["ci95"][1]
    (row,) = [line for line in v2.probe_lines(probes) if line.startswith("| sft")]
    assert "| 0.75 |" in row and "2 / 0 / 0 / 0" in row and "+0.50 [" in row
    assert probes["sft"]["majority_rate"] == 0.5


DECS = ("ok", "counterfeit", "prohibited", "escalate")


def test_fitted_offsets_recover_a_judgement_that_only_leans_and_not_one_that_is_absent(
    chain: Any,
) -> None:
    """offset_cv_accuracy: scores that rank the true decision second-best behind a constant lean
    to escalate are all right once the lean is taken off; scores unrelated to the case stay near
    the majority rate."""
    rng = __import__("numpy").random.default_rng(1)
    truths = [DECS[i % 4] for i in range(80)]
    leaning = [
        {"truth": t, "logprobs": {d: (-1.0 if d == t else -3.0) + 3.0 * (d == "escalate")
                                  for d in DECS}}
        for t in truths
    ]  # fmt: skip
    assert sum(max(r["logprobs"], key=r["logprobs"].get) == r["truth"] for r in leaning) == 20
    assert chain.offset_cv_accuracy(leaning) == 1.0
    absent = [{"truth": t, "logprobs": {d: float(rng.normal()) for d in DECS}} for t in truths]
    assert chain.offset_cv_accuracy(absent) < 0.45


def test_a_probes_lean_from_sft_is_each_decisions_log_odds_change_over_ok_on_shared_rows(
    v2: Any, tmp_path: Path
) -> None:
    """probe_lean: per decision, the change from SFT of log p(d) - log p(ok) on the rows both
    probed (mean, sd over rows, rows where it rose); probe_results gives it to every model but
    SFT and the report prints it."""
    base = [
        {"index": i, "truth": "ok", "choice": "ok",
         "logprobs": {"ok": -1.0, "counterfeit": -2.0, "prohibited": -3.0, "escalate": -2.0}}
        for i in range(4)
    ]  # fmt: skip
    # escalate gains 1 or 3 over ok, counterfeit loses 1 everywhere, prohibited does not move;
    # row 9 is not in the SFT probe and is left out
    moved = [
        {**r, "logprobs": {**r["logprobs"], "ok": -1.5, "counterfeit": -3.5, "prohibited": -3.5,
                           "escalate": -2.5 + (1.0 if i < 2 else 3.0)}}
        for i, r in enumerate([*base, {**base[0], "index": 9}])
    ]  # fmt: skip
    lean = v2.probe_lean(moved, base)
    assert lean["rows"] == 4
    assert lean["escalate"] == {"mean": 2.0, "sd": 1.0, "rose": 4}
    assert lean["counterfeit"] == {"mean": -1.0, "sd": 0.0, "rose": 0}
    assert lean["prohibited"] == {"mean": 0.0, "sd": 0.0, "rose": 0}
    assert v2.probe_lean(moved, [{**base[0], "index": 7}]) is None

    summary = {"rows": 4, "accuracy": 1.0, "truth_prob": 0.5, "chosen": {"ok": 4}}
    for name, scores in (("sft", base), ("grpo", moved)):
        (tmp_path / f"probe-{name}.json").write_text(json.dumps({**summary, "scores": scores}))
    v2.parse_args(["--chain", "v2"])
    probes = v2.probe_results("v2")
    assert "lean_from_sft" not in probes["sft"] and probes["grpo"]["lean_from_sft"] == lean
    (row,) = [line for line in v2.probe_lines(probes) if "rose on" in line]
    assert row == (
        "| grpo | 4 | -1.00 (0.00), rose on 0 | +0.00 (0.00), rose on 0 | +2.00 (1.00), rose on 4 |"
    )


def test_the_probes_decisions_are_paid_what_each_constant_earned_on_the_same_case(
    v2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """probe_reward: each row's decision earns the reward of the always-<decision> reference on
    that test case; offsets fitted for reward (5-fold) take a lean to a costly decision off,
    and the fitted choices are set against the best constant on the same rows."""
    # the right decision earns 1.0, escalate 0.5 elsewhere, a wrong ok -1.0, any other 0.2
    truths = [DECS[i % 4] for i in range(80)]
    paid = {d: [1.0 if d == t else (0.5 if d == "escalate" else (-1.0 if d == "ok" else 0.2))
                for t in truths] for d in DECS}  # fmt: skip
    for d in DECS:
        rows = [{"index": i, "reward": r} for i, r in enumerate(paid[d])]
        (tmp_path / f"episodes-always_{d}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
    v2.parse_args(["--chain", "v2"])
    # the right decision second-best behind a lean to ok: its own choices pay -1 on 3 in 4 rows
    leaning = [
        {"index": i, "truth": t,
         "logprobs": {d: (-1.0 if d == t else -3.0) + 3.0 * (d == "ok") for d in DECS}}
        for i, t in enumerate(truths)
    ]  # fmt: skip
    r = v2.probe_reward(leaning)
    assert r["choices"] == pytest.approx((20 * 1.0 + 60 * -1.0) / 80)
    assert r["fitted"] == pytest.approx(1.0)  # the lean fitted away: every row right
    # escalate: 1.0 on the escalate rows, 0.5 on the others; counterfeit and prohibited 0.4
    assert r["best_constant"] == "escalate" and r["best_constant_reward"] == pytest.approx(0.625)
    diff = r["fitted_minus_best_constant"]
    lo, hi = diff["ci95"]
    assert diff["mean_diff"] == pytest.approx(0.375) and 0.25 < lo < 0.375 < hi < 0.5
    # scores unrelated to the case: fitting for reward learns to escalate, which is the best
    # constant (fitting for accuracy would not: the four decisions are equally common)
    rng = __import__("numpy").random.default_rng(1)
    absent = [{"index": i, "truth": t, "logprobs": {d: float(rng.normal()) for d in DECS}}
              for i, t in enumerate(truths)]  # fmt: skip
    assert v2.probe_reward(absent)["fitted"] == pytest.approx(0.625, abs=0.02)
    # a row the references did not evaluate: no reward figures rather than a partial one
    assert v2.probe_reward([*leaning, {**leaning[0], "index": 500}]) is None
    lines = v2.probe_reward_lines({"sft": {"reward": r}, "grpo": {"reward": None}})
    (row,) = [line for line in lines if line.startswith("| ")][2:]
    assert row == f"| sft | -0.500 | +1.000 | escalate +0.625 | +0.375 [{lo:+.3f}, {hi:+.3f}] |"


def test_the_reward_gap_to_a_reference_splits_into_parts_that_add_up(v2: Any) -> None:
    """reward_gap: an unsubmitted episode's whole difference is 'no_submit'; a submitted one's
    splits into each term's weight times its component difference, the rest in 'other' (here
    the clip to [-1, 1]); the parts are per-case means and add up to the total."""

    def row(case: int, reward: float, submitted: bool, c: float, a: float, p: float) -> dict:
        comps = {"category": c, "attributes": a, "policy": p, "penalty": 0.0}
        return {"case_id": f"t/{case}", "reward": reward, "submitted": submitted,
                "components": comps}  # fmt: skip

    reference = [row(i, 0.4, True, 1.0, 1.0, -0.5) for i in range(4)]  # escalates everywhere
    model = [
        row(0, -1.0, False, 0.0, 0.0, -6.0),  # never submitted
        row(1, 1.0, True, 1.0, 1.0, 1.0),  # the right decision: +0.6 from the policy term
        row(2, 0.5, True, 0.0, 1.0, 0.5),  # wrong category (-0.3), a better decision (+0.4)
        row(3, -1.0, True, 1.0, 0.5, -6.0),  # wrong attributes and a miss, clipped at -1
        row(9, 1.0, True, 1.0, 1.0, 1.0),  # a case the reference did not play: left out
    ]
    gap = v2.reward_gap(model, reference)
    assert gap["cases"] == 4 and gap["not_submitted"] == 1
    assert gap["no_submit"] == pytest.approx(-1.4 / 4)
    assert gap["category"] == pytest.approx(-0.3 / 4)
    assert gap["attributes"] == pytest.approx(-0.15 / 4)
    assert gap["decision"] == pytest.approx((0.6 + 0.4 - 2.2) / 4)
    # case 3: -1.4 in all, -0.15 attributes and -2.2 decision, so +0.95 of it is the clip
    assert gap["other"] == pytest.approx(0.95 / 4)
    assert gap["total"] == pytest.approx((-1.4 + 0.6 + 0.1 - 1.4) / 4)
    assert sum(gap[k] for k in v2.GAP_PARTS) == pytest.approx(gap["total"])
    (line,) = [x for x in v2.reward_gap_lines({"sft": gap}, "always_escalate") if "| sft" in x]
    assert line == "| sft | -0.525 | -0.350 (1) | -0.075 | -0.037 | -0.300 | +0.237 |"


def test_a_chain_reports_its_bases_wall_clock_for_the_runs_the_base_trained(
    v2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain whose SFT is its base's reports the base's recorded SFT wall-clock, floored by
    the summed step time of the base's kept run, never the smaller of the two."""
    own = tmp_path / "t07"
    own.mkdir()
    monkeypatch.setitem(v2.CHAINS["v2-t07"], "run_dir", own)
    (tmp_path / "timings.json").write_text(json.dumps({"sft": 500.0, "eval-sft": 60.0}))
    (own / "timings.json").write_text(json.dumps({"grpo": 70.0}))
    kept = tmp_path / "kept" / "sft"  # where the base keeps its finished SFT run
    kept.mkdir(parents=True)
    steps = [{"step": s, "perf/step_s": 100.0} for s in range(4)]
    (kept / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    v2.parse_args(["--chain", "v2-t07"])
    assert v2.chain_timings() == {"sft": 500.0, "eval-sft": 60.0, "grpo": 70.0}
    (tmp_path / "timings.json").write_text(json.dumps({"sft": 300.0}))  # stopped sittings
    assert v2.chain_timings()["sft"] == 400.0


def test_auto_precision_is_float32_on_a_cpu_without_bf16_and_the_report_says_from_where(
    v2: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU without bfloat16 instructions --autocast auto trains and scores in float32; a run
    resumed there records the step it changed at, and the report names it."""
    assert v2.resolve_autocast("auto", "v2", None) == "bfloat16"  # flags unknown: the chain's
    assert v2.resolve_autocast("auto", "heuristic", ["amx_bf16"]) == "float32"
    assert v2.resolve_autocast("bfloat16", "heuristic", []) == "bfloat16"  # asked for: given
    out = v2.RUN_DIR / "sft"
    _save(out, 3, {"total_steps": 9})
    args = v2.parse_args(["--chain", "v2"])
    v2.train("sft", args)  # steps 0-2 ran before at the chain's bfloat16
    assert "model.autocast=bfloat16" in v2.ran[-1]
    monkeypatch.setattr("trainer.models.cpu_bf16_flags", lambda cpuinfo=None: [])
    args = v2.parse_args(["--chain", "v2"])
    _save(out, 5, {"total_steps": 9})
    v2.train("sft", args)
    assert "model.autocast=null" in v2.ran[-1] and "--resume" in v2.ran[-1]
    v2.actions(args)["zeroshot"]()
    assert "autocast" not in v2.evaluated[-1][1]
    precision = v2.read_precision()
    assert precision["record"] == {"sft": [["bfloat16", 0], ["float32", 5]]}
    (line,) = [x for x in v2.precision_lines(precision) if x]
    assert line == (
        "Compute precision: bfloat16 autocast over float32 weights, except sft: bfloat16 "
        "autocast over float32 weights from step 0, float32 from step 5."
    )
    args = v2.parse_args(["--chain", "v2", "--autocast", "bfloat16"])  # asked for: given
    v2.actions(args)["zeroshot"]()
    assert "autocast=bfloat16" in v2.evaluated[-1][1]


def _submit(decision: str, reward: float = 1.0) -> dict[str, Any]:
    call = {"function": {"name": "submit", "arguments": json.dumps({"decision": decision})}}
    return {"messages": [{"role": "assistant", "tool_calls": [call]}], "reward": reward}


def test_the_decisions_nll_is_reported_on_first_epoch_steps_against_its_frequencies(
    v2: Any,
) -> None:
    """The report blocks SFT's decision NLL over first-epoch steps (each scored before it is
    trained on), leaves later epochs out, and sets it against the teachers' decision mix."""
    import math
    from collections import Counter

    from twin.evaluation.collect import write_dataset

    v2.parse_args(["--chain", "v2"])
    assert v2.decision_prior_entropy() is None  # no dataset in this checkout
    rows = [_submit("ok")] * 2 + [_submit("escalate"), _submit("counterfeit"), _submit("ok", 0.5)]
    write_dataset(rows, v2.data_dir())
    # the kept rows (reward >= 0.99): ok 2, escalate 1, counterfeit 1
    expected = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert v2.decision_prior_entropy() == pytest.approx(expected)
    metrics = [
        {"step": s, "sft/emphasis_nll": 1.3 - 0.01 * s, "sft/epoch": s / 40} for s in range(45)
    ]
    metrics[39]["sft/holdout_emphasis_nll"] = 0.95
    counts = Counter({"ok": 2, "escalate": 1, "counterfeit": 1})
    summary = v2.decision_nll(metrics, counts)
    first, second = summary["first_epoch_blocks"]
    assert first["steps"] == [0, 31] and second["steps"] == [32, 39]  # steps 40-44: epoch 2
    assert first["mean"] == pytest.approx(1.3 - 0.01 * 15.5)
    assert first["ci95"][0] < first["mean"] < first["ci95"][1]
    assert summary["held_out"] == [(39, 0.95)]
    text = "\n".join(v2.decision_lines(summary))
    assert "| 0-31 | 1.145 [" in text and f"frequencies scores {expected:.3f}" in text
    assert summary["first_epoch_all"]["mean"] == pytest.approx(1.3 - 0.01 * 19.5)
    assert "| all, 0-39 (40 steps) | 1.105 [" in text
    assert "after 40 steps 0.950" in text
    v2.DOCS_DIR.mkdir(parents=True)
    assert v2.plot_decision_curve(summary) == ["v2-decision-curve.png"]
    assert (v2.DOCS_DIR / "v2-decision-curve.png").stat().st_size > 0
    assert v2.decision_lines(v2.decision_nll([], None)) == []
    # paired by step with a compared run scored on the same demonstrations (its steps 0-9 only)
    other = [{**r, "sft/emphasis_nll": r["sft/emphasis_nll"] + 0.1} for r in metrics[:10]]
    first = v2.decision_nll(metrics, counts, other)["first_epoch_blocks"][0]
    assert first["minus_compared"]["mean"] == pytest.approx(-0.1)
    assert first["minus_compared"]["steps"] == 10


def test_the_emphasis_chain_weights_the_decision_on_the_1k_demonstrations(
    v2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(v2.CHAINS["v2-1k-emph"], "run_dir", tmp_path / "emph")
    args = v2.parse_args(["--chain", "v2-1k-emph"])
    assert args.collect_episodes == 1040
    assert v2.compared_dir("v2-1k-emph") == v2.CHAINS["v2-1k"]["run_dir"]
    v2.data_dir().mkdir(parents=True)
    (v2.data_dir() / "dataset.json").write_text('{"rows": 1038}')
    v2.train("sft", args)
    (cmd,) = v2.ran
    assert "data.emphasis.weight=10" in cmd and "optim.lr_decay_steps=256" in cmd


def test_a_run_trained_over_stopped_sittings_reports_its_summed_step_time(v2: Any) -> None:
    """A sitting stopped mid-run records no wall-clock: the report takes the summed time of the
    run's logged steps where that is more than what the sittings that finished recorded."""
    v2.parse_args(["--chain", "v2"])
    (v2.RUN_DIR / "timings.json").write_text(json.dumps({"collect": 20.0, "sft": 50.0}))
    (v2.RUN_DIR / "sft").mkdir()
    steps = [{"step": s, "losses/loss": 0.1, "perf/step_s": 40.0} for s in range(3)]
    (v2.RUN_DIR / "sft" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (v2.RUN_DIR / "grpo").mkdir()
    (v2.RUN_DIR / "grpo" / "metrics.jsonl").write_text(json.dumps({"perf/step_s": 7.5}) + "\n")
    timings = v2.chain_timings()
    assert timings == {"collect": 20.0, "sft": 120.0, "grpo": 7.5}
    (v2.RUN_DIR / "timings.json").write_text(json.dumps({"sft": 500.0}))  # set-up counted too
    assert v2.chain_timings()["sft"] == 500.0


def test_the_decisions_nll_is_pooled_per_true_decision_against_each_ones_frequency(
    v2: Any,
) -> None:
    """Steps that logged the decision NLL per value are pooled per block by demonstrations, and
    each value is set against minus the log of its share of the teacher's decisions."""
    import math
    from collections import Counter

    metrics = []
    for s in range(40):  # every step: one "ok" demonstration at 0.5, three "escalate" at 2.0
        metrics.append({
            "step": s, "sft/epoch": s / 40, "sft/emphasis_nll": (0.5 + 3 * 2.0) / 4,
            "sft/emphasis_nll/ok": 0.5, "sft/emphasis_nll_count/ok": 1.0,
            "sft/emphasis_nll/escalate": 2.0, "sft/emphasis_nll_count/escalate": 3.0,
        })  # fmt: skip
    metrics[5].update({"sft/emphasis_nll/ok": 1.5, "sft/emphasis_nll_count/ok": 3.0})
    counts = Counter({"ok": 3, "escalate": 1})
    summary = v2.decision_nll(metrics, counts)
    first, second = summary["first_epoch_blocks"]
    ok = first["by_decision"]["ok"]
    assert ok["n"] == 34 and ok["nll"] == pytest.approx((31 * 0.5 + 3 * 1.5) / 34)
    assert second["by_decision"]["escalate"] == {"nll": 2.0, "n": 24}
    assert summary["prior_by_decision"] == pytest.approx(
        {"escalate": math.log(4), "ok": -math.log(0.75)}
    )
    lines = v2.decision_lines(summary)
    header = lines.index("| steps | escalate | ok |")
    assert lines[header + 2] == "| frequencies only | 1.386 | 0.288 |"
    assert lines[header + 3] == f"| 0-31 | 2.000 (96) | {ok['nll']:.3f} (34) |"
    plain = v2.decision_nll([{"step": 0, "sft/emphasis_nll": 1.0}], None)  # no per-value keys
    assert "by_decision" not in plain["first_epoch_blocks"][0]
    assert v2.by_decision_lines(plain) == []

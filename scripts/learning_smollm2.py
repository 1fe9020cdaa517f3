"""The SmolLM2 learning proof on the Catalog twin (v1): zero-shot -> SFT -> GRPO, on CPU.

Every stage runs the product's own commands (``twin eval``, ``twin collect``, ``twin sft``,
``twin train``) with the recipes ``data/recipes/catalog-smollm2-sft-cpu.yaml`` and
``data/recipes/catalog-smollm2-grpo-cpu.yaml``, and writes into ``runs/learning-smollm2/``
(gitignored). A stage whose output exists is skipped, so a run that was stopped continues where it
left off. The last step (``report``) reads the per-episode results from the run store
(``twin.store.RunStore``) and writes ``docs/learning/results.json``, ``docs/learning/table.md`` and
the curves ``docs/learning/*.png``, which docs/learning.md shows.

Every policy is scored on the same test cases (``0 .. test_cases - 1``), so stages can be compared
case by case: mean reward with a 95% percentile bootstrap interval (numpy, seed 0, 10,000
resamples) and, for the stage differences, a paired bootstrap over the case ids.

Usage::

    .venv/bin/python scripts/learning_smollm2.py                     # the run of docs/learning.md
    .venv/bin/python scripts/learning_smollm2.py --collect-episodes 160 --sft-epochs 2 \
        --sft-batch-size 8 --grpo-steps 8                            # a longer run (many hours on CPU)
    .venv/bin/python scripts/learning_smollm2.py --only report       # rewrite the report

The defaults are the sizes of the run docs/learning.md reports: 200 test cases per policy, SFT on
the heuristic's good episodes among 16 (one epoch, 2 per step), 2 GRPO steps. Its training stages
ran with one torch thread and its model evaluations with two (``--threads 2``, on an idle machine).

Run it with ``nohup ... > runs/learning-smollm2/log.txt 2>&1 &``; each stage logs its wall-clock.
Stopped (a crash, a reboot, Ctrl-C), it picks up where it stopped when run again with the same
arguments: finished stages are skipped, SFT and GRPO continue from their newest checkpoint
(``--resume``), an evaluation or a collection that did not finish runs again.

``--chain expert`` runs the same stages with the compact expert teacher (``twin collect catalog
--policy compact``: 1.000 on every test case), the recipes ``catalog-smollm2-expert-*-cpu.yaml``
(bf16 autocast, 192-token turns, a held-out SFT loss, groups of 8 with dynamic sampling, RLOO) into
``runs/learning-smollm2-expert/`` (its report too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RUN_DIR = ROOT / "runs" / "learning-smollm2"
DOCS_DIR = ROOT / "docs" / "learning"
SFT_RECIPE = "data/recipes/catalog-smollm2-sft-cpu.yaml"
GRPO_RECIPE = "data/recipes/catalog-smollm2-grpo-cpu.yaml"
#: The twin settings every stage uses (the recipes say the same): the compact prompt, three turns.
TWIN_SETS = ["prompt_style=compact", "max_turns=3"]
#: Per-turn token limit of every model evaluation: the heuristic's longest turn is 109 tokens.
MAX_NEW_TOKENS = 112
#: The SFT teacher (a catalog baseline) and the reward its kept episodes reach.
TEACHER = {"policy": "heuristic", "min_reward": "0.9"}

#: ``--chain``: what differs between the reported heuristic-teacher run and the expert chain.
#: The expert chain's teacher is ``compact`` (careful's decisions in the fewest tokens, 1.000 on
#: every test case); its recipes use bf16 autocast, 192-token turns, groups of 8 with dynamic
#: sampling; its report goes to its run folder, not docs/learning/.
CHAINS: dict[str, dict[str, Any]] = {
    "heuristic": {
        "run_dir": RUN_DIR,
        "docs_dir": DOCS_DIR,
        "sft_recipe": SFT_RECIPE,
        "grpo_recipe": GRPO_RECIPE,
        "max_new_tokens": 112,
        "teacher": "heuristic",
        "min_reward": "0.9",
        "eval_options": "",
        "defaults": {"collect_episodes": 16, "sft_epochs": 1, "sft_batch_size": 2, "grpo_steps": 2},
    },
    "expert": {
        "run_dir": ROOT / "runs" / "learning-smollm2-expert",
        "docs_dir": ROOT / "runs" / "learning-smollm2-expert" / "report",
        "sft_recipe": "data/recipes/catalog-smollm2-expert-sft-cpu.yaml",
        "grpo_recipe": "data/recipes/catalog-smollm2-expert-grpo-cpu.yaml",
        "max_new_tokens": 192,
        "teacher": "compact",
        "min_reward": "0.99",
        "eval_options": ",autocast=bfloat16",
        "defaults": {
            "collect_episodes": 400,
            "sft_epochs": 1,
            "sft_batch_size": 8,
            "grpo_steps": 8,
        },
    },
}


def use_chain(name: str) -> dict[str, Any]:
    """Point the module's settings at chain ``name`` (:data:`CHAINS`); return its defaults."""
    global RUN_DIR, DOCS_DIR, SFT_RECIPE, GRPO_RECIPE, MAX_NEW_TOKENS
    chain = CHAINS[name]
    RUN_DIR, DOCS_DIR = chain["run_dir"], chain["docs_dir"]
    SFT_RECIPE, GRPO_RECIPE = chain["sft_recipe"], chain["grpo_recipe"]
    MAX_NEW_TOKENS = chain["max_new_tokens"]
    TEACHER.update(policy=chain["teacher"], min_reward=chain["min_reward"])
    return dict(chain["defaults"])


STAGES = ("refs", "collect", "zeroshot", "sft", "sft_eval", "grpo", "grpo_eval", "report")
#: The policies of the table before the GRPO rows (see :func:`rows`): (evaluation name, label).
BASE_ROWS = (
    ("heuristic", "heuristic (reference)"),
    ("careful", "careful (reference)"),
    ("zeroshot", "SmolLM2 zero-shot"),
    ("sft", "SmolLM2 after SFT"),
)
VERDICTS = ("ok", "counterfeit", "prohibited")
BOOT_SEED = 0
BOOT_RESAMPLES = 10_000


def log(message: str) -> None:
    """One timestamped line on stdout (the log file of a nohup run)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def twin_cmd(*args: str) -> list[str]:
    return [str(ROOT / ".venv" / "bin" / "twin"), *args]


#: torch threads of every stage (``--threads``): 1 is fastest on a 2-core machine shared with other
#: work, 2 on an idle one.
THREADS = ["1"]


def run(cmd: list[str], stdout_path: Path | None = None) -> None:
    """Run a product command with ``THREADS`` torch threads."""
    n = THREADS[0]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "TOKENIZERS_PARALLELISM": "false",
    }
    log("$ " + " ".join(cmd))
    if stdout_path is None:
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        return
    with open(stdout_path, "w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out)
    # twin eval exits 3 when some episodes failed: they are stored and scored, so keep going.
    if proc.returncode not in (0, 3):
        raise subprocess.CalledProcessError(proc.returncode, cmd)


class Timings:
    """Wall-clock seconds per stage, kept in ``timings.json`` across resumed runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    def record(self, stage: str, seconds: float, *, add: bool = False) -> None:
        """Keep ``seconds`` for ``stage`` (``add``: on top of an earlier, stopped part of it)."""
        # read again first: two stages may run at once in two processes (docs/learning.md)
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.data[stage] = round(seconds + (self.data.get(stage, 0.0) if add else 0.0), 1)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")


def rows(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The table's policies: the references, zero-shot, SFT, then GRPO at each ``--grpo-eval-at``
    step (``grpo-K``) and at its last step (``grpo``)."""
    grpo = [(f"grpo-{k}", f"SmolLM2 after SFT + GRPO ({k} steps)") for k in args.grpo_eval_at]
    return [*BASE_ROWS, *grpo, ("grpo", f"SmolLM2 after SFT + GRPO ({args.grpo_steps} steps)")]


# -- stages ------------------------------------------------------------------------------------
def take_lock(path: Path) -> bool:
    """Create ``path`` holding this process's id; False while a live process holds it (a stage may
    run in two processes at once, e.g. an evaluation beside GRPO). A dead holder's lock is taken."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                os.kill(int(path.read_text().strip() or 0), 0)
                return False
            except (ProcessLookupError, ValueError):
                path.unlink(missing_ok=True)
                continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def evaluate(name: str, policy: str, args: argparse.Namespace) -> None:
    """``twin eval`` of ``policy`` on test cases 0..N-1, then its episodes exported from the store.

    Its wall-clock is kept in ``timings.json`` as ``eval-<name>``.
    """
    summary = RUN_DIR / f"eval-{name}.json"
    if summary.exists():
        log(f"{name}: {summary.name} exists, skipped")
        return
    lock = summary.with_suffix(".lock")
    if not take_lock(lock):
        log(f"{name}: being evaluated by another process ({lock.name}), skipped")
        return
    try:
        _evaluate(name, policy, summary, args)
    finally:
        lock.unlink(missing_ok=True)


def _evaluate(name: str, policy: str, summary: Path, args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    partial = summary.with_suffix(".partial")
    cmd = twin_cmd(
        "eval",
        "catalog",
        "--policy",
        policy,
        "--split",
        "test",
        "--episodes",
        str(args.test_cases),
        "--store",
        str(args.store),
        "--json",
        "--no-progress",
        "-c",
        str(min(args.eval_batch, args.test_cases)),
    )
    for s in TWIN_SETS:
        cmd += ["--set", s]
    run(cmd, partial)
    data = json.loads(partial.read_text())
    export_episodes(data["run_id"], RUN_DIR / f"episodes-{name}.jsonl", args.store)
    partial.rename(summary)
    Timings(RUN_DIR / "timings.json").record(f"eval-{name}", time.monotonic() - t0)


def export_episodes(run_id: int, out: Path, store_path: Path) -> None:
    """One line per episode: case, kind, reward, components, parse rate and verdicts."""
    from twin.registry import make_twin
    from twin.store import RunStore

    twin = make_twin("catalog")
    store = RunStore(str(store_path))
    try:
        episodes = store.episodes(run_id)
    finally:
        store.close()
    with open(out, "w") as f:
        for t in episodes:
            turns = [m for m in t.messages if m.get("role") == "assistant"]
            parsed = sum(1 for m in turns if m.get("tool_calls"))
            truth = twin.case(t.split, t.index).truth
            f.write(
                json.dumps(
                    {
                        "case_id": t.case_id,
                        "index": t.index,
                        "kind": t.case_kind,
                        "reward": t.reward,
                        "components": t.components,
                        "turns": len(turns),
                        "parsed_turns": parsed,
                        "submitted": t.submission is not None,
                        "verdict": (t.submission or {}).get("verdict", "none"),
                        "true_verdict": truth["verdict"],
                    }
                )
                + "\n"
            )


def data_dir() -> Path:
    """The teacher's dataset folder of this chain."""
    return RUN_DIR / f"data-{TEACHER['policy']}"


def collect(args: argparse.Namespace) -> None:
    out = data_dir()
    if (out / "dataset.json").exists():
        log(f"collect: {out.name} exists, skipped")
        return
    cmd = twin_cmd(
        "collect",
        "catalog",
        "--policy",
        TEACHER["policy"],
        "--split",
        "train",
        "--episodes",
        str(args.collect_episodes),
        "--min-reward",
        TEACHER["min_reward"],
        "--out",
        str(out),
        "--store",
        str(args.store),
        "--no-progress",
    )
    for s in TWIN_SETS:
        cmd += ["--set", s]
    run(cmd)


def evaluate_grpo(policy: str, args: argparse.Namespace) -> None:
    """Score GRPO's ``--grpo-eval-at`` snapshots, then its last checkpoint when that is the step
    ``--grpo-steps`` names (a run stopped early, or longer than asked, would be mislabelled)."""
    for k in args.grpo_eval_at:
        evaluate(f"grpo-{k}", f"hf:{snapshot_dir(k)},{policy}", args)
    step = last_step(RUN_DIR / "grpo")
    if step != args.grpo_steps:
        log(f"grpo: the run is at step {step}, not {args.grpo_steps}; not evaluated")
        return
    evaluate("grpo", f"hf:{RUN_DIR / 'grpo'},{policy}", args)


def sft_finished(out: Path) -> bool:
    """Whether the SFT run in ``out`` reached its last step (or stopped early): its newest
    checkpoint says so (``total_steps``); a checkpoint without it is a finished one-checkpoint run."""
    from trainer.checkpoint import latest_checkpoint, load_checkpoint

    ckpt = latest_checkpoint(out)
    if ckpt is None:
        return False
    state = load_checkpoint(ckpt)
    total = state.get("total_steps")
    return total is None or int(state["step"]) >= int(total) or bool(state.get("stopped_early"))


def last_step(out: Path) -> int:
    """The step count of a training run's newest complete checkpoint (0: none)."""
    from trainer.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(out)
    return int(ckpt.name.removeprefix("step-")) if ckpt is not None else 0


def snapshot_dir(step: int) -> Path:
    """Where GRPO's checkpoint of ``step`` is kept for ``--grpo-eval-at`` (the run itself keeps
    only its newest two)."""
    return RUN_DIR / f"grpo-step-{step}"


def train_grpo(args: argparse.Namespace) -> bool:
    """Run GRPO to ``--grpo-steps`` in segments that end at each ``--grpo-eval-at`` step, where
    the checkpoint's adapter and recipe are copied to :func:`snapshot_dir`; True when it continued
    an earlier run.

    Each segment after the first is ``twin train --resume`` with a larger ``train.steps``: the
    trainer's resume restores the weights, optimizer, sampling RNG and case cursor, so the run is
    the one an uninterrupted run would have been (``tests/trainer/test_resume.py``; the learning
    rate is constant). A run that was stopped continues the same way.
    """
    out = RUN_DIR / "grpo"
    resumed = bool(last_step(out))
    for target in sorted({*args.grpo_eval_at, args.grpo_steps}):
        if last_step(out) < target:
            train("grpo", args, steps=target)
        snap = snapshot_dir(target)
        if target in args.grpo_eval_at and not snap.exists():
            ckpt = out / "checkpoints" / f"step-{target:06d}"
            snap.mkdir()
            shutil.copytree(ckpt / "adapter", snap / "adapter")
            shutil.copy2(ckpt / "recipe.yaml", snap / "recipe.yaml")
    return resumed


def train(stage: str, args: argparse.Namespace, steps: int = 0) -> bool:
    """Run the SFT stage, or GRPO to ``steps``; True when it continued an earlier run.

    A stage whose checkpoints already reach its length is skipped; a run stopped before it
    continues from its newest checkpoint (``--resume``): SFT's checkpoints record its length.
    """
    out = RUN_DIR / stage
    done = last_step(out)
    if done and (sft_finished(out) if stage == "sft" else done >= steps):
        log(f"{stage}: {out.name}/checkpoints reach step {done}, skipped")
        return False
    sets = [f"train.output_dir={out}", "twin.config.max_turns=3"]
    if stage == "sft":
        sets += [
            f"data.paths=[{data_dir()}]",
            f"data.epochs={args.sft_epochs}",
            f"data.batch_size={args.sft_batch_size}",
            f"eval.cases={args.sft_eval_cases}",
        ]
        cmd = twin_cmd("sft", SFT_RECIPE)
        if done:
            log(f"sft: continuing from step {done}")
            cmd.append("--resume")
    else:
        sets += [f"model.init_from={RUN_DIR / 'sft'}", f"train.steps={steps}"]
        cmd = twin_cmd("train", GRPO_RECIPE)
        if done:
            log(f"{stage}: continuing from step {done} to {steps}")
            cmd.append("--resume")
    for s in sets:
        cmd += ["--set", s]
    env_store = os.environ.get("TWINRL_STORE")
    os.environ["TWINRL_STORE"] = str(args.store)  # the training runs go to the same store
    try:
        run(cmd)
    finally:
        if env_store is None:
            os.environ.pop("TWINRL_STORE", None)
        else:
            os.environ["TWINRL_STORE"] = env_store
    return bool(done)


# -- report ------------------------------------------------------------------------------------
def bootstrap_ci(values: np.ndarray) -> tuple[float, float]:
    """95% percentile interval of the mean of ``values`` over resampled cases.

    Each interval draws from its own generator seeded ``BOOT_SEED``, so a figure does not depend
    on which other stages exist or the order they are reported in.
    """
    rng = np.random.default_rng(BOOT_SEED)
    idx = rng.integers(0, len(values), size=(BOOT_RESAMPLES, len(values)))
    means = values[idx].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def read_episodes(name: str) -> list[dict[str, Any]] | None:
    path = RUN_DIR / f"episodes-{name}.jsonl"
    if not path.exists():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rewards = np.array([r["reward"] if r["reward"] is not None else 0.0 for r in rows], dtype=float)
    lo, hi = bootstrap_ci(rewards)
    turns = sum(r["turns"] for r in rows)
    confusion = {t: {p: 0 for p in (*VERDICTS, "none")} for t in VERDICTS}
    for r in rows:
        confusion[r["true_verdict"]][r["verdict"] if r["verdict"] in VERDICTS else "none"] += 1
    kinds: dict[str, list[float]] = {}
    for r, x in zip(rows, rewards, strict=True):
        kinds.setdefault(r["kind"], []).append(float(x))
    return {
        "episodes": len(rows),
        "reward_mean": float(rewards.mean()),
        "reward_ci95": [lo, hi],
        "parse_rate": (sum(r["parsed_turns"] for r in rows) / turns) if turns else 0.0,
        "submit_rate": sum(r["submitted"] for r in rows) / len(rows),
        "verdict_accuracy": sum(r["verdict"] == r["true_verdict"] for r in rows) / len(rows),
        "verdict_confusion": confusion,
        "by_kind": {
            k: {"episodes": len(v), "reward_mean": float(np.mean(v))}
            for k, v in sorted(kinds.items())
        },
    }


def paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of ``b - a`` over the shared case ids, with a paired 95% bootstrap interval."""
    ra = {r["case_id"]: r["reward"] or 0.0 for r in a}
    rb = {r["case_id"]: r["reward"] or 0.0 for r in b}
    ids = sorted(set(ra) & set(rb))
    diff = np.array([rb[i] - ra[i] for i in ids], dtype=float)
    lo, hi = bootstrap_ci(diff)
    return {"cases": len(ids), "mean_diff": float(diff.mean()), "ci95": [lo, hi]}


def read_metrics(stage: str) -> list[dict[str, Any]]:
    path = RUN_DIR / stage / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(test_points: list[tuple[int, dict[str, Any]]]) -> list[str]:
    """Loss of the SFT stage and sampled reward of the GRPO stage per step, as PNGs.

    ``test_points``: (GRPO step, summary) of the greedy test evaluations (step 0 = the SFT
    checkpoint GRPO starts from), drawn on the GRPO curve with their 95% intervals.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for stage, keys, ylabel in (
        ("sft", ("losses/loss",), "token NLL (assistant tokens)"),
        ("grpo", ("rewards/total", "reward/mean"), "mean reward"),
    ):
        records = read_metrics(stage)
        key = next((k for k in keys if any(k in r for r in records)), None)
        if key is None:
            continue
        pts = [(r["step"], r[key]) for r in records if key in r]
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", label="sampled rollouts (T=0.7)"
        )
        if stage == "grpo" and test_points:
            xs = [k for k, _ in test_points]
            ys = [t["reward_mean"] for _, t in test_points]
            err = [
                [y - t["reward_ci95"][0] for y, (_, t) in zip(ys, test_points, strict=True)],
                [t["reward_ci95"][1] - y for y, (_, t) in zip(ys, test_points, strict=True)],
            ]
            ax.errorbar(
                xs,
                ys,
                yerr=err,
                marker="s",
                capsize=3,
                label=f"greedy test reward ({test_points[0][1]['episodes']} cases, 95% CI)",
            )
            ax.legend(fontsize=7)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"SmolLM2 on Catalog v1: {stage} ({key})")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        name = f"{stage}-curve.png"
        fig.savefig(DOCS_DIR / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written


def fmt_ci(s: dict[str, Any]) -> str:
    return f"{s['reward_mean']:+.3f} [{s['reward_ci95'][0]:+.3f}, {s['reward_ci95'][1]:+.3f}]"


def report(args: argparse.Namespace) -> None:
    DOCS_DIR.mkdir(parents=True, exist_ok=True)
    timings = Timings(RUN_DIR / "timings.json").data
    sizes_path = RUN_DIR / "sizes.json"
    sizes = json.loads(sizes_path.read_text()) if sizes_path.exists() else {}
    table_rows = rows(args)
    episodes = {name: read_episodes(name) for name, _ in table_rows}
    stats = {name: summarize(eps) for name, eps in episodes.items() if eps}
    diffs = {}
    early = [f"grpo-{k}" for k in args.grpo_eval_at]
    pairs = [
        ("sft", "grpo"),
        *[("sft", e) for e in early],
        *[(e, "grpo") for e in early],
        ("zeroshot", "sft"),
        ("heuristic", "grpo"),
        ("heuristic", "sft"),
    ]
    for a, b in pairs:
        if episodes.get(a) and episodes.get(b):
            diffs[f"{b}-{a}"] = paired(episodes[a], episodes[b])
    sft_rows = read_metrics("sft")
    grpo_rows = read_metrics("grpo")
    # The cases every stage was scored on (the same ids: evaluate() always runs 0..N-1).
    n_cases = max((s["episodes"] for s in stats.values()), default=0)
    results = {
        "twin": "Catalog v1",
        "split": "test",
        "test_cases": n_cases,
        "twin_config": TWIN_SETS,
        "max_new_tokens": MAX_NEW_TOKENS,
        "bootstrap": {"seed": BOOT_SEED, "resamples": BOOT_RESAMPLES, "interval": "percentile 95%"},
        "sizes": {
            **sizes,
            "sft_steps_run": len([r for r in sft_rows if "losses/loss" in r]),
            "grpo_steps_run": len(
                [r for r in grpo_rows if "losses/loss" in r or "rewards/total" in r]
            ),
        },
        "stages": stats,
        "differences": diffs,
        "wall_clock_s": timings,
    }
    (DOCS_DIR / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    test_points = [
        (k, stats[n])
        for k, n in (
            (0, "sft"),
            *((k, f"grpo-{k}") for k in args.grpo_eval_at),
            (results["sizes"]["grpo_steps_run"], "grpo"),
        )
        if n in stats
    ]
    curves = plot_curves(test_points)

    def wall(name: str) -> float:
        return timings.get(f"eval-{name}", float("nan"))

    lines = [
        f"Catalog v1, test cases 0..{n_cases - 1} ({n_cases} cases, one greedy episode each; "
        f"compact prompt, 3 turns, {MAX_NEW_TOKENS} new tokens per turn). Reward: mean [95% bootstrap interval].",
        "",
        "| policy | reward [95% CI] | parse rate | submitted | verdict accuracy | eval wall-clock (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, label in table_rows:
        if name not in stats:
            lines.append(f"| {label} | not run | | | | |")
            continue
        s = stats[name]
        lines.append(
            f"| {label} | {fmt_ci(s)} | {s['parse_rate']:.2f} | {s['submit_rate']:.2f} | "
            f"{s['verdict_accuracy']:.2f} | {wall(name):.0f} |"
        )
    lines += [
        "",
        "Training wall-clock (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in timings.items() if k in ("collect", "sft", "grpo")),
    ]
    if diffs:
        lines += ["", "| difference (paired over cases) | mean [95% CI] |", "| --- | --- |"]
        for key, d in diffs.items():
            lines.append(
                f"| {key} | {d['mean_diff']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] |"
            )
    lines += [
        "",
        "Verdict confusion (rows: true verdict; columns: submitted, `none` = no submit):",
        "",
    ]
    for name, label in table_rows:
        if name not in stats:
            continue
        c = stats[name]["verdict_confusion"]
        lines += [
            f"{label}:",
            "",
            "| true \\ submitted | " + " | ".join((*VERDICTS, "none")) + " |",
            "| --- |" + " --- |" * (len(VERDICTS) + 1),
        ]
        lines += [
            f"| {t} | " + " | ".join(str(c[t][p]) for p in (*VERDICTS, "none")) + " |"
            for t in VERDICTS
        ]
        lines.append("")
    kinds = sorted({k for s in stats.values() for k in s["by_kind"]})
    names = [n for n, _ in table_rows if n in stats]
    lines += [
        "Mean reward per case kind:",
        "",
        "| kind | n | " + " | ".join(names) + " |",
        "| --- | --- |" + " --- |" * len(names),
    ]
    for k in kinds:
        n = next(s["by_kind"][k]["episodes"] for s in stats.values() if k in s["by_kind"])
        cells = [
            f"{stats[x]['by_kind'][k]['reward_mean']:+.2f}" if k in stats[x]["by_kind"] else ""
            for x in names
        ]
        lines.append(f"| {k} | {n} | " + " | ".join(cells) + " |")
    if curves:
        lines += [""] + [f"![{c}]({c})" for c in curves]
    (DOCS_DIR / "table.md").write_text("\n".join(lines) + "\n")
    log(
        f"report: {DOCS_DIR / 'results.json'}, {DOCS_DIR / 'table.md'}, {', '.join(curves) or 'no curves'}"
    )


# -- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--chain",
        choices=sorted(CHAINS),
        default="heuristic",
        help="heuristic: the reported run (heuristic teacher); expert: the compact teacher, "
        "bf16 autocast, groups of 8 with dynamic sampling (runs/learning-smollm2-expert)",
    )
    p.add_argument(
        "--test-cases",
        type=int,
        default=200,
        help="test cases 0..N-1 for every policy (200 = the whole split)",
    )
    p.add_argument(
        "--collect-episodes",
        type=int,
        default=None,
        help="teacher train episodes run (kept: the chain's min reward); default 16 (heuristic), 400 (expert)",
    )
    p.add_argument("--sft-epochs", type=int, default=None, help="default 1")
    p.add_argument(
        "--sft-batch-size", type=int, default=None, help="default 2 (heuristic), 8 (expert)"
    )
    p.add_argument(
        "--sft-eval-cases", type=int, default=0, help="dev cases scored during SFT (0 = none)"
    )
    p.add_argument("--grpo-steps", type=int, default=None, help="default 2 (heuristic), 8 (expert)")
    p.add_argument(
        "--grpo-eval-at",
        type=int,
        action="append",
        default=[],
        metavar="K",
        help="also score GRPO's checkpoint of step K (repeatable; K < --grpo-steps)",
    )
    p.add_argument(
        "--eval-batch",
        type=int,
        default=24,
        help="episodes played at once per model evaluation (their keys/values must fit the "
        "sampler's 4 GiB prefix cache across turns: 24 SmolLM2 episodes take ~3 GiB)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per stage (2 on an idle 2-core machine)",
    )
    p.add_argument(
        "--only", choices=STAGES, action="append", help="run only these stages (repeatable)"
    )
    args = p.parse_args(argv)
    for key, value in use_chain(args.chain).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 1 <= args.test_cases <= 200:
        p.error(
            f"--test-cases must be in 1..200 (the catalog test split has 200 cases), got {args.test_cases}"
        )
    if any(not 1 <= k < args.grpo_steps for k in args.grpo_eval_at):
        p.error(
            f"--grpo-eval-at takes steps in 1..{args.grpo_steps - 1} (before --grpo-steps), got {args.grpo_eval_at}"
        )
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    args.store = RUN_DIR / "store.db"
    timings = Timings(RUN_DIR / "timings.json")
    if not args.only or set(args.only) - {
        "report"
    }:  # the sizes the stages ran with, for the report
        sizes = {
            k: getattr(args, k)
            for k in (
                "test_cases",
                "collect_episodes",
                "sft_epochs",
                "sft_batch_size",
                "grpo_steps",
                "grpo_eval_at",
                "eval_batch",
                "threads",
            )
        }
        (RUN_DIR / "sizes.json").write_text(json.dumps(sizes, indent=1) + "\n")
    THREADS[0] = str(args.threads)
    batch = min(args.eval_batch, args.test_cases)
    policy = (
        f"temperature=0,max_new_tokens={MAX_NEW_TOKENS},max_batch={batch}"
        + CHAINS[args.chain]["eval_options"]
    )
    actions = {
        "refs": lambda: (
            evaluate("heuristic", "heuristic", args),
            evaluate("careful", "careful", args),
        ),
        "collect": lambda: collect(args),
        "zeroshot": lambda: evaluate("zeroshot", f"hf:smollm2,{policy}", args),
        "sft": lambda: train("sft", args),
        "sft_eval": lambda: evaluate("sft", f"hf:{RUN_DIR / 'sft'},{policy}", args),
        "grpo": lambda: train_grpo(args),
        "grpo_eval": lambda: evaluate_grpo(policy, args),
        "report": lambda: report(args),
    }
    for stage in STAGES:
        if args.only and stage not in args.only:
            continue
        log(f"stage {stage}")
        t0 = time.monotonic()
        resumed = actions[stage]()
        seconds = time.monotonic() - t0
        # evaluations keep their own wall-clock (evaluate); a skipped stage keeps its first one
        if stage in ("collect", "sft", "grpo") and seconds > 5:
            timings.record(stage, seconds, add=resumed is True)
        log(f"stage {stage} done in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

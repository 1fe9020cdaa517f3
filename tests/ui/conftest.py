"""Stores for the ``twin ui`` tests.

``planted_store``: a small store written through :class:`twin.store.RunStore` with episodes made
here (two evaluations of the same cases, one case flipping between them; a training run with its
metric curve; model and listing text carrying ``<script>``). ``real_store``: a store filled by the
real commands, ``twin eval`` (two policies on the same Catalog cases) and ``twin train`` (the Toy
recipe, a few steps), made once per test session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from twin.rollout import summarize
from twin.store import RunStore
from twin.trajectory import Group, ToolCallRecord, Trajectory

ROOT = Path(__file__).resolve().parents[2]
#: Text planted in a listing, a model reply and a policy name: shown, never run.
SCRIPT = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


def episode(
    case: int,
    reward: float,
    *,
    kind: str = "ok_listing",
    policy: str = "p",
    answer: str = "ok",
    truth: str = "ok",
    invalid: bool = False,
    listing: str = "Title: Blue mug",
    reply: str = "",
    twin: str = "Catalog",
) -> Trajectory:
    """A scored, submitted Catalog-like episode of case ``case``."""
    calls = []
    if invalid:
        calls.append(
            ToolCallRecord(
                id="bad",
                name="lookup_brnd",
                arguments={"name": "x"},
                ok=False,
                error="unknown tool 'lookup_brnd'",
                turn=0,
            )
        )
    calls.append(
        ToolCallRecord(
            id="sub",
            name="submit",
            arguments={"verdict": answer},
            ok=True,
            result={"status": "submitted"},
            terminal=True,
            turn=1 if invalid else 0,
        )
    )
    messages = [
        {"role": "system", "content": "Review the listing."},
        {"role": "user", "content": listing},
    ]
    if invalid:
        messages += _exchange(
            "bad",
            "lookup_brnd",
            '{"name": "x"}',
            reply or "calling lookup_brnd",
            "error: unknown tool 'lookup_brnd'",
        )
    messages += _exchange(
        "sub",
        "submit",
        f'{{"verdict": "{answer}"}}',
        reply or "submitting",
        '{"status": "submitted"}',
    )
    return Trajectory(
        twin=twin,
        case_id=f"{twin}/test/{case}",
        split="test",
        index=case,
        case_kind=kind,
        policy=policy,
        messages=messages,
        calls=calls,
        submission={"verdict": answer},
        invalid_calls=int(invalid),
        num_turns=2 if invalid else 1,
        terminated=True,
        reward=reward,
        components={"policy": reward, "submitted": 1.0},
        weighted={"policy": reward, "submitted": 0.0},
        reward_notes=[f"policy: true {truth!r}, submitted {answer!r}"],
        info={"outcome": {"truth": {"verdict": truth, "category_id": "hg-1"}, "kind": kind}},
    )


def _exchange(
    call_id: str, name: str, arguments: str, content: str, result: str
) -> list[dict[str, object]]:
    """An assistant message calling tool ``name``, and the tool's answer."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "name": name, "content": result},
    ]


@pytest.fixture()
def planted_store(tmp_path: Path) -> Iterator[dict[str, object]]:
    """A SQLite store: runs ``a`` and ``b`` (evals on cases 0-3; case 1 solved only by ``b``,
    case 2 only by ``a``), ``train`` (3 metric steps), ``xss`` (``<script>`` everywhere)."""
    path = tmp_path / "runs.db"
    store = RunStore(path)
    ids: dict[str, object] = {"path": path}
    with store.track_run("eval", "Catalog", "heuristic") as run:
        trajectories = [
            episode(0, 1.0, policy="heuristic"),
            episode(1, -1.0, answer="counterfeit", policy="heuristic"),
            episode(
                2,
                1.0,
                kind="counterfeit",
                truth="counterfeit",
                answer="counterfeit",
                policy="heuristic",
            ),
            episode(3, 0.2, kind="counterfeit", truth="counterfeit", policy="heuristic"),
        ]
        run.add_episodes(trajectories)
        # the summary `twin eval` stores: the run page reads a finished run's figures from it
        run.metrics = summarize([Group(case_id=t.case_id, trajectories=[t]) for t in trajectories])
        run.metrics["split"] = "test"
        ids["a"] = run.id
    with store.track_run("eval", "Catalog", "openai:tuned") as run:
        run.add_episodes(
            [
                episode(0, 1.0, policy="tuned"),
                episode(1, 1.0, policy="tuned"),
                episode(
                    2, -0.5, kind="counterfeit", truth="counterfeit", policy="tuned", invalid=True
                ),
                episode(
                    3,
                    1.0,
                    kind="counterfeit",
                    truth="counterfeit",
                    answer="counterfeit",
                    policy="tuned",
                ),
            ]
        )
        ids["b"] = run.id
    with store.track_run("train", "Toy", "tiny") as run:
        for step in range(3):
            run.log_metrics(
                step,
                {
                    "rewards/total": 0.1 * step,
                    "losses/loss": 1.0 - 0.2 * step,
                    "losses/kl": 0.01 * step,
                    "perf/tokens_per_s": 100.0 + step,
                    "batch/groups": 8,
                    f"custom/{SCRIPT}": 1.0,  # a metric name is text from the store too
                },
            )
            run.add_episodes([episode(step, 0.1 * step, twin="Toy", kind="red")], step=step)
        ids["train"] = run.id
    with store.track_run("eval", "Catalog", SCRIPT) as run:
        run.add_episodes(
            [
                episode(
                    0,
                    0.0,
                    listing=f"Title: mug {SCRIPT}",
                    reply=f"I think {SCRIPT}",
                    invalid=True,
                    kind=SCRIPT,
                ),
            ]
        )
        ids["xss"] = run.id
    store.close()
    yield ids


def _run(args: list[str], store: Path, cwd: Path) -> None:
    env = dict(os.environ, TWINRL_STORE=str(store), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "twinrl_cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, f"twin {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="session")
def real_store(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A store filled by `twin eval` (random, then heuristic, on Catalog test cases 0-7) and
    `twin train` (data/recipes/toy-cpu.yaml, 3 steps): run ids 1, 2 and 3."""
    work = tmp_path_factory.mktemp("ui-real")
    store = work / "runs.db"
    _run(["eval", "Catalog", "-p", "random", "-n", "8", "--no-progress"], store, work)
    _run(["eval", "Catalog", "-p", "heuristic", "-n", "8", "--no-progress"], store, work)
    _run(
        [
            "train",
            str(ROOT / "data/recipes/toy-cpu.yaml"),
            "--set",
            "train.steps=3",
            "--set",
            f"train.output_dir={work / 'toy'}",
            "--set",
            "train.checkpoint_every=100",
        ],
        store,
        work,
    )
    return {"path": store, "random": 1, "heuristic": 2, "train": 3}

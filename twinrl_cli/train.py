"""``twin train``, ``twin sft``, ``twin collect`` and ``twin plan``: recipes (trainer/cli.py,
trainer/plan.py) and the trajectory datasets ``twin sft`` learns from
(twin/evaluation/collect.py)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape

from twinrl_cli.app import (
    JsonOpt,
    SetOpt,
    SplitOpt,
    StoreOpt,
    app,
    console,
    dump,
    errors,
    make_twin,
    needs,
    parse_overrides,
    run_target,
)

__all__ = ["collect", "plan", "sft", "train"]


@app.command()
def train(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML, e.g. data/recipes/toy-cpu.yaml.")],
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="Recipe override KEY=VALUE (dotted keys), repeatable."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the latest checkpoint.")
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Start over in an output folder that holds checkpoints (deletes them).",
        ),
    ] = False,
) -> None:
    """Train a policy with GRPO from a recipe (trainer.cli.train)."""
    with needs("train", "trainer.cli:train"):
        from trainer.cli import train as run_recipe
    run_target(run_recipe, recipe, list(overrides or []), resume, overwrite=overwrite)


@app.command()
def collect(
    name: Annotated[
        str | None,
        typer.Argument(metavar="TWIN", help="Twin name or id (optional with --from-run)."),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            "-p",
            help="A twin baseline (heuristic, oracle) | openai:MODEL | hf:PATH (a checkpoint too)"
            " | replay:FILE | random.",
        ),
    ] = None,
    split: SplitOpt = "train",
    episodes: Annotated[int, typer.Option("--episodes", "-n", min=1, help="Episodes to run.")] = 64,
    start: Annotated[int, typer.Option("--start", min=0, help="First case index.")] = 0,
    min_reward: Annotated[
        float | None,
        typer.Option("--min-reward", help="Keep only episodes with at least this reward."),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            "-o",
            help="Dataset folder (default runs/datasets/<twin>-<policy>-<split>-run<ID>).",
        ),
    ] = None,
    from_run: Annotated[
        int | None,
        typer.Option(
            "--from-run", help="Export the episodes of this stored run instead of running."
        ),
    ] = None,
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", min=1, help="Episodes in flight.")
    ] = 64,
    base_url: Annotated[
        str | None,
        typer.Option("--base-url", help="OpenAI-compatible base URL of openai: policies."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", envvar="OPENAI_API_KEY", show_envvar=True, help="Key of openai: policies."
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random policy.")] = 0,
    store: StoreOpt = None,
    overrides: SetOpt = None,
    progress: Annotated[
        bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")
    ] = True,
    as_json: JsonOpt = False,
) -> None:
    """Write a policy's episodes as a trajectory dataset (JSONL + Hugging Face) for `twin sft`.

    The episodes run through the same evaluation as `twin eval` and are stored as a run too.
    """
    from twin.store import RunStore

    with errors():
        run_store = RunStore(store)
        try:
            if from_run is not None:
                result = _export_run(run_store, from_run, name, overrides, out, min_reward)
            else:
                result = _collect_episodes(
                    run_store, name, policy, overrides, split=split, start=start,
                    episodes=episodes, out=out, min_reward=min_reward, concurrency=concurrency,
                    seed=seed, base_url=base_url, api_key=api_key, progress=progress,
                )  # fmt: skip
        finally:
            run_store.close()
    _print_collected(result, as_json=as_json)


def _export_run(
    run_store: Any,
    run_id: int,
    name: str | None,
    overrides: list[str] | None,
    out: str | None,
    min_reward: float | None,
) -> Any:
    """``twin collect --from-run``: a stored run's episodes as a dataset (checked against TWIN
    when it is given)."""
    from twin.errors import ConfigError
    from twin.evaluation.collect import export_run

    twin = None
    if name is not None:
        twin = make_twin(name, parse_overrides(overrides))
        info = run_store.run(run_id)
        if info.twin != twin.name:
            raise ConfigError(
                f"run {run_id} is of twin {info.twin!r}, not {twin.name!r}; drop TWIN or fix it"
            )
    return export_run(run_store, run_id, out=out, min_reward=min_reward, twin=twin)


def _collect_episodes(
    run_store: Any,
    name: str | None,
    policy: str | None,
    overrides: list[str] | None,
    *,
    split: str,
    start: int,
    episodes: int,
    seed: int,
    base_url: str | None,
    api_key: str | None,
    **collect_options: Any,
) -> Any:
    """``twin collect TWIN --policy P``: run the policy's episodes into a dataset.

    ``collect_options``: ``out``, ``min_reward``, ``concurrency``, ``progress`` of
    :func:`twin.evaluation.collect.collect`.
    """
    from twin.errors import ConfigError
    from twin.evaluation.collect import collect
    from twin.policies import make_policy

    if name is None or policy is None:
        raise ConfigError(
            "give TWIN and --policy to run episodes, or --from-run RUN_ID to export a run"
        )
    config = parse_overrides(overrides)
    twin = make_twin(name, config)
    agent = make_policy(policy, twin, seed=seed, base_url=base_url, api_key=api_key)
    if episodes > twin.num_cases(split) - start:
        raise ConfigError(
            f"{twin.name} split {split!r} has {twin.num_cases(split)} cases; {episodes} from "
            f"index {start} do not fit: lower --episodes or pick another --split"
        )
    cases = [(split, start + i) for i in range(episodes)]
    return collect(
        twin,
        agent,
        cases,
        store=run_store,
        policy_spec=policy,
        config={
            "twin_config": config,
            "split": split,
            "start": start,
            "episodes": episodes,
            "seed": seed,
        },
        **collect_options,
    )


def _print_collected(result: Any, *, as_json: bool) -> None:
    """What ``twin collect`` wrote: a JSON report, or a few lines."""
    report = {
        "out": str(result.out),
        "rows": result.rows,
        "episodes": result.episodes,
        "dropped_reward": result.dropped_reward,
        "dropped_failed": result.dropped_failed,
        "run_id": result.run_id,
        "jsonl": str(result.jsonl),
        "hf": str(result.hf) if result.hf else None,
        "note": result.note,
        "reward_mean": result.summary.get("reward_mean"),
    }
    if as_json:
        dump(report)
        return
    mean = report["reward_mean"]
    console.print(
        f"{result.rows} of {result.episodes} episodes -> {escape(str(result.out))} "
        f"(run {result.run_id}"
        + (f", mean reward {mean:.3f}" if isinstance(mean, (int, float)) else "")
        + ")"
        + (f"; {result.dropped_reward} under --min-reward" if result.dropped_reward else "")
        + (f"; {result.dropped_failed} failed" if result.dropped_failed else "")
    )
    console.print(f"  JSONL: {escape(str(result.jsonl))}")
    if result.hf is not None:
        console.print(f"  Hugging Face: {escape(str(result.hf))} (datasets.load_from_disk)")
    elif result.note:
        console.print(f"  [yellow]no Hugging Face copy:[/] {escape(result.note)}")


@app.command()
def sft(
    recipe: Annotated[
        str, typer.Argument(help="Recipe YAML with a data: section (algorithm: sft is implied).")
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="Recipe override KEY=VALUE (dotted keys), repeatable."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the latest checkpoint.")
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Start over in an output folder that holds checkpoints (deletes them).",
        ),
    ] = False,
) -> None:
    """Supervised warm start on a trajectory dataset: `twin train` with algorithm.name=sft."""
    with needs("sft", "trainer.cli:train"):
        from trainer.cli import train as run_recipe
    run_target(
        run_recipe, recipe, [*(overrides or []), "algorithm.name=sft"], resume, overwrite=overwrite
    )


@app.command()
def plan(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML (or a shipped recipe's name).")],
    gpu_memory_gb: Annotated[
        float,
        typer.Option(
            "--gpu-memory-gb",
            min=0.0,
            help="Memory of a GPU that is not visible here (decimal GB).",
        ),
    ] = 96.0,
    gradient_checkpointing: Annotated[
        bool | None,
        typer.Option(
            "--gradient-checkpointing/--no-gradient-checkpointing",
            help="Plan the learner with or without gradient checkpointing (default: the recipe's).",
        ),
    ] = None,
    vllm_utilization: Annotated[
        float,
        typer.Option(
            "--vllm-utilization", min=0.0, max=1.0, help="vLLM's --gpu-memory-utilization."
        ),
    ] = 0.9,
    gpus: Annotated[
        int,
        typer.Option(
            "--gpus",
            help="GPUs of the machine planned for when none is visible here.",
        ),
    ] = 2,
    nodes: Annotated[
        int | None,
        typer.Option("--nodes", min=1, help="Also plan a Ray cluster of this many nodes."),
    ] = None,
    gpus_per_node: Annotated[
        int | None,
        typer.Option("--gpus-per-node", min=1, help="GPUs of each node of that cluster."),
    ] = None,
    bench: Annotated[
        str | None,
        typer.Option(
            "--bench", help="A `twin bench trainer --json` report: the measured per-side seconds."
        ),
    ] = None,
    rollout_s: Annotated[
        float | None,
        typer.Option(
            "--rollout-s", min=0.0, help="Seconds of one lot on one engine (over --bench's)."
        ),
    ] = None,
    learner_s: Annotated[
        float | None,
        typer.Option(
            "--learner-s", min=0.0, help="Seconds of one learner update (over --bench's)."
        ),
    ] = None,
) -> None:
    """Print the per-device memory plan of a recipe (trainer.plan); exit 1 when a device does not
    fit."""
    with needs("plan", "trainer.plan:main"):
        from trainer.plan import main as plan_recipe
    run_target(
        plan_recipe, recipe, gpu_memory_gb=gpu_memory_gb,
        gradient_checkpointing=gradient_checkpointing, vllm_utilization=vllm_utilization,
        gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node, bench=bench,
        rollout_s=rollout_s, learner_s=learner_s,
    )  # fmt: skip

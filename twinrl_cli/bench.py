"""``twin bench catalog | trainer | trl | openenv``: each benchmark's options, typed, passed to
its function (bench/catalog.py, bench/trainers.py, bench/trl_ratio.py,
bench/openenv_latency.py).

The defaults are the functions' own; tests/twinrl_cli/test_typed_options.py checks that they agree.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer
import yaml

from twinrl_cli.app import bench_app, needs, run_target

#: ``--json FILE`` and ``--output-dir DIR`` of the trainer benches.
FiguresJsonOpt = Annotated[
    str | None, typer.Option("--json", help="Also write the figures as JSON to this file.")
]
RunsDirOpt = Annotated[
    str | None,
    typer.Option("--output-dir", help="Where the runs write (default: a temporary folder)."),
]

__all__ = ["bench_catalog", "bench_openenv", "bench_trainer", "bench_trl"]


# -- catalog -----------------------------------------------------------------------------------
@bench_app.command("catalog")
def bench_catalog(
    n: Annotated[int, typer.Option("--n", min=1, help="Timed calls per figure.")] = 2000,
    episodes: Annotated[
        int, typer.Option("--episodes", min=1, help="Concurrent episodes for the memory figure.")
    ] = 10_000,
    seed: Annotated[int, typer.Option("--seed", help="World seed.")] = 0,
    taxonomy: Annotated[
        str | None,
        typer.Option(
            "--taxonomy", help="A Shopify taxonomy checkout instead of the generated world."
        ),
    ] = None,
    cold: Annotated[
        bool,
        typer.Option(
            "--cold/--no-cold", help="Time a cold world build in a fresh process, empty cache."
        ),
    ] = True,
    warm: Annotated[
        bool,
        typer.Option(
            "--warm/--no-warm", help="Time a warm (cached) world build in a fresh process."
        ),
    ] = True,
    out: Annotated[
        str | None, typer.Option("--out", help="Also write the figures as JSON to this file.")
    ] = None,
    version: Annotated[
        int,
        typer.Option(
            "--version", min=0, max=1, help="Catalog version to time: 1 (the latest) or 0."
        ),
    ] = 1,
) -> None:
    """Catalog twin benchmarks: tool latency, reset/step overhead, world build, memory."""
    with needs("bench catalog", "bench.catalog:main"):
        from bench.catalog import main as run
    run_target(
        run, n=n, episodes=episodes, seed=seed, taxonomy=taxonomy, cold=cold, warm=warm, out=out,
        version=version,
    )  # fmt: skip


# -- trainer -----------------------------------------------------------------------------------
class K0Threads(str, enum.Enum):
    """How the synchronous baseline of ``twin bench trainer`` runs."""

    best = "best"
    one = "1"
    all = "all"


class Backend(str, enum.Enum):
    """Where ``twin bench trainer`` runs its workers."""

    local = "local"
    ray = "ray"


@bench_app.command("trainer")
def bench_trainer(
    steps: Annotated[int, typer.Option("--steps", min=1, help="Measured steps per run.")] = 6,
    warmup: Annotated[
        int,
        typer.Option(
            "--warmup",
            min=0,
            help="Steps run first and left out of the figures (start-up, first LoRA request); the "
            "first run calibrates the update passes on them.",
        ),
    ] = 4,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Recipe override KEY=VALUE (repeatable) on top of toy-cpu with LoRA, e.g. "
            "--set algorithm.groups_per_step=4 for longer steps.",
        ),
    ] = None,
    json: FiguresJsonOpt = None,
    output_dir: RunsDirOpt = None,
    epochs: Annotated[
        int | None,
        typer.Option(
            "--epochs",
            min=1,
            help="Update passes per lot (default: calibrated so that learner + sync ~= rollout).",
        ),
    ] = None,
    k0_threads: Annotated[
        K0Threads,
        typer.Option(
            "--k0-threads",
            help="The synchronous baseline: best (the faster of pinned with 1 thread per side and "
            "unpinned with a thread per core), 1 (pinned only) or all (unpinned only).",
        ),
    ] = K0Threads.best,
    backend: Annotated[
        Backend,
        typer.Option(
            "--backend",
            help="local (processes) or ray (the same runs on a local Ray cluster or"
            " $RAY_ADDRESS's; also prints Ray's overhead per lot).",
        ),
    ] = Backend.local,
) -> None:
    """Trainer benchmarks: the async two-worker loop (k=1) vs the same loop run synchronously
    (k=0)."""
    with needs("bench trainer", "bench.trainers:main"):
        from bench.trainers import main as run
    run_target(
        run, steps=steps, warmup=warmup, set=list(overrides or []), json=json,
        output_dir=output_dir, epochs=epochs, k0_threads=k0_threads.value, backend=backend.value,
    )  # fmt: skip


# -- trl ---------------------------------------------------------------------------------------
@bench_app.command("trl")
def bench_trl(
    steps: Annotated[
        int, typer.Option("--steps", min=1, help="Measured optimizer steps per side.")
    ] = 5,
    warmup: Annotated[
        int,
        typer.Option(
            "--warmup", min=1, help="Steps run first and left out (first-call overheads)."
        ),
    ] = 1,
    prompts: Annotated[
        int, typer.Option("--prompts", min=1, help="Prompts (groups) per step.")
    ] = 4,
    group: Annotated[
        int, typer.Option("--group", min=1, help="Completions per prompt (TRL's num_generations).")
    ] = 8,
    max_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens",
            min=1,
            help="Completion limit (TRL's max_completion_length, our max_new_tokens).",
        ),
    ] = 16,
    lr: Annotated[
        float, typer.Option("--lr", min=0.0, help="Learning rate (constant) on both sides.")
    ] = 5e-3,
    threads: Annotated[
        int, typer.Option("--threads", min=1, help="torch CPU threads on both sides.")
    ] = 1,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of both runs and of the prompt draw.")
    ] = 0,
    rounds: Annotated[
        int,
        typer.Option(
            "--rounds",
            min=1,
            help="Runs per side in ABBA order (TRL, ours, ours, TRL, ...), pooled; 2 or more even "
            "out a drift in machine load.",
        ),
    ] = 1,
    json: FiguresJsonOpt = None,
    output_dir: RunsDirOpt = None,
) -> None:
    """Our synchronous GRPO step vs TRL's GRPOTrainer: same tiny model, prompts and batch."""
    with needs("bench trl", "bench.trl_ratio:main"):
        from bench.trl_ratio import main as run
    run_target(
        run, steps=steps, warmup=warmup, prompts=prompts, group=group, max_tokens=max_tokens, lr=lr,
        threads=threads, seed=seed, rounds=rounds, json=json, output_dir=output_dir,
    )  # fmt: skip


# -- openenv -----------------------------------------------------------------------------------
TRANSPORTS = ("ws", "http")


def _transports(raw: str) -> str:
    """Check ``--transports``: a comma-separated list of ws and http (a usage error otherwise)."""
    names = [t.strip() for t in raw.split(",") if t.strip()]
    unknown = [t for t in names if t not in TRANSPORTS]
    if not names or unknown:
        raise typer.BadParameter(
            f"{raw!r}: expected a comma-separated list of {', '.join(TRANSPORTS)}"
        )
    return raw


def _parse_arguments(raw: str | None) -> dict[str, Any] | None:
    """``--arguments '{"query": "boxes"}'`` -> a dict (JSON, or YAML flow style)."""
    return None if raw is None else yaml.safe_load(raw)


def _arguments(raw: str | None) -> str | None:
    """Check ``--arguments``: a JSON object (a usage error otherwise)."""
    try:
        value = _parse_arguments(raw)
    except yaml.YAMLError:
        value = raw
    if raw is not None and not isinstance(value, dict):
        raise typer.BadParameter(
            f"{raw!r}: expected a JSON object of the tool's arguments, e.g. "
            '\'{"query": "boxes"}\''
        )
    return raw


@bench_app.command("openenv")
def bench_openenv(
    twin: Annotated[str, typer.Option("--twin", help="The registered twin to serve.")] = "Catalog",
    steps: Annotated[
        int, typer.Option("--steps", min=1, help="Timed steps per server and transport.")
    ] = 300,
    tool: Annotated[
        str, typer.Option("--tool", help="The tool each timed step of the twin calls.")
    ] = "search_taxonomy",
    arguments: Annotated[
        str | None,
        typer.Option(
            "--arguments",
            help='The tool\'s arguments as a JSON object (default: {"query": "electrical boxes", '
            '"limit": 3}).',
            callback=_arguments,
        ),
    ] = None,
    split: Annotated[str, typer.Option("--split", help="Split of the episodes' cases.")] = "test",
    index: Annotated[int, typer.Option("--index", min=0, help="Case index of the episodes.")] = 0,
    transports: Annotated[
        str,
        typer.Option(
            "--transports",
            help="Comma-separated: ws (WebSocket client) and/or http.",
            callback=_transports,
        ),
    ] = ",".join(TRANSPORTS),
) -> None:
    """Step latency of a twin served by OpenEnv vs OpenEnv's echo environment (WebSocket, HTTP)."""
    with needs("bench openenv", "bench.openenv_latency:step_latency"):
        from bench.openenv_latency import step_latency as run
    run_target(
        run, twin=twin, steps=steps, tool=tool, arguments=_parse_arguments(arguments), split=split,
        index=index, transports=tuple(t.strip() for t in transports.split(",") if t.strip()),
    )  # fmt: skip

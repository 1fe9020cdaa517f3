"""``twin demo``: the catalog demo (envs/catalog/demo.py): build the world, run the baselines,
print tables, write a report."""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from twinrl_cli.app import app, needs, run_target

__all__ = ["demo"]


@app.command()
def demo(
    episodes: Annotated[
        int | None,
        typer.Option(
            "--episodes",
            min=1,
            help="Test cases to run, each --group-size times (default: the whole split).",
        ),
    ] = None,
    group_size: Annotated[
        int, typer.Option("--group-size", min=1, help="Episodes per case (k of pass@k and pass^k).")
    ] = 4,
    split: Annotated[str, typer.Option("--split", help="Split to run on.")] = "test",
    taxonomy: Annotated[
        str | None,
        typer.Option(
            "--taxonomy", help="A Shopify taxonomy checkout instead of the generated world."
        ),
    ] = None,
    out: Annotated[
        str, typer.Option("--out", help="Folder for report.md and the plots.")
    ] = "reports/demo",
    store: Annotated[
        str | None,
        typer.Option(
            "--store", help="Run store URL or file (default $TWINRL_STORE or runs/twinrl.db)."
        ),
    ] = None,
    no_store: Annotated[
        bool, typer.Option("--no-store", help="Do not write the run store.")
    ] = False,
    policies: Annotated[
        str | None,
        typer.Option(
            "--policies",
            help="Baselines to run, comma-separated (default for v1: random, heuristic, careful,"
            " oracle and the degenerate ones; for v0: random, heuristic, oracle).",
        ),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="World and case seed.")] = 0,
    progress: Annotated[
        bool, typer.Option("--progress/--no-progress", help="Progress bars.")
    ] = True,
    version: Annotated[
        int, typer.Option("--version", min=0, max=1, help="Catalog version: 1 (the latest) or 0.")
    ] = 1,
) -> None:
    """Catalog demo: build the world, run the baselines, print tables, write a report."""
    with needs("demo", "envs.catalog.demo:main"):
        from envs.catalog.demo import main as run
    run_target(
        run, episodes=episodes, group_size=group_size, split=split, taxonomy=taxonomy, out=out,
        store=False if no_store else store, policies=policies, seed=seed, progress=progress,
        version=version,
    )  # fmt: skip
    if not no_store and str(store).lower() not in ("none", "false"):
        where = f" --store {shlex.quote(store)}" if store else ""
        print(f"look at these runs in a browser: twin ui{where}")

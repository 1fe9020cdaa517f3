"""``twin reward test FILES...``: score hand-written rollouts against their expectations
(rewards/testing/)."""

from __future__ import annotations

from typing import Annotated

import typer

from twinrl_cli.app import needs, reward_app, run_target

__all__ = ["reward_test"]


@reward_app.command("test")
def reward_test(
    files: Annotated[list[str], typer.Argument(help="*.rollouts.yaml files.")],
    allow_import: Annotated[
        bool,
        typer.Option(
            "--allow-import",
            help="Let the files' `reward: module:attr` import any module (runs its code); by"
            " default only the reward library and registered twins' packages.",
        ),
    ] = False,
) -> None:
    """Score hand-written rollouts against their expectations (exit 1 on a mismatch)."""
    with needs("reward test", "rewards.testing:cli_main"):
        from rewards.testing import cli_main
    run_target(cli_main, list(files), allow_import=allow_import)

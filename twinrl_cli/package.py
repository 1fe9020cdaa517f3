"""``twin package TWIN DIR``: a twin's verifiers environment package
(integrations/verifiers_package.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from twinrl_cli.app import app, console, errors, needs

__all__ = ["package"]


@app.command("package")
def package(
    twin_name: Annotated[
        str, typer.Argument(metavar="TWIN", help="Registered twin, e.g. Returns.")
    ],
    dest: Annotated[str, typer.Argument(metavar="DIR", help="Folder to write (new or empty).")],
    requirement: Annotated[
        str,
        typer.Option(
            "--requirement", help="How the package requires twinrl (a name, URL or path)."
        ),
    ] = "twinrl[verifiers]",
    force: Annotated[bool, typer.Option("--force", help="Write into a folder with files.")] = False,
) -> None:
    """Write a twin's verifiers environment package (pip install DIR; vf-eval --env.taskset.id
    twinrl-<twin>); every twin option passes through load_environment and the taskset flags."""
    with needs("package", "integrations.verifiers_package:write_package"):
        from integrations.verifiers_package import module_name, write_package
    with errors():
        root = write_package(twin_name, dest, requirement=requirement, overwrite=force)
        module = module_name(twin_name if "/" not in twin_name else twin_name.split("/")[-1])
    console.print(f"wrote {root}: pyproject.toml, {module}.py, README.md")

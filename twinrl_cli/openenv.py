"""``twin openenv serve TWIN`` (a twin behind OpenEnv's server) and ``twin openenv init TWIN DIR``
(its OpenEnv environment package): integrations/openenv_server.py, openenv_layout.py."""

from __future__ import annotations

from typing import Annotated

import typer

from twinrl_cli.app import app, console, errors, needs, parse_overrides, run_target

__all__ = ["init", "serve"]

openenv_app = typer.Typer(
    help="A twin as an OpenEnv environment: `twin openenv serve TWIN`,"
    " `twin openenv init TWIN DIR`.",
    no_args_is_help=True,
)
app.add_typer(openenv_app, name="openenv")

SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Twin option KEY=VALUE, repeatable.")
]


@openenv_app.command("serve")
def serve(
    twin_name: Annotated[
        str, typer.Argument(metavar="TWIN", help="Registered twin, e.g. Catalog.")
    ],
    host: Annotated[
        str, typer.Option("--host", help="Interface (loopback by default).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="TWINRL_API_KEY",
            show_envvar=True,
            help="Key every route but /health needs (prefer the variable).",
        ),
    ] = None,
    overrides: SetOpt = None,
) -> None:
    """Serve a twin behind OpenEnv's own server: WebSocket /ws, HTTP /reset and /step, /health."""
    with needs("openenv serve", "integrations.openenv_server:serve"):
        from integrations.openenv_server import require_openenv
        from integrations.openenv_server import serve as serve_twin
    with errors():
        require_openenv()
        config = parse_overrides(overrides)
    run_target(serve_twin, twin_name, host=host, port=port, api_key=api_key, **config)


@openenv_app.command("init")
def init(
    twin_name: Annotated[
        str, typer.Argument(metavar="TWIN", help="Registered twin, e.g. Catalog.")
    ],
    dest: Annotated[str, typer.Argument(metavar="DIR", help="Folder to write (new or empty).")],
    requirement: Annotated[
        str,
        typer.Option(
            "--requirement",
            help="What the package's server extra installs for twinrl"
            " (a name, a URL or a wheel path).",
        ),
    ] = "twinrl[openenv]",
    lock: Annotated[bool, typer.Option("--lock", help="Also run `uv lock` (needs uv).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Write into a folder with files.")] = False,
    overrides: SetOpt = None,
) -> None:
    """Write a twin's OpenEnv environment package: openenv.yaml, pyproject.toml, a client on
    openenv-core alone, server/app.py and server/Dockerfile (`openenv validate DIR` checks it)."""
    with needs("openenv init", "integrations.openenv_layout:write_layout"):
        from integrations.openenv_layout import write_layout
    with errors():
        config = parse_overrides(overrides)
        root = write_layout(
            twin_name, dest, requirement=requirement, config=config, overwrite=force, lock=lock
        )
    console.print(f"wrote {root}: openenv.yaml, pyproject.toml, client.py, models.py, server/")

"""``twin ui``: browse the run store in a web browser (twin/ui), read-only, on loopback."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from twinrl_cli.app import StoreOpt, app, console, errors, needs

__all__ = ["ui"]


@app.command()
def ui(
    store: StoreOpt = None,
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="Port to listen on (0: any free one).")
    ] = 8321,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            help="Address to listen on (default 127.0.0.1). A non-loopback address serves the "
            "store's prompts, outputs and hidden truths to the network: only when you name it.",
        ),
    ] = None,
) -> None:
    """Look at runs, episodes and comparisons in a browser: a local, read-only web viewer."""
    with needs("ui", "twin.ui.server:serve"):
        import starlette  # noqa: F401 - a missing web stack is an install hint, not a traceback
        import uvicorn  # noqa: F401

        from twin.ui.server import DEFAULT_HOST, is_loopback, serve

    def ready(url: str) -> None:
        where = "" if is_loopback(host or DEFAULT_HOST) else " [bold yellow](network)[/]"
        console.print(f"twin ui: {escape(url)}{where} (read-only; Ctrl-C stops)", soft_wrap=True)

    with errors():
        try:
            serve(
                store,
                host=host or DEFAULT_HOST,
                port=port,
                explicit_host=host is not None,
                on_ready=ready,
            )
        except KeyboardInterrupt:
            pass

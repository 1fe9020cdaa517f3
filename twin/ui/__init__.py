"""``twin ui``: a local, read-only web viewer over the run store.

:func:`create_app` builds the Starlette application (pages in :mod:`twin.ui.app`, queries in
:mod:`twin.ui.queries`); :func:`serve` runs it with uvicorn, on loopback unless told otherwise.
Everything the pages need (templates, one stylesheet, one script) ships in this package; charts
are SVG drawn on the server. Nothing in the core of ``twin`` imports this package.
"""

from __future__ import annotations

from twin.ui.server import DEFAULT_HOST, DEFAULT_PORT, check_host, is_loopback, serve

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "check_host", "create_app", "is_loopback", "serve"]


def __getattr__(name: str) -> object:
    if name == "create_app":  # starlette is imported only when the app is made
        from twin.ui.app import create_app

        return create_app
    raise AttributeError(name)

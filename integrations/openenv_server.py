"""A twin as an OpenEnv environment: OpenEnv's own server, client and wire protocol
(openenv-core 0.3).

::

    python -m integrations.openenv_server Catalog --port 8000      # http://127.0.0.1:8000

    from integrations.openenv_server import TwinAction, TwinEnvClient
    async with TwinEnvClient(base_url="http://127.0.0.1:8000") as env:     # WebSocket /ws
        first = await env.reset(split="test", index=3)      # the case's opening messages, the tools
        result = await env.step(TwinAction(tool="search_taxonomy", arguments={"query": "boxes"}))
        result.observation.text, result.done, result.reward  # reward: the twin's, once done

What each side sees:

- **Action** :class:`TwinAction` ``{"tool": NAME, "arguments": {...}}``: one tool call, run as one
  assistant turn of the twin's :class:`twin.env.TwinEnv` (:mod:`integrations._episode`): the
  twin's validation, error text, hidden arguments, turn budget (one call is one turn) and reward.
- **Observation** :class:`TwinObservation`: after ``reset`` the opening ``messages``, the tool
  ``tools`` schemas and the ``episode_id``; after ``step`` the tool's result ``text`` and whether
  the call failed (``error``). ``done`` turns true when a terminal tool succeeds or the turn
  budget runs out, and only then is ``reward`` set: the twin's total for the episode.
- **State** :class:`TwinState` (``state`` over WebSocket, ``GET /episodes/{episode_id}`` over
  HTTP): status, turns and invalid calls; the reward's components, the submission and the outcome
  appear only once the episode has ended. Nothing derived from the case's truth reaches the
  agent while it can still act.

Transports. OpenEnv's WebSocket endpoint ``/ws`` (what :class:`openenv.core.EnvClient` speaks)
gives each connection its own environment, so an episode lives as long as its connection. OpenEnv's
HTTP ``POST /reset`` and ``POST /step`` build a fresh environment per request; an HTTP episode is
therefore kept in the server under its ``episode_id`` (returned by ``reset``, or the one you pass)
and each ``/step`` names it: ``{"action": {...}, "episode_id": "..."}``. At most
``max_http_episodes`` are kept (the oldest is dropped first).

Not served: OpenEnv's MCP endpoints (``/mcp``), which need a FastMCP server object inside the
environment; ``twin mcp`` (:mod:`integrations.mcp_server`) serves the same tools over MCP.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from integrations._episode import EpisodeBook, EpisodeNotFoundError, resolve_twin
from twin.core import Twin
from twin.errors import CaseError, MissingDependencyError

if TYPE_CHECKING:  # at run time these come from __getattr__, on first use
    from integrations._openenv_models import (
        TwinAction,
        TwinEnvClient,
        TwinEnvironment,
        TwinObservation,
        TwinState,
    )

__all__ = [
    "TwinAction",
    "TwinEnvClient",
    "TwinEnvironment",
    "TwinObservation",
    "TwinState",
    "build_app",
    "require_openenv",
    "running",
    "serve",
]

_INSTALL = "pip install 'twinrl[openenv]'"


def require_openenv() -> Any:
    """``openenv.core``, or a clear error saying how to install it."""
    try:
        import openenv.core as core
        from openenv.core.env_server.http_server import create_fastapi_app  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(
            "the OpenEnv bridge needs openenv-core>=0.3, which is not installed "
            f"({exc}): {_INSTALL}"
        ) from None
    return core


# -- models, environment and client: integrations._openenv_models, imported on first use -------
# (openenv-core is optional)
def _models() -> Any:
    """:mod:`integrations._openenv_models` (the OpenEnv classes), once openenv-core is known to
    be installed (a clear error otherwise)."""
    require_openenv()
    from integrations import _openenv_models

    return _openenv_models


def __getattr__(name: str) -> Any:
    if name in ("TwinAction", "TwinObservation", "TwinState", "TwinEnvironment", "TwinEnvClient"):
        return getattr(_models(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- server -------------------------------------------------------------------------------------
class _KeyGate:
    """ASGI middleware: every HTTP request and WebSocket but ``/health`` must carry the key, as
    ``Authorization: Bearer KEY`` or (for WebSocket clients that cannot set headers, such as
    OpenEnv's ``EnvClient``) the query parameter ``api_key``."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    def _allowed(self, scope: dict[str, Any]) -> bool:
        import hmac
        from urllib.parse import parse_qs

        given = ""
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                given = value.decode("latin-1").removeprefix("Bearer ").strip()
        if not given:
            query = parse_qs((scope.get("query_string") or b"").decode("latin-1"))
            given = (query.get("api_key") or [""])[0]
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] not in ("http", "websocket")
            or scope.get("path") == "/health"
            or self._allowed(scope)
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send(
                {"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"}
            )
            return
        body = b'{"detail": "missing or wrong API key: send Authorization: Bearer KEY"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def build_app(
    twin: Twin | str = "Catalog",
    *,
    max_concurrent_envs: int = 64,
    max_http_episodes: int = 1024,
    api_key: str | None = None,
    **config: Any,
) -> Any:
    """OpenEnv's FastAPI app serving ``twin`` (a :class:`Twin`, or a registered name with
    ``config``).

    Routes: OpenEnv's ``/ws``, ``/reset``, ``/step``, ``/state``, ``/schema``, ``/metadata``,
    ``/health``, plus ``GET /episodes/{episode_id}`` (an HTTP episode's state). With
    ``api_key``, every route but ``/health`` needs it (:class:`_KeyGate`).
    """
    models = _models()
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse
    from openenv.core.env_server.http_server import create_fastapi_app

    resolved = resolve_twin(twin, **config)
    book = EpisodeBook(max_http_episodes)
    app = create_fastapi_app(
        lambda: models.TwinEnvironment(resolved, book),
        models.TwinAction,
        models.TwinObservation,
        max_concurrent_envs=max_concurrent_envs,
    )

    async def bad_request(_request: Any, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": str(exc)})

    async def not_found(_request: Any, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=404, content={"detail": str(exc)})

    app.add_exception_handler(CaseError, bad_request)
    app.add_exception_handler(ValueError, bad_request)
    app.add_exception_handler(EpisodeNotFoundError, not_found)

    @app.get("/episodes/{episode_id}", tags=["twinrl"], summary="An HTTP episode's state")
    def episode_state(episode_id: str) -> dict[str, Any]:
        try:
            episode = book.get(episode_id)
        except EpisodeNotFoundError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None
        return models.state_of(episode, episode_id).model_dump()

    if api_key:
        app.add_middleware(_KeyGate, api_key=api_key)
    return app


def serve(
    twin: Twin | str = "Catalog",
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    **config: Any,
) -> None:
    """Serve ``twin`` with uvicorn until interrupted (binds ``host``, loopback by default; a
    warning on stderr when another address is bound without ``api_key``)."""
    import sys

    import uvicorn

    from integrations.mcp_server import open_warning

    warning = open_warning("the OpenEnv server", host, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    uvicorn.run(
        build_app(twin, api_key=api_key, **config),
        host=host,
        port=port,
        log_level="warning",
        ws="websockets",
    )


# -- serving in a background thread ----------------------------------------------------------------
def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(
    app: Any, host: str = "127.0.0.1", port: int | None = None, timeout_s: float = 30.0
) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a background thread; yields its ``http://host:port`` URL."""
    import uvicorn

    port = port or _free_port(host)
    # uvicorn's "websockets" protocol, not its newer sans-io one: with that, OpenEnv's /ws handler
    # logs a traceback for every client that closes (it closes an already closed socket).
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", ws="websockets")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*websockets.* implementation is deprecated")
        config.load()
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"openenv-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:  # bounded: the server starts or the wait fails
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(
                f"the OpenEnv server on {host}:{port} did not start within {timeout_s:.0f}s"
            )
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)


def main(argv: list[str] | None = None) -> None:
    """``python -m integrations.openenv_server TWIN [--host H] [--port P]``."""
    parser = argparse.ArgumentParser(description="Serve a twin as an OpenEnv environment.")
    parser.add_argument("twin", nargs="?", default="Catalog")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    ns = parser.parse_args(argv)
    import os

    serve(ns.twin, host=ns.host, port=ns.port, api_key=os.environ.get("TWINRL_API_KEY") or None)


if __name__ == "__main__":
    main()

"""A twin as an OpenEnv environment: OpenEnv's own server, client and wire protocol (openenv-core 0.3).

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
import asyncio
import contextlib
import socket
import statistics
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from integrations._episode import ToolCallEpisode, resolve_twin
from twin.core import Twin
from twin.errors import CaseError, MissingDependencyError
from twin.tools import thaw

__all__ = [
    "TwinAction",
    "TwinEnvClient",
    "TwinEnvironment",
    "TwinObservation",
    "TwinState",
    "bench",
    "build_app",
    "serve",
]

_INSTALL = "pip install 'twinrl[openenv]'"


def _require_openenv() -> Any:
    try:
        import openenv.core as core
        from openenv.core.env_server.http_server import create_fastapi_app  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(
            f"the OpenEnv bridge needs openenv-core>=0.3, which is not installed ({exc}): {_INSTALL}"
        ) from None
    return core


class EpisodeNotFoundError(LookupError):
    """An HTTP step or state for an episode id the server does not hold (never reset, or dropped)."""


class _EpisodeBook:
    """HTTP episodes by id, oldest dropped past ``limit``; shared by the request threads."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_id: OrderedDict[str, ToolCallEpisode] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, episode_id: str, episode: ToolCallEpisode) -> None:
        with self._lock:
            self._by_id[episode_id] = episode
            self._by_id.move_to_end(episode_id)
            while len(self._by_id) > self.limit:
                self._by_id.popitem(last=False)

    def get(self, episode_id: str) -> ToolCallEpisode:
        with self._lock:
            episode = self._by_id.get(episode_id)
        if episode is None:
            raise EpisodeNotFoundError(
                f"no episode {episode_id!r} on this server; reset with it first (the server keeps "
                f"the last {self.limit} HTTP episodes)"
            )
        return episode


# -- models, environment and client (built on first use: openenv-core is optional) --------------
_BUILT: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    if _BUILT:
        return _BUILT
    core = _require_openenv()
    from openenv.core.client_types import StepResult
    from pydantic import Field

    class TwinAction(core.Action):  # type: ignore[misc, name-defined]
        """One tool call of the twin's agent."""

        tool: str = Field(description="The tool's name, as in the observation's `tools`.")
        arguments: dict[str, Any] = Field(default_factory=dict, description="The tool's arguments.")

    class TwinObservation(core.Observation):  # type: ignore[misc, name-defined]
        """What the agent sees: the opening messages after reset, a tool's result after step."""

        episode_id: str | None = Field(default=None, description="The episode (name it in HTTP /step).")
        messages: list[dict[str, Any]] = Field(
            default_factory=list, description="Opening messages (reset)."
        )
        tools: list[dict[str, Any]] = Field(default_factory=list, description="Tool schemas (reset).")
        text: str = Field(default="", description="The tool's result, or what was wrong (step).")
        error: bool = Field(default=False, description="Whether the call failed.")
        reward_components: dict[str, float] | None = Field(
            default=None,
            description="Once done: each reward term's weighted share of `reward` (OpenEnv drops "
            "`metadata` on the wire, so they travel here too).",
        )

    class TwinState(core.State):  # type: ignore[misc, name-defined]
        """The episode's status; reward, submission and outcome only once it has ended."""

        status: str = "not_started"
        twin: str | None = None
        split: str | None = None
        index: int | None = None
        case_id: str | None = None
        turns: int = 0
        invalid_calls: int = 0
        submission: Any = None
        reward: dict[str, Any] | None = None
        outcome: Any = None

    class TwinEnvironment(core.Environment):  # type: ignore[misc, name-defined]
        """A twin's episode behind OpenEnv's ``reset`` / ``step`` / ``state``.

        Args:
            twin: The twin (shared read-only by every session).
            book: Where HTTP episodes are kept between requests (None: WebSocket sessions only).
        """

        # Each instance holds its own TwinEnv; the twin's world is shared read-only.
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self, twin: Twin, book: _EpisodeBook | None = None) -> None:
            super().__init__()
            self.twin = twin
            self._book = book
            # made by reset: HTTP builds one environment per request, most never reset
            self._episode: ToolCallEpisode | None = None
            self._episode_id: str | None = None

        def reset(  # type: ignore[override]
            self,
            seed: int | None = None,
            episode_id: str | None = None,
            split: str = "train",
            index: int | None = None,
            **unknown: Any,
        ) -> TwinObservation:
            """Start case ``(split, index)`` (``index=None``: drawn from ``seed``)."""
            if unknown:
                raise ValueError(
                    f"unknown reset option(s) {', '.join(sorted(unknown))}; the options are seed, "
                    "episode_id, split and index"
                )
            episode = ToolCallEpisode(self.twin)
            messages = episode.reset(split, index, seed)
            self._episode = episode
            self._episode_id = str(episode_id) if episode_id else uuid.uuid4().hex
            if self._book is not None:
                self._book.put(self._episode_id, episode)
            return TwinObservation(
                episode_id=self._episode_id,
                messages=thaw(messages),
                tools=thaw(self.twin.frozen_tool_schemas),
                text=str(messages[-1].get("content", "")) if messages else "",
            )

        def step(  # type: ignore[override]
            self, action: TwinAction, timeout_s: float | None = None, episode_id: str | None = None
        ) -> TwinObservation:
            """Run ``action`` as one assistant turn; ``episode_id`` picks an HTTP episode."""
            episode = self._episode
            if episode_id and self._book is not None:
                episode = self._book.get(episode_id)
            if episode is None or not episode.started:
                raise ValueError(
                    "reset() the episode before a step (over HTTP each request gets a fresh "
                    "environment: send the reset's episode_id with the step, "
                    '{"action": ..., "episode_id": ...})'
                )
            if episode.done:
                return TwinObservation(
                    episode_id=episode_id or self._episode_id,
                    text="Error: the episode has ended; reset to start another.",
                    error=True, done=True, reward=episode.final_reward(),
                )
            text, failed = episode.call(action.tool, action.arguments)
            done = episode.done
            terms = episode.final_terms() if done else None
            return TwinObservation(
                episode_id=episode_id or self._episode_id, text=text, error=failed, done=done,
                reward=episode.final_reward() if done else None, reward_components=terms,
                metadata={"reward_components": terms} if terms else {},
            )

        @property
        def state(self) -> TwinState:
            """This session's episode status (see :func:`_state_of`)."""
            if self._episode is None:
                return TwinState()
            return _state_of(self._episode, self._episode_id)

        def get_metadata(self) -> Any:
            from openenv.core.env_server.types import EnvironmentMetadata

            return EnvironmentMetadata(
                name=f"twinrl/{self.twin.name}",
                description=f"The {self.twin.name} twin: its tools, controlled cases and reward.",
            )

    def _state_of(episode: ToolCallEpisode, episode_id: str | None) -> TwinState:
        report = episode.report()
        return TwinState(episode_id=episode_id, step_count=int(report.get("turns") or 0), **report)

    class TwinEnvClient(core.EnvClient):  # type: ignore[misc, name-defined]
        """OpenEnv's WebSocket client, typed for a twin."""

        def _step_payload(self, action: TwinAction) -> dict[str, Any]:
            return {"tool": action.tool, "arguments": action.arguments}

        def _parse_result(self, payload: dict[str, Any]) -> Any:
            obs = TwinObservation(**payload.get("observation", {}), reward=payload.get("reward"),
                                  done=bool(payload.get("done", False)))
            return StepResult(observation=obs, reward=payload.get("reward"), done=obs.done)

        def _parse_state(self, payload: dict[str, Any]) -> TwinState:
            return TwinState(**payload)

    _BUILT.update(TwinAction=TwinAction, TwinObservation=TwinObservation, TwinState=TwinState,
                  TwinEnvironment=TwinEnvironment, TwinEnvClient=TwinEnvClient, state_of=_state_of)
    return _BUILT


def __getattr__(name: str) -> Any:
    if name in ("TwinAction", "TwinObservation", "TwinState", "TwinEnvironment", "TwinEnvClient"):
        return _build()[name]
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
        if scope["type"] not in ("http", "websocket") or scope.get("path") == "/health" \
                or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
            return
        body = b'{"detail": "missing or wrong API key: send Authorization: Bearer KEY"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def build_app(
    twin: Twin | str = "Catalog",
    *,
    max_concurrent_envs: int = 64,
    max_http_episodes: int = 1024,
    api_key: str | None = None,
    **config: Any,
) -> Any:
    """OpenEnv's FastAPI app serving ``twin`` (a :class:`Twin`, or a registered name with ``config``).

    Routes: OpenEnv's ``/ws``, ``/reset``, ``/step``, ``/state``, ``/schema``, ``/metadata``,
    ``/health``, plus ``GET /episodes/{episode_id}`` (an HTTP episode's state). With
    ``api_key``, every route but ``/health`` needs it (:class:`_KeyGate`).
    """
    built = _build()
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse
    from openenv.core.env_server.http_server import create_fastapi_app

    resolved = resolve_twin(twin, **config)
    book = _EpisodeBook(max_http_episodes)
    env_cls = built["TwinEnvironment"]
    app = create_fastapi_app(
        lambda: env_cls(resolved, book), built["TwinAction"], built["TwinObservation"],
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
        return built["state_of"](episode, episode_id).model_dump()

    if api_key:
        app.add_middleware(_KeyGate, api_key=api_key)
    return app


def serve(
    twin: Twin | str = "Catalog", host: str = "127.0.0.1", port: int = 8000,
    api_key: str | None = None, **config: Any,
) -> None:
    """Serve ``twin`` with uvicorn until interrupted (binds ``host``, loopback by default; a
    warning on stderr when another address is bound without ``api_key``)."""
    import sys

    import uvicorn

    from integrations.mcp_server import open_warning

    warning = open_warning("the OpenEnv server", host, api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    uvicorn.run(build_app(twin, api_key=api_key, **config), host=host, port=port,
                log_level="warning", ws="websockets")


# -- benchmark ----------------------------------------------------------------------------------
def _echo_app() -> Any:
    """OpenEnv's echo example (``envs/echo_env`` in the OpenEnv repository, not on PyPI): the
    message comes back with its length, reward ``0.1 * length``; same server code as ours."""
    core = _require_openenv()
    from openenv.core.env_server.http_server import create_fastapi_app

    class EchoAction(core.Action):  # type: ignore[misc, name-defined]
        message: str

    class EchoObservation(core.Observation):  # type: ignore[misc, name-defined]
        echoed_message: str = ""
        message_length: int = 0

    class EchoEnvironment(core.Environment):  # type: ignore[misc, name-defined]
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state = core.State(episode_id=uuid.uuid4().hex, step_count=0)

        def reset(  # type: ignore[override]
            self, seed: int | None = None, episode_id: str | None = None
        ) -> EchoObservation:
            self._state = core.State(episode_id=uuid.uuid4().hex, step_count=0)
            return EchoObservation(echoed_message="Echo environment ready!", reward=0.0)

        def step(  # type: ignore[override]
            self, action: EchoAction, timeout_s: float | None = None
        ) -> EchoObservation:
            self._state.step_count += 1
            n = len(action.message)
            return EchoObservation(echoed_message=action.message, message_length=n, reward=n * 0.1)

        @property
        def state(self) -> Any:
            return self._state

    class EchoClient(core.EnvClient):  # type: ignore[misc, name-defined]
        def _step_payload(self, action: Any) -> dict[str, Any]:
            return dict(action)

        def _parse_result(self, payload: dict[str, Any]) -> Any:
            from openenv.core.client_types import StepResult

            return StepResult(observation=payload.get("observation"), reward=payload.get("reward"),
                              done=bool(payload.get("done")))

        def _parse_state(self, payload: dict[str, Any]) -> Any:
            return payload

    app = create_fastapi_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=8)
    app.state.client_cls = EchoClient
    return app


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


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
        "n": float(len(ordered)),
    }


async def _ws_pair(
    mine: Any, theirs: Any, steps: int, my_action: Any, their_action: Any, reset: dict[str, Any]
) -> tuple[list[float], list[float]]:
    """Alternate one timed step of each client (load on the machine hits both alike)."""
    a: list[float] = []
    b: list[float] = []
    await mine.reset(**reset)
    await theirs.reset()
    for _ in range(steps):
        t0 = time.perf_counter()
        result = await mine.step(my_action)
        a.append(time.perf_counter() - t0)
        if result.done:  # the turn budget ran out: a new episode, untimed
            await mine.reset(**reset)
        t0 = time.perf_counter()
        await theirs.step(their_action)
        b.append(time.perf_counter() - t0)
    return a, b


def _http_pair(
    my_url: str, their_url: str, steps: int, my_action: dict[str, Any], their_action: dict[str, Any],
    reset: dict[str, Any],
) -> tuple[list[float], list[float]]:
    """:func:`_ws_pair` over OpenEnv's HTTP ``/reset`` and ``/step`` (the twin's steps name its
    episode)."""
    import httpx

    a: list[float] = []
    b: list[float] = []
    with (
        httpx.Client(base_url=my_url, timeout=30.0) as mine,
        httpx.Client(base_url=their_url, timeout=30.0) as theirs,
    ):
        def start() -> str:
            response = mine.post("/reset", json=reset)
            response.raise_for_status()
            return str(response.json()["observation"]["episode_id"])

        episode_id = start()
        theirs.post("/reset", json={}).raise_for_status()
        for _ in range(steps):
            t0 = time.perf_counter()
            response = mine.post("/step", json={"action": my_action, "episode_id": episode_id})
            a.append(time.perf_counter() - t0)
            response.raise_for_status()
            if response.json().get("done"):
                episode_id = start()
            t0 = time.perf_counter()
            theirs.post("/step", json={"action": their_action}).raise_for_status()
            b.append(time.perf_counter() - t0)
    return a, b


def bench(
    twin: str = "Catalog",
    steps: int = 300,
    tool: str = "search_taxonomy",
    arguments: dict[str, Any] | None = None,
    split: str = "test",
    index: int = 0,
    transports: tuple[str, ...] | str = ("ws", "http"),
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Step latency of ``twin`` served by OpenEnv vs OpenEnv's echo environment, in one run.

    Both servers run in this process on 127.0.0.1 (uvicorn), and OpenEnv's own client drives
    them: the WebSocket ``EnvClient`` and plain HTTP ``POST /step``, one step of each in turn so
    that load on the machine hits both alike. Each timed step of the twin is the call
    ``tool(**arguments)`` (default: a Catalog taxonomy search); each of the echo environment
    echoes the same arguments' text. When the twin's turn budget ends an episode, a new one
    starts outside the timing.

    Returns:
        ``{transport: {"twin": {...}, "echo": {...}, "ratio": twin median / echo median}}`` with
        median, p90 and mean in milliseconds.
    """
    built = _build()
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if isinstance(transports, str):  # the CLI's --transports ws,http
        transports = tuple(t.strip() for t in transports.split(",") if t.strip())
    unknown = set(transports) - {"ws", "http"}
    if unknown:
        raise ValueError(f"unknown transports {sorted(unknown)}; use ws and/or http")
    args = dict(arguments) if arguments is not None else {"query": "electrical boxes", "limit": 3}
    message = " ".join(str(v) for v in args.values())
    reset = {"split": split, "index": index}
    action_cls = built["TwinAction"]
    results: dict[str, Any] = {}
    echo = _echo_app()
    with running(build_app(twin)) as twin_url, running(echo) as echo_url:
        for transport in transports:
            if transport == "ws":
                async def run() -> tuple[list[float], list[float]]:
                    async with built["TwinEnvClient"](base_url=twin_url) as mine, \
                            echo.state.client_cls(base_url=echo_url) as theirs:
                        call = action_cls(tool=tool, arguments=args)
                        return await _ws_pair(mine, theirs, steps, call, {"message": message}, reset)

                mine, theirs = asyncio.run(run())
            else:
                mine, theirs = _http_pair(twin_url, echo_url, steps, {"tool": tool, "arguments": args},
                                          {"message": message}, reset)
            row = {"twin": _summary(mine), "echo": _summary(theirs)}
            row["ratio"] = row["twin"]["median_ms"] / row["echo"]["median_ms"]
            results[transport] = row
            out(
                f"{transport:>4}: {twin} step median {row['twin']['median_ms']:.3f} ms "
                f"(p90 {row['twin']['p90_ms']:.3f}), echo median {row['echo']['median_ms']:.3f} ms "
                f"(p90 {row['echo']['p90_ms']:.3f}), ratio {row['ratio']:.2f}x  [{steps} steps]"
            )
    return results


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

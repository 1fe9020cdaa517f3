"""``twin bench openenv``: step latency of a twin served by OpenEnv vs OpenEnv's echo environment.

Both servers run in this process on 127.0.0.1 (uvicorn, :func:`integrations.openenv_server.running`)
and OpenEnv's own clients drive them, one step of each in turn::

    twin bench openenv                                  # Catalog, 300 steps, WebSocket and HTTP
    twin bench openenv --steps 1000 --transports ws
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from integrations import openenv_server
from integrations.openenv_server import build_app, require_openenv, running

__all__ = ["step_latency"]


def _echo_app() -> Any:
    """OpenEnv's echo example (``envs/echo_env`` in the OpenEnv repository, not on PyPI): the
    message comes back with its length, reward ``0.1 * length``; same server code as ours."""
    core = require_openenv()
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

            return StepResult(
                observation=payload.get("observation"),
                reward=payload.get("reward"),
                done=bool(payload.get("done")),
            )

        def _parse_state(self, payload: dict[str, Any]) -> Any:
            return payload

    app = create_fastapi_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=8)
    app.state.client_cls = EchoClient
    return app


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
    my_url: str,
    their_url: str,
    steps: int,
    my_action: dict[str, Any],
    their_action: dict[str, Any],
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


def step_latency(
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
    require_openenv()
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
    action_cls = openenv_server.TwinAction
    results: dict[str, Any] = {}
    echo = _echo_app()
    with running(build_app(twin)) as twin_url, running(echo) as echo_url:
        for transport in transports:
            if transport == "ws":

                async def run() -> tuple[list[float], list[float]]:
                    async with (
                        openenv_server.TwinEnvClient(base_url=twin_url) as mine,
                        echo.state.client_cls(base_url=echo_url) as theirs,
                    ):
                        call = action_cls(tool=tool, arguments=args)
                        return await _ws_pair(
                            mine, theirs, steps, call, {"message": message}, reset
                        )

                mine, theirs = asyncio.run(run())
            else:
                mine, theirs = _http_pair(
                    twin_url,
                    echo_url,
                    steps,
                    {"tool": tool, "arguments": args},
                    {"message": message},
                    reset,
                )
            row = {"twin": _summary(mine), "echo": _summary(theirs)}
            row["ratio"] = row["twin"]["median_ms"] / row["echo"]["median_ms"]
            results[transport] = row
            out(
                f"{transport:>4}: {twin} step median {row['twin']['median_ms']:.3f} ms "
                f"(p90 {row['twin']['p90_ms']:.3f}), echo median {row['echo']['median_ms']:.3f} ms "
                f"(p90 {row['echo']['p90_ms']:.3f}), ratio {row['ratio']:.2f}x  [{steps} steps]"
            )
    return results

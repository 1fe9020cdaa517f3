"""Benchmark of ``twin serve``'s HTTP layer (asyncio + h11) against FastAPI + uvicorn.

``python -m bench.serving [--clients 8] [--seconds 3] [--rounds 3] [--core fake|tiny]``

Each stack serves the same core in a child process (so the server does not share the client's
GIL) on a loopback port; ``clients`` threads each keep one connection open and post the same
``/v1/completions`` body back to back for ``seconds``. Rounds alternate the stacks so that load
from other processes falls on all of them; the table shows the median round of each stack
(requests/s, p50 latency) and its ratio to ``twin-serve``, the layer ``twin serve`` uses
(``trainer/serving/http.py``).

Stacks:

- ``twin-serve``: ``trainer/serving/http.py`` as served.
- ``fastapi``: the candidate the layer was measured against: the same routes and core on FastAPI
  + uvicorn (httptools, uvloop when installed), with the API key and body-size checks as plain
  ASGI code and the blocking core calls in a thread pool of ``http_threads``. It leaves out the
  connection cap, stalled-connection answers and chunked-body refusal of the served layer, which
  would only add work. ``pip install 'twinrl[bench]'`` brings FastAPI and uvicorn.

Cores: ``fake`` validates each body with the server's request model and answers a fixed
completion (the HTTP layer's own cost); ``tiny`` is the completions server on the tiny test model
with a 4-token request (what sampling costs around it).
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations
# (``request: Request``) at run time, and Request is imported inside asgi_app.
import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from trainer.serving.api import ServeLimits, ServerError, completion_request_model, validate
from twin.errors import ConfigError

__all__ = ["STACKS", "FakeCore", "Result", "asgi_app", "main", "measure"]

STACKS = ("twin-serve", "fastapi")
CORES = ("fake", "tiny")

#: The request every client sends: a 200-token prompt, as the trainer sends token ids.
BODY = {
    "model": "bench",
    "prompt": list(range(1, 201)),
    "max_tokens": 4,
    "logprobs": 0,
    "ignore_eos": True,
    "return_token_ids": True,
    "seed": 0,
}


class FakeCore:
    """A served model that validates like the completions server and answers a fixed completion."""

    def __init__(self, limits: ServeLimits | None = None) -> None:
        self.limits = limits or ServeLimits()
        self._request_model = completion_request_model(self.limits)

    def models(self) -> dict[str, Any]:
        """One model card."""
        return {
            "object": "list",
            "data": [{"id": "bench", "object": "model", "max_model_len": 2048}],
        }

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """Validate ``body``; answer four fixed tokens."""
        validate(self._request_model, body, "completions request")
        ids = [5, 6, 7, 8]
        choice = {
            "index": 0,
            "text": "",
            "token_ids": ids,
            "finish_reason": "length",
            "stop_reason": None,
            "logprobs": {"token_logprobs": [-0.5] * 4, "tokens": [f"token_id:{t}" for t in ids]},
        }
        return {
            "id": "cmpl-bench",
            "object": "text_completion",
            "model": "bench",
            "choices": [choice],
        }

    def load_lora_adapter(self, body: dict[str, Any]) -> str:
        """Refuse: the fake core has no adapters."""
        raise ServerError("the benchmark core loads no adapters", 400)

    unload_lora_adapter = load_lora_adapter


def asgi_app(core: Any, api_key: str | None = None) -> Any:
    """The ``fastapi`` candidate: ``twin serve``'s routes over ``core`` as a FastAPI app."""
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    from trainer.serving.http import OPEN_ROUTES, _key_matches

    limits: ServeLimits = core.limits
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    threads = anyio.CapacityLimiter(limits.http_threads)

    def answer(code: int, payload: Any, headers: dict[str, str] | None = None) -> Response:
        if isinstance(payload, str):
            return Response(payload, code, headers=headers, media_type="text/plain; charset=utf-8")
        return Response(
            json.dumps(payload, allow_nan=False),
            code,
            headers=headers,
            media_type="application/json",
        )

    async def call(request: Request, handler: Any) -> Response:
        try:
            length = int(request.headers.get("content-length") or 0)
            if length > limits.max_body_bytes:
                raise ServerError(
                    f"the request body has {length} bytes; at most {limits.max_body_bytes}", 413
                )
            with anyio.fail_after(limits.read_timeout):
                raw = await request.body()
            try:
                body = json.loads(raw or b"{}")
            except (RecursionError, ValueError) as exc:
                raise ServerError(f"the request body is not valid UTF-8 JSON: {exc}", 400) from None
            if not isinstance(body, dict):
                raise ServerError(
                    f"the request body must be a JSON object, got {type(body).__name__}", 400
                )
            return answer(200, await anyio.to_thread.run_sync(handler, body, limiter=threads))
        except ServerError as exc:
            return answer(exc.code, exc.body())

    @app.get("/health")
    async def health() -> Response:
        return answer(200, "")

    @app.get("/v1/models")
    async def models() -> Response:
        return answer(200, core.models())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await call(request, core.completions)

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> Response:
        return await call(request, core.load_lora_adapter)

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> Response:
        return await call(request, core.unload_lora_adapter)

    if api_key is None:
        return app

    async def keyed(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not _key_matches(header, api_key):
                error = ServerError("missing or wrong API key", 401).body()
                denied = answer(401, error, {"WWW-Authenticate": "Bearer"})
                await denied(scope, receive, send)
                return
        await app(scope, receive, send)

    return keyed


def _core(kind: str) -> Any:
    if kind == "fake":
        return FakeCore()
    from trainer.models import load_model
    from trainer.serving.completions import CompletionServer

    model, tokenizer = load_model("tiny", "float32")
    return CompletionServer(model, tokenizer, model_name="bench")


def _serve(stack: str, core_kind: str) -> None:
    """Child process: serve ``core_kind`` with ``stack`` on a free loopback port, print the port."""
    core = _core(core_kind)
    if stack == "twin-serve":
        from trainer.serving import http as layer

        httpd = layer.make_http_server(core, "127.0.0.1", 0)
        print(httpd.server_address[1], flush=True)
        httpd.serve_forever()
        return
    import importlib.util

    import uvicorn

    # a socket of protocol TCP: asyncio sets TCP_NODELAY only on those
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(
        asgi_app(core),
        log_level="warning",
        access_log=False,
        lifespan="off",
        http="httptools" if importlib.util.find_spec("httptools") else "h11",
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        timeout_keep_alive=int(core.limits.read_timeout),
        limit_concurrency=core.limits.max_connections,
    )
    uvicorn.Server(config).run(sockets=[sock])


@dataclass
class Result:
    """One stack's measurement: answers per second and the median latency (ms) of one round."""

    stack: str
    requests: int
    requests_per_s: float
    p50_ms: float


def _load(port: int, clients: int, seconds: float, body: bytes) -> tuple[int, float, float]:
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a client like httpx
        mine = []
        while time.perf_counter() < stop:
            start = time.perf_counter()
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            mine.append(time.perf_counter() - start)
            if response.status != 200:
                with lock:
                    failures.append(f"HTTP {response.status}: {data[:200]!r}")
                break
        conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures or not latencies:
        raise RuntimeError(f"the benchmark request failed: {failures[:1] or 'no answers'}")
    return (
        len(latencies),
        len(latencies) / (time.perf_counter() - began),
        statistics.median(latencies) * 1000,
    )


def measure(
    stacks: tuple[str, ...] = STACKS,
    *,
    clients: int = 8,
    seconds: float = 3.0,
    rounds: int = 3,
    core: str = "fake",
) -> dict[str, Result]:
    """Each stack's median round (by requests/s), rounds alternating between the stacks.

    Raises:
        ConfigError: an unknown stack or core, or a count below 1.
    """
    unknown = [s for s in stacks if s not in STACKS]
    if unknown or core not in CORES or clients < 1 or rounds < 1 or seconds <= 0:
        raise ConfigError(
            f"bench serving: stacks from {', '.join(STACKS)} (got {', '.join(stacks)}), core from "
            f"{', '.join(CORES)} (got {core}), clients and rounds >= 1, seconds > 0"
        )
    body = json.dumps(BODY).encode()
    runs: dict[str, list[Result]] = {s: [] for s in stacks}
    for _ in range(rounds):
        for stack in stacks:
            child = subprocess.Popen(
                [sys.executable, "-m", "bench.serving", "--serve", stack, "--core", core],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert child.stdout is not None
                line = child.stdout.readline()
                if not line.strip().isdigit():
                    raise RuntimeError(
                        f"the {stack} server did not start (exit code {child.wait(30)})"
                    )
                port = int(line)
                _load(
                    port, 1, min(0.5, seconds), body
                )  # warm up: imports, first batch, thread pool
                n, rps, p50 = _load(port, clients, seconds, body)
                runs[stack].append(Result(stack, n, rps, p50))
            finally:
                child.terminate()
                child.wait(30)
    return {s: sorted(r, key=lambda x: x.requests_per_s)[len(r) // 2] for s, r in runs.items()}


def main(
    stacks: tuple[str, ...] = STACKS,
    *,
    clients: int = 8,
    seconds: float = 3.0,
    rounds: int = 3,
    core: str = "fake",
) -> dict[str, Result]:
    """Measure and print one line per stack, with its ratios to ``twin-serve``."""
    results = measure(stacks, clients=clients, seconds=seconds, rounds=rounds, core=core)
    base = results.get("twin-serve")
    print(
        f"twin serve HTTP layer, core={core}, {clients} clients x {seconds:g} s, median of "
        f"{rounds} round(s)"
    )
    for r in results.values():
        ratio = (
            f"  x{r.requests_per_s / base.requests_per_s:.2f} req/s, x{r.p50_ms / base.p50_ms:.2f} "
            "p50 vs twin-serve"
            if base is not None and r is not base
            else ""
        )
        print(
            f"  {r.stack:18s} {r.requests_per_s:8.0f} req/s  p50 {r.p50_ms:7.2f} ms  ({r.requests} "
            f"requests){ratio}"
        )
    return results


def _cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serving", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--stacks", default=",".join(STACKS), help=f"comma-separated, from {', '.join(STACKS)}"
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--core", default="fake", choices=CORES)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve, args.core)
        return
    main(
        tuple(s for s in args.stacks.split(",") if s),
        clients=args.clients,
        seconds=args.seconds,
        rounds=args.rounds,
        core=args.core,
    )


if __name__ == "__main__":
    _cli()

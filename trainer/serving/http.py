"""The HTTP layer of ``twin serve``: authentication, a bounded server, exposure warnings.

:class:`trainer.serving.completions.CompletionServer` holds the model and the batching worker;
this module puts it on a socket without letting a client hold more than its share (see
``docs/security.md``):

- Optional API key (``Authorization: Bearer``, compared in constant time); ``/health``, ``/ping``
  and ``/version`` stay open for load balancers.
- :func:`make_http_server`: one asyncio event loop reads every request with h11 (a client that
  sends slowly holds no thread), a deadline for each whole request, the API key checked on the
  head before any body byte is read, a cap on open connections (503 beyond it), on body size
  (413) and on the bytes of all bodies in flight (:class:`BodyBudget`); a fixed pool of threads
  runs the handlers (``trainer/serving/api.py``'s :class:`ServeLimits` holds every limit).

Client side, :func:`auth_headers` gives the header the trainer's clients send (the key from
``$TWINRL_API_KEY`` unless given).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import http
import ipaddress
import json
import logging
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol

import h11

from trainer.serving.api import API_KEY_ENV, ServeLimits, ServerError

__all__ = [
    "MAX_HEAD_BYTES",
    "OPEN_ROUTES",
    "BodyBudget",
    "ServedModel",
    "auth_headers",
    "exposure_warnings",
    "is_loopback",
    "make_http_server",
]

log = logging.getLogger("twinrl.serve")

#: Routes answered without an API key (health checks of load balancers and process managers).
OPEN_ROUTES = frozenset({"/health", "/ping", "/version"})


class ServedModel(Protocol):
    """What the HTTP layer calls on the model server
    (:class:`trainer.serving.completions.CompletionServer`).

    A protocol, so that this layer needs nothing from the module that builds on it.
    """

    limits: ServeLimits

    def models(self) -> dict[str, Any]:
        """The ``/v1/models`` answer."""
        ...

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """Answer a ``/v1/completions`` body."""
        ...

    def load_lora_adapter(self, body: dict[str, Any]) -> str:
        """Load the adapter a ``/v1/load_lora_adapter`` body names."""
        ...

    def unload_lora_adapter(self, body: dict[str, Any]) -> str:
        """Unload the adapter a ``/v1/unload_lora_adapter`` body names."""
        ...


# -- authentication -------------------------------------------------------------------------------
def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """``{"Authorization": "Bearer KEY"}`` for a client of ``twin serve``; ``{}`` without a key.

    ``api_key`` defaults to ``$TWINRL_API_KEY``, the variable the server reads too, so a trainer
    that starts its own server and the clients it makes agree without passing the key around.
    """
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


def _key_matches(header: str | None, key: str) -> bool:
    """Does an ``Authorization`` header carry ``key``? Digests of equal length compared in constant
    time."""
    scheme, _, token = (header or "").strip().partition(" ")
    return hmac.compare_digest(_digest(token.strip()), _digest(key)) and scheme.lower() == "bearer"


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warnings(host: str, api_key: str | None, adapter_root: str | None) -> list[str]:
    """What is unsafe about serving on ``host`` with these settings (empty when nothing is)."""
    if is_loopback(host):
        return []
    warnings = []
    if not api_key:
        warnings.append(
            f"binding {host} without an API key: anyone who can reach this port can sample and "
            f"load adapters; set ${API_KEY_ENV} (or --api-key) and see docs/security.md"
        )
    if not adapter_root:
        warnings.append(
            f"binding {host} without --adapter-root: a client can load an adapter from any folder "
            "this process can read"
        )
    return warnings


# -- the HTTP server ------------------------------------------------------------------------------
#: Largest request head (request line + headers); a longer one is answered 431 and closed.
MAX_HEAD_BYTES = 64 << 10
_READ_CHUNK = 64 << 10


class _Deadline(Exception):
    """The request did not arrive whole before its deadline."""


class _Closed(Exception):
    """The client closed the connection."""


def _timeout_at(deadline: float) -> Any:
    """``asyncio.timeout_at`` (Python 3.11+; no task per wait, unlike
    ``wait_for``) or a stand-in."""
    if hasattr(asyncio, "timeout_at"):
        return asyncio.timeout_at(deadline)
    return _TimeoutAt(deadline)


class _TimeoutAt:
    """Python 3.10's stand-in for ``asyncio.timeout_at``: cancel the task at ``deadline`` and
    turn that cancellation into ``asyncio.TimeoutError``."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.fired = False
        self.handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None

        def fire() -> None:
            self.fired = True
            task.cancel()

        self.handle = asyncio.get_running_loop().call_at(self.deadline, fire)

    async def __aexit__(self, kind: object, exc: object, tb: object) -> None:
        assert self.handle is not None
        self.handle.cancel()
        if self.fired and kind is asyncio.CancelledError:
            raise asyncio.TimeoutError from None


class BodyBudget:
    """The bytes of request bodies in flight (read, parsed or being answered) on all connections.

    A request reserves its ``Content-Length`` before its body is read and gives it back when its
    answer is sent; a reservation that does not fit waits (without reading) until others give
    theirs back or its request's deadline passes. Used by one event loop only.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._freed: asyncio.Condition | None = None

    async def acquire(self, size: int, timeout: float) -> bool:
        """Reserve ``size`` bytes within ``timeout`` seconds; False when they never fit."""
        if self._freed is None:
            self._freed = asyncio.Condition()
        if size > self.limit:
            return False
        if self.used + size <= self.limit:  # the common case: no wait, no lock
            self.used += size
            return True
        async with self._freed:
            try:
                await asyncio.wait_for(
                    self._freed.wait_for(lambda: self.used + size <= self.limit), max(timeout, 0.0)
                )
            except asyncio.TimeoutError:
                return False
            self.used += size
            return True

    async def release(self, size: int) -> None:
        """Give back a reservation of ``size`` bytes."""
        assert self._freed is not None
        async with self._freed:
            self.used -= size
            self._freed.notify_all()


class _Answer(NamedTuple):
    code: int
    data: bytes
    kind: str
    headers: tuple[tuple[str, str], ...] = ()


def _answer(code: int, payload: Any, headers: tuple[tuple[str, str], ...] = ()) -> _Answer:
    if isinstance(payload, str):
        return _Answer(code, payload.encode(), "text/plain; charset=utf-8", headers)
    try:
        data = json.dumps(payload, allow_nan=False).encode()
    except ValueError as exc:  # NaN/inf would not be JSON
        code, data = (
            500,
            json.dumps(ServerError(f"the response is not valid JSON: {exc}", 500).body()).encode(),
        )
    return _Answer(code, data, "application/json", headers)


def _error(exc: ServerError) -> _Answer:
    extra = (("WWW-Authenticate", "Bearer"),) if exc.code == 401 else ()
    if exc.code == 503:
        extra += (("Retry-After", "1"),)
    return _answer(exc.code, exc.body(), extra)


def _parse_body(raw: bytes | bytearray) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise ServerError("the request body is nested too deeply", 400) from None
    except (
        ValueError
    ) as exc:  # JSONDecodeError, UnicodeDecodeError, an int over Python's digit limit
        raise ServerError(
            f"the request body is not valid UTF-8 JSON: {_short(str(exc))}", 400
        ) from None
    if not isinstance(body, dict):
        raise ServerError(f"the request body must be a JSON object, got {type(body).__name__}", 400)
    return body


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Request(NamedTuple):
    method: str
    path: str
    headers: dict[bytes, bytes]


class _AsyncHTTPServer:
    """``twin serve``'s HTTP server: one asyncio event loop reads every request, a fixed pool of
    threads runs the handlers.

    A connection costs no thread while its request arrives, so clients that send slowly (a
    header byte at a time) hold no handler and ``/health`` keeps answering. Each request must
    arrive whole (head and body) within ``read_timeout`` of its first moment (408 otherwise, and
    an idle keep-alive connection is closed then); the API key is checked on the head, before any
    body byte is read; bodies are reserved against :class:`BodyBudget` before they are read.
    """

    def __init__(
        self, address: tuple[str, int], core: ServedModel, limits: ServeLimits, api_key: str | None
    ) -> None:
        self.core = core
        self.limits = limits
        self.api_key = api_key or None
        host, port = address
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(sockaddr)
            # socketserver's backlog is 5: a trainer opening 64+ connections at once would
            # be refused
            self.socket.listen(1024)
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        self.server_address: tuple[Any, ...] = self.socket.getsockname()
        self.budget = BodyBudget(limits.body_budget_bytes)
        self._pool = ThreadPoolExecutor(
            max_workers=limits.http_threads, thread_name_prefix="twin-serve-http"
        )
        self._open = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._running = threading.Event()
        self._stopped = threading.Event()
        self._stop_requested = False

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed (each counts against ``max_connections``)."""
        return self._open

    # -- life cycle --------------------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until :meth:`shutdown` (``poll_interval`` is accepted for
        ``HTTPServer`` parity)."""
        self._stopped.clear()
        try:
            asyncio.run(self._main())
        finally:
            self._running.clear()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop :meth:`serve_forever` (from another thread) and wait until it has returned."""
        self._stop_requested = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._running.is_set():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop already closed
                return
            self._stopped.wait()

    def server_close(self) -> None:
        """Close the listening socket and drop the requests still waiting for a handler thread."""
        self.socket.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._connection, sock=self.socket, limit=_READ_CHUNK)
        self._running.set()
        if self._stop_requested:
            self._stop.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- one connection ----------------------------------------------------------------------------
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # the head and body of an answer are two writes: with Nagle's algorithm the body would
            # wait for the client's delayed ACK of the head (~40 ms on Linux) on every request
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._open >= self.limits.max_connections:
            busy = ServerError(
                f"too many open connections (at most {self.limits.max_connections}); retry later",
                503,
            )
            await self._refuse(writer, _error(busy))
            return
        self._open += 1
        try:
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
            while await self._one_request(conn, reader, writer):
                conn.start_next_cycle()
        except (_Closed, ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # the server is stopping
            pass
        except Exception:  # one connection's failure must not stop the server
            log.debug("connection failed", exc_info=True)
        finally:
            self._open -= 1
            writer.close()

    async def _refuse(self, writer: asyncio.StreamWriter, answer: _Answer) -> None:
        head = (
            f"HTTP/1.1 {answer.code} {http.HTTPStatus(answer.code).phrase}\r\nContent-Type: "
            f"{answer.kind}\r\n"
            f"Content-Length: {len(answer.data)}\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in answer.headers)
            + "Connection: close\r\n\r\n"
        )
        try:
            writer.write(head.encode() + answer.data)
            await asyncio.wait_for(writer.drain(), 1.0)
        except (asyncio.TimeoutError, OSError):
            pass
        finally:
            writer.close()

    async def _next_event(
        self, conn: h11.Connection, reader: asyncio.StreamReader, deadline: float
    ) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                async with _timeout_at(deadline):
                    data = await reader.read(_READ_CHUNK)
            except asyncio.TimeoutError:
                raise _Deadline from None
            conn.receive_data(data)  # b"": the client closed (h11 then reports it)

    async def _one_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Read, answer and account one request; True when the connection may carry another."""
        assert self._loop is not None
        # the whole request, head and body, must arrive within read_timeout; an idle keep-alive
        # connection counts as a request that has not arrived
        deadline = self._loop.time() + self.limits.read_timeout
        try:
            event = await self._next_event(conn, reader, deadline)
        except _Deadline:
            if conn.their_state is h11.IDLE and not conn.trailing_data[0]:
                return False  # idle: close quietly
            await self._send(conn, writer, _error(self._late()), close=True)
            return False
        except h11.RemoteProtocolError as exc:
            await self._protocol_error(conn, writer, exc)
            return False
        if isinstance(event, h11.ConnectionClosed) or not isinstance(event, h11.Request):
            return False
        # h11 caps an incomplete head; one that arrives whole in a single read is measured here
        head_bytes = (
            len(event.method)
            + len(event.target)
            + sum(len(n) + len(v) + 4 for n, v in event.headers)
        )
        if head_bytes > MAX_HEAD_BYTES:
            too_long = ServerError(f"the request head is longer than {MAX_HEAD_BYTES} bytes", 431)
            await self._send(conn, writer, _error(too_long), close=True)
            return False
        request = _Request(
            event.method.decode("latin-1"),
            event.target.decode("latin-1").split("?", 1)[0],
            {name: value for name, value in event.headers},
        )
        answer = self._head_answer(request)
        if answer is not None:  # refused on its head: the body stays unread
            await self._send(conn, writer, answer, close=conn.their_state is not h11.DONE)
            return False if conn.their_state is not h11.DONE else conn.our_state is h11.DONE
        if request.method == "GET":
            whole = isinstance(conn.next_event(), h11.EndOfMessage)  # no body: the request is whole
            if whole:
                answer = await self._get(request.path)
            else:
                answer = _error(ServerError("a GET request must not have a body", 400))
            await self._send(conn, writer, answer, close=not whole)
            return conn.our_state is h11.DONE and conn.their_state is h11.DONE
        return await self._post(conn, reader, writer, request, deadline)

    def _late(self) -> ServerError:
        return ServerError(
            f"the request did not arrive whole within {self.limits.read_timeout:g} s", 408
        )

    async def _protocol_error(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, exc: h11.RemoteProtocolError
    ) -> None:
        code = exc.error_status_hint if exc.error_status_hint in (400, 413, 414, 431) else 400
        if code == 431 or "exceeded" in str(exc):
            message = f"the request head is longer than {MAX_HEAD_BYTES} bytes"
            code = 431
        else:
            message = f"malformed HTTP request: {_short(str(exc))}"
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await self._refuse(writer, _answer(code, ServerError(message, code).body()))

    def _head_answer(self, request: _Request) -> _Answer | None:
        """The answer a request gets on its head alone (auth, route, body size), or None."""
        if request.method not in ("GET", "POST"):
            return _error(
                ServerError(f"method {request.method} is not supported; use GET or POST", 405)
            )
        authorization = request.headers.get(b"authorization", b"").decode("latin-1")
        if self.api_key is not None and request.path not in OPEN_ROUTES:  # noqa: SIM102
            if not _key_matches(authorization, self.api_key):
                return _error(
                    ServerError("missing or wrong API key: send 'Authorization: Bearer <key>'", 401)
                )
        if request.method == "GET":
            return None
        if request.path not in _POST_ROUTES:
            return _error(
                ServerError(f"no route POST {request.path}; routes: {', '.join(_POST_ROUTES)}", 404)
            )
        if b"transfer-encoding" in request.headers:
            return _error(
                ServerError("chunked request bodies are not supported; send a Content-Length", 400)
            )
        length = int(request.headers.get(b"content-length", b"0"))
        if length > self.limits.max_body_bytes:
            return _error(
                ServerError(
                    f"the request body has {length} bytes; at most {self.limits.max_body_bytes} "
                    "are allowed (twin serve --max-body-bytes)",
                    413,
                )
            )
        return None

    async def _get(self, path: str) -> _Answer:
        if path in ("/health", "/ping"):
            return _answer(200, "")
        if path == "/version":
            return _answer(200, {"version": "twinrl"})
        if path == "/v1/models":
            return await self._in_pool(lambda: _answer(200, self.core.models()))
        return _error(ServerError(f"no route GET {path}", 404))

    async def _post(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
        request: _Request, deadline: float,
    ) -> bool:  # fmt: skip
        assert self._loop is not None
        length = int(request.headers.get(b"content-length", b"0"))
        if not await self.budget.acquire(length, deadline - self._loop.time()):
            busy = ServerError(
                f"the server is reading {self.budget.limit} bytes of other request bodies "
                "(twin serve --body-budget-bytes); retry later",
                503,
            )
            await self._send(conn, writer, _error(busy), close=True)
            return False
        try:
            if conn.they_are_waiting_for_100_continue:
                writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
            body = bytearray()
            try:
                while True:
                    event = await self._next_event(conn, reader, deadline)
                    if isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:  # ConnectionClosed
                        return False
            except _Deadline:
                await self._send(conn, writer, _error(self._late()), close=True)
                return False
            except h11.RemoteProtocolError as exc:
                await self._protocol_error(conn, writer, exc)
                return False
            handler = _POST_ROUTES[request.path]
            answer = await self._in_pool(functools.partial(self._handle, handler, body))
            del body
        finally:
            await self.budget.release(length)
        await self._send(conn, writer, answer)
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE

    def _handle(self, route: str, raw: bytearray) -> _Answer:
        """Run in a pool thread: parse the body, call the model server, encode the answer."""
        try:
            return _answer(200, getattr(self.core, route)(_parse_body(raw)))
        except ServerError as exc:
            return _error(exc)
        except Exception as exc:
            log.exception("request failed")
            return _error(ServerError(_short(f"{type(exc).__name__}: {exc}"), 500))

    async def _in_pool(self, fn: Any) -> _Answer:
        assert self._loop is not None
        return await self._loop.run_in_executor(self._pool, fn)

    async def _send(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        answer: _Answer,
        *,
        close: bool = False,
    ) -> None:
        headers = [
            ("Content-Type", answer.kind),
            ("Content-Length", str(len(answer.data))),
            *answer.headers,
        ]
        if close:
            headers.append(("Connection", "close"))
        try:
            data = conn.send(
                h11.Response(
                    status_code=answer.code,
                    headers=headers,
                    reason=http.HTTPStatus(answer.code).phrase,
                )
            )
            data += conn.send(h11.Data(data=answer.data)) + conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # the connection cannot carry an answer any more
            return
        writer.write(data)
        try:
            async with _timeout_at(asyncio.get_running_loop().time() + self.limits.read_timeout):
                await writer.drain()
        except asyncio.TimeoutError:  # a client that does not read its answer
            raise _Closed from None


#: ``POST`` routes and the :class:`ServedModel` method answering each.
_POST_ROUTES = {
    "/v1/completions": "completions",
    "/v1/load_lora_adapter": "load_lora_adapter",
    "/v1/unload_lora_adapter": "unload_lora_adapter",
}


def make_http_server(
    core: ServedModel,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    limits: ServeLimits | None = None,
    api_key: str | None = None,
) -> _AsyncHTTPServer:
    """An HTTP server answering vLLM's routes with ``core`` (call ``serve_forever``; ``shutdown``
    from another thread, then ``server_close``).

    Args:
        core: The model server.
        host, port: Where to listen (port 0: a free one, see ``server_address``).
        limits: Connection limits (default: ``core.limits``).
        api_key: Required as ``Authorization: Bearer`` on every route but ``/health``, ``/ping``
            and ``/version``; None: no authentication.
    """
    return _AsyncHTTPServer((host, port), core, limits or core.limits, api_key)

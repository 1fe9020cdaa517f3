"""The HTTP layer of ``twin serve``: authentication, a bounded server, exposure warnings.

:class:`trainer.serving.completions.CompletionServer` holds the model and the batching worker;
this module puts it on a socket without letting a client hold more than its share (see
``docs/security.md``):

- Optional API key (``Authorization: Bearer``, compared in constant time); ``/health``, ``/ping``
  and ``/version`` stay open for load balancers.
- :func:`make_http_server`: a fixed pool of handler threads, a read timeout on every connection,
  a cap on open connections (503 beyond it) and on body size (``trainer/serving/api.py``'s
  :class:`ServeLimits`).

Client side, :func:`auth_headers` gives the header the trainer's clients send (the key from
``$TWINRL_API_KEY`` unless given).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Protocol

from trainer.serving.api import API_KEY_ENV, ServeLimits, ServerError

__all__ = [
    "OPEN_ROUTES",
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
    """What the HTTP layer calls on the model server (:class:`trainer.serving.completions.CompletionServer`).

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
    """Does an ``Authorization`` header carry ``key``? Digests of equal length compared in constant time."""
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
            f"binding {host} without an API key: anyone who can reach this port can sample and load "
            f"adapters; set ${API_KEY_ENV} (or --api-key) and see docs/security.md"
        )
    if not adapter_root:
        warnings.append(
            f"binding {host} without --adapter-root: a client can load an adapter from any folder this "
            "process can read"
        )
    return warnings


# -- the HTTP server ------------------------------------------------------------------------------
_CONTENT_LENGTH = re.compile(r"[0-9]{1,15}")


class _Handler(BaseHTTPRequestHandler):
    server: _PooledHTTPServer
    protocol_version = "HTTP/1.1"
    # The head and the body of an answer are two writes: with Nagle's algorithm the body would
    # wait for the client's delayed ACK of the head (~40 ms on Linux) on every request.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        # StreamRequestHandler applies this to the socket: a client that stops sending (a body
        # shorter than its Content-Length, an idle keep-alive) frees its thread after it
        self.timeout = self.server.limits.read_timeout
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, code: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        if isinstance(payload, str):
            data, kind = payload.encode(), "text/plain; charset=utf-8"
        else:
            try:
                data, kind = json.dumps(payload, allow_nan=False).encode(), "application/json"
            except ValueError as exc:  # NaN/inf would not be JSON
                code, kind = 500, "application/json"
                data = json.dumps(ServerError(f"the response is not valid JSON: {exc}", 500).body()).encode()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _fail(self, exc: ServerError, *, close: bool = False) -> None:
        if close:  # the rest of the body is still unread: this connection cannot carry another request
            self.close_connection = True
        extra = {"WWW-Authenticate": "Bearer"} if exc.code == 401 else None
        self._send(exc.code, exc.body(), extra)

    def _body(self) -> dict[str, Any]:
        limits = self.server.limits
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise ServerError("chunked request bodies are not supported; send a Content-Length", 400)
        raw_length = self.headers.get("Content-Length")
        if raw_length is None:
            length = 0
        elif not _CONTENT_LENGTH.fullmatch(raw_length.strip()):
            self.close_connection = True
            raise ServerError(f"Content-Length must be a non-negative integer, got {raw_length[:40]!r}", 400)
        else:
            length = int(raw_length)
        if length > limits.max_body_bytes:
            self.close_connection = True
            raise ServerError(
                f"the request body has {length} bytes; at most {limits.max_body_bytes} are allowed "
                "(twin serve --max-body-bytes)",
                413,
            )
        raw = self.rfile.read(length) if length else b""
        if len(raw) < length:
            self.close_connection = True
            raise ServerError(f"the request body ended after {len(raw)} of {length} bytes", 400)
        try:
            body = json.loads(raw or b"{}")
        except RecursionError:
            raise ServerError("the request body is nested too deeply", 400) from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int over Python's digit limit
            raise ServerError(f"the request body is not valid UTF-8 JSON: {exc}", 400) from None
        if not isinstance(body, dict):
            raise ServerError(f"the request body must be a JSON object, got {type(body).__name__}", 400)
        return body

    def _authorized(self, path: str) -> bool:
        key = self.server.api_key
        if key is None or path in OPEN_ROUTES:
            return True
        if _key_matches(self.headers.get("Authorization"), key):
            return True
        self._fail(
            ServerError("missing or wrong API key: send 'Authorization: Bearer <key>'", 401), close=True
        )
        return False

    def do_GET(self) -> None:
        core = self.server.core
        path = self.path.split("?", 1)[0]
        if not self._authorized(path):
            return
        if path in ("/health", "/ping"):
            self._send(200, "")
        elif path == "/v1/models":
            self._send(200, core.models())
        elif path == "/version":
            self._send(200, {"version": "twinrl"})
        else:
            self._fail(ServerError(f"no route GET {path}", 404))

    def do_POST(self) -> None:
        core = self.server.core
        path = self.path.split("?", 1)[0]
        if not self._authorized(path):
            return
        routes = {
            "/v1/completions": core.completions,
            "/v1/load_lora_adapter": core.load_lora_adapter,
            "/v1/unload_lora_adapter": core.unload_lora_adapter,
        }
        handler = routes.get(path)
        try:
            if handler is None:
                raise ServerError(f"no route POST {path}; routes: {', '.join(routes)}", 404)
            self._send(200, handler(self._body()))
        except ServerError as exc:
            self._fail(exc)
        except TimeoutError:
            self._fail(
                ServerError(f"the request body did not arrive within {self.server.limits.read_timeout:g} s", 408),
                close=True,
            )
        except Exception as exc:
            log.exception("request failed")
            self._fail(ServerError(f"{type(exc).__name__}: {exc}", 500))


class _PooledHTTPServer(HTTPServer):
    """An HTTP server whose connections are served by a fixed pool of threads.

    ``ThreadingHTTPServer`` starts a thread per connection, so stalled clients add threads without
    bound. Here at most ``http_threads`` connections are served at once, the rest wait (accepted)
    for a thread, and beyond ``max_connections`` open connections a new one is answered 503.
    """

    # socketserver's default backlog is 5: a trainer opening 64+ connections at once would see
    # refused connections. Requests wait in the batching queue instead.
    request_queue_size = 1024

    def __init__(
        self, address: tuple[str, int], core: ServedModel, limits: ServeLimits, api_key: str | None
    ) -> None:
        super().__init__(address, _Handler)
        self.core = core
        self.limits = limits
        self.api_key = api_key or None
        self._pool = ThreadPoolExecutor(max_workers=limits.http_threads, thread_name_prefix="twin-serve-http")
        self._open = 0
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            busy = self._open >= self.limits.max_connections
            if not busy:
                self._open += 1
        if busy:
            self._refuse(request)
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - one connection's failure must not end the pool thread
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._open_lock:
                self._open -= 1

    def _refuse(self, request: socket.socket) -> None:
        body = json.dumps(
            ServerError(f"too many open connections (at most {self.limits.max_connections}); retry later", 503).body()
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        try:
            request.settimeout(1.0)
            request.sendall(head.encode() + body)
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("connection from %s failed", client_address, exc_info=True)

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_http_server(
    core: ServedModel,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    limits: ServeLimits | None = None,
    api_key: str | None = None,
) -> HTTPServer:
    """An HTTP server answering vLLM's routes with ``core`` (call ``serve_forever``).

    Args:
        core: The model server.
        host, port: Where to listen (port 0: a free one, see ``server_address``).
        limits: Connection limits (default: ``core.limits``).
        api_key: Required as ``Authorization: Bearer`` on every route but ``/health``, ``/ping``
            and ``/version``; None: no authentication.
    """
    return _PooledHTTPServer((host, port), core, limits or core.limits, api_key)

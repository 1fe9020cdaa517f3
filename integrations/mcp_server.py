"""A twin's tools as an MCP server (``twin mcp TWIN``), one episode per client session.

::

    twin mcp Returns                                  # stdio (an agent harness starts it)
    twin mcp Catalog --http --port 8765               # streamable HTTP at http://127.0.0.1:8765/mcp

What each side of the connection sees:

- **Tools** (``tools/list``, ``tools/call``): exactly the twin's tools, with the schemas the
  twin's agent sees, nothing else. Each call is one assistant turn of a :class:`twin.env.TwinEnv`
  (validation, error text, turn budget, hidden arguments injected by the twin). A failed call,
  and a call the server could not run (its message included), comes back with ``isError``.
- **Prompt** ``case`` (``prompts/get``, arguments ``split`` and ``index``): the harness starts
  (or restarts) the session's episode on that controlled case and gets its opening messages,
  worded for a host with native tool calling (the twin's lines that teach a text format for
  calls are left out). Calling a tool first starts a case drawn from the ``train`` split.
- **Resource** ``twin://episode`` (``resources/read``): the episode's status for the harness;
  its reward (total and components), submission and outcome appear only once the episode has
  ended (a terminal tool succeeded or the turn budget ran out).

Why the agent cannot reach the reward or the truth: MCP hands a model only the *tools* a server
lists (prompts are chosen by the user or harness, resources by the host application), and this
server lists no tool but the twin's own, which never receive the case's truth. Even a host that
showed resources to the model would show nothing truth-derived while the agent can still act:
before the episode ends ``reward``, ``submission`` and ``outcome`` are null, and after it ends
every tool call is refused.

Sessions: over stdio one server process is one session. Over streamable HTTP each MCP session
(``Mcp-Session-Id``, made by the ``initialize`` handshake) has its own episode. The SDK's default
client (``mode="auto"``) asks for the sessionless 2026 protocol first; this server declines it
(JSON-RPC -32022 naming the handshake versions), so the client falls back to the handshake and
gets a session. A client pinned to the sessionless protocol gets that refusal, whose message
names the fix (``mode="legacy"`` or ``"auto"``). :class:`SessionBook` bounds the sessions: one
without requests for ``idle_timeout_s`` expires with its episode, at most ``max_sessions`` live
at once, and a new session past the cap is refused (HTTP 503) rather than evicting a live one.
A request on an expired or closed session is an error that says so.

Episodes that end (terminal call or turn budget) are written to the run store when the server
has one (``twin mcp`` opens ``$TWINRL_STORE`` or ``runs/twinrl.db`` unless ``--no-store``): one
``eval`` run per server process, policy ``mcp``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from integrations._episode import ToolCallEpisode, resolve_twin
from twin.core import Twin
from twin.errors import CaseError, MissingDependencyError

__all__ = ["EPISODE_URI", "SessionBook", "SessionGone", "build_app", "build_server", "serve"]

#: The harness-only resource holding the session's episode status and, at the end, its reward.
EPISODE_URI = "twin://episode"
_PROMPT = "case"
_GONE_KEPT = 4096  # expired/closed session ids remembered, so their next call says why it fails

log = logging.getLogger("twinrl.mcp")

# JSON-RPC error codes (the MCP SDK's values)
_INVALID_REQUEST, _INVALID_PARAMS, _UNSUPPORTED_VERSION = -32600, -32602, -32022


def _require_mcp() -> Any:
    try:
        import mcp_types
        from mcp.server.lowlevel import Server
    except ImportError as exc:
        raise MissingDependencyError(
            f"twin mcp needs the MCP SDK, a dependency of twinrl missing here ({exc}): "
            "pip install 'mcp>=2,<3'"
        ) from None
    return Server, mcp_types


class SessionGone(LookupError):
    """A request named a session that expired, was closed by its client, or never existed."""


class _Session:
    __slots__ = ("episode", "last")

    def __init__(self, now: float) -> None:
        self.episode: ToolCallEpisode | None = None
        self.last = now


class SessionBook:
    """The live sessions of one server and their episodes (one event loop: no locking needed).

    Args:
        twin: The twin every episode plays.
        max_sessions: Most live sessions; :meth:`admit` refuses past it (none is evicted).
        idle_timeout_s: A session with no request for this long expires with its episode.
        clock: Seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        twin: Twin,
        *,
        max_sessions: int = 1024,
        idle_timeout_s: float = 1800.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sessions < 1 or idle_timeout_s <= 0:
            raise ValueError(
                "need max_sessions >= 1 and idle_timeout_s > 0, got "
                f"{max_sessions}, {idle_timeout_s}"
            )
        self.twin = twin
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._live: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._pending = 0

    def __len__(self) -> int:
        return len(self._live)

    def sweep(self) -> None:
        """Expire every session idle for ``idle_timeout_s`` or more."""
        now = self._clock()
        while self._live:
            key, session = next(iter(self._live.items()))
            if now - session.last < self.idle_timeout_s:
                break
            self.close(key, f"expired after {self.idle_timeout_s:g} s without requests")

    def admit(self) -> bool:
        """Reserve room for a new session (False: at the cap). Pair with :meth:`opened` or
        :meth:`abandon`."""
        self.sweep()
        if len(self._live) + self._pending >= self.max_sessions:
            return False
        self._pending += 1
        return True

    def abandon(self) -> None:
        """Give back a reservation whose session was not created."""
        self._pending = max(0, self._pending - 1)

    def opened(self, key: str, *, reserved: bool = True) -> None:
        """Record the new session ``key`` (made by the handshake)."""
        if reserved:
            self.abandon()
        self._live[key] = _Session(self._clock())

    def touch(self, key: str) -> str | None:
        """Note a request on ``key``; the reason it is gone, or None when it is live."""
        self.sweep()
        session = self._live.get(key)
        if session is None:
            return self._gone.get(key)
        session.last = self._clock()
        self._live.move_to_end(key)
        return None

    def close(self, key: str, reason: str) -> None:
        """End session ``key`` and drop its episode; later requests on it get ``reason``."""
        if self._live.pop(key, None) is not None:
            self._gone[key] = reason
            while len(self._gone) > _GONE_KEPT:
                self._gone.popitem(last=False)

    def episode(self, key: str) -> ToolCallEpisode:
        """The episode of session ``key`` (made on first use).

        Raises:
            SessionGone: ``key`` expired or was closed; the message says which.
        """
        session = self._live.get(key)
        if session is None:
            if key in self._gone:
                raise SessionGone(_gone_message(key, self._gone[key]))
            session = self._live[key] = _Session(self._clock())  # stdio: the one session
        if session.episode is None:
            session.episode = ToolCallEpisode(self.twin)
        return session.episode


def _gone_message(key: str, reason: str) -> str:
    return (
        f"MCP session {key[:16]}... has ended ({reason}); its episode is gone. Open a new session "
        "(reconnect the client) and get the 'case' prompt to start another episode."
    )


def _session_key(ctx: Any) -> str:
    """The HTTP ``Mcp-Session-Id`` of the request, or ``""`` (stdio: the process)."""
    request = getattr(ctx, "request", None)
    headers = getattr(request, "headers", None)
    if headers is not None:
        return str(headers.get("mcp-session-id") or "")
    return ""


# The twins' prompts teach a text format for calls (for models without native tool calling);
# an MCP host calls tools natively, so those sentences are left out of the `case` prompt.
_TEXT_CALL_SENTENCE = re.compile(r"[^.\n]*<tool_call>.*?</tool_call>\.?[ \t]*")
_NATIVE_CALLS = "Call the tools through the tool-calling interface."


def native_tool_calling(text: str) -> str:
    """``text`` without sentences that describe ``<tool_call>`` text calls (and saying to call
    tools natively when there were any)."""
    cleaned = _TEXT_CALL_SENTENCE.sub("", text)
    if cleaned == text:
        return text
    return cleaned.rstrip() + ("\n\n" if "\n" in cleaned else " ") + _NATIVE_CALLS


class _Recorder:
    """Writes ended episodes to a run store: one ``eval`` run, started on the first episode."""

    def __init__(self, store: Any, twin: Twin) -> None:
        self.store = store
        self.twin = twin
        self.run_id: int | None = None
        self.count = 0

    def record(self, episode: ToolCallEpisode) -> None:
        trajectory = episode.trajectory
        if self.store is None or trajectory is None:
            return
        try:
            if self.run_id is None:
                self.run_id = self.store.start_run(
                    "eval",
                    twin=self.twin.name,
                    policy="mcp",
                    config={"source": "twin mcp", **self.twin.config.model_dump(mode="json")},
                )
            self.store.add_episodes(self.run_id, [trajectory.model_copy(update={"policy": "mcp"})])
            self.count += 1
        except Exception as exc:  # noqa: BLE001 - the store is a record; the episode went fine
            log.warning("run store: episode %s not stored: %s", trajectory.case_id, exc)

    def close(self) -> None:
        if self.store is None:
            return
        try:
            if self.run_id is not None:
                self.store.finish_run(self.run_id, metrics={"episodes": self.count})
        except Exception as exc:  # noqa: BLE001
            log.warning("run store: run %s not finished: %s", self.run_id, exc)


class _Handlers:
    """The MCP request handlers of one server: tools, the ``case`` prompt and the episode
    resource, each on the calling session's episode."""

    def __init__(self, twin: Twin, sessions: SessionBook, recorder: _Recorder, types: Any) -> None:
        from mcp.shared.exceptions import MCPError

        self.twin = twin
        self.sessions = sessions
        self.recorder = recorder
        self.types = types
        self.error = MCPError
        self.tools = [
            types.Tool(
                name=t.name,
                description=t.description,
                input_schema=t.schema["function"]["parameters"],
            )
            for t in twin.tools
        ]

    def episode_of(self, ctx: Any) -> ToolCallEpisode:
        try:
            return self.sessions.episode(_session_key(ctx))
        except SessionGone as exc:
            raise self.error(_INVALID_REQUEST, str(exc)) from None

    def tool_result(self, text: str, *, is_error: bool) -> Any:
        content = [self.types.TextContent(type="text", text=text)]
        return self.types.CallToolResult(content=content, is_error=is_error)

    async def list_tools(self, ctx: Any, params: Any) -> Any:
        return self.types.ListToolsResult(tools=self.tools)

    async def call_tool(self, ctx: Any, params: Any) -> Any:
        episode = self.episode_of(ctx)
        try:
            if not episode.started:
                episode.reset("train")
            if episode.done:
                return self.tool_result(
                    "Error: the episode has ended; no tool runs now. The harness starts another "
                    "with the 'case' prompt.",
                    is_error=True,
                )
            text, failed = episode.call(params.name, params.arguments or {})
        except Exception as exc:  # noqa: BLE001 - the client gets the message, the log one line
            log.warning("tool %s failed: %s: %s", params.name, type(exc).__name__, exc)
            return self.tool_result(
                f"Error: the server could not run {params.name}: {type(exc).__name__}: {exc}",
                is_error=True,
            )
        if episode.done:
            self.recorder.record(episode)
        return self.tool_result(text, is_error=failed)

    async def list_prompts(self, ctx: Any, params: Any) -> Any:
        types = self.types
        splits = ", ".join(self.twin.splits)
        split = types.PromptArgument(name="split", description=f"One of: {splits}.", required=False)
        index = types.PromptArgument(
            name="index", description="The case index in the split.", required=False
        )
        prompt = types.Prompt(
            name=_PROMPT,
            description=f"Start this session's {self.twin.name} episode on a controlled case; "
            "returns its opening messages.",
            arguments=[split, index],
        )
        return types.ListPromptsResult(prompts=[prompt])

    async def get_prompt(self, ctx: Any, params: Any) -> Any:
        if params.name != _PROMPT:
            raise self.error(
                _INVALID_PARAMS, f"unknown prompt {params.name!r}; the only prompt is {_PROMPT!r}"
            )
        args = dict(params.arguments or {})
        unknown = set(args) - {"split", "index"}
        if unknown:
            raise self.error(
                _INVALID_PARAMS,
                f"unknown prompt arguments {sorted(unknown)}; allowed: split, index",
            )
        episode = self.episode_of(ctx)
        try:
            messages = episode.reset(args.get("split") or "train", args.get("index"))
        except CaseError as exc:
            raise self.error(_INVALID_PARAMS, str(exc)) from None
        out = []
        for m in messages:
            role, text = m.get("role"), str(m.get("content") or "")
            if role == "system":  # MCP prompts carry user and assistant messages only
                role, text = "user", f"[system]\n{native_tool_calling(text)}"
            content = self.types.TextContent(type="text", text=text)
            out.append(self.types.PromptMessage(role=role, content=content))
        report = episode.report()
        return self.types.GetPromptResult(description=f"{report['case_id']}", messages=out)

    async def list_resources(self, ctx: Any, params: Any) -> Any:
        resource = self.types.Resource(
            uri=EPISODE_URI,
            name="episode",
            mime_type="application/json",
            description="This session's episode: status; reward, submission and outcome once it "
            "has ended.",
        )
        return self.types.ListResourcesResult(resources=[resource])

    async def read_resource(self, ctx: Any, params: Any) -> Any:
        if str(params.uri) != EPISODE_URI:
            raise self.error(
                _INVALID_PARAMS,
                f"unknown resource {params.uri!s}; the only resource is {EPISODE_URI}",
            )
        report = self.episode_of(ctx).report()
        contents = self.types.TextResourceContents(
            uri=EPISODE_URI,
            mime_type="application/json",
            text=json.dumps(report, ensure_ascii=False),
        )
        return self.types.ReadResourceResult(contents=[contents])


def build_server(
    twin: Twin | str,
    *,
    max_sessions: int = 1024,
    idle_timeout_s: float = 1800.0,
    store: Any = None,
    book: SessionBook | None = None,
    **config: Any,
) -> Any:
    """The MCP server (``mcp.server.lowlevel.Server``) of ``twin``; see the module docstring.

    Args:
        twin: A twin or a registered twin name (built with ``config``, e.g. ``max_turns=12``).
        max_sessions: Most live sessions (HTTP); a new one past it is refused.
        idle_timeout_s: Seconds without requests after which a session expires.
        store: A run store (``twin.store.RunStore``'s interface) for ended episodes, or None.
        book: The sessions (default: a new :class:`SessionBook`); :func:`build_app` shares it.
    """
    Server, types = _require_mcp()
    the_twin = resolve_twin(twin, **config)
    sessions = book or SessionBook(
        the_twin, max_sessions=max_sessions, idle_timeout_s=idle_timeout_s
    )
    recorder = _Recorder(store, the_twin)
    handlers = _Handlers(the_twin, sessions, recorder, types)
    server = Server(
        f"twin-{the_twin.name}",
        version=str(the_twin.version),
        instructions=the_twin.description or None,
        on_list_tools=handlers.list_tools,
        on_call_tool=handlers.call_tool,
        on_list_prompts=handlers.list_prompts,
        on_get_prompt=handlers.get_prompt,
        on_list_resources=handlers.list_resources,
        on_read_resource=handlers.read_resource,
    )
    server.twin_sessions = sessions  # type: ignore[attr-defined]  # build_app's gate shares it
    server.twin_recorder = recorder  # type: ignore[attr-defined]
    return server


# -- streamable HTTP -----------------------------------------------------------------------------
def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _json_error(send: Any, status: int, code: int, message: str, data: Any = None) -> None:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    body = json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _SessionGate:
    """ASGI middleware in front of the SDK's streamable-HTTP app: the key, the protocol era, the
    session cap and expiry (see the module docstring)."""

    def __init__(self, app: Any, book: SessionBook, api_key: str | None) -> None:
        self.app = app
        self.book = book
        self.api_key = api_key

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan: the SDK's session manager starts here
            await self.app(scope, receive, send)
            return
        if self.api_key is not None:
            given = _header(scope, b"authorization") or ""
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                await _json_error(
                    send,
                    401,
                    _INVALID_REQUEST,
                    "missing or wrong API key: send 'Authorization: Bearer KEY'",
                )
                return
        from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

        version = _header(scope, b"mcp-protocol-version")
        if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
            await _json_error(
                send,
                400,
                _UNSUPPORTED_VERSION,
                f"protocol {version} has no sessions, and twin mcp keeps one episode per MCP "
                "session: connect with the initialize handshake (the SDK's Client(url, "
                "mode='legacy'), or mode='auto', its default, which falls back to it)",
                {"supported": list(HANDSHAKE_PROTOCOL_VERSIONS), "requested": version},
            )
            return
        key = _header(scope, b"mcp-session-id")
        if key:
            await self._existing(key, scope, receive, send)
        elif scope.get("method") == "POST":
            await self._new(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _existing(self, key: str, scope: dict[str, Any], receive: Any, send: Any) -> None:
        reason = self.book.touch(key)
        if reason is not None:
            await _json_error(send, 404, _INVALID_REQUEST, _gone_message(key, reason))
            return
        status: list[int] = []

        async def watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        await self.app(scope, receive, watch)
        if scope.get("method") == "DELETE" and status and status[0] < 300:
            self.book.close(key, "closed by its client")

    async def _new(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self.book.admit():
            await _json_error(
                send,
                503,
                _INVALID_REQUEST,
                f"this server already holds {self.book.max_sessions} MCP sessions (its "
                "--max-sessions); a session frees when its client closes it or after "
                f"{self.book.idle_timeout_s:g} s without requests",
            )
            return
        opened: list[str] = []

        async def watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and not opened:
                for name, value in message.get("headers") or ():
                    if name.lower() == b"mcp-session-id":
                        opened.append(value.decode("latin-1"))
                        self.book.opened(opened[0])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            if not opened:
                self.book.abandon()


def build_app(
    twin: Twin | str,
    *,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    max_sessions: int = 1024,
    idle_timeout_s: float = 1800.0,
    store: Any = None,
    **config: Any,
) -> Any:
    """The streamable-HTTP ASGI app of ``twin`` at ``/mcp`` (see the module docstring).

    Args:
        host: The interface it will be served on (loopback turns on the SDK's DNS-rebinding
            protection).
        api_key: When set, every request must send ``Authorization: Bearer KEY``.
        max_sessions, idle_timeout_s, store, config: As :func:`build_server`.
    """
    server = build_server(
        twin, max_sessions=max_sessions, idle_timeout_s=idle_timeout_s, store=store, **config
    )
    app = server.streamable_http_app(host=host)
    # The SDK's own expiry frees a session's transport; the gate expires its episode no later.
    server.session_manager.session_idle_timeout = idle_timeout_s
    gate = _SessionGate(app, server.twin_sessions, api_key)
    gate.server = server  # type: ignore[attr-defined]
    return gate


def is_loopback(host: str) -> bool:
    """True for an address or name that only this machine reaches."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_warning(what: str, host: str, api_key: str | None) -> str | None:
    """The warning to print when a server without a key binds an address others can reach."""
    if api_key or is_loopback(host):
        return None
    return (
        f"warning: {what} on {host} has no API key: anyone who can reach this port can play "
        "episodes and fill the run store; set $TWINRL_API_KEY (or --api-key) or bind 127.0.0.1"
    )


def serve(
    twin: Twin | str,
    *,
    transport: str = "stdio",
    host: str = "127.0.0.1",
    port: int = 8765,
    api_key: str | None = None,
    max_sessions: int = 1024,
    idle_timeout_s: float = 1800.0,
    store: Any = None,
    **config: Any,
) -> None:
    """Serve ``twin`` over ``transport`` (``"stdio"`` or ``"http"``: streamable HTTP at ``/mcp``).

    Args:
        store: A run store for ended episodes (closed, its run finished, when serving stops).

    Raises:
        ValueError: another transport.
    """
    if transport not in ("stdio", "http"):
        raise ValueError(f"transport must be 'stdio' or 'http', got {transport!r}")
    if transport == "http":
        import uvicorn

        warning = open_warning("twin mcp", host, api_key)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        app = build_app(
            twin,
            host=host,
            api_key=api_key,
            max_sessions=max_sessions,
            idle_timeout_s=idle_timeout_s,
            store=store,
            **config,
        )
        try:
            uvicorn.run(app, host=host, port=port, log_level="warning")
        finally:
            app.server.twin_recorder.close()
        return
    server = build_server(twin, store=store, **config)  # first: a missing SDK is one line
    import anyio
    from mcp.server.stdio import stdio_server

    async def run() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    try:
        anyio.run(run)
    finally:
        server.twin_recorder.close()


if __name__ == "__main__":  # pragma: no cover - `python -m integrations.mcp_server Returns`
    serve(sys.argv[1] if len(sys.argv) > 1 else "Returns")

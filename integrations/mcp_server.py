"""A twin's tools as an MCP server (``twin mcp TWIN``), one episode per client session.

::

    twin mcp Returns                                  # stdio (an agent harness starts it)
    twin mcp Catalog --http --port 8765               # streamable HTTP at http://127.0.0.1:8765/mcp

What each side of the connection sees:

- **Tools** (``tools/list``, ``tools/call``): exactly the twin's tools, with the schemas the
  twin's agent sees, nothing else. Each call is one assistant turn of a :class:`twin.env.TwinEnv`
  (validation, error text, turn budget, hidden arguments injected by the twin). A failed call
  comes back with ``isError`` and says what was wrong.
- **Prompt** ``case`` (``prompts/get``, arguments ``split`` and ``index``): the harness starts
  (or restarts) the session's episode on that controlled case and gets its opening messages.
  Calling a tool first starts a case drawn from the ``train`` split.
- **Resource** ``twin://episode`` (``resources/read``): the episode's status for the harness;
  its reward (total and components), submission and outcome appear only once the episode has
  ended (a terminal tool succeeded or the turn budget ran out).

Why the agent cannot reach the reward or the truth: MCP hands a model only the *tools* a server
lists (prompts are chosen by the user or harness, resources by the host application), and this
server lists no tool but the twin's own, which never receive the case's truth. Even a host that
showed resources to the model would show nothing truth-derived while the agent can still act:
before the episode ends ``reward``, ``submission`` and ``outcome`` are null, and after it ends
every tool call is refused.

Sessions: over stdio one server process is one session (a harness starts one per episode
slot). Over streamable HTTP each MCP session (``Mcp-Session-Id``, handshake-era clients) has its
own episode (at most ``max_sessions`` are kept; the oldest is dropped first); requests without a
session id (the sessionless 2026 protocol) share the process's one episode, so run one HTTP
server per concurrent episode for such clients.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from typing import Any

from integrations._episode import ToolCallEpisode, resolve_twin
from twin.core import Twin
from twin.errors import CaseError, MissingDependencyError

__all__ = ["EPISODE_URI", "build_server", "serve"]

#: The harness-only resource holding the session's episode status and, at the end, its reward.
EPISODE_URI = "twin://episode"
_PROMPT = "case"


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


def _session_key(ctx: Any) -> str:
    """The HTTP ``Mcp-Session-Id`` of the request, or ``""`` (stdio, sessionless HTTP: the process)."""
    request = getattr(ctx, "request", None)
    headers = getattr(request, "headers", None)
    if headers is not None:
        return str(headers.get("mcp-session-id") or "")
    return ""


class _Episodes:
    """The episode of each client session, by :func:`_session_key` (oldest dropped past the cap)."""

    def __init__(self, twin: Twin, max_sessions: int) -> None:
        self.twin = twin
        self.max_sessions = max_sessions
        self._by_key: OrderedDict[str, ToolCallEpisode] = OrderedDict()

    def get(self, ctx: Any) -> ToolCallEpisode:
        key = _session_key(ctx)
        episode = self._by_key.get(key)
        if episode is None:
            episode = self._by_key[key] = ToolCallEpisode(self.twin)
            while len(self._by_key) > self.max_sessions:
                self._by_key.popitem(last=False)
        return episode


def build_server(twin: Twin | str, *, max_sessions: int = 1024, **config: Any) -> Any:
    """The MCP server (``mcp.server.lowlevel.Server``) of ``twin``; see the module docstring.

    Args:
        twin: A twin or a registered twin name (built with ``config``, e.g. ``max_turns=12``).
        max_sessions: Most concurrent sessions whose episodes are kept.
    """
    Server, types = _require_mcp()
    the_twin = resolve_twin(twin, **config)
    episodes = _Episodes(the_twin, max_sessions)
    tools = [
        types.Tool(
            name=t.name,
            description=t.description,
            input_schema=t.schema["function"]["parameters"],
        )
        for t in the_twin.tools
    ]
    splits = ", ".join(the_twin.splits)

    async def list_tools(ctx: Any, params: Any) -> Any:
        return types.ListToolsResult(tools=tools)

    async def call_tool(ctx: Any, params: Any) -> Any:
        episode = episodes.get(ctx)
        if not episode.started:
            episode.reset("train")
        text, failed = episode.call(params.name, params.arguments or {})
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=failed)

    async def list_prompts(ctx: Any, params: Any) -> Any:
        return types.ListPromptsResult(prompts=[types.Prompt(
            name=_PROMPT,
            description=f"Start this session's {the_twin.name} episode on a controlled case; "
            "returns its opening messages.",
            arguments=[
                types.PromptArgument(name="split", description=f"One of: {splits}.", required=False),
                types.PromptArgument(name="index", description="The case index in the split.", required=False),
            ],
        )])

    async def get_prompt(ctx: Any, params: Any) -> Any:
        if params.name != _PROMPT:
            raise ValueError(f"unknown prompt {params.name!r}; the only prompt is {_PROMPT!r}")
        args = dict(params.arguments or {})
        unknown = set(args) - {"split", "index"}
        if unknown:
            raise ValueError(f"unknown prompt arguments {sorted(unknown)}; allowed: split, index")
        episode = episodes.get(ctx)
        try:
            messages = episode.reset(args.get("split") or "train", args.get("index"))
        except CaseError as exc:
            raise ValueError(str(exc)) from None
        out = []
        for m in messages:
            role, text = m.get("role"), str(m.get("content") or "")
            if role == "system":  # MCP prompts carry user and assistant messages only
                role, text = "user", f"[system]\n{text}"
            out.append(types.PromptMessage(role=role, content=types.TextContent(type="text", text=text)))
        report = episode.report()
        return types.GetPromptResult(description=f"{report['case_id']}", messages=out)

    async def list_resources(ctx: Any, params: Any) -> Any:
        return types.ListResourcesResult(resources=[types.Resource(
            uri=EPISODE_URI, name="episode", mime_type="application/json",
            description="This session's episode: status; reward, submission and outcome once it has ended.",
        )])

    async def read_resource(ctx: Any, params: Any) -> Any:
        if str(params.uri) != EPISODE_URI:
            raise ValueError(f"unknown resource {params.uri!s}; the only resource is {EPISODE_URI}")
        report = episodes.get(ctx).report()
        return types.ReadResourceResult(contents=[types.TextResourceContents(
            uri=EPISODE_URI, mime_type="application/json", text=json.dumps(report, ensure_ascii=False),
        )])

    return Server(
        f"twin-{the_twin.name}",
        version=str(the_twin.version),
        instructions=the_twin.description or None,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_prompts=list_prompts,
        on_get_prompt=get_prompt,
        on_list_resources=list_resources,
        on_read_resource=read_resource,
    )


def serve(twin: Twin | str, *, transport: str = "stdio", host: str = "127.0.0.1", port: int = 8765,
          **config: Any) -> None:
    """Serve ``twin`` over ``transport`` (``"stdio"`` or ``"http"``: streamable HTTP at ``/mcp``).

    Raises:
        ValueError: another transport.
    """
    if transport not in ("stdio", "http"):
        raise ValueError(f"transport must be 'stdio' or 'http', got {transport!r}")
    server = build_server(twin, **config)
    if transport == "http":
        import uvicorn

        app = server.streamable_http_app(host=host)
        uvicorn.run(app, host=host, port=port, log_level="warning")
        return
    import anyio
    from mcp.server.stdio import stdio_server

    async def run() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(run)


if __name__ == "__main__":  # pragma: no cover - `python -m integrations.mcp_server Returns`
    serve(sys.argv[1] if len(sys.argv) > 1 else "Returns")

"""``twin mcp``: the MCP client library plays a catalog episode over stdio and streamable HTTP."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import anyio.lowlevel
import httpx
import pytest

from integrations._episode import ToolCallEpisode
from integrations.mcp_server import EPISODE_URI
from twin.registry import make_twin

pytest.importorskip(
    "mcp", reason="the MCP SDK (a twinrl dependency) is not installed: pip install 'mcp>=2,<3'"
)

ROOT = Path(__file__).resolve().parents[2]


def _calls(twin, split: str, index: int) -> list[tuple[str, dict]]:
    """A right answer to the case, as a harness that knew it would play it (the agent never
    does)."""
    truth = twin.case(split, index).truth
    return [
        ("search_taxonomy", {"query": "electrical boxes", "limit": 3}),
        (
            "submit",
            {
                "category_id": truth["category_id"],
                "attributes": dict(truth["attributes"]),
                "verdict": truth["verdict"],
                "reason": "checked",
            },
        ),
    ]


async def _play(client, twin) -> dict:
    listed = await client.list_tools()
    names = [t.name for t in listed.tools]
    assert names == [t.name for t in twin.tools]  # the twin's tools and nothing else
    for tool in listed.tools:
        assert not set(tool.input_schema.get("properties", {})) & {"task", "world", "state"}
    before = json.loads((await client.read_resource(EPISODE_URI)).contents[0].text)
    prompt = await client.get_prompt("case", {"split": "test", "index": "0"})
    assert "LST-" in prompt.messages[-1].content.text
    running = json.loads((await client.read_resource(EPISODE_URI)).contents[0].text)
    assert (
        running["status"] == "running" and running["reward"] is None and running["outcome"] is None
    )
    for name, args in _calls(twin, "test", 0):
        result = await client.call_tool(name, args)
        assert not result.is_error, result.content[0].text
    late = await client.call_tool("search_taxonomy", {"query": "boxes"})
    assert late.is_error and "episode has ended" in late.content[0].text
    report = json.loads((await client.read_resource(EPISODE_URI)).contents[0].text)
    return {"before": before, "report": report}


def _expected(twin) -> float:
    episode = ToolCallEpisode(twin)
    episode.reset("test", 0)
    for name, args in _calls(twin, "test", 0):
        episode.call(name, args)
    assert episode.done
    return episode.final_reward()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("twinrl-cache")
    store = tmp_path_factory.mktemp("twinrl-store") / "runs.db"
    env = dict(os.environ, TWINRL_CACHE=str(cache), PYTHONPATH=str(ROOT), TWINRL_STORE=str(store))
    old = os.environ.get("TWINRL_CACHE")
    os.environ["TWINRL_CACHE"] = str(cache)
    yield env
    if old is None:
        os.environ.pop("TWINRL_CACHE", None)
    else:
        os.environ["TWINRL_CACHE"] = old


def _check(out: dict, twin) -> None:
    assert out["before"]["status"] == "not_started"
    report = out["report"]
    assert report["status"] == "terminated" and report["case_id"] == "Catalog/test/0"
    assert report["reward"]["total"] == pytest.approx(_expected(twin))
    assert report["reward"]["total"] > 0.5  # the right answer scores
    assert report["outcome"]["truth"]["verdict"] == twin.case("test", 0).truth["verdict"]


def test_stdio_plays_a_catalog_episode_and_reads_the_reward(env):
    from mcp.client import Client
    from mcp.client.stdio import StdioServerParameters, stdio_client

    twin = make_twin("Catalog")
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "twinrl_cli", "mcp", "Catalog"], cwd=str(ROOT), env=env
    )

    async def main() -> dict:
        async with Client(stdio_client(params)) as client:
            return await _play(client, twin)

    _check(anyio.run(main), twin)
    from twin.store import RunStore

    store = RunStore(env["TWINRL_STORE"])  # `twin mcp` wrote the ended episode there
    (run,) = [r for r in store.runs() if r.policy == "mcp"]
    assert [e.case_id for e in store.episodes(run.id)] == ["Catalog/test/0"]
    store.close()


def test_streamable_http_plays_a_catalog_episode_and_reads_the_reward(env):
    from mcp.client import Client

    twin = make_twin("Catalog")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "twinrl_cli", "mcp", "Catalog", "--http", "--port", str(port)],
        cwd=str(ROOT),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1.0)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        proc.stdout.read().decode() if proc.stdout else "no output"
                    ) from None
                time.sleep(0.2)

        async def main() -> dict:
            async with Client(f"http://127.0.0.1:{port}/mcp") as client:
                return await _play(client, twin)

        _check(anyio.run(main), twin)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# -- sessions over streamable HTTP (in this process: uvicorn in a thread) -----------------------
@contextlib.contextmanager
def _http_server(app):
    import threading

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the MCP server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_eight_concurrent_default_clients_get_eight_episodes_with_their_own_turns(env):
    """The SDK's default client (mode="auto") first asks for the sessionless protocol; each of 8
    concurrent clients must still end up with its own episode and only its own turns."""
    from mcp.client import Client

    from integrations.mcp_server import build_app

    async def one(url: str, i: int) -> dict:
        async with Client(url) as client:  # the SDK's defaults
            await client.get_prompt("case", {"split": "test", "index": str(i)})
            for k in range(i % 3 + 1):  # a different number of turns per client
                await client.call_tool("search_taxonomy", {"query": f"boxes {i} {k}"})
                await anyio.lowlevel.checkpoint()
            return json.loads((await client.read_resource(EPISODE_URI)).contents[0].text)

    async def main(url: str) -> dict:
        out: dict = {}

        async def run(i: int) -> None:
            out[i] = await one(url, i)

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(run, i)
        return out

    with _http_server(build_app("Catalog")) as url:
        reports = anyio.run(main, url)
    assert sorted(reports) == list(range(8))
    for i, report in reports.items():
        assert report["case_id"] == f"Catalog/test/{i}"
        assert report["turns"] == i % 3 + 1 and report["status"] == "running"


def test_a_client_pinned_to_the_sessionless_protocol_is_refused_with_the_fix(env):
    from mcp.client import Client
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS

    from integrations.mcp_server import build_app

    async def main(url: str) -> None:
        async with Client(url, mode=MODERN_PROTOCOL_VERSIONS[-1]) as client:
            await client.list_tools()

    with _http_server(build_app("Returns")) as url, pytest.raises(Exception) as info:
        anyio.run(main, url)
    assert "mode='legacy'" in _messages(info.value)


def _messages(exc: BaseException) -> str:
    """Every message in an exception (group) tree."""
    parts = [str(exc)]
    for inner in getattr(exc, "exceptions", ()) or ():
        parts.append(_messages(inner))
    return " | ".join(parts)


def test_sessions_past_the_cap_are_refused_and_idle_ones_expire_with_a_clear_error(env):
    """Issue 24: no live session is evicted to make room; an expired session's next call fails
    and says so (before, the victim's episode restarted silently on another case)."""
    from mcp.client import Client

    from integrations.mcp_server import build_app

    async def main(url: str) -> tuple[str, str]:
        async with Client(url) as first, Client(url) as second:
            await first.get_prompt("case", {"split": "test", "index": "1"})
            await second.get_prompt("case", {"split": "test", "index": "2"})
            with pytest.raises(Exception) as full:
                async with Client(url) as third:
                    await third.list_tools()
            report = json.loads((await first.read_resource(EPISODE_URI)).contents[0].text)
            assert report["case_id"] == "Catalog/test/1"  # the live victim kept its case
            now[0] += 1.3  # past the idle timeout
            with pytest.raises(Exception) as gone:
                await first.call_tool("search_taxonomy", {"query": "boxes"})
            return _messages(full.value), _messages(gone.value)

    app = build_app("Catalog", max_sessions=2, idle_timeout_s=1.0)
    # the sessions' clock is the test's: a slow machine cannot expire them early; the SDK's own
    # transport expiry (wall-clock) is pushed out of the way, the gate's is what is tested
    now = [0.0]
    app.server.twin_sessions._clock = lambda: now[0]
    app.server.session_manager.session_idle_timeout = 3600.0
    with _http_server(app) as url:
        full, gone = anyio.run(main, url)
    assert "already holds 2 MCP sessions" in full
    assert "expired after 1 s without requests" in gone and "episode is gone" in gone


def test_session_book_expires_idle_sessions_and_never_evicts_live_ones():
    from integrations.mcp_server import SessionBook, SessionGone

    now = [0.0]
    book = SessionBook(
        make_twin("Returns"), max_sessions=2, idle_timeout_s=10, clock=lambda: now[0]
    )
    for key in ("a", "b"):
        assert book.admit()
        book.opened(key)
    book.episode("a").reset("test", 0)
    assert not book.admit()  # full: refused, nothing evicted
    assert book.episode("a").report()["case_id"] == "Returns/test/0"
    now[0] = 5.0
    assert book.touch("a") is None
    now[0] = 12.0  # b idle 12 s, a idle 7 s
    assert book.admit()  # b expired, room for one
    assert book.touch("b") is not None and book.touch("a") is None
    with pytest.raises(SessionGone, match="expired after 10 s"):
        book.episode("b")


def test_a_server_error_reaches_the_client_as_a_tool_error_with_its_message(
    env, monkeypatch, caplog
):
    from mcp.client import Client

    from integrations.mcp_server import build_app

    def broken(self, name, arguments):
        raise RuntimeError("the warehouse database is down")

    async def main(url: str) -> tuple:
        async with Client(url) as client:
            await client.get_prompt("case", {"split": "test", "index": "0"})
            monkeypatch.setattr(ToolCallEpisode, "call", broken)
            result = await client.call_tool("search_taxonomy", {"query": "boxes"})
            monkeypatch.undo()
            with pytest.raises(Exception) as bad:  # a client error: one line, no traceback
                await client.get_prompt("case", {"split": "nope"})
            return result, _messages(bad.value)

    with caplog.at_level(logging.DEBUG), _http_server(build_app("Catalog")) as url:
        result, bad = anyio.run(main, url)
    assert result.is_error
    assert "RuntimeError: the warehouse database is down" in result.content[0].text
    assert "unknown split 'nope'" in bad
    assert not [r for r in caplog.records if r.exc_info], "a client error logged a traceback"


def test_the_case_prompt_suits_native_tool_calling():
    from mcp.client import Client

    from integrations.mcp_server import build_server

    async def main(name: str) -> str:
        async with Client(build_server(name)) as client:
            prompt = await client.get_prompt("case", {"split": "test", "index": "0"})
            return "\n".join(m.content.text for m in prompt.messages)

    for name in ("Catalog", "Returns", "Catalog-v1"):
        text = anyio.run(main, name)
        assert "<tool_call>" not in text and "tool-calling interface" in text, name


def test_ended_mcp_episodes_go_to_the_run_store(tmp_path):
    from mcp.client import Client

    from integrations.mcp_server import build_server
    from twin.store import RunStore

    twin = make_twin("Catalog")
    store = RunStore(str(tmp_path / "runs.db"))
    server = build_server(twin, store=store)

    async def main() -> None:
        async with Client(server) as client:
            await client.get_prompt("case", {"split": "test", "index": "0"})
            for name, args in _calls(twin, "test", 0):
                await client.call_tool(name, args)

    anyio.run(main)
    server.twin_recorder.close()
    (run,) = store.runs()
    (episode,) = store.episodes(run.id)
    assert run.kind == "eval" and run.policy == "mcp" and run.status == "finished"
    assert episode.case_id == "Catalog/test/0"
    assert episode.reward == pytest.approx(_expected(twin))
    store.close()


def test_an_api_key_is_required_when_set_and_open_binds_warn(env):
    from integrations.mcp_server import build_app, open_warning

    with _http_server(build_app("Returns", api_key="s3cret")) as url:
        hello = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "0"},
            },
        }
        headers = {"accept": "application/json, text/event-stream"}
        refused = httpx.post(url, json=hello, headers=headers, timeout=10)
        allowed = httpx.post(
            url, json=hello, timeout=10, headers={**headers, "authorization": "Bearer s3cret"}
        )
    assert refused.status_code == 401 and "API key" in refused.text
    assert allowed.status_code == 200
    assert open_warning("twin mcp", "0.0.0.0", None) is not None
    assert open_warning("twin mcp", "0.0.0.0", "k") is None
    assert open_warning("twin mcp", "127.0.0.1", None) is None


def test_stdio_serves_even_where_the_default_store_cannot_be_opened(env, tmp_path):
    """A host may start `twin mcp` in a folder where runs/twinrl.db cannot be made: it serves,
    warning that episodes are not stored (an explicit --store that fails is an error)."""
    from mcp.client import Client
    from mcp.client.stdio import StdioServerParameters, stdio_client

    (tmp_path / "runs").write_text("a file where the store's folder would go")
    no_store_env = {k: v for k, v in env.items() if k != "TWINRL_STORE"}
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "twinrl_cli", "mcp", "Returns"],
        cwd=str(tmp_path),
        env=no_store_env,
    )

    async def main() -> list[str]:
        async with Client(stdio_client(params)) as client:
            return [t.name for t in (await client.list_tools()).tools]

    assert anyio.run(main) == [t.name for t in make_twin("Returns").tools]
    bad = subprocess.run(
        [sys.executable, "-m", "twinrl_cli", "mcp", "Returns", "--store", "runs/x.db"],
        cwd=tmp_path,
        env=no_store_env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert bad.returncode == 2 and "cannot open the run store" in bad.stderr

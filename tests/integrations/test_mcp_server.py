"""``twin mcp``: the MCP client library plays a catalog episode over stdio and streamable HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest

from integrations._episode import ToolCallEpisode
from integrations.mcp_server import EPISODE_URI
from twin.registry import make_twin

pytest.importorskip("mcp", reason="the MCP SDK (a twinrl dependency) is not installed: pip install 'mcp>=2,<3'")

ROOT = Path(__file__).resolve().parents[2]


def _calls(twin, split: str, index: int) -> list[tuple[str, dict]]:
    """A right answer to the case, as a harness that knew it would play it (the agent never does)."""
    truth = twin.case(split, index).truth
    return [
        ("search_taxonomy", {"query": "electrical boxes", "limit": 3}),
        ("submit", {"category_id": truth["category_id"], "attributes": dict(truth["attributes"]),
                    "verdict": truth["verdict"], "reason": "checked"}),
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
    assert running["status"] == "running" and running["reward"] is None and running["outcome"] is None
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
    env = dict(os.environ, TWINRL_CACHE=str(cache), PYTHONPATH=str(ROOT))
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
    params = StdioServerParameters(command=sys.executable, args=["-m", "twinrl_cli", "mcp", "Catalog"],
                                   cwd=str(ROOT), env=env)

    async def main() -> dict:
        async with Client(stdio_client(params)) as client:
            return await _play(client, twin)

    _check(anyio.run(main), twin)


def test_streamable_http_plays_a_catalog_episode_and_reads_the_reward(env):
    from mcp.client import Client

    twin = make_twin("Catalog")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "twinrl_cli", "mcp", "Catalog", "--http", "--port", str(port)],
        cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1.0)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(proc.stdout.read().decode() if proc.stdout else "no output")
                time.sleep(0.2)

        async def main() -> dict:
            async with Client(f"http://127.0.0.1:{port}/mcp") as client:
                return await _play(client, twin)

        _check(anyio.run(main), twin)
    finally:
        proc.terminate()
        proc.wait(timeout=10)

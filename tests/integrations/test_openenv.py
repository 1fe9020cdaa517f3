"""A twin as an OpenEnv environment: OpenEnv's own client plays a catalog episode over loopback
(WebSocket and HTTP) and reads the reward, which is the twin's score of the same episode."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from integrations._episode import ToolCallEpisode
from twin.registry import make_twin

pytest.importorskip(
    "openenv.core", reason="openenv-core is not installed: pip install 'twinrl[openenv]'"
)

from integrations.openenv_server import (  # noqa: E402 - after the skip
    TwinAction,
    TwinEnvClient,
    build_app,
    running,
)

HIDDEN = {"task", "world", "state"}


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TWINRL_CACHE", str(tmp_path_factory.mktemp("twinrl-cache")))
        yield


@pytest.fixture(scope="module")
def twin():
    return make_twin("Catalog")


@pytest.fixture(scope="module")
def url(twin):
    with running(build_app(twin, max_http_episodes=2)) as base:  # 127.0.0.1, a free port
        yield base


def _calls(twin) -> list[tuple[str, dict]]:
    """A right answer to test case 0, as a harness that knew it (the agent never does)."""
    truth = twin.case("test", 0).truth
    return [
        ("search_taxonomy", {"query": "electrical boxes", "limit": 3}),
        ("search_taxonomy", {"limit": "many"}),  # a failed call counts as in the twin
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


def _expected(twin) -> float:
    """The twin's own score of the same calls (ToolCallEpisode == TwinEnv, one call per turn)."""
    episode = ToolCallEpisode(twin)
    episode.reset("test", 0)
    for name, args in _calls(twin):
        episode.call(name, args)
    assert episode.done
    traj = episode.trajectory
    assert float(twin.score(traj, twin.case("test", 0)).total) == episode.final_reward()
    return episode.final_reward()


def test_openenv_client_plays_a_catalog_episode_over_websocket(twin, url):
    async def play() -> dict:
        seen: dict = {"steps": []}
        async with TwinEnvClient(base_url=url) as env:
            first = await env.reset(split="test", index=0)
            seen["first"] = first
            seen["before"] = await env.state()
            for name, args in _calls(twin):
                seen["steps"].append(await env.step(TwinAction(tool=name, arguments=args)))
            seen["after"] = await env.state()
            seen["late"] = await env.step(
                TwinAction(tool="search_taxonomy", arguments={"query": "x"})
            )
        return seen

    seen = asyncio.run(play())
    first = seen["first"]
    assert "LST-" in first.observation.messages[-1]["content"]
    assert [t["function"]["name"] for t in first.observation.tools] == [t.name for t in twin.tools]
    for tool in first.observation.tools:
        assert not set(tool["function"]["parameters"].get("properties", {})) & HIDDEN
    assert (first.reward, first.done) == (None, False)
    assert (
        seen["before"].status == "running"
        and seen["before"].reward is None
        and seen["before"].outcome is None
    )
    search, bad, submit = seen["steps"]
    assert (search.observation.error, search.done, search.reward) == (False, False, None)
    assert bad.observation.error and "query" in bad.observation.text and bad.reward is None
    assert submit.done and submit.reward == pytest.approx(_expected(twin))
    assert submit.reward > 0.5
    after = seen["after"]
    assert after.status == "terminated" and after.reward["total"] == submit.reward
    assert after.invalid_calls == 1 and after.case_id == "Catalog/test/0"
    assert seen["late"].done and seen["late"].observation.error
    assert "episode has ended" in seen["late"].observation.text


def test_http_reset_step_and_state_play_the_same_episode(twin, url):
    with httpx.Client(base_url=url, timeout=30.0) as http:
        first = http.post("/reset", json={"split": "test", "index": 0})
        assert first.status_code == 200, first.text
        episode_id = first.json()["observation"]["episode_id"]
        last = None
        for name, args in _calls(twin):
            last = http.post(
                "/step",
                json={"action": {"tool": name, "arguments": args}, "episode_id": episode_id},
            )
            assert last.status_code == 200, last.text
        assert last.json()["done"] and last.json()["reward"] == pytest.approx(_expected(twin))
        state = http.get(f"/episodes/{episode_id}").json()
        assert state["status"] == "terminated" and state["reward"]["total"] == last.json()["reward"]


def test_bad_requests_say_what_is_wrong(url):
    with httpx.Client(base_url=url, timeout=30.0) as http:
        r = http.post("/reset", json={"split": "nope"})
        assert (r.status_code, r.json()["detail"]) == (
            400,
            "Catalog: unknown split 'nope'; splits: train, dev, test",
        )
        for index in (1.5, True, "2x"):  # issue 24: 1.5 was played as case 1
            r = http.post("/reset", json={"split": "test", "index": index})
            assert r.status_code == 400 and "index must be a whole number" in r.json()["detail"], (
                index
            )
        r = http.post("/reset", json={"split": "test", "indx": 1})
        assert (
            r.json()["detail"]
            == "unknown reset option(s) indx; the options are seed, episode_id, split and index"
        )
        r = http.post("/step", json={"action": {"tool": "search_taxonomy", "arguments": {}}})
        assert (
            r.status_code == 400
            and "send the reset's episode_id with the step" in r.json()["detail"]
        )
        r = http.post("/step", json={"action": {"tool": "search_taxonomy"}, "episode_id": "gone"})
        assert r.status_code == 404 and r.json()["detail"].startswith(
            "no episode 'gone' on this server"
        )
        # The server keeps max_http_episodes (2 here): the oldest is dropped.
        ids = [
            http.post("/reset", json={"split": "test", "index": 0}).json()["observation"][
                "episode_id"
            ]
            for _ in range(3)
        ]
        assert http.get(f"/episodes/{ids[0]}").status_code == 404
        assert http.get(f"/episodes/{ids[2]}").status_code == 200


# -- the server as OpenEnv's tooling sees it; the generated package -------------------------------
def test_openenvs_runtime_validation_accepts_the_server(twin):
    from openenv.cli._validation import validate_running_environment

    with running(build_app(twin)) as base:
        report = validate_running_environment(base, timeout_s=30)
    assert report["passed"], [c for c in report["criteria"] if not c["passed"]]


def test_reward_components_reach_the_client_when_the_episode_ends(twin, url):
    async def play():
        async with TwinEnvClient(base_url=url) as env:
            await env.reset(split="test", index=0)
            return [await env.step(TwinAction(tool=n, arguments=a)) for n, a in _calls(twin)]

    search, _bad, submit = asyncio.run(play())
    assert search.observation.reward_components is None
    terms = submit.observation.reward_components
    assert terms and sum(terms.values()) == pytest.approx(submit.reward)


def _load_generated(root):
    """The generated package's client side, imported from its folder (as a harness would)."""
    import importlib
    import sys

    sys.path.insert(0, str(root.parent))
    try:
        return importlib.import_module(root.name)
    finally:
        sys.path.remove(str(root.parent))


def test_init_writes_a_layout_whose_client_needs_only_openenv(twin, tmp_path):
    import ast

    from openenv.cli._validation import validate_multi_mode_deployment

    from integrations.openenv_layout import write_layout

    root = write_layout("Catalog", tmp_path / "catalog_gen_env", config={"max_turns": 6})
    for rel in (
        "openenv.yaml",
        "pyproject.toml",
        "server/app.py",
        "server/Dockerfile",
        "README.md",
    ):
        assert (root / rel).is_file(), rel
    # OpenEnv's own check: everything but the lock file (`--lock` runs uv; the slow test does)
    _ok, issues = validate_multi_mode_deployment(root)
    assert [i for i in issues if "uv.lock" not in i] == []
    for rel in ("models.py", "client.py", "__init__.py"):  # the client side imports no twinrl
        tree = ast.parse((root / rel).read_text())
        names = {
            a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
        }
        names |= {
            (n.module or "").split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and not n.level
        }
        assert names <= {"openenv", "pydantic", "typing", "urllib", "models", ""}, (rel, names)
    generated = _load_generated(root)

    async def play(base: str):
        async with generated.TwinEnvClient(base_url=base, api_key="k3y") as env:
            await env.reset(split="test", index=0)
            for name, args in _calls(twin):
                result = await env.step(generated.TwinAction(tool=name, arguments=args))
            return result, await env.state()

    with running(build_app(twin, api_key="k3y")) as base:
        result, state = asyncio.run(play(base))
        refused = httpx.post(f"{base}/reset", json={}, timeout=30)
        health = httpx.get(f"{base}/health", timeout=30)
    assert result.done and result.reward == pytest.approx(_expected(twin))
    assert state.status == "terminated" and state.reward["total"] == result.reward
    assert refused.status_code == 401 and health.status_code == 200


def test_cli_init_refuses_a_folder_with_files(tmp_path):
    from typer.testing import CliRunner

    from twinrl_cli import app

    (tmp_path / "x.txt").write_text("mine")
    result = CliRunner().invoke(app, ["openenv", "init", "Catalog", str(tmp_path)])
    assert result.exit_code == 2 and "is not empty" in result.output

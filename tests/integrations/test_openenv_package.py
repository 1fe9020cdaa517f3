"""Slow: `twin openenv init` makes a package that OpenEnv's own `openenv validate` accepts (with the
uv.lock that `--lock` writes), and whose client, in a venv holding openenv-core and nothing of
twinrl, plays a catalog episode against `twin openenv serve`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import venv
from pathlib import Path
from typing import Any

import httpx
import pytest

from integrations._episode import ToolCallEpisode
from twin.registry import make_twin

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

_PLAY = textwrap.dedent("""
    import asyncio, json, sys
    sys.path.insert(0, sys.argv[1])
    import importlib
    pkg = importlib.import_module(sys.argv[2])
    calls = json.loads(sys.argv[4])

    async def main():
        async with pkg.TwinEnvClient(base_url=sys.argv[3]) as env:
            first = await env.reset(split="test", index=0)
            for name, args in calls:
                result = await env.step(pkg.TwinAction(tool=name, arguments=args))
            return {"tools": [t["function"]["name"] for t in first.observation.tools],
                    "done": result.done, "reward": result.reward,
                    "terms": result.observation.reward_components,
                    "twinrl": any(m.startswith(("twin", "integrations")) for m in sys.modules)}

    print(json.dumps(asyncio.run(main())))
""")


def _calls(twin) -> list:
    truth = twin.case("test", 0).truth
    return [
        ["search_taxonomy", {"query": "electrical boxes", "limit": 3}],
        [
            "submit",
            {
                "category_id": truth["category_id"],
                "attributes": dict(truth["attributes"]),
                "verdict": truth["verdict"],
                "reason": "checked",
            },
        ],
    ]


def test_generated_package_validates_and_its_openenv_only_client_plays(tmp_path):
    pytest.importorskip(
        "openenv.core", reason="openenv-core is not installed: pip install 'twinrl[openenv]'"
    )
    lean = _lean_venv(tmp_path)
    py = lean / "bin" / "python"
    env = dict(
        os.environ,
        PATH=f"{lean / 'bin'}{os.pathsep}{os.environ['PATH']}",
        PYTHONPATH=str(ROOT),
        TWINRL_CACHE=str(tmp_path / "cache"),
    )
    package = tmp_path / "catalog_env"
    _init_and_validate(package, env, lean)
    twin = make_twin("Catalog")
    play = _serve_and_play(package, env, py, twin)
    assert play.returncode == 0, play.stderr[-3000:]
    out = json.loads(play.stdout.strip().splitlines()[-1])
    episode = ToolCallEpisode(twin)
    episode.reset("test", 0)
    for name, args in _calls(twin):
        episode.call(name, args)
    assert out["tools"] == [t.name for t in twin.tools] and out["done"]
    assert out["reward"] == pytest.approx(episode.final_reward()) and not out["twinrl"]
    assert sum(out["terms"].values()) == pytest.approx(out["reward"])


def _lean_venv(tmp_path: Path) -> Path:
    """A venv with openenv-core (the version twinrl runs) and uv only."""
    from importlib.metadata import version

    lean = tmp_path / "lean"
    venv.create(lean, with_pip=True)
    py = lean / "bin" / "python"
    pip = (
        subprocess.run(  # openenv-core (the version twinrl runs) and uv; pip's cache keeps it quick
            [
                str(py),
                "-m",
                "pip",
                "install",
                "-q",
                f"openenv-core=={version('openenv-core')}",
                "uv",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    return lean


def _init_and_validate(package: Path, env: dict[str, str], lean: Path) -> None:
    """``twin openenv init`` writes the package; OpenEnv's own ``openenv validate`` passes it."""
    init = subprocess.run(
        [
            sys.executable,
            "-m",
            "twinrl_cli",
            "openenv",
            "init",
            "Catalog",
            str(package),
            "--lock",
            "--requirement",
            f"twinrl[openenv] @ {ROOT.as_uri()}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert init.returncode == 0, init.stdout + init.stderr
    check = subprocess.run(
        [str(lean / "bin" / "openenv"), "validate", str(package)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert check.returncode == 0 and "[OK]" in check.stdout, check.stdout + check.stderr


def _serve_and_play(
    package: Path, env: dict[str, str], py: Path, twin: Any
) -> subprocess.CompletedProcess[str]:
    """Serve the twin, and play one episode with the package's client under the lean venv."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "twinrl_cli", "openenv", "serve", "Catalog", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        play = subprocess.run(
            [
                str(py),
                "-c",
                _PLAY,
                str(package.parent),
                package.name,
                f"http://127.0.0.1:{port}",
                json.dumps(_calls(twin)),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={"PATH": os.environ["PATH"]},
            check=False,
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    return play

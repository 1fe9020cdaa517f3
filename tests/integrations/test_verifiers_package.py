"""Slow: `twin package Returns DIR` installs into a fresh venv with pip, and `vf-eval` there runs it
offline (a loopback fake OpenAI server) with a twin option on the command line; the rewards equal
`twin eval`'s for the same actions and options.

Lean: the package and twinrl are pip-installed into the new venv without dependencies; the
third-party libraries (verifiers and the rest) are read from this venv through a .pth line, so
nothing is downloaded but pip's build backend (cached)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import sysconfig
import threading
import venv
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip(
    "verifiers.v1", reason="verifiers not installed: pip install 'twinrl[verifiers]'"
)

from integrations.verifiers_package import write_package  # noqa: E402 - after the skip
from twin.evaluation import evaluate  # noqa: E402
from twin.policies import ReplayPolicy  # noqa: E402
from twin.registry import make_twin  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CASES = 3
TURNS = [  # right on test case 0 in 3 turns: with max_turns=2 every case is cut short
    {"name": "lookup_order", "arguments": {"order_id": "R-10273"}},
    {"name": "return_policy", "arguments": {}},
    {
        "name": "decide",
        "arguments": {
            "order_id": "R-10273",
            "decision": "refund",
            "amount": 50.0,
            "reason": "unopened",
        },
    },
]


class FakeOpenAI(BaseHTTPRequestHandler):
    """/v1/chat/completions answering with the replay policy's next turn for that chat."""

    policy = ReplayPolicy(TURNS)
    requests: ClassVar[list[dict]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(body)
        message = asyncio.run(self.policy.act(body["messages"], body.get("tools") or []))
        data = json.dumps(
            {
                "id": f"c{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                    }
                ],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


_VF_EVAL = "import sys; from verifiers.v1.cli.eval.main import main; sys.exit(main())"


def test_package_installs_in_a_fresh_venv_and_vf_eval_runs_it_offline(tmp_path):
    package = write_package("Returns", tmp_path / "twinrl-returns")
    fresh = tmp_path / "venv"
    py = _install_in_fresh_venv(package, fresh)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "FAKE_OPENAI_KEY": "not-a-secret",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TWINRL_CACHE": str(tmp_path / "cache"),
    }
    run = _vf_eval_against_a_fake_server(py, env, tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    (traces,) = (tmp_path / "out").glob("*/traces.jsonl")
    got = {}
    for line in traces.read_text().splitlines():
        record = json.loads(line)
        assert record["ok"], record["errors"]
        (trace,) = (
            record["traces"] if isinstance(record["traces"], list) else record["traces"].values()
        )
        data = record["task"]["data"]
        assert data["twin_config"] == {"max_turns": 2}
        got[data["case_id"]] = trace["metrics"]["twin/total"]
    twin = make_twin("returns", max_turns=2)
    expected = evaluate(
        twin, ReplayPolicy(TURNS), [("test", i) for i in range(CASES)], progress=False
    )
    want = {g.trajectories[0].case_id: g.trajectories[0].reward for g in expected.groups}
    assert got == pytest.approx(want)
    where = subprocess.run(
        [str(py), "-c", "import twinrl_returns; print(twinrl_returns.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert where.stdout.strip().startswith(str(fresh))  # the installed package, not a checkout
    assert sys.executable != str(py)


def _install_in_fresh_venv(package: Path, fresh: Path) -> Path:
    """The package and twinrl (no deps; this interpreter's site-packages on the path) in a fresh
    venv; returns its python."""
    venv.create(fresh, with_pip=True)
    py = fresh / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "third_party.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", str(package), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]

    return py


def _vf_eval_against_a_fake_server(
    py: Path, env: dict[str, str], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """``vf-eval`` of the installed taskset, its model a local fake OpenAI server that replays
    the turns."""
    FakeOpenAI.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run = subprocess.run(
            [
                str(py),
                "-c",
                _VF_EVAL,
                "--env.taskset.id",
                "twinrl-returns",
                "--env.taskset.split",
                "test",
                "--env.taskset.num-cases",
                str(CASES),
                "--env.taskset.max-turns",
                "2",
                "--env.agent.runtime.type",
                "subprocess",
                "--model",
                "replay",
                "--client.base-url",
                f"http://127.0.0.1:{server.server_address[1]}/v1",
                "--client.api-key-var",
                "FAKE_OPENAI_KEY",
                "-r",
                "1",
                "--output-dir",
                str(tmp_path / "out"),
                "--no-rich",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        server.shutdown()
        server.server_close()
    return run

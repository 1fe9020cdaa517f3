"""verifiers (v1) bridge: a vf-eval style run against a loopback fake OpenAI server."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip(
    "verifiers.v1", reason="verifiers not installed: pip install 'twinrl[verifiers]'"
)

from integrations.verifiers_env import TASKSET_ID, load_environment  # noqa: E402
from twin.evaluation import evaluate  # noqa: E402
from twin.policies import ReplayPolicy  # noqa: E402
from twin.registry import make_twin  # noqa: E402

# Right on the first case (R-10273), a wrong order elsewhere: rewards differ between cases,
# and a case that never ends with a valid decision runs to the turn limit.
TURNS = [
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
CASES = 4


class _FakeOpenAI(BaseHTTPRequestHandler):
    """/v1/chat/completions answering with the replay policy's next turn for that chat."""

    policy = ReplayPolicy(TURNS)
    requests: list[dict] = []

    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(body)
        message = asyncio.run(self.policy.act(body["messages"], body.get("tools") or []))
        reply = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_openai() -> Iterator[str]:
    _FakeOpenAI.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_vf_eval_rewards_equal_twin_eval_with_the_same_actions(fake_openai, tmp_path, monkeypatch):
    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.configs.cli.eval import EvalConfig

    monkeypatch.setenv("FAKE_OPENAI_KEY", "not-a-secret")
    config = EvalConfig.model_validate(
        {
            "env": {
                "taskset": {
                    "id": TASKSET_ID,
                    "twin": "returns",
                    "split": "test",
                    "num_cases": CASES,
                },
                "agent": {"runtime": {"type": "subprocess"}},
            },
            "model": "replay",
            "client": {"base_url": fake_openai, "api_key_var": "FAKE_OPENAI_KEY"},
            "num_rollouts": 1,
            "rich": None,
            "push": False,
            "output_dir": str(tmp_path / "vf"),
        }
    )
    episodes = asyncio.run(run_eval(config))

    twin = make_twin("returns")
    expected = evaluate(
        twin, ReplayPolicy(TURNS), [("test", i) for i in range(CASES)], progress=False
    )
    by_index = {g.trajectories[0].case_id: g.trajectories[0] for g in expected.groups}
    assert len(episodes) == CASES
    weights = dict(twin.reward.weights)
    totals = []
    for episode in episodes:
        (trace,) = (
            list(episode.traces.values()) if isinstance(episode.traces, dict) else episode.traces
        )
        assert trace.ok, trace.errors
        want = by_index[episode.task.data.case_id]
        assert trace.reward == pytest.approx(want.reward, abs=1e-9)
        # the rubric: each term under its own name with the twin's weight, then the adjustment
        for name, weight in weights.items():
            assert trace.rewards[name].weight == weight
            assert trace.rewards[name].score == pytest.approx(want.components[name])
        assert trace.rewards["adjustment"].weight == 1.0
        assert trace.metrics["twin/total"] == pytest.approx(want.reward)
        totals.append(trace.reward)
    assert len(set(totals)) > 1  # the cases did not all score alike
    # the model saw the twin's tools and never the case's truth
    first = _FakeOpenAI.requests[0]
    assert {t["function"]["name"] for t in first["tools"]} == {t.name for t in twin.tools}
    assert "truth" not in json.dumps(first)


def test_load_environment_builds_each_builtin_twin():
    for name in ("catalog", "returns", "toy"):
        env = load_environment(name, split="test" if name != "toy" else "train", num_cases=2)
        tasks = list(env.taskset)
        assert [t.data.index for t in tasks] == [0, 1]
        assert tasks[0].data.tools and tasks[0].data.prompt


def test_unknown_split_is_a_clear_error():
    env = load_environment("returns", split="nope")
    with pytest.raises(ValueError, match="has no split 'nope'; allowed: train, dev, test"):
        list(env.taskset)


def test_a_generated_package_runs_with_twin_options_passed_through(
    fake_openai, tmp_path, monkeypatch
):
    """`twin package Returns DIR`: its own taskset id, the twin options (max_turns) reaching the
    twin, train as the default split, and rewards equal to twin eval's with the same options."""
    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.configs.cli.eval import EvalConfig

    from integrations.verifiers_package import write_package

    root = write_package("Returns", tmp_path / "pkg")
    monkeypatch.syspath_prepend(str(root))  # as `pip install DIR` would put it on the path
    monkeypatch.setenv("FAKE_OPENAI_KEY", "not-a-secret")
    import twinrl_returns

    env = twinrl_returns.load_environment(num_cases=1, max_turns=2, max_result_chars=4000)
    (task,) = list(env.taskset)
    assert task.data.split == "train" and task.data.twin_config == {
        "max_result_chars": 4000,
        "max_turns": 2,
    }
    config = EvalConfig.model_validate(
        {
            "env": {
                "taskset": {
                    "id": "twinrl-returns",
                    "split": "test",
                    "num_cases": 3,
                    "max_turns": 2,
                },
                "agent": {"runtime": {"type": "subprocess"}},
            },
            "model": "replay",
            "client": {"base_url": fake_openai, "api_key_var": "FAKE_OPENAI_KEY"},
            "num_rollouts": 1,
            "rich": None,
            "push": False,
            "output_dir": str(tmp_path / "vf"),
        }
    )
    episodes = asyncio.run(run_eval(config))
    twin = make_twin("returns", max_turns=2)
    expected = evaluate(twin, ReplayPolicy(TURNS), [("test", i) for i in range(3)], progress=False)
    want = {g.trajectories[0].case_id: g.trajectories[0] for g in expected.groups}
    assert len(episodes) == 3
    for episode in episodes:
        (trace,) = (
            list(episode.traces.values()) if isinstance(episode.traces, dict) else episode.traces
        )
        assert trace.ok, trace.errors
        assert trace.reward == pytest.approx(want[episode.task.data.case_id].reward, abs=1e-9)
        assert len(trace.info["twin"]["actions"]) <= 2  # the twin's budget was max_turns=2

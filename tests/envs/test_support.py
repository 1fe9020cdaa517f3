"""SupportDesk-v0: the simulated customer, the world-state reward, the scripted agents, `twin
check`, check_env, and `twin eval` with an LLM customer on a fake OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
from gymnasium.utils.env_checker import check_env
from typer.testing import CliRunner

import twin
from envs.support import SupportDeskTwin, final_changes
from envs.support.agents import CarefulAgent, HeuristicAgent
from envs.support.customer import RuleCustomer, is_yes, opening_message
from envs.support.world import CYCLE, KINDS, POLICY
from twin.doctor import doctor
from twin.errors import ConfigError
from twin.rollout import run_episodes, success_fn, summarize


@pytest.fixture(scope="module")
def desk() -> SupportDeskTwin:
    return SupportDeskTwin()


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _goal(desk: SupportDeskTwin, kind: str, split: str = "dev") -> tuple[Any, dict[str, Any]]:
    case = desk.case(split, CYCLE.index(kind))
    return case, dict(case.task["customer"])


# -- cases and the customer ----------------------------------------------------------------------
def test_cases_are_deterministic_balanced_and_hide_the_goal(desk) -> None:
    again = SupportDeskTwin()
    for i in range(12):
        a, b = desk.case("test", i), again.case("test", i)
        assert a.model_dump_json() == b.model_dump_json()
        assert a.kind == CYCLE[i % len(CYCLE)]
        opening = desk.prompt(a)[-1]["content"]
        goal = a.task["customer"]
        assert goal["order_id"] not in opening and goal["email"] not in opening  # must be asked for
    assert POLICY in desk.prompt(desk.case("test", 0))[0]["content"]
    train = {desk.case("train", i).truth["customer_id"] for i in range(300)}
    test = {desk.case("test", i).truth["customer_id"] for i in range(120)}
    assert not train & test  # held-out customers


def test_rule_customer_reveals_details_only_when_asked_and_pushes_twice(desk) -> None:
    _, goal = _goal(desk, "return_late_push")
    c = RuleCustomer()
    assert goal["email"] not in c.reply(goal, [], "Hello! How are you today.")
    both = c.reply(goal, [], "Could you give me the email on your account and your order number?")
    assert goal["email"] in both and goal["order_id"] in both
    history: list[dict[str, str]] = []
    replies = []
    for _ in range(4):
        said = "I'm sorry, but that order is past the window, so I cannot return it."
        replies.append(c.reply(goal, history, said))
        history.append({"agent": said, "customer": replies[-1]})
    assert [r.startswith("Please,") for r in replies] == [True, True, False, False]  # bounded push
    assert is_yes(c.reply(goal, [], f"To confirm: shall I return order {goal['order_id']}?"))
    assert not is_yes(c.reply(goal, [], f"To confirm: shall I cancel order {goal['order_id']}?"))
    assert c.reply(goal, [], "Do you have a question?") == c.reply(
        goal, [], "Do you have a question?"
    )


def test_wrong_claim_customer_misremembers_the_date(desk) -> None:
    case, goal = _goal(desk, "wrong_claim")
    assert "last week" in opening_message(goal)
    order = desk.world["orders"][goal["order_id"]]
    assert order["days_since_delivery"] > 30 and case.truth["changes"] == {}


# -- reward: the final state ---------------------------------------------------------------------
def _play(desk: SupportDeskTwin, index: int, turns: list[str]) -> Any:
    env = twin.TwinEnv(desk)
    env.reset(options={"split": "dev", "index": index})
    info: dict[str, Any] = {}
    for t in turns:
        *_, terminated, truncated, info = env.step(t)
        if terminated or truncated:
            break
    return env.trajectory, info


def test_reward_reads_the_world_state_not_the_wording(desk) -> None:
    case, goal = _goal(desk, "cancel_ok")
    oid, email = goal["order_id"], goal["email"]
    careful = [
        call("find_customer", email=email),
        call("ask_customer", message=f"To confirm: shall I cancel order {oid}?"),
        call("cancel_order", order_id=oid),
        call("end_conversation", summary="cancelled"),
    ]
    traj, info = _play(desk, case.index, careful)
    assert final_changes(traj) == {oid: {"status": "cancelled"}}
    assert info["reward"]["total"] == 1.0
    hasty = [
        call("cancel_order", order_id=oid),
        call("end_conversation", summary="Cancelled as you asked, per policy!"),
    ]
    traj, info = _play(desk, case.index, hasty)
    assert info["reward"]["components"] == pytest.approx(
        {"state": 1.0, "procedure": 0.0, "submitted": 1.0, "invalid_calls": 0.0, "penalty": 0.0}
    )
    assert "not looked up by email" in " ".join(info["reward"]["notes"])
    nothing = [call("end_conversation", summary="I cancelled your order.")]  # words change nothing
    assert _play(desk, case.index, nothing)[1]["reward"]["components"]["state"] == 0.0


def test_policy_edge_cases_tools_refuse_and_exceptions_fail(desk) -> None:
    case, goal = _goal(desk, "cancel_shipped")
    traj, _ = _play(desk, case.index, [call("cancel_order", order_id=goal["order_id"])])
    assert "only processing orders can be cancelled" in traj.messages[-1]["content"]
    case, goal = _goal(desk, "return_late_push")  # the tool allows it; the policy does not
    turns = [
        call("return_order", order_id=goal["order_id"], refund_to="original"),
        call("end_conversation", summary="x"),
    ]
    assert _play(desk, case.index, turns)[1]["reward"]["components"]["state"] == 0.0


def test_bad_config_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="customer"):
        SupportDeskTwin(customer="gpt-4o")
    with pytest.raises(ConfigError, match="max_turns"):
        SupportDeskTwin(max_turns=0)


# -- agents, check, check_env --------------------------------------------------------------------
def test_careful_agent_scores_the_maximum_and_the_heuristic_clearly_less(desk) -> None:
    cases = [("test", i) for i in range(64)]
    got = {}
    for policy in (CarefulAgent(), HeuristicAgent()):
        groups = run_episodes(desk, policy, cases, progress=False)
        got[policy.name] = summarize(groups, success=success_fn(desk))
    assert got["careful"]["reward_mean"] >= 0.95 and got["careful"]["pass^k"]["1"] == 1.0
    assert got["heuristic"]["reward_mean"] <= 0.6 and got["heuristic"]["success_rate"] <= 0.3
    assert got["careful"]["by_kind"].keys() == set(KINDS)


def test_twin_check_passes(desk) -> None:
    doctor(desk, subprocess_check=False).assert_ok()


def test_check_env_passes_without_warnings() -> None:
    import gymnasium

    env = gymnasium.make("twin/SupportDesk-v0", render_mode="ansi")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    env.close()


# -- an LLM customer and an LLM agent on one fake OpenAI-compatible server ------------------------
class _Server(BaseHTTPRequestHandler):
    customer_requests: ClassVar[list[dict[str, Any]]] = []
    agent_requests: ClassVar[list[dict[str, Any]]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body.get("tools"):  # the agent: the careful script, answered as an OpenAI server would
            self.agent_requests.append(body)
            message = asyncio.run(CarefulAgent().act(body["messages"], body["tools"]))
        else:  # the customer: plays the persona in its system prompt
            self.customer_requests.append(body)
            persona, said = body["messages"][0]["content"], body["messages"][-1]["content"].lower()
            email = re.search(r"email is (\S+?)\.( |$)", persona).group(1)
            order = re.search(r"order (#W\d+)", persona).group(1)
            if "to confirm" in said:
                text = "Yes, please do that."
            elif "refund" in said:
                text = (
                    "Store credit is fine."
                    if "prefer store credit" in persona
                    else "Original payment, please."
                )
            elif "email" in said:
                text = f"Sure: {email}, and the order is {order}."
            else:
                text = "Okay, thanks."
            message = {"role": "assistant", "content": text}
        data = json.dumps({"choices": [{"message": message}], "usage": {}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture()
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    server.daemon_threads = True
    _Server.customer_requests, _Server.agent_requests = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_twin_eval_with_an_llm_customer_on_the_same_server(server_url, tmp_path) -> None:
    from twinrl_cli import app

    result = CliRunner().invoke(
        app,
        [
            "eval",
            "SupportDesk",
            "--policy",
            "openai:agent",
            "--base-url",
            server_url,
            "--episodes",
            "12",
            "--group-size",
            "2",
            "--split",
            "dev",
            "--store",
            str(tmp_path / "runs.db"),
            "--no-progress",
            "--set",
            "customer=openai:customer",
            "--set",
            f"customer_base_url={server_url}",
        ],
    )
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert _Server.customer_requests and _Server.agent_requests
    assert all("tools" not in r and r["model"] == "customer" for r in _Server.customer_requests)
    persona = _Server.customer_requests[0]["messages"][0]["content"]
    assert "You want to" in persona  # the hidden goal reaches the customer model, not the agent
    assert all("You want to" not in json.dumps(r["messages"]) for r in _Server.agent_requests)
    assert "reward │ 1.0000 ± 0.0000" in out  # the careful script, talking to the model customer
    assert "│ 2 │ 1.0000 │ 1.0000 │" in out  # pass@2 and pass^2
    from twin.store import RunStore

    store = RunStore(tmp_path / "runs.db")
    (run,) = store.runs()
    replies = [
        m["content"]
        for t in store.episodes(run.id)
        for m in t.messages
        if m.get("name") == "ask_customer"
    ]
    assert any("Sure:" in r for r in replies)  # the customer's words came from the model
    store.close()


@pytest.mark.slow
def test_grpo_on_the_customer_twin_runs_end_to_end_on_cpu(tmp_path, monkeypatch) -> None:
    """Plumbing: the random tiny model, two GRPO steps, the rule customer in every episode."""
    import io

    from rich.console import Console

    from trainer.cli import train
    from trainer.metrics import read_metrics

    monkeypatch.setenv("TWINRL_STORE", str(tmp_path / "store.db"))
    buffer = io.StringIO()
    code = train(
        "data/recipes/support-tiny-cpu.yaml",
        [f"train.output_dir={tmp_path / 'run'}"],
        False,
        console=Console(file=buffer, width=120),
    )
    assert code == 0, buffer.getvalue()
    history = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len(history) == 2 and all(
        "rewards/state" in h and "rewards/procedure" in h for h in history
    )


def test_the_simulated_user_example_in_the_twin_guide_runs() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "define_your_own_twin.md").read_text()
    (code,) = re.findall(r"```py\n(.*?)```", doc, re.DOTALL)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1.0"

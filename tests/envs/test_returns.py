"""The returns-desk twin: its policy table, its cases, its reward, and an oracle that scores 1."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import twin
from envs.returns import ReturnsTwin, expected_decision
from envs.returns.twin import KINDS


def order(days, price=100.0, final_sale=False):
    return {
        "order_id": "R-1",
        "item": "kettle",
        "price": price,
        "days_since_delivery": days,
        "final_sale": final_sale,
    }


@pytest.mark.parametrize(
    ("o", "reason", "expected"),
    [
        (order(10), "changed_mind", ("refund", 100.0)),
        (order(30), "changed_mind", ("refund", 100.0)),
        (order(31), "changed_mind", ("deny", 0.0)),
        (order(45), "damaged", ("refund", 100.0)),
        (order(91), "damaged", ("deny", 0.0)),
        (order(5, final_sale=True), "damaged", ("refund", 100.0)),
        (order(5, final_sale=True), "changed_mind", ("deny", 0.0)),
        (order(5, price=59.99), "opened", ("partial", 47.99)),
        (order(40), "opened", ("deny", 0.0)),
    ],
)
def test_policy_table(o, reason, expected):
    assert expected_decision(o, reason) == expected


def test_cases_cover_every_kind_and_match_the_policy():
    t = ReturnsTwin()
    seen = set()
    for i in range(50):
        case = t.case("dev", i)
        seen.add(case.kind)
        o = t.world["orders"][case.task["order_id"]]
        assert (case.truth["decision"], case.truth["amount"]) == expected_decision(
            o, case.truth["reason"]
        )
        assert case.task["order_id"] in case.task["message"]
    assert seen == set(KINDS)


def play(env, policy, index, split="dev"):
    messages, info = env.reset(options={"split": split, "index": index})
    history = list(messages)
    while True:
        action = asyncio.run(policy.act(history, info["tools"]))
        obs, reward, terminated, truncated, step_info = env.step(action)
        history = env.messages
        if terminated or truncated:
            return reward, step_info


def test_oracle_scores_the_maximum_on_every_kind():
    t = ReturnsTwin()
    env = twin.TwinEnv(t)
    oracle = t.baselines()["oracle"](t)
    for i in range(len(KINDS) * 3):
        reward, info = play(env, oracle, i)
        assert reward == 1.0, (env.case.kind, info["reward"])
        assert info["trajectory"].invalid_calls == 0


def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_reward_parts():
    env = twin.make("returns")
    env.reset(options={"split": "dev", "index": 1})  # past_window: deny
    oid = env.case.task["order_id"]
    env.step(call("lookup_order", order_id=oid))
    *_, info = env.step(call("decide", order_id=oid, decision="refund", amount=1.0, reason="ok"))
    r = info["reward"]
    assert r["components"]["correct_decision"] == 0.0 and r["components"]["checked_order"] == 1.0
    assert r["total"] == pytest.approx(0.1)


def test_deciding_on_another_order_is_refused():
    env = twin.make("returns")
    env.reset(options={"split": "dev", "index": 0})
    obs, _, terminated, _, info = env.step(
        call("decide", order_id="R-99999", decision="deny", amount=0, reason="x")
    )
    assert not terminated
    assert obs[0]["content"] == (
        "Error: this request is about another order than 'R-99999'; decide on the order in the "
        "customer's message"
    )


def test_no_decision_fails_the_gate_and_invalid_calls_cost():
    env = twin.make("returns", max_turns=2)
    env.reset(options={"split": "dev", "index": 0})
    env.step("hello")
    *_, truncated, info = env.step(call("return_policy"))
    assert truncated and info["reward"]["components"]["submitted"] == 0.0
    assert info["reward"]["total"] == pytest.approx(-0.02)


def test_unknown_order_message():
    env = twin.make("returns")
    env.reset(options={"split": "dev", "index": 0})
    obs, *_ = env.step(call("lookup_order", order_id="X"))
    assert (
        obs[0]["content"] == "Error: no order 'X'; order ids look like 'R-10042' (see the message)"
    )


def test_check_twin():
    twin.check_twin(ReturnsTwin())


def test_the_define_your_own_twin_example_runs():
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "define_your_own_twin.md").read_text()
    code = re.findall(r"```python\n(.*?)```", doc, re.S)[0]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("1.0 {'correct_decision': 1.0")


def test_changing_a_stored_result_changes_no_later_episode():
    import contextlib

    env = twin.make("returns")
    env.reset(options={"split": "test", "index": 0})
    oid = env.case.task["order_id"]
    lookup = (
        f'<tool_call>{{"name": "lookup_order", "arguments": {{"order_id": "{oid}"}}}}</tool_call>'
    )
    first, *_ = env.step(lookup)
    price = json.loads(first[0]["content"])["price"]
    with contextlib.suppress(TypeError):  # read-only results refuse; copies may change freely
        env.trajectory.calls[-1].result["price"] = 0.01
    env.reset(options={"split": "test", "index": 0})
    again, *_ = env.step(lookup)
    assert json.loads(again[0]["content"])["price"] == price != 0.01
    assert env.case.truth["amount"] in (price, 0.0, round(price * 0.8, 2))

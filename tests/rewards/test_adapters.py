"""TRL adapters and logging helpers."""

from __future__ import annotations

import json

import pytest

from envs.catalog.reward import make_catalog_reward
from rewards.adapters import (
    as_trl_reward,
    as_trl_reward_funcs,
    completion_trajectory,
    component_metrics,
    flatten_result,
    terminal_tool_names,
)
from twin import Case

REWARD = make_catalog_reward(lambda i: True)
TRUTH = {"category_id": "aa-1", "attributes": {"color": "red"}, "verdict": "ok", "signals": []}
CASE = Case(twin="Catalog", split="train", index=0, task={}, truth=TRUTH)


def submit(**args) -> str:
    base = {"category_id": "aa-1", "attributes": {"color": "Red"}, "verdict": "ok", "reason": "x"}
    return (
        "<tool_call>"
        + json.dumps({"name": "submit", "arguments": {**base, **args}})
        + "</tool_call>"
    )


def test_trl_reward_scores_text_and_conversational_completions():
    f = as_trl_reward(REWARD)
    assert f.__name__ == "catalog_reward"
    completions = [
        submit(),
        "I am not sure.",
        [
            {"role": "assistant", "content": "<tool_call>{bad json</tool_call>"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {
                            "name": "submit",
                            "arguments": json.dumps(
                                {
                                    "category_id": "aa-2",
                                    "attributes": {},
                                    "verdict": "counterfeit",
                                    "reason": "",
                                }
                            ),
                        },
                    }
                ],
            },
        ],
    ]
    got = f(["p"] * 3, completions, truth=[TRUTH, json.dumps(TRUTH), TRUTH])
    assert got == pytest.approx([1.0, -0.4, 0.3 * 0.5 + 0.4 * 5 / 7 - 0.01])


def test_completion_trajectory_counts_invalid_calls():
    text = (
        submit()
        + submit(verdict="counterfeit")
        + '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    )
    t = completion_trajectory(text, CASE, tool_names=["submit", "search_taxonomy"])
    assert t.submission["verdict"] == "ok"  # the first submit counts
    assert t.invalid_calls == 2 and [c.ok for c in t.calls] == [True, False, False]
    assert "second terminal call" in t.calls[1].error and "unknown tool" in t.calls[2].error

    def validate(name, args):
        if args.get("verdict") not in ("ok", "counterfeit", "prohibited"):
            raise ValueError("verdict must be ok, counterfeit or prohibited")
        return args

    t = completion_trajectory(submit(verdict="approve"), CASE, validate=validate)
    assert t.submission is None and t.invalid_calls == 1


def test_component_funcs_and_metrics():
    funcs, weights = as_trl_reward_funcs(REWARD)
    assert [f.__name__ for f in funcs] == [
        "catalog_reward",
        "catalog_reward/category",
        "catalog_reward/attributes",
        "catalog_reward/policy",
        "catalog_reward/invalid_calls",
    ]
    assert weights == [1.0, 0.0, 0.0, 0.0, 0.0]
    vals = [f(["p"], [submit(category_id="aa-1-3")], truth=[TRUTH])[0] for f in funcs]
    assert vals == pytest.approx([0.3 * 2 / 3 + 0.7, 2 / 3, 1.0, 1.0, 0.0])
    r1 = REWARD(completion_trajectory(submit(), CASE), CASE)
    r2 = REWARD(completion_trajectory("nothing", CASE), CASE)
    flat = flatten_result(r1)
    assert flat["rewards/total"] == 1.0 and flat["rewards/category"] == 1.0
    m = component_metrics([r1, r2])
    assert (
        m["rewards/total"] == pytest.approx(0.3)
        and m["rewards/policy"] == 0.0
        and m["rewards/submitted"] == 0.5
    )


def test_missing_truth_column_is_a_clear_error():
    with pytest.raises(KeyError, match="no 'truth' column"):
        as_trl_reward(REWARD)(["p"], [submit()])


def test_terminal_tools_come_from_the_twin():
    from envs.returns.twin import ReturnsTwin

    twin = ReturnsTwin()
    case = twin.case("train", 0)
    answer = {
        "order_id": case.task["order_id"],
        "decision": case.truth["decision"],
        "amount": case.truth["amount"],
        "reason": "per policy",
    }
    lookup = {"name": "lookup_order", "arguments": {"order_id": case.task["order_id"]}}
    decide = "".join(
        f"<tool_call>{json.dumps(c)}</tool_call>"
        for c in (lookup, {"name": "decide", "arguments": answer})
    )
    f = as_trl_reward(twin.score, twin=twin)
    assert f(["p"], [decide], split=["train"], index=[0]) == [pytest.approx(twin.reward.bounds[1])]
    funcs, _ = as_trl_reward_funcs(twin.reward, twin=twin)
    assert funcs[0](["p"], [decide], split=["train"], index=[0]) == [
        pytest.approx(twin.reward.bounds[1])
    ]
    # an explicit list still wins, and without a twin `submit` stays the default
    assert (
        as_trl_reward(twin.score, twin=twin, terminal_tools=["submit"])(
            ["p"], [decide], split=["train"], index=[0]
        )[0]
        < 1.0
    )
    assert terminal_tool_names() == ("submit",)
    assert terminal_tool_names(twin) == ("decide",)

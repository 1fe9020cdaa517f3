"""Reasoning inside <think>...</think> is never read as a tool call."""

from __future__ import annotations

from twin.env import TwinEnv
from twin.parsing import parse_tool_calls, split_reasoning
from twin.registry import make_twin

SUBMIT = '<tool_call>{"name": "submit", "arguments": {"answer": "red"}}</tool_call>'
LOOKUP = '<tool_call>{"name": "lookup", "arguments": {"id": "R-1"}}</tool_call>'


def test_a_call_drafted_inside_think_is_not_a_call() -> None:
    text = f"<think>\nMaybe I should just {SUBMIT} now. No, look first.\n</think>\n\n{LOOKUP}"
    turn = parse_tool_calls(text)
    assert [c.name for c in turn.calls] == ["lookup"]
    assert turn.errors == []
    # the reasoning is kept as text, ahead of what was outside it
    assert turn.content.startswith("<think>") and "Maybe I should just" in turn.content


def test_mentioning_the_tag_inside_think_is_not_opened_twice() -> None:
    text = f"<think>I will write a <tool_call> block with the lookup.</think>\n{LOOKUP}"
    turn = parse_tool_calls(text)
    assert turn.errors == []
    [call] = turn.calls
    assert (call.name, call.arguments, call.error) == ("lookup", {"id": "R-1"}, None)


def test_a_turn_cut_mid_thought_runs_nothing() -> None:
    turn = parse_tool_calls(f"<think>\nfirst {SUBMIT} then")
    assert turn.calls == [] and turn.errors == []
    assert "first" in turn.content


def test_a_close_tag_without_an_opening_closes_prompt_opened_reasoning() -> None:
    # templates that put "<think>\n" in the generation prompt leave only "</think>" in the turn
    turn = parse_tool_calls(f"drafting {SUBMIT}\n</think>\n\n{LOOKUP}")
    assert [c.name for c in turn.calls] == ["lookup"] and turn.errors == []


def test_split_reasoning_keeps_every_character() -> None:
    text = "a<think>b</think>c<think>d"
    reasoning, rest = split_reasoning(text)
    assert (reasoning, rest) == ("<think>b</think><think>d", "ac")
    assert split_reasoning("plain") == ("", "plain")


def test_the_env_does_not_execute_a_submit_drafted_in_reasoning() -> None:
    twin = make_twin("Toy", max_turns=3)
    env = TwinEnv(twin)
    env.reset(options={"split": "train", "index": 0})
    drafted = (
        '<think>Answer: <tool_call>{"name": "submit", "arguments": {"answer": "red"}}</tool_call>?'
        "</think>\nLet me think more."
    )
    _obs, _reward, terminated, _truncated, _info = env.step(drafted)
    assert not terminated  # the toy twin's submit ends the episode: it did not run
    _obs, _reward, terminated, _truncated, _info = env.step("<think>now</think>" + SUBMIT)
    assert terminated

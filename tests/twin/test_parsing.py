"""parse_tool_calls: every format, and the exact message for each kind of junk."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from twin.parsing import CALL_FORMAT, ParsedTurn, parse_tool_calls

F = CALL_FORMAT


# -- the formats --------------------------------------------------------------------------------
def test_hermes_single_call_keeps_text_outside():
    turn = parse_tool_calls(
        'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"id": "R-1"}}\n</tool_call>',
        turn=3,
    )
    assert turn.content == "Let me look."
    assert turn.errors == []
    [call] = turn.calls
    assert (call.id, call.name, call.arguments, call.error) == (
        "call_3_0",
        "lookup",
        {"id": "R-1"},
        None,
    )
    assert call.raw == '{"name": "lookup", "arguments": {"id": "R-1"}}'


def test_hermes_several_calls_in_order_with_ids():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>'
    )
    turn = parse_tool_calls(text, turn=1)
    assert [(c.id, c.name, c.arguments) for c in turn.calls] == [
        ("call_1_0", "a", {}),
        ("call_1_1", "b", {"x": 1}),
    ]
    assert turn.content == "and"


def test_hermes_arguments_as_json_string_and_missing_arguments():
    turn = parse_tool_calls(
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>'
    )
    assert turn.calls[0].arguments == {"x": [1, 2]}
    turn = parse_tool_calls('<tool_call>{"name": "a"}</tool_call>')
    assert turn.calls[0].arguments == {}
    turn = parse_tool_calls('<tool_call>{"name": "a", "parameters": {"y": 2}}</tool_call>')
    assert turn.calls[0].arguments == {"y": 2}


def test_hermes_openai_shape_inside_the_tag():
    turn = parse_tool_calls(
        '<tool_call>{"type": "function", "function": {"name": "a", "arguments": "{}"}}</tool_call>'
    )
    assert (turn.calls[0].name, turn.calls[0].arguments) == ("a", {})


def test_unicode_survives():
    turn = parse_tool_calls(
        'Ok 👍 <tool_call>{"name": "a", "arguments": {"q": "Grüße 日本"}}</tool_call>'
    )
    assert turn.content == "Ok 👍"
    assert turn.calls[0].arguments == {"q": "Grüße 日本"}


def test_openai_message_dict():
    msg = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "abc", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
            {"type": "function", "function": {"name": "b", "arguments": {"y": 2}}},
        ],
    }
    turn = parse_tool_calls(msg, turn=4)
    assert turn.content == ""
    assert [(c.id, c.name, c.arguments, c.error) for c in turn.calls] == [
        ("abc", "a", {"x": 1}, None),
        ("call_4_1", "b", {"y": 2}, None),
    ]
    assert turn.calls[0].raw == '{"x": 1}'


def test_openai_message_content_only_is_parsed_as_text():
    turn = parse_tool_calls(
        {"role": "assistant", "content": '<tool_call>{"name": "a"}</tool_call>'}
    )
    assert [c.name for c in turn.calls] == ["a"]
    turn = parse_tool_calls({"role": "assistant", "content": [{"type": "text", "text": "hi"}]})
    assert (turn.content, turn.calls, turn.errors) == ("hi", [], [])


def test_bare_json_and_fenced_json():
    turn = parse_tool_calls('  {"name": "a", "arguments": {"x": "}"}}  ', turn=2)
    assert [(c.id, c.name, c.arguments) for c in turn.calls] == [("call_2_0", "a", {"x": "}"})]
    fenced = '```json\n{"name": "a", "arguments": {}}\n```'
    assert parse_tool_calls(fenced).calls[0].name == "a"
    assert parse_tool_calls('```\n{"name": "a"}\n```').calls[0].name == "a"


def test_plain_text_has_no_calls_and_no_errors():
    for text in ("I think the answer is 4.", "a < b and c > d", "json looks like {this}, ok?"):
        turn = parse_tool_calls(text)
        assert turn == ParsedTurn(text, [], [])


def test_same_input_same_ids():
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    assert parse_tool_calls(text, turn=7) == parse_tool_calls(text, turn=7)


# -- junk: the exact messages -------------------------------------------------------------------
TURN_ERRORS = [
    ("", f"the turn is empty; call a tool like {F}"),
    ("  \n\t ", f"the turn is empty; call a tool like {F}"),
    (
        '<tool_call>{"name": "a"}',
        f"tool call #1: <tool_call> is not closed; end it with </tool_call>: {F}",
    ),
    (
        '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}',
        f"tool call #2: <tool_call> is not closed; end it with </tool_call>: {F}",
    ),
    ("done </tool_call>", f"</tool_call> without a matching <tool_call>; write {F}"),
    ('<tool_call {"name": "a"}>', f"malformed <tool_call> tag; write it exactly as {F}"),
    (
        None,
        "the action must be the assistant's text (str) or an assistant message (dict), got "
        "NoneType",
    ),
    (
        3.5,
        "the action must be the assistant's text (str) or an assistant message (dict), got float",
    ),
    (
        ["<tool_call>"],
        "the action must be the assistant's text (str) or an assistant message (dict), got list",
    ),
    (
        b"bytes",
        "the action must be the assistant's text (str) or an assistant message (dict), got bytes",
    ),
    ({}, 'the assistant message has neither "content" nor "tool_calls"; send one of them'),
    ({"role": "user", "content": "hi"}, "the message role must be \"assistant\", got 'user'"),
    ({"role": "assistant", "content": None}, f"the turn is empty; call a tool like {F}"),
    ({"content": 5}, '"content" must be a string or null, got int'),
    ({"tool_calls": "x"}, '"tool_calls" must be a list, got str'),
]

CALL_ERRORS = [
    ("<tool_call></tool_call>", f"tool call #1 is empty; expected {F}"),
    (
        '<tool_call>{"name": "a", }</tool_call>',
        "tool call #1 is not valid JSON: Expecting property name enclosed in double quotes at "
        "line 1 "
        "column 15 (char 14)",
    ),
    (
        '<tool_call>{"name": "a"} {"name": "b"}</tool_call>',
        "tool call #1 is not valid JSON: extra data after the object at line 1 column 15 (char "
        "14); "
        "send exactly one JSON object per call",
    ),
    (
        "<tool_call>[1, 2]</tool_call>",
        'tool call #1: expected a JSON object {"name": ..., "arguments": {...}}, got an array',
    ),
    ('<tool_call>{"arguments": {}}</tool_call>', f'tool call #1: missing "name"; expected {F}'),
    ('<tool_call>{"name": 7}</tool_call>', 'tool call #1: "name" must be a string, got a number'),
    ('<tool_call>{"name": null}</tool_call>', f'tool call #1: missing "name"; expected {F}'),
    (
        '<tool_call>{"name": ["a"]}</tool_call>',
        'tool call #1: "name" must be a string, got an array',
    ),
    ('<tool_call>{"name": "  "}</tool_call>', 'tool call #1: "name" is empty; give the tool name'),
    (
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
        'tool call #1 (a): "arguments" must be a JSON object, got an array',
    ),
    (
        '<tool_call>{"name": "a", "arguments": true}</tool_call>',
        'tool call #1 (a): "arguments" must be a JSON object, got a boolean',
    ),
    (
        '<tool_call>{"name": "a", "arguments": "{bad"}</tool_call>',
        'tool call #1 (a): "arguments" is not valid JSON: Expecting property name enclosed in '
        "double "
        "quotes at line 1 column 2 (char 1)",
    ),
    (
        '<tool_call><tool_call>{"name": "a"}</tool_call>',
        "tool call #1: <tool_call> opened twice before </tool_call>; close each call before the "
        f"next: {F}",
    ),
    (
        '{"name": "a", "arguments": 3}',
        'the JSON call (a): "arguments" must be a JSON object, got a number',
    ),
    ('{"nam": "a"}', f'the JSON call: missing "name"; expected {F}'),
    (
        "{not json}",
        "the JSON call is not valid JSON: Expecting property name enclosed in double quotes at "
        "line 1 "
        "column 2 (char 1)",
    ),
    (
        '```json\n{"name": "a",\n "arguments": {"x": }}\n```',
        "the JSON call is not valid JSON: Expecting value at line 2 column 21 (char 34)",
    ),
    ({"tool_calls": [5]}, "tool_calls[0]: expected an object, got int"),
    (
        {"tool_calls": [{"id": "c", "type": "function"}]},
        'tool_calls[0]: missing "function": {"name": ..., "arguments": "<json>"}',
    ),
    (
        {"tool_calls": [{"function": {"name": "a", "arguments": "[1]"}}]},
        'tool_calls[0] (a): "arguments" must be a JSON object, got an array',
    ),
    (
        {"tool_calls": [{"function": {"name": "a", "arguments": '{"x": 1'}}]},
        "tool_calls[0] (a): \"arguments\" is not valid JSON: Expecting ',' delimiter at line 1 "
        "column 8 (char 7)",
    ),
    (
        {"tool_calls": [{"function": {"name": "a", "arguments": {"x": {1, 2}}}}]},
        'tool_calls[0] (a): "arguments" must be JSON data (Object of type set is not JSON '
        "serializable)",
    ),
    (
        {"tool_calls": [{"function": {"arguments": "{}"}}]},
        f'tool_calls[0]: missing "name"; expected {F}',
    ),
]


@pytest.mark.parametrize(("action", "message"), TURN_ERRORS)
def test_turn_level_errors(action, message):
    turn = parse_tool_calls(action)
    assert turn.errors == [message]
    assert all(c.error is None for c in turn.calls)


@pytest.mark.parametrize(("action", "message"), CALL_ERRORS)
def test_call_level_errors(action, message):
    turn = parse_tool_calls(action)
    assert [c.error for c in turn.calls] == [message]
    assert turn.calls[0].arguments is None
    assert turn.errors == []


def test_at_least_twenty_malformed_inputs_are_covered():
    assert len(TURN_ERRORS) + len(CALL_ERRORS) >= 20


def test_good_and_bad_calls_mix():
    turn = parse_tool_calls('<tool_call>{"name": "a"}</tool_call><tool_call>{oops}</tool_call>')
    assert [c.error is None for c in turn.calls] == [True, False]


def test_deep_nesting_does_not_raise():
    turn = parse_tool_calls("<tool_call>" + "[" * 100_000 + "</tool_call>")
    assert turn.calls[0].error is not None


def test_lone_surrogate_is_parsed_like_python_json():
    turn = parse_tool_calls('<tool_call>{"name": "a", "arguments": {"s": "\\ud800"}}</tool_call>')
    assert turn.calls[0].arguments == {"s": "\ud800"}


# -- properties ---------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_never_raises(text):
    turn = parse_tool_calls(text)
    assert isinstance(turn.content, str)
    for call in turn.calls:
        assert (call.arguments is None) == (call.error is not None) or call.arguments is None


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "x"]), json_values))
def test_any_dict_never_raises(msg):
    parse_tool_calls(msg)


@settings(max_examples=200, deadline=None)
@given(
    name=st.text(min_size=1).filter(lambda s: s.strip()),
    args=st.dictionaries(st.text(), json_values, max_size=4),
    prose=st.text().filter(lambda s: "<tool_call" not in s and "</tool_call>" not in s),
)
def test_roundtrip_of_well_formed_calls(name, args, prose):
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    # The Hermes format cannot carry its own tags inside a call (a model would not write them).
    assume("<tool_call>" not in body and "</tool_call>" not in body)
    turn = parse_tool_calls(f"{prose}<tool_call>{body}</tool_call>")
    assert turn.errors == []
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [(name, args, None)]
    msg = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": name, "arguments": json.dumps(args)}}],
    }
    assert parse_tool_calls(msg).calls[0].arguments == args


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_json_constants_are_rejected_with_a_message(constant):
    # Python's json reads these, but they are not JSON and would not survive the trajectory's
    # JSON round trip: the call must be refused with a message, never recorded as a value.
    tagged = parse_tool_calls(
        f'<tool_call>{{"name": "look", "arguments": {{"a": {constant}}}}}</tool_call>'
    )
    assert tagged.calls[0].arguments is None
    assert f"{constant.lstrip('-')} is not a JSON value" in tagged.calls[0].error
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "i",
                "type": "function",
                "function": {"name": "look", "arguments": f'{{"": {constant}}}'},
            }
        ],
    }
    call = parse_tool_calls(message).calls[0]
    assert call.arguments is None and "not a JSON value" in call.error


def test_arguments_nested_too_deeply_are_refused():
    from twin.parsing import MAX_DEPTH

    deep = '{"a":' * 300 + "1" + "}" * 300
    for action in (
        f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>',
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": deep}}],
        },
    ):
        call = parse_tool_calls(action).calls[0]
        assert call.arguments is None
        assert call.error.endswith(
            f'"arguments" are nested more than {MAX_DEPTH} levels deep; send flat JSON arguments'
        )
    ok = '{"a":' * (MAX_DEPTH - 1) + "1" + "}" * (MAX_DEPTH - 1)
    assert (
        parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {ok}}}</tool_call>')
        .calls[0]
        .error
        is None
    )

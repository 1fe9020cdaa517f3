"""parse_tool_calls on other models' formats: Qwen3-Coder XML, Llama 3 JSON, Mistral, gpt-oss
harmony. Each: the documented shape, its malformed cases (exact messages), and a round trip."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from twin.parsing import (
    HARMONY_FORMAT,
    LLAMA_FORMAT,
    MISTRAL_FORMAT,
    QWEN_XML_FORMAT,
    parse_tool_calls,
)


def _calls(text, **kw):
    turn = parse_tool_calls(text, **kw)
    return [(c.id, c.name, c.arguments, c.error) for c in turn.calls]


# -- Qwen3-Coder XML ----------------------------------------------------------------------------
XML = (
    "Checking.\n<tool_call>\n<function=decide>\n<parameter=order_id>\nR-7\n</parameter>\n"
    "<parameter=amount>\n12.5\n</parameter>\n<parameter=reason>\nline one\nline two\n</parameter>\n"
    "</function>\n</tool_call>"
)
SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "decide",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string"},
                    "amount": {"type": "number"},
                    "reason": {"type": "string"},
                    "urgent": {"type": "boolean"},
                    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
]


def test_qwen_xml_call_reads_values_as_text_lines():
    turn = parse_tool_calls(XML, turn=2)
    assert turn.content == "Checking."
    assert turn.errors == []
    assert _calls(XML, turn=2) == [
        (
            "call_2_0",
            "decide",
            {"order_id": "R-7", "amount": 12.5, "reason": "line one\nline two"},
            None,
        )
    ]


def test_qwen_xml_values_are_typed_by_the_schema_when_given():
    text = (
        "<tool_call><function=decide><parameter=order_id>10042</parameter><parameter=amount>3</parameter>"
        "<parameter=urgent>True</parameter><parameter=note>null</parameter>"
        '<parameter=tags>["a", "b"]</parameter><parameter=extra>{"k": '
        "1}</parameter></function></tool_call>"
    )
    typed = parse_tool_calls(text, tools=SCHEMAS).calls[0].arguments
    assert typed == {
        "order_id": "10042",
        "amount": 3,
        "urgent": True,
        "note": None,
        "tags": ["a", "b"],
        "extra": {"k": 1},
    }
    # Without schemas a value is JSON when it parses, else text.
    untyped = parse_tool_calls(text).calls[0].arguments
    assert untyped["order_id"] == 10042 and untyped["urgent"] == "True"
    # A mapping from tool name to its parameters' schema works too.
    by_name = {"decide": SCHEMAS[0]["function"]["parameters"]}
    assert parse_tool_calls(text, tools=by_name).calls[0].arguments == typed


def test_qwen_xml_value_of_the_wrong_type_stays_text_for_validation():
    text = "<tool_call><function=decide><parameter=amount>lots</parameter></function></tool_call>"
    assert parse_tool_calls(text, tools=SCHEMAS).calls[0].arguments == {"amount": "lots"}


def test_env_types_xml_values_with_the_twins_schemas():
    import twin

    env = twin.TwinEnv(twin.make_twin("Returns"))
    env.reset(options={"split": "test", "index": 0})
    xml = (
        "<tool_call>\n<function=lookup_order>\n<parameter=order_id>\n12345\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    _, _, _, _, info = env.step(xml)
    # A string parameter keeps "12345" as text: the twin answers about the order, not the type.
    assert info["errors"] == ["no order '12345'; order ids look like 'R-10042' (see the message)"]


X = QWEN_XML_FORMAT
XML_ERRORS = [
    (
        "<tool_call><function=a><parameter=x>1</parameter></tool_call>",
        f"tool call #1 (a): <function=...> is not closed; end it with </function>: {X}",
    ),
    (
        "<tool_call><function=><parameter=x>1</parameter></function></tool_call>",
        'tool call #1: "name" is empty; give the tool name',
    ),
    (
        "<tool_call><function a></function></tool_call>",
        f"tool call #1: malformed <function=...> tag; write {X}",
    ),
    (
        "<tool_call><function=a><parameter=x>1</function></tool_call>",
        "tool call #1 (a): <parameter=x> is not closed; end it with </parameter>",
    ),
    (
        "<tool_call><function=a><arg=x>1</arg></function></tool_call>",
        "tool call #1 (a): unexpected text '<arg=x>1</arg>'; write each argument as "
        "<parameter=NAME>\\nVALUE\\n</parameter>",
    ),
    (
        "<tool_call><function=a><parameter=x>1</parameter><parameter=x>2</parameter></function></tool_call>",
        "tool call #1 (a): parameter 'x' is given twice; give each argument once",
    ),
    (
        "<tool_call><function=a><parameter=>1</parameter></function></tool_call>",
        "tool call #1 (a): a parameter name is empty; write each argument as "
        "<parameter=NAME>\\nVALUE\\n</parameter>",
    ),
    (
        "<tool_call><function=a></function><function=b></function></tool_call>",
        "tool call #1 (a): unexpected text '</function><function=b>'; write each argument as "
        "<parameter=NAME>\\nVALUE\\n</parameter>",
    ),
]


# -- Llama 3 JSON -------------------------------------------------------------------------------
def test_llama_python_tag_calls_separated_by_semicolons():
    text = (
        'Let me check.<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
        '{"name": "b", "parameters": {}}<|eom_id|>'
    )
    turn = parse_tool_calls(text, turn=1)
    assert (turn.content, turn.errors) == ("Let me check.", [])
    assert _calls(text, turn=1) == [("call_1_0", "a", {"x": 1}, None), ("call_1_1", "b", {}, None)]


def test_llama_bare_json_calls_and_a_string_holding_a_separator():
    text = '{"name": "a", "parameters": {"q": "x"}};\n{"name": "b", "parameters": {"q": "}; {"}}'
    assert _calls(text) == [
        ("call_0_0", "a", {"q": "x"}, None),
        ("call_0_1", "b", {"q": "}; {"}, None),
    ]
    one = '{"name": "a", "parameters": {"q": "}; {"}}'
    assert _calls(one) == [("call_0_0", "a", {"q": "}; {"}, None)]


L = LLAMA_FORMAT
LLAMA_ERRORS = [
    (
        '<|python_tag|>{"name": "a", "parameters": {"x": 1',
        "tool call #1 is not valid JSON: Expecting ',' delimiter at line 1 column 36 (char 35)",
    ),
    (
        '<|python_tag|>{"name": "a", "parameters": [1]}',
        'tool call #1 (a): "arguments" must be a JSON object, got an array',
    ),
    (
        '<|python_tag|>{"nme": "a", "parameters": {}}',
        'tool call #1: missing "name"; expected '
        '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>',
    ),
    (
        '<|python_tag|>brave_search.call(query="x")',
        "tool call #1 is not valid JSON: Expecting value at line 1 column 1 (char 0)",
    ),
    (
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {x}}',
        "tool call #2 is not valid JSON: Expecting property name enclosed in double quotes at "
        "line 1 "
        "column 63 (char 62)",
    ),
]
LLAMA_TURN_ERRORS = [
    ("<|python_tag|>  <|eom_id|>", f"no call after <|python_tag|>; write {L}"),
    (
        '<|python_tag|>{"name": "a", "parameters": {}} then more',
        "unexpected text after tool call #1: 'then more'; separate calls with ';' and write "
        "nothing "
        f"after them: {L}",
    ),
    (
        '<|python_tag|>{"name": "a"}<|python_tag|>{"name": "b"}',
        f"<|python_tag|> written twice; write it once and separate the calls with ';': {L}",
    ),
]


# -- Mistral ------------------------------------------------------------------------------------
def test_mistral_json_list_keeps_ids_and_content():
    text = (
        'Sure.[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "Abc123xyz"}, '
        '{"name": "b", "arguments": "{\\"y\\": 2}"}]</s>'
    )
    turn = parse_tool_calls(text, turn=3)
    assert (turn.content, turn.errors) == ("Sure.", [])
    assert _calls(text, turn=3) == [
        ("Abc123xyz", "a", {"x": 1}, None),
        ("call_3_1", "b", {"y": 2}, None),
    ]


def test_mistral_named_form_one_token_per_call():
    text = (
        '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[CALL_ID]k9Xm2pQ7r[ARGS]{}[TOOL_CALLS]c{"z": null}'
    )
    assert _calls(text) == [
        ("call_0_0", "a", {"x": 1}, None),
        ("k9Xm2pQ7r", "b", {}, None),
        ("call_0_2", "c", {"z": None}, None),
    ]


M = MISTRAL_FORMAT
MISTRAL_ERRORS = [
    (
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}',
        "tool call #1 is not valid JSON: Expecting ',' delimiter at line 1 column 37 (char 36)",
    ),
    (
        "[TOOL_CALLS][1]",
        'tool call #1: expected a JSON object {"name": ..., "arguments": {...}}, got a number',
    ),
    (
        '[TOOL_CALLS][{"arguments": {}}]',
        'tool call #1: missing "name"; expected '
        '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>',
    ),
    (
        "[TOOL_CALLS]lookup",
        "tool call #1 (lookup): the arguments are missing; write [TOOL_CALLS]lookup[ARGS]{...}",
    ),
    (
        '[TOOL_CALLS]a[ARGS]{"x": }',
        'tool call #1 (a): "arguments" is not valid JSON: Expecting value at line 1 column 7 '
        "(char 6)",
    ),
    ("[TOOL_CALLS]a[ARGS][1]", 'tool call #1 (a): "arguments" must be a JSON object, got an array'),
    (
        "[TOOL_CALLS]]oops",
        "tool call #1: expected a tool name or a JSON list after [TOOL_CALLS]; write "
        f"{M} or [TOOL_CALLS]<tool>[ARGS]{{...}}",
    ),
]
MISTRAL_TURN_ERRORS = [
    ("[TOOL_CALLS]", f"no call after [TOOL_CALLS]; write {M}"),
    ("[TOOL_CALLS][]", f"[TOOL_CALLS] holds an empty list; put the calls in it: {M}"),
]


# -- gpt-oss harmony ----------------------------------------------------------------------------
def test_harmony_call_after_analysis_and_preamble():
    text = (
        '<|channel|>analysis<|message|>User wants R-1. {"name": "not_a_call"}<|end|>'
        "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.lookup <|constrain|>json"
        '<|message|>{"order_id": "R-1"}<|call|>'
    )
    turn = parse_tool_calls(text, turn=4)
    assert (turn.content, turn.errors) == ("Looking it up.", [])
    assert _calls(text, turn=4) == [("call_4_0", "lookup", {"order_id": "R-1"}, None)]


def test_harmony_recipient_in_the_role_part_and_a_final_answer():
    text = "<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{}<|call|>"
    assert _calls(text) == [("call_0_0", "a", {}, None)]
    final = (
        "<|channel|>analysis<|message|>hmm<|end|>"
        "<|start|>assistant<|channel|>final<|message|>All done.<|return|>"
    )
    assert parse_tool_calls(final) == parse_tool_calls("All done.")


H = HARMONY_FORMAT
HARMONY_ERRORS = [
    (
        '<|channel|>commentary to=functions.a <|constrain|>json<|message|>{"x": 1',
        f"tool call #1 (a): the call is not closed; end it with <|call|>: {H}",
    ),
    (
        "<|channel|>commentary to=functions.a<|message|>{bad}<|call|>",
        'tool call #1 (a): "arguments" is not valid JSON: Expecting property name enclosed in '
        "double "
        "quotes at line 1 column 2 (char 1)",
    ),
    (
        "<|channel|>commentary to=functions.a<|message|>[1]<|call|>",
        'tool call #1 (a): "arguments" must be a JSON object, got an array',
    ),
    (
        "<|channel|>commentary to=functions.<|message|>{}<|call|>",
        'tool call #1: "name" is empty; give the tool name',
    ),
]
HARMONY_TURN_ERRORS = [
    (
        "<|channel|>commentary to=functions.a <|constrain|>json",
        f"tool call #1: the message has no <|message|>; write {H}",
    ),
]


@pytest.mark.parametrize(
    ("text", "message"), XML_ERRORS + LLAMA_ERRORS + MISTRAL_ERRORS + HARMONY_ERRORS
)
def test_malformed_call_gets_its_message(text, message):
    turn = parse_tool_calls(text)
    assert [c.error for c in turn.calls if c.error] == [message]
    assert all(c.arguments is None for c in turn.calls if c.error)
    assert turn.errors == []


@pytest.mark.parametrize(
    ("text", "message"), LLAMA_TURN_ERRORS + MISTRAL_TURN_ERRORS + HARMONY_TURN_ERRORS
)
def test_malformed_turn_gets_its_message(text, message):
    turn = parse_tool_calls(text)
    assert turn.errors == [message]
    assert all(c.error is None for c in turn.calls)


def test_malformed_turn_through_the_env_is_an_invalid_call_not_a_crash():
    import twin

    env = twin.TwinEnv(twin.make_twin("Returns"))
    env.reset(options={"split": "test", "index": 0})
    for text, message in MISTRAL_ERRORS[:1] + HARMONY_ERRORS[:1]:
        _, reward, _, _, info = env.step(text)
        assert info["errors"] == [message] and reward == 0.0


# -- round trips --------------------------------------------------------------------------------
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=6,
)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,15}", fullmatch=True)
args_st = st.dictionaries(st.text(max_size=12), json_values, max_size=4)
calls_st = st.lists(st.tuples(names, args_st), min_size=1, max_size=3)
_TOKENS = ("<|", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "</s>", "<tool_call", "</tool_call>")


def _clean(*texts: str) -> bool:
    return not any(t in text for text in texts for t in _TOKENS)


def _expected(calls):
    return [(n, a, None) for n, a in calls]


def _got(text, **kw):
    turn = parse_tool_calls(text, **kw)
    assert turn.errors == []
    return [(c.name, c.arguments, c.error) for c in turn.calls]


@settings(max_examples=150, deadline=None)
@given(calls=calls_st, prose=st.text(max_size=20))
def test_llama_roundtrip(calls, prose):
    body = "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)
    assume(_clean(body, prose))
    assert _got(f"{prose}<|python_tag|>{body}<|eom_id|>") == _expected(calls)
    assert _got(body) == _expected(calls)


@settings(max_examples=150, deadline=None)
@given(calls=calls_st, prose=st.text(max_size=20))
def test_mistral_roundtrip_both_forms(calls, prose):
    listed = json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)
    named = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}" for n, a in calls)
    assume(_clean(listed, prose))
    assert _got(f"{prose}[TOOL_CALLS]{listed}") == _expected(calls)
    assert _got(prose + named) == _expected(calls)


@settings(max_examples=150, deadline=None)
@given(calls=calls_st, thought=st.text(max_size=30))
def test_harmony_roundtrip(calls, thought):
    bodies = [json.dumps(a, ensure_ascii=False) for _, a in calls]
    assume(_clean(thought, *bodies))
    msgs = "".join(
        f"<|start|>assistant<|channel|>commentary to=functions.{n} "
        f"<|constrain|>json<|message|>{body}<|call|>"
        for (n, _), body in zip(calls, bodies)
    )
    text = f"<|channel|>analysis<|message|>{thought}<|end|>{msgs}"
    assert _got(text) == _expected(calls)


xml_values = st.one_of(st.text(max_size=20), json_values)


@settings(max_examples=150, deadline=None)
@given(
    calls=st.lists(
        st.tuples(names, st.dictionaries(names, xml_values, max_size=4)), min_size=1, max_size=3
    )
)
def test_qwen_xml_roundtrip_with_schemas(calls):
    # One schema per name: the last tool of a repeated name would shadow the first.
    assume(len({n for n, _ in calls}) == len(calls))
    tools, parts = [], []
    for n, a in calls:
        props = {k: ({"type": "string"} if isinstance(v, str) else {}) for k, v in a.items()}
        tools.append(
            {"type": "function", "function": {"name": n, "parameters": {"properties": props}}}
        )
        rendered = {
            k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in a.items()
        }
        # A value cannot hold the format's own tags (a model would not write them).
        assume(
            not any(
                t in v for v in rendered.values() for t in ("parameter", "function>", "tool_call")
            )
        )
        params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in rendered.items())
        parts.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
    text = "\n".join(parts)
    assert _got(text, tools=tools) == _expected(calls)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "<|python_tag|>",
                "<|eom_id|>",
                "[TOOL_CALLS]",
                "[ARGS]",
                "[CALL_ID]",
                "<|channel|>",
                "<|message|>",
                "<|call|>",
                "<|end|>",
                "<|start|>",
                "to=functions.",
                "analysis",
                "<tool_call>",
                "</tool_call>",
                "<function=",
                "</function>",
                "<parameter=",
                "</parameter>",
                ">",
                "{",
                "}",
                "[",
                "]",
                ";",
                '"',
                ":",
                "a",
                " ",
                "\n",
                "1",
            ]
        ),
        max_size=30,
    )
)
def test_format_tokens_in_any_order_never_raise(pieces):
    turn = parse_tool_calls("".join(pieces), tools=SCHEMAS)
    for call in turn.calls:
        assert (call.arguments is None) == (call.error is not None)

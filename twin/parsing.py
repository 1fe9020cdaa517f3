"""Tool calls out of an assistant turn, in the formats models are trained to write.

:func:`parse_tool_calls` accepts what a policy produces and never raises. The formats:

* Hermes/Qwen text, any number of calls per turn::

      Let me look.<tool_call>{"name": "lookup_order", "arguments": {"order_id": "R-1"}}</tool_call>

* Qwen3-Coder XML inside the same tags (values are text; see *Typed XML values* below)::

      <tool_call>
      <function=lookup_order>
      <parameter=order_id>
      R-1
      </parameter>
      </function>
      </tool_call>

* An OpenAI assistant message dict whose ``tool_calls`` carry JSON-string arguments::

      {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
       "function": {"name": "lookup_order", "arguments": "{\\"order_id\\": \\"R-1\\"}"}}]}

* A bare JSON object as the whole text, optionally inside a ```json fence; Llama 3 writes
  ``"parameters"`` for ``"arguments"`` and separates several calls with ``;``::

      {"name": "lookup_order", "arguments": {"order_id": "R-1"}}
      {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}

* Llama 3 after its ``<|python_tag|>`` token (``;`` between calls; ``<|eom_id|>`` ends it)::

      <|python_tag|>{"name": "lookup_order", "parameters": {"order_id": "R-1"}}

* Mistral, the JSON list (ids kept) and the newer one-call-per-token form::

      [TOOL_CALLS][{"name": "lookup_order", "arguments": {"order_id": "R-1"}, "id": "a1b2c3d4e"}]
      [TOOL_CALLS]lookup_order[ARGS]{"order_id": "R-1"}

* gpt-oss (harmony): a message addressed ``to=functions.NAME`` is a call; messages on the
  ``analysis`` channel are reasoning (left out of the content), the others are content::

      <|channel|>analysis<|message|>Need the order.<|end|><|start|>assistant<|channel|>commentary
      to=functions.lookup_order <|constrain|>json<|message|>{"order_id": "R-1"}<|call|>

*Typed XML values*: a Qwen3-Coder value is text. Given the tool schemas (``tools=``), a value
whose parameter is declared ``string`` stays text and any other is read as JSON when it parses
(``3`` -> 3, ``true`` -> True, ``null`` -> None); without a schema for the parameter a value is
read as JSON when it parses, else kept as text.

*Reasoning is never a call*: text inside ``<think>...</think>`` (Qwen3, DeepSeek-R1 style) is the
model's reasoning. A call drafted there is not executed and a tag merely mentioned there is not
read as one; the reasoning stays in :attr:`ParsedTurn.content`, ahead of the text outside it. A
``<think>`` never closed (the turn was cut mid-thought) makes the rest of the turn reasoning, and
a ``</think>`` with no opening tag (the chat template wrote ``<think>`` into the prompt) makes
everything before it reasoning.

Everything that goes wrong becomes an error text written for the agent: a problem with one call
sits on that :class:`ParsedCall` (``error``), a problem with the turn as a whole (an unclosed tag,
empty text, an action of the wrong type) sits in :attr:`ParsedTurn.errors`. Calls without an id
get ``call_<turn>_<k>``, so the same turn always yields the same ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import from_json

__all__ = [
    "CALL_FORMAT",
    "HARMONY_FORMAT",
    "LLAMA_FORMAT",
    "MISTRAL_FORMAT",
    "QWEN_XML_FORMAT",
    "ParsedCall",
    "ParsedTurn",
    "ToolSchemas",
    "parse_tool_calls",
    "short_text",
    "split_reasoning",
]

#: How a call should look; error messages end with it.
CALL_FORMAT = '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'
#: The same, in the other formats (for their own error messages).
QWEN_XML_FORMAT = (
    "<tool_call>\\n<function=<tool>>\\n<parameter=<arg>>\\nvalue\\n</parameter>\\n</function>"
    "\\n</tool_call>"
)
LLAMA_FORMAT = '<|python_tag|>{"name": "<tool>", "parameters": {...}}'
MISTRAL_FORMAT = '[TOOL_CALLS][{"name": "<tool>", "arguments": {...}}]'
HARMONY_FORMAT = (
    "<|channel|>commentary to=functions.<tool> <|constrain|>json<|message|>{...}<|call|>"
)

#: Tool schemas for typing Qwen3-Coder XML values: OpenAI tool specs (``[{"type": "function",
#: "function": {"name", "parameters"}}]``, what ``Twin.tool_schemas`` gives) or a mapping from tool
#: name to its parameters' JSON schema.
ToolSchemas = Sequence[Mapping[str, Any]] | Mapping[str, Mapping[str, Any]]

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_FENCE = re.compile(r"\A```(?:json|JSON)?[ \t]*\n?(.*?)\n?```\Z", re.DOTALL)


def _no_constant(name: str) -> Any:
    # Python's json reads NaN / Infinity, which JSON does not allow and which would not survive
    # the trajectory's own JSON round trip (they come back as null).
    raise ValueError(
        f"is not valid JSON: {name} is not a JSON value (use a finite number or a string)"
    )


_py_decoder = json.JSONDecoder(parse_constant=_no_constant)
_py_loads = _py_decoder.decode
_raw_decode = _py_decoder.raw_decode


def _loads(text: str) -> Any:
    """Parse JSON: pydantic-core's parser (2x faster), Python's on failure for exact messages."""
    try:
        return from_json(text, allow_inf_nan=False)
    except Exception:  # also TypeError on lone surrogates, which Python's json accepts
        return _py_loads(text)


@dataclass(slots=True)
class ParsedCall:
    """One tool call read from a turn.

    Attributes:
        id: The call id (from the message, or ``call_<turn>_<k>``).
        name: The tool name as written ("" when it could not be read).
        arguments: The arguments as a dict, or None when they could not be read.
        raw: The call's source text (the JSON inside the tag, or the arguments string).
        error: Why the call is unusable (shown to the agent), or None.
    """

    id: str
    name: str
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None


@dataclass(slots=True)
class ParsedTurn:
    """What an assistant turn contained.

    Attributes:
        content: The text outside tool calls, stripped.
        calls: The calls in order, usable or not.
        errors: Problems with the turn as a whole (not tied to one call).
    """

    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_tool_calls(action: Any, *, turn: int = 0, tools: ToolSchemas | None = None) -> ParsedTurn:
    """Read the tool calls of one assistant turn; never raises.

    Args:
        action: The assistant's raw text, or an OpenAI assistant message dict.
        turn: Index of the turn in its episode; used for generated call ids.
        tools: The tools' schemas (:data:`ToolSchemas`), used only to type the text values of
            Qwen3-Coder XML calls; without them a value is read as JSON when it parses.

    Returns:
        The turn's text outside calls, its calls (each with an ``error`` when unusable) and the
        turn-level errors.
    """
    if isinstance(action, str):
        return _parse_text(action, turn, 0, tools)
    if isinstance(action, dict):
        return _parse_message(action, turn, tools)
    return ParsedTurn(
        "",
        errors=[
            f"the action must be the assistant's text (str) or an assistant message (dict), "
            f"got {type(action).__name__}"
        ],
    )


# -- text ---------------------------------------------------------------------------------------
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


def split_reasoning(text: str) -> tuple[str, str]:
    """``(reasoning, rest)`` of an assistant turn: the ``<think>`` blocks (tags kept) and the text
    outside them, where tool calls are read.

    A ``</think>`` before any ``<think>`` closes reasoning the prompt opened; an unclosed
    ``<think>`` runs to the end of the turn. Tags nested inside a block are part of its text.
    """
    if _THINK_CLOSE not in text and _THINK_OPEN not in text:
        return "", text
    reasoning: list[str] = []
    outside: list[str] = []
    pos = 0
    first_close = text.find(_THINK_CLOSE)
    first_open = text.find(_THINK_OPEN)
    if first_close >= 0 and (first_open < 0 or first_close < first_open):
        pos = first_close + len(_THINK_CLOSE)
        reasoning.append(text[:pos])
    while True:
        start = text.find(_THINK_OPEN, pos)
        if start < 0:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        end = text.find(_THINK_CLOSE, start + len(_THINK_OPEN))
        if end < 0:
            reasoning.append(text[start:])
            break
        pos = end + len(_THINK_CLOSE)
        reasoning.append(text[start:pos])
    return "".join(reasoning), "".join(outside)


def _parse_text(
    text: str, turn: int, first: int = 0, tools: ToolSchemas | None = None
) -> ParsedTurn:
    if not text.strip():
        return ParsedTurn("", errors=[f"the turn is empty; call a tool like {CALL_FORMAT}"])
    if "think>" in text:
        reasoning, rest = split_reasoning(text)
        if reasoning:
            if not rest.strip():  # only reasoning: prose, no call and nothing to complain about
                return ParsedTurn(text.strip())
            parsed = _parse_outside(rest, turn, first, tools)
            parsed.content = (reasoning.strip() + "\n\n" + parsed.content).strip()
            return parsed
    return _parse_outside(text, turn, first, tools)


def _parse_outside(
    text: str, turn: int, first: int = 0, tools: ToolSchemas | None = None
) -> ParsedTurn:
    # Fast path: a call needs a '<' (tag), a '[' (Mistral) or a '{' (bare JSON); prose has none
    # of them most of the time.
    if "<" in text:
        if "<tool_call" in text or _CLOSE in text:
            return _parse_tagged(text, turn, first, tools)
        if "<|" in text:
            if _PY_TAG in text:
                return _parse_llama(text, turn)
            if "<|message|>" in text or "<|channel|>" in text:
                return _parse_harmony(text, turn)
    if "[TOOL_CALLS]" in text:
        return _parse_mistral(text, turn)
    if "{" in text:
        body = text.strip()
        fence = _FENCE.match(body)
        if fence is not None:
            body = fence.group(1).strip()
        if body.startswith("{") and body.endswith("}"):
            if ";" in body and _SEMI.search(body) is not None:
                # Llama 3's several calls: {...}; {...}. One object holding "}; {" in a string
                # decodes as one call, and is read as the single JSON call below.
                calls, errors = _json_sequence(body, turn, LLAMA_FORMAT)
                if len(calls) > 1 or errors:
                    return ParsedTurn("", calls, errors)
            call = _call_from_json(body, _call_id(turn, first), "the JSON call")
            return ParsedTurn("", [call])
    return ParsedTurn(text.strip())


def _parse_tagged(text: str, turn: int, first: int, tools: ToolSchemas | None = None) -> ParsedTurn:
    calls: list[ParsedCall] = []
    errors: list[str] = []
    pieces: list[str] = []
    pos = 0
    k = 0
    find = text.find
    while True:
        start = find(_OPEN, pos)
        if start < 0:
            break
        end = find(_CLOSE, start)
        if end < 0:
            errors.append(
                f"tool call #{k + 1}: <tool_call> is not closed; end it with </tool_call>: "
                f"{CALL_FORMAT}"
            )
            pieces.append(text[pos:start])
            pos = len(text)
            break
        pieces.append(text[pos:start])
        body = text[start + 11 : end].strip()  # 11 == len("<tool_call>")
        pos = end + 12  # 12 == len("</tool_call>")
        call_id = f"call_{turn}_{first + k}"
        if _OPEN in body:
            call = ParsedCall(
                call_id,
                "",
                None,
                body,
                f"tool call #{k + 1}: <tool_call> opened twice before </tool_call>; close each "
                f"call before the next: {CALL_FORMAT}",
            )
        elif body.startswith("<function"):
            call = _call_from_xml(body, call_id, k, tools)
        else:
            call = _call_from_json(body, call_id, k)
        calls.append(call)
        k += 1
    if pos == 0 and not calls and not errors:
        content = text
    else:
        pieces.append(text[pos:])
        content = "".join(pieces)
    if _CLOSE in content:
        errors.append(f"</tool_call> without a matching <tool_call>; write {CALL_FORMAT}")
        content = content.replace(_CLOSE, "")
    elif "<tool_call" in content:
        errors.append(f"malformed <tool_call> tag; write it exactly as {CALL_FORMAT}")
    return ParsedTurn(content.strip(), calls, errors)


def _call_from_json(body: str, call_id: str, where: str | int) -> ParsedCall:
    if not body:
        where = _label(where)
        return ParsedCall(call_id, "", None, body, f"{where} is empty; expected {CALL_FORMAT}")
    try:
        obj = _loads(body)
    except (ValueError, RecursionError) as exc:
        return ParsedCall(call_id, "", None, body, f"{_label(where)} {_json_error(exc)}")
    return _call_from_obj(obj, call_id, body, where)


def _call_from_obj(obj: Any, call_id: str, body: str, where: str | int) -> ParsedCall:
    """A call from the decoded JSON ``obj`` of one call (``body`` is its source text)."""
    if not isinstance(obj, dict):
        where = _label(where)
        return ParsedCall(
            call_id,
            "",
            None,
            body,
            f'{where}: expected a JSON object {{"name": ..., "arguments": {{...}}}}, '
            f"got {_json_type(obj)}",
        )
    # Accept the OpenAI shape {"type": "function", "function": {...}} inside a tag too.
    if "name" not in obj and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    return _call_from_fields(obj, call_id, body, where)


def _call_from_fields(
    obj: dict[str, Any], call_id: str, raw: str, where: str | int, from_message: bool = False
) -> ParsedCall:
    name = obj.get("name")
    if isinstance(name, str) and type(name) is not str:
        name = str.__str__(name)  # a str subclass's own methods must not run in the env
    if type(name) is str and name.strip():
        args = obj.get("arguments", _MISSING)
        if type(args) is dict and not from_message and _shallow(args):  # the common case
            return ParsedCall(call_id, name, args, raw)
    where = _label(where)
    if name is None:
        return ParsedCall(
            call_id, "", None, raw, f'{where}: missing "name"; expected {CALL_FORMAT}'
        )
    if not isinstance(name, str):
        return ParsedCall(
            call_id, "", None, raw, f'{where}: "name" must be a string, got {_json_type(name)}'
        )
    if not name.strip():
        return ParsedCall(call_id, "", None, raw, f'{where}: "name" is empty; give the tool name')
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        text = args.strip()
        if not text:
            args = {}
        else:
            try:
                args = _loads(text)
            except (ValueError, RecursionError) as exc:
                return ParsedCall(
                    call_id,
                    name,
                    None,
                    args,
                    f'{where} ({short_text(name)}): "arguments" {_json_error(exc)}',
                )
    elif isinstance(args, dict) and from_message:
        # A dict from a message may hold anything Python allows; keep only JSON data.
        try:
            args = json.loads(json.dumps(args, allow_nan=False))
        except (TypeError, ValueError, RecursionError) as exc:
            why = (
                "nested too deeply"
                if isinstance(exc, RecursionError)
                else short_text(str(exc), 120)
            )
            return ParsedCall(
                call_id,
                name,
                None,
                _safe_repr(args),
                f'{where} ({short_text(name)}): "arguments" must be JSON data ({why})',
            )
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParsedCall(
            call_id,
            name,
            None,
            raw,
            f'{where} ({short_text(name)}): "arguments" must be a JSON object, got '
            f"{_json_type(args)}",
        )
    if not _shallow(args):
        return ParsedCall(
            call_id,
            name,
            None,
            raw if isinstance(raw, str) else _safe_repr(raw),
            f'{where} ({short_text(name)}): "arguments" are nested more than {MAX_DEPTH} levels '
            "deep; send flat JSON arguments",
        )
    return ParsedCall(call_id, name, args, raw)


# -- other models' formats ----------------------------------------------------------------------
_PY_TAG = "<|python_tag|>"
_LLAMA_ENDS = ("<|eom_id|>", "<|eot_id|>")
_SEMI = re.compile(r"\}\s*;\s*\{")
_MISTRAL = "[TOOL_CALLS]"
_MISTRAL_END = "</s>"
# NAME, an optional [CALL_ID]id, an optional [ARGS], then the arguments (the newer Mistral form;
# with special tokens skipped on decoding, "NAME{...}" is left).
_MISTRAL_NAMED = re.compile(
    r"([^\[\]{}\s]+)\s*(?:\[CALL_ID\]\s*([^\[\]{}\s]*)\s*)?(\[ARGS\])?(.*)\Z", re.DOTALL
)
_H_MESSAGE = "<|message|>"
_H_STOP = re.compile(r"<\|(?:end|call|return)\|>|<\|start\|>")
_H_TOKEN = re.compile(r"<\|[a-z_]+\|>")
_H_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]*)")
_H_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]*)")
_WS = re.compile(r"\s*")


def _json_sequence(body: str, turn: int, fmt: str) -> tuple[list[ParsedCall], list[str]]:
    """Calls written as JSON objects separated by ``;`` (Llama 3); stops at the first unreadable
    one."""
    calls: list[ParsedCall] = []
    errors: list[str] = []
    n = len(body)
    pos = _WS.match(body).end()  # type: ignore[union-attr]
    if pos == n:
        return calls, [f"no call after {_PY_TAG}; write {fmt}"]
    k = 0
    while pos < n:
        call_id = _call_id(turn, k)
        try:
            obj, end = _raw_decode(body, pos)
        except (ValueError, RecursionError) as exc:
            rest = body[pos:].strip()
            calls.append(ParsedCall(call_id, "", None, rest, f"{_label(k)} {_json_error(exc)}"))
            break
        calls.append(_call_from_obj(obj, call_id, body[pos:end], k))
        k += 1
        pos = _WS.match(body, end).end()  # type: ignore[union-attr]
        if pos == n:
            break
        if body[pos] != ";":
            errors.append(
                f"unexpected text after tool call #{k}: {short_text(body[pos:].strip())!r}; "
                f"separate calls with ';' and write nothing after them: {fmt}"
            )
            break
        pos = _WS.match(body, pos + 1).end()  # type: ignore[union-attr]
    return calls, errors


def _parse_llama(text: str, turn: int) -> ParsedTurn:
    """``content<|python_tag|>{call}; {call}<|eom_id|>`` (Llama 3.1+ JSON tool calling)."""
    start = text.find(_PY_TAG)
    content = text[:start]
    body = text[start + len(_PY_TAG) :]
    for stop in _LLAMA_ENDS:
        cut = body.find(stop)
        if cut >= 0:
            body = body[:cut]
    if _PY_TAG in body:
        return ParsedTurn(
            content.strip(),
            errors=[
                f"{_PY_TAG} written twice; write it once and separate the calls with ';': "
                f"{LLAMA_FORMAT}"
            ],
        )
    calls, errors = _json_sequence(body, turn, LLAMA_FORMAT)
    return ParsedTurn(content.strip(), calls, errors)


def _parse_mistral(text: str, turn: int) -> ParsedTurn:
    """``content[TOOL_CALLS][{...}, ...]`` or
    ``content[TOOL_CALLS]NAME[ARGS]{...}[TOOL_CALLS]...``."""
    segments = text.split(_MISTRAL)
    content = [segments[0]]
    calls: list[ParsedCall] = []
    errors: list[str] = []
    for segment in segments[1:]:
        seg = segment.strip()
        if seg.endswith(_MISTRAL_END):
            seg = seg[: -len(_MISTRAL_END)].rstrip()
        k = len(calls)
        call_id = _call_id(turn, k)
        if not seg:
            errors.append(f"no call after {_MISTRAL}; write {MISTRAL_FORMAT}")
            continue
        if seg[0] in "[{":
            try:
                obj, end = _raw_decode(seg)
            except (ValueError, RecursionError) as exc:
                calls.append(ParsedCall(call_id, "", None, seg, f"{_label(k)} {_json_error(exc)}"))
                continue
            content.append(seg[end:])
            items = obj if isinstance(obj, list) else [obj]
            if not items:
                errors.append(
                    f"{_MISTRAL} holds an empty list; put the calls in it: {MISTRAL_FORMAT}"
                )
            for item in items:
                k = len(calls)
                given = item.get("id") if isinstance(item, dict) else None
                cid = given if isinstance(given, str) and given else _call_id(turn, k)
                calls.append(_call_from_obj(item, cid, _safe_repr(item, 100_000), k))
            continue
        named = _MISTRAL_NAMED.match(seg)
        if named is None:
            calls.append(
                ParsedCall(
                    call_id,
                    "",
                    None,
                    seg,
                    f"{_label(k)}: expected a tool name or a JSON list after {_MISTRAL}; write "
                    f"{MISTRAL_FORMAT} or [TOOL_CALLS]<tool>[ARGS]{{...}}",
                )
            )
            continue
        name, given, args_tag, args = named.groups()
        args = args.strip()
        if given:
            call_id = given
        if not args and args_tag is None:
            calls.append(
                ParsedCall(
                    call_id,
                    name,
                    None,
                    seg,
                    f"{_label(k)} ({short_text(name)}): the arguments are missing; write "
                    f"[TOOL_CALLS]{short_text(name)}[ARGS]{{...}}",
                )
            )
            continue
        calls.append(_call_from_fields({"name": name, "arguments": args}, call_id, args, k))
    return ParsedTurn("".join(content).strip(), calls, errors)


def _parse_harmony(text: str, turn: int) -> ParsedTurn:
    """gpt-oss messages: a header (``to=RECIPIENT`` marks a call), ``<|message|>``, the body and
    a stop token."""
    calls: list[ParsedCall] = []
    errors: list[str] = []
    content: list[str] = []
    n = len(text)
    pos = 0
    while pos < n:
        at = text.find(_H_MESSAGE, pos)
        if at < 0:
            rest = text[pos:]
            if _H_RECIPIENT.search(rest):
                errors.append(
                    f"tool call #{len(calls) + 1}: the message has no <|message|>; "
                    f"write {HARMONY_FORMAT}"
                )
            else:
                content.append(_H_TOKEN.sub("", rest))
            break
        header = text[pos:at]
        start = at + len(_H_MESSAGE)
        stop = _H_STOP.search(text, start)
        body = text[start : stop.start() if stop else n]
        if stop is None:
            pos = n
        elif stop.group() == "<|start|>":  # the next message's header starts here
            pos = stop.start() + len("<|start|>")
        else:
            pos = stop.end()
        recipient = _H_RECIPIENT.search(header)
        if recipient is not None:
            k = len(calls)
            call_id = _call_id(turn, k)
            name = recipient.group(1)
            name = name[len("functions.") :] if name.startswith("functions.") else name
            if stop is None or stop.group() == "<|start|>":
                calls.append(
                    ParsedCall(
                        call_id,
                        name,
                        None,
                        body,
                        f"{_label(k)} ({short_text(name)}): the call is not closed; end it with "
                        f"<|call|>: {HARMONY_FORMAT}",
                    )
                )
            else:
                calls.append(_call_from_fields({"name": name, "arguments": body}, call_id, body, k))
            continue
        channel = _H_CHANNEL.search(header)
        if channel is not None and channel.group(1) == "analysis":
            continue  # reasoning, not said to anyone
        content.append(body)
    return ParsedTurn("\n".join(c.strip() for c in content if c.strip()), calls, errors)


def _call_from_xml(body: str, call_id: str, k: int, tools: ToolSchemas | None) -> ParsedCall:
    """``<function=NAME><parameter=ARG>VALUE</parameter>...</function>`` (Qwen3-Coder)."""
    where = _label(k)
    close = body.find(">")
    if not body.startswith("<function=") or close < 0 or "\n" in body[:close]:
        return ParsedCall(
            call_id,
            "",
            None,
            body,
            f"{where}: malformed <function=...> tag; write {QWEN_XML_FORMAT}",
        )
    name = body[10:close].strip()  # 10 == len("<function=")
    if not name:
        return ParsedCall(call_id, "", None, body, f'{where}: "name" is empty; give the tool name')
    where = f"{where} ({short_text(name)})"
    end = body.rfind("</function>")
    if end < 0:
        return ParsedCall(
            call_id,
            name,
            None,
            body,
            f"{where}: <function=...> is not closed; end it with </function>: {QWEN_XML_FORMAT}",
        )
    if body[end + 11 :].strip():  # 11 == len("</function>")
        return ParsedCall(
            call_id,
            name,
            None,
            body,
            f"{where}: text after </function>; write one function per <tool_call>",
        )
    values = _xml_parameters(body[close + 1 : end], where)
    if isinstance(values, str):
        return ParsedCall(call_id, name, None, body, values)
    props = _properties(tools, name)
    args = {
        arg: _typed(value, props.get(arg) if props is not None else None)
        for arg, value in values.items()
    }
    if not _shallow(args):
        return ParsedCall(
            call_id,
            name,
            None,
            body,
            f'{where}: "arguments" are nested more than {MAX_DEPTH} levels deep; '
            "send flat JSON arguments",
        )
    return ParsedCall(call_id, name, args, body)


def _xml_parameters(inner: str, where: str) -> dict[str, str] | str:
    """The ``<parameter=NAME>VALUE</parameter>`` values inside a ``<function=...>`` (raw text),
    or the error message for the first malformed one."""
    values: dict[str, str] = {}
    pos = 0
    usage = "write each argument as <parameter=NAME>\\nVALUE\\n</parameter>"
    while True:
        start = inner.find("<parameter=", pos)
        gap = inner[pos : start if start >= 0 else len(inner)]
        if gap.strip():
            return f"{where}: unexpected text {short_text(gap.strip())!r}; {usage}"
        if start < 0:
            return values
        tag_end = inner.find(">", start)
        if tag_end < 0 or "\n" in inner[start:tag_end]:
            return f"{where}: malformed <parameter=...> tag; {usage}"
        arg = inner[start + 11 : tag_end].strip()  # 11 == len("<parameter=")
        if not arg:
            return f"{where}: a parameter name is empty; {usage}"
        value_end = inner.find("</parameter>", tag_end)
        if value_end < 0:
            return f"{where}: <parameter={short_text(arg)}> is not closed; end it with </parameter>"
        if arg in values:
            return f"{where}: parameter {short_text(arg)!r} is given twice; give each argument once"
        value = inner[tag_end + 1 : value_end]
        # The template puts the value on lines of its own: one newline each side is layout.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        values[arg] = value
        pos = value_end + 12  # 12 == len("</parameter>")


def _properties(tools: ToolSchemas | None, name: str) -> Mapping[str, Any] | None:
    """The ``properties`` of tool ``name``'s parameters schema in ``tools``, or None."""
    if not tools:
        return None
    spec: Any = None
    if isinstance(tools, Mapping):
        spec = tools.get(name)
    else:
        for tool in tools:
            fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
            if isinstance(fn, Mapping) and fn.get("name") == name:
                spec = fn
                break
    if isinstance(spec, Mapping) and isinstance(spec.get("parameters"), Mapping):
        spec = spec["parameters"]
    props = spec.get("properties") if isinstance(spec, Mapping) else None
    return props if isinstance(props, Mapping) else None


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows (``type``, ``anyOf``/``oneOf`` members,
    ``enum``/``const``)."""
    if not isinstance(schema, Mapping):
        return set()
    types: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        types.add(kind)
    elif isinstance(kind, Sequence):
        types.update(t for t in kind if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, Sequence) and not isinstance(options, str):
            for option in options:
                types |= _schema_types(option)
    values = list(schema.get("enum") or ()) if isinstance(schema.get("enum"), Sequence) else []
    if "const" in schema:
        values.append(schema["const"])
    types.update(_json_kind(v) for v in values)
    return types


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _typed(value: str, schema: Any) -> Any:
    """A Qwen3-Coder text value as its parameter's type (see the module docs)."""
    types = _schema_types(schema) if schema is not None else set()
    if types == {"string"}:
        return value
    text = value.strip()
    if "boolean" in types and text in ("True", "False"):  # Python spelling, seen in the wild
        return text == "True"
    try:
        decoded = _loads(text)
    except Exception:  # noqa: BLE001 - not JSON (ValueError), nested too deeply: keep the text
        return value
    if not types:
        return decoded
    kind = _json_kind(decoded)
    if kind == "string":
        return value if "string" in types else decoded
    if kind in types or (kind == "integer" and "number" in types):
        return decoded
    return value  # the tool's validation says what was expected


# -- message dicts ------------------------------------------------------------------------------
def _parse_message(msg: dict[str, Any], turn: int, tools: ToolSchemas | None = None) -> ParsedTurn:
    role = msg.get("role", "assistant")
    if role != "assistant":
        return ParsedTurn(
            "",
            errors=[
                'the message role must be "assistant", got '
                + (short_text(repr(role)) if isinstance(role, str) else _safe_repr(role, 60))
            ],
        )
    has_content = msg.get("content") is not None
    tool_calls = msg.get("tool_calls")
    if not has_content and not tool_calls:
        if "content" in msg or "tool_calls" in msg:
            return ParsedTurn("", errors=[f"the turn is empty; call a tool like {CALL_FORMAT}"])
        return ParsedTurn(
            "",
            errors=[
                'the assistant message has neither "content" nor "tool_calls"; send one of them'
            ],
        )
    content = msg.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(
            p.get("text", "")
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    if content is not None and not isinstance(content, str):
        return ParsedTurn(
            "", errors=[f'"content" must be a string or null, got {type(content).__name__}']
        )
    if not tool_calls:
        # No structured calls: the calls may be in the text (a server without a tool parser).
        return _parse_text(content or "", turn, 0, tools)
    if not isinstance(tool_calls, list):
        return ParsedTurn(
            (content or "").strip(),
            errors=[f'"tool_calls" must be a list, got {type(tool_calls).__name__}'],
        )
    calls: list[ParsedCall] = []
    for k, item in enumerate(tool_calls):
        where = f"tool_calls[{k}]"
        call_id = _call_id(turn, k)
        if not isinstance(item, dict):
            calls.append(
                ParsedCall(
                    call_id,
                    "",
                    None,
                    _safe_repr(item),
                    f"{where}: expected an object, got {type(item).__name__}",
                )
            )
            continue
        given = item.get("id")
        if isinstance(given, str) and given:
            call_id = given
        fn = item.get("function", item if "name" in item else None)
        if not isinstance(fn, dict):
            calls.append(
                ParsedCall(
                    call_id,
                    "",
                    None,
                    _safe_repr(item),
                    f'{where}: missing "function": {{"name": ..., "arguments": "<json>"}}',
                )
            )
            continue
        raw = fn.get("arguments")
        raw_text = raw if isinstance(raw, str) else _safe_repr(raw)
        calls.append(_call_from_fields(fn, call_id, raw_text, where, from_message=True))
    return ParsedTurn((content or "").strip(), calls)


# -- helpers ------------------------------------------------------------------------------------
_MISSING = object()

#: Deepest nesting of lists and objects accepted in a call's arguments. No tool needs more, and
#: a trajectory holding deeper data could not be written as JSON (pydantic stops near 255).
MAX_DEPTH = 64


def _shallow(args: dict[str, Any]) -> bool:
    """True when ``args`` nests at most :data:`MAX_DEPTH` levels (checked without recursion)."""
    stack = [(v, 2) for v in args.values() if type(v) is dict or type(v) is list]
    while stack:
        value, level = stack.pop()
        if level > MAX_DEPTH:
            return False
        children = value.values() if type(value) is dict else value
        stack.extend((v, level + 1) for v in children if type(v) is dict or type(v) is list)
    return True


def _label(where: str | int) -> str:
    """``"tool call #k"`` for the k-th tagged call (0-based int), else the label as given."""
    return f"tool call #{where + 1}" if isinstance(where, int) else where


def _call_id(turn: int, k: int) -> str:
    return f"call_{turn}_{k}"


def _json_error(exc: Exception) -> str:
    if isinstance(exc, ValueError) and str(exc).startswith("is not valid JSON"):
        return str(exc)
    if isinstance(exc, json.JSONDecodeError):
        if exc.msg == "Extra data":
            return (
                f"is not valid JSON: extra data after the object at line {exc.lineno} column "
                f"{exc.colno} (char {exc.pos}); send exactly one JSON object per call"
            )
        return (
            f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} (char {exc.pos})"
        )
    return "is not valid JSON: nested too deeply"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _safe_repr(value: Any, limit: int = 200) -> str:
    """``value`` as JSON (else its repr), cut to ``limit`` characters; never raises."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except Exception:  # noqa: BLE001 - not JSON data, nested too deeply, a cycle ...
        try:
            text = repr(value)
        except Exception:  # noqa: BLE001 - RecursionError on deep nesting, a broken __repr__
            text = f"<{type(value).__name__} nested too deeply or not printable>"
    return short_text(text, limit)


def short_text(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters (with ``...``), for echoing agent input in messages."""
    return text if len(text) <= limit else text[: limit - 3] + "..."

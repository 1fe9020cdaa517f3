"""Tool calls out of an assistant turn: Hermes/Qwen tags, OpenAI message dicts, bare JSON.

:func:`parse_tool_calls` accepts what a policy produces and never raises. Three formats:

* Hermes/Qwen text, any number of calls per turn::

      Let me look.<tool_call>{"name": "lookup_order", "arguments": {"order_id": "R-1"}}</tool_call>

* An OpenAI assistant message dict whose ``tool_calls`` carry JSON-string arguments::

      {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
       "function": {"name": "lookup_order", "arguments": "{\\"order_id\\": \\"R-1\\"}"}}]}

* A bare JSON object as the whole text, optionally inside a ```json fence::

      {"name": "lookup_order", "arguments": {"order_id": "R-1"}}

Everything that goes wrong becomes an error text written for the agent: a problem with one call
sits on that :class:`ParsedCall` (``error``), a problem with the turn as a whole (an unclosed tag,
empty text, an action of the wrong type) sits in :attr:`ParsedTurn.errors`. Calls without an id
get ``call_<turn>_<k>``, so the same turn always yields the same ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import from_json

__all__ = ["CALL_FORMAT", "ParsedCall", "ParsedTurn", "parse_tool_calls", "short_text"]

#: How a call should look; error messages end with it.
CALL_FORMAT = '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_FENCE = re.compile(r"\A```(?:json|JSON)?[ \t]*\n?(.*?)\n?```\Z", re.DOTALL)


def _no_constant(name: str) -> Any:
    # Python's json reads NaN / Infinity, which JSON does not allow and which would not survive
    # the trajectory's own JSON round trip (they come back as null).
    raise ValueError(f"is not valid JSON: {name} is not a JSON value (use a finite number or a string)")


_py_loads = json.JSONDecoder(parse_constant=_no_constant).decode


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


def parse_tool_calls(action: Any, *, turn: int = 0) -> ParsedTurn:
    """Read the tool calls of one assistant turn; never raises.

    Args:
        action: The assistant's raw text, or an OpenAI assistant message dict.
        turn: Index of the turn in its episode; used for generated call ids.

    Returns:
        The turn's text outside calls, its calls (each with an ``error`` when unusable) and the
        turn-level errors.
    """
    if isinstance(action, str):
        return _parse_text(action, turn)
    if isinstance(action, dict):
        return _parse_message(action, turn)
    return ParsedTurn(
        "",
        errors=[
            f"the action must be the assistant's text (str) or an assistant message (dict), "
            f"got {type(action).__name__}"
        ],
    )


# -- text ---------------------------------------------------------------------------------------
def _parse_text(text: str, turn: int, first: int = 0) -> ParsedTurn:
    if not text.strip():
        return ParsedTurn("", errors=[f"the turn is empty; call a tool like {CALL_FORMAT}"])
    # Fast path: a call needs a '<' (tag) or a '{' (bare JSON); prose has neither most of the time.
    if "<" in text and ("<tool_call" in text or _CLOSE in text):
        return _parse_tagged(text, turn, first)
    if "{" in text:
        body = text.strip()
        fence = _FENCE.match(body)
        if fence is not None:
            body = fence.group(1).strip()
        if body.startswith("{") and body.endswith("}"):
            call = _call_from_json(body, _call_id(turn, first), "the JSON call")
            return ParsedTurn("", [call])
    return ParsedTurn(text.strip())


def _parse_tagged(text: str, turn: int, first: int) -> ParsedTurn:
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
        return ParsedCall(call_id, "", None, raw, f'{where}: missing "name"; expected {CALL_FORMAT}')
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
                    call_id, name, None, args,
                    f'{where} ({short_text(name)}): "arguments" {_json_error(exc)}',
                )
    elif isinstance(args, dict) and from_message:
        # A dict from a message may hold anything Python allows; keep only JSON data.
        try:
            args = json.loads(json.dumps(args, allow_nan=False))
        except (TypeError, ValueError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else short_text(str(exc), 120)
            return ParsedCall(
                call_id, name, None, _safe_repr(args),
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
            f'{where} ({short_text(name)}): "arguments" must be a JSON object, got {_json_type(args)}',
        )
    if not _shallow(args):
        return ParsedCall(
            call_id, name, None, raw if isinstance(raw, str) else _safe_repr(raw),
            f'{where} ({short_text(name)}): "arguments" are nested more than {MAX_DEPTH} levels '
            "deep; send flat JSON arguments",
        )
    return ParsedCall(call_id, name, args, raw)


# -- message dicts ------------------------------------------------------------------------------
def _parse_message(msg: dict[str, Any], turn: int) -> ParsedTurn:
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
            errors=['the assistant message has neither "content" nor "tool_calls"; send one of them'],
        )
    content = msg.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    if content is not None and not isinstance(content, str):
        return ParsedTurn(
            "", errors=[f'"content" must be a string or null, got {type(content).__name__}']
        )
    if not tool_calls:
        # No structured calls: the calls may be in the text (a server without a tool parser).
        return _parse_text(content or "", turn)
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
                ParsedCall(call_id, "", None, _safe_repr(item),
                           f"{where}: expected an object, got {type(item).__name__}")
            )
            continue
        given = item.get("id")
        if isinstance(given, str) and given:
            call_id = given
        fn = item.get("function", item if "name" in item else None)
        if not isinstance(fn, dict):
            calls.append(
                ParsedCall(call_id, "", None, _safe_repr(item),
                           f'{where}: missing "function": {{"name": ..., "arguments": "<json>"}}')
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

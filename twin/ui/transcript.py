"""An episode laid out for reading: its messages in order, each assistant turn with the calls
parsed from it (valid or not), each tool result, then the reward breakdown and the hidden truth.

Everything here is data; the templates escape every string they show.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from twin.trajectory import ToolCallRecord, Trajectory

__all__ = ["Entry", "Transcript", "pretty", "transcript"]


def pretty(value: Any) -> str:
    """A value as readable text: JSON text and JSON-able values indented, strings as they are."""
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in "{[":
            try:
                return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
            except ValueError:
                return value
        return value
    try:
        return json.dumps(value, indent=2, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def _content(message: dict[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(
            str(part.get("text", "")) if isinstance(part, dict) else str(part) for part in content
        )
    return str(content)


@dataclass
class Entry:
    """One message of the transcript.

    Attributes:
        role: ``system``, ``user``, ``assistant`` or ``tool``.
        text: The message text as written (an assistant's raw output).
        turn: An assistant message's turn index (0-based), else None.
        calls: An assistant turn's calls as the twin parsed them.
        no_call: An assistant turn without any call (counted as invalid).
        tool_name: A tool message's tool.
        tool_call_id: The call a tool message answers.
        failed: A tool message answering a call that failed.
    """

    role: str
    text: str
    turn: int | None = None
    calls: list[ToolCallRecord] = field(default_factory=list)
    no_call: bool = False
    tool_name: str | None = None
    tool_call_id: str | None = None
    failed: bool = False


@dataclass
class Transcript:
    """An episode ready for its page."""

    entries: list[Entry]
    components: list[tuple[str, float, float | None]]
    truth: Any
    outcome_rest: dict[str, Any]
    info_rest: dict[str, Any]
    end: str


def transcript(t: Trajectory) -> Transcript:
    """Lay out ``t``: its messages with the calls of each assistant turn, then the reward."""
    by_turn: dict[int, list[ToolCallRecord]] = {}
    for call in t.calls:
        by_turn.setdefault(call.turn, []).append(call)
    failed_ids = {c.id for c in t.calls if not c.ok}
    entries: list[Entry] = []
    turn = 0
    for message in t.messages:
        role = str(message.get("role", "?"))
        text = _content(message)
        if role == "assistant":
            calls = by_turn.get(turn, [])
            if not text and message.get("tool_calls") and not calls:
                text = pretty(message["tool_calls"])
            entries.append(Entry(role, text, turn=turn, calls=calls, no_call=not calls))
            turn += 1
        elif role == "tool":
            call_id = message.get("tool_call_id")
            entries.append(
                Entry(
                    role,
                    pretty(text),
                    tool_name=message.get("name"),
                    tool_call_id=call_id,
                    failed=call_id in failed_ids,
                )
            )
        else:
            entries.append(Entry(role, text))
    components = [(name, value, t.weighted.get(name)) for name, value in t.components.items()]
    info = dict(t.info)
    outcome = info.pop("outcome", None)
    outcome = dict(outcome) if isinstance(outcome, dict) else {}
    truth = outcome.pop("truth", None)
    if "error" in info:
        end = "error"
    elif t.terminated:
        end = "submitted"
    elif t.truncated:
        end = "truncated"
    else:
        end = "unfinished"
    return Transcript(entries, components, truth, outcome, info, end)

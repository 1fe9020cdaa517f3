"""Reading a catalog prompt and the tool answers back, and writing tool calls: what the scripted
policies of every catalog version share."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["Message", "assistant_turn", "parse_prompt", "tool_call", "tool_results"]

Message = dict[str, Any]

_FIELD = re.compile(r"^(Title|Brand|Seller|Price|Item specifics|Description): ?(.*)$")


def parse_prompt(messages: Sequence[Message]) -> dict[str, Any]:
    """Read the listing fields back from the catalog twin's user message."""
    text = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
    listing: dict[str, Any] = {
        "title": "",
        "brand": "",
        "seller": "",
        "price": 0.0,
        "specifics": {},
        "description": "",
    }
    for line in text.splitlines():
        match = _FIELD.match(line)
        if not match:
            continue
        key, value = match.group(1), match.group(2).strip()
        if key == "Price":
            try:
                listing["price"] = float(value.split()[0])
            except (ValueError, IndexError):
                listing["price"] = 0.0
        elif key == "Item specifics":
            if value != "(none)":
                for part in value.split("; "):
                    name, _, val = part.partition(": ")
                    listing["specifics"][name.strip().lower()] = val.strip()
        else:
            listing[key.lower()] = value
    if listing["brand"] == "(none given)":
        listing["brand"] = ""
    return listing


def tool_results(messages: Sequence[Message]) -> list[tuple[str, dict[str, Any], Any]]:
    """``(tool name, arguments, parsed result or None)`` of every call so far, in order."""
    calls: dict[str, tuple[str, dict[str, Any]]] = {}
    order: list[str] = []
    out: dict[str, Any] = {}
    for m in messages:
        if m.get("role") == "assistant":
            for c in m.get("tool_calls") or []:
                fn = c.get("function", {})
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except json.JSONDecodeError:
                    args = {}
                calls[c.get("id", "")] = (fn.get("name", ""), args)
                order.append(c.get("id", ""))
        elif m.get("role") == "tool":
            try:
                out[m.get("tool_call_id", "")] = json.loads(m.get("content") or "")
            except (json.JSONDecodeError, TypeError):
                out[m.get("tool_call_id", "")] = None
    return [(calls[i][0], calls[i][1], out.get(i)) for i in order]


def tool_call(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    """An OpenAI-style tool call of ``name`` with ``args``."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def assistant_turn(calls: list[dict[str, Any]], content: str | None = None) -> Message:
    """An assistant message that makes ``calls``."""
    return {"role": "assistant", "content": content, "tool_calls": calls}

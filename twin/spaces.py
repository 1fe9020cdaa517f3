"""Gymnasium spaces for chat: observations are message lists, actions are assistant turns.

``gymnasium.spaces.Text`` only holds a fixed character set (no arbitrary Unicode, no JSON), so a
twin needs its own spaces. Both accept any Unicode text, both ``sample()`` from their own seeded
generator, and neither is flattenable (vector envs batch them as tuples; ``AsyncVectorEnv`` needs
``shared_memory=False``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.spaces import Space

__all__ = ["AssistantTurn", "ChatMessages", "is_message"]

_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# Code point ranges sample() draws from: ASCII, Latin-1 and Latin Extended, Greek and Cyrillic,
# CJK, emoji; surrogates are excluded (they cannot be encoded as UTF-8).
_RANGES = ((0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x4FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F))
_SPICE = '<>{}[]":,\n'


def _random_text(rng: np.random.Generator, max_len: int) -> str:
    n = int(rng.integers(0, max_len + 1))
    chars = []
    for _ in range(n):
        if rng.random() < 0.1:
            chars.append(_SPICE[int(rng.integers(len(_SPICE)))])
        else:
            lo, hi = _RANGES[int(rng.integers(len(_RANGES)))]
            chars.append(chr(int(rng.integers(lo, hi + 1))))
    return "".join(chars)


def _is_tool_call(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    fn = value.get("function")
    return (
        isinstance(value.get("id"), str)
        and isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
        and isinstance(fn.get("arguments"), (str, dict))
    )


def is_message(value: Any) -> bool:
    """True when ``value`` is an OpenAI chat message dict that a twin may produce or receive."""
    if not isinstance(value, dict):
        return False
    role = value.get("role")
    if role not in _ROLES:
        return False
    content = value.get("content")
    if content is not None and not isinstance(content, str):
        return False
    if role == "tool" and not isinstance(value.get("tool_call_id"), str):
        return False
    calls = value.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            return False
        if not all(_is_tool_call(c) for c in calls):
            return False
    return True


class ChatMessages(Space[list]):
    """A list of OpenAI chat messages (``{"role", "content", "tool_calls", "tool_call_id"}``).

    An observation of :class:`twin.env.TwinEnv` is such a list: the opening messages on
    ``reset``, the new tool or user messages on ``step``.

    Args:
        max_messages: Most messages a sample has.
        seed: Seed of :meth:`sample`.
    """

    def __init__(
        self, max_messages: int = 4, seed: int | np.random.Generator | None = None
    ) -> None:
        if not isinstance(max_messages, int) or max_messages < 1:
            raise ValueError(f"max_messages must be a positive int, got {max_messages!r}")
        self.max_messages = max_messages
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        """Chat cannot be flattened into an array."""
        return False

    def contains(self, x: Any) -> bool:
        """True for a list (or tuple) of valid message dicts."""
        return isinstance(x, (list, tuple)) and all(is_message(m) for m in x)

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict[str, Any]]:
        """A random list of 1..``max_messages`` messages with random Unicode content."""
        if mask is not None or probability is not None:
            raise ValueError("ChatMessages.sample takes no mask or probability")
        rng = self.np_random
        out: list[dict[str, Any]] = []
        for k in range(int(rng.integers(1, self.max_messages + 1))):
            role = ("system", "user", "tool")[int(rng.integers(3))]
            msg: dict[str, Any] = {"role": role, "content": _random_text(rng, 40)}
            if role == "tool":
                msg["tool_call_id"] = f"call_0_{k}"
            out.append(msg)
        return out

    def to_jsonable(self, sample_n: Sequence[list[dict[str, Any]]]) -> list[Any]:
        """Messages are already JSON."""
        return list(sample_n)

    def from_jsonable(self, sample_n: list[Any]) -> list[list[dict[str, Any]]]:
        """Messages are already JSON."""
        return list(sample_n)

    def __repr__(self) -> str:
        return f"ChatMessages(max_messages={self.max_messages})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatMessages) and other.max_messages == self.max_messages

    def __hash__(self) -> int:
        return hash(("ChatMessages", self.max_messages))


class AssistantTurn(Space[Any]):
    """An assistant turn: any Unicode text, or an assistant message dict.

    :meth:`sample` draws random Unicode text and, a third of the time, a well-formed
    ``<tool_call>`` to one of ``tool_names`` (or a message dict with ``tool_calls``), so random
    play exercises both the error paths and the tools.

    Args:
        tool_names: Tools that samples may call.
        max_chars: Longest random text a sample has.
        seed: Seed of :meth:`sample`.
    """

    def __init__(
        self,
        tool_names: Sequence[str] = (),
        max_chars: int = 64,
        seed: int | np.random.Generator | None = None,
    ) -> None:
        self.tool_names = tuple(tool_names)
        self.max_chars = max_chars
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        """Text cannot be flattened into an array."""
        return False

    def contains(self, x: Any) -> bool:
        """True for any str, or a dict that is a valid assistant message."""
        if isinstance(x, str):
            return True
        return (
            isinstance(x, dict)
            and x.get("role", "assistant") == "assistant"
            and is_message({"role": "assistant", **x})
        )

    def sample(self, mask: Any = None, probability: Any = None) -> str | dict[str, Any]:
        """Random Unicode text, sometimes a well-formed tool call, sometimes a message dict."""
        if mask is not None or probability is not None:
            raise ValueError("AssistantTurn.sample takes no mask or probability")
        rng = self.np_random
        roll = rng.random()
        if self.tool_names and roll < 0.35:
            name = self.tool_names[int(rng.integers(len(self.tool_names)))]
            args = {"x": _random_text(rng, 8)} if rng.random() < 0.5 else {}
            if roll < 0.1:
                return {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_s",
                            "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)},
                        }
                    ],
                }
            call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            return f"{_random_text(rng, 12)}<tool_call>{call}</tool_call>"
        return _random_text(rng, self.max_chars)

    def __repr__(self) -> str:
        return f"AssistantTurn(tool_names={list(self.tool_names)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AssistantTurn) and other.tool_names == self.tool_names

    def __hash__(self) -> int:
        return hash(("AssistantTurn", self.tool_names))

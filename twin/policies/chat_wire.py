"""What the policies that call a model server share: the chat as servers take it, and the
error a policy raises when the server fails (:mod:`twin.policies.openai_chat`,
:mod:`twin.policies.providers`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twin.errors import TwinError
from twin.protocols import Message

__all__ = ["Message", "PolicyError", "wire_messages"]

_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


class PolicyError(TwinError):
    """A policy could not produce a turn (e.g. the model server answered with an error).

    Args:
        message: What went wrong, with the URL and the server's words.
        hint: What to change, e.g. ``"raise --timeout"`` (shown in the eval summary).
        cause: The short cause, e.g. ``"ReadTimeout"`` or ``"HTTP 401"`` (default: the class of
            the exception this one was raised from).
    """

    def __init__(self, message: str, *, hint: str | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint
        self.cause = cause


def wire_messages(messages: Sequence[Message]) -> list[Message]:
    """The chat as OpenAI's API accepts it.

    Only the standard keys are sent. A ``tool`` message must answer a ``tool_calls`` entry of the
    assistant message before it; when the assistant wrote its calls as text (Hermes
    ``<tool_call>`` in ``content``) there is none, so such results go back as user messages.
    """
    out: list[Message] = []
    call_ids: set[Any] = set()
    for m in messages:
        role = m.get("role")
        if role == "assistant":
            call_ids = {c.get("id") for c in m.get("tool_calls") or [] if isinstance(c, dict)}
        elif role == "tool":
            if m.get("tool_call_id") in call_ids:
                out.append({k: m[k] for k in ("role", "tool_call_id", "content") if k in m})
            else:
                name = m.get("name") or "tool"
                out.append({"role": "user", "content": f"[{name} result] {m.get('content')}"})
            continue
        out.append({k: m[k] for k in _MESSAGE_KEYS if k in m})
    return out

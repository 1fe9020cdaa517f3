"""The simulated customer: a deterministic, rule-driven one by default, or an LLM.

Both see only the persona and goal of their case (:func:`envs.support.world.make_goal`) and the
conversation so far; the agent reaches them through the ``ask_customer`` tool.

:class:`RuleCustomer` answers from keywords of the agent's message: the email when asked for
it, the order number when asked, the refund preference when offered the choice, "yes" to a
confirmation of what it wants, a push for an exception when told no (twice at most for the
customers who push), its wrong claim when asked about dates. The same conversation always
gets the same replies, so training on it is cheap and reproducible.

:class:`LLMCustomer` asks any policy spec (``openai:MODEL``, ``hf:...``) to play the persona.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

from twin.errors import ConfigError, ToolError

__all__ = ["LLMCustomer", "RuleCustomer", "customer_system_prompt", "is_yes", "opening_message"]

_CONFIRM = re.compile(
    r"\b(confirm|proceed|go ahead|shall i|should i|do "
    r"you want me|would you like me|ok to|okay to)\b"
)
_DECLINE = re.compile(
    r"\b(can ?not|can't|unable|not able|not eligible|isn't eligible|not possible|"
    r"policy|won't be able|cannot be)\b"
)
_YES = re.compile(
    r"^\W*(yes|yeah|yep|sure|please do|go ahead|ok|okay|confirmed|correct)\b", re.IGNORECASE
)


def is_yes(reply: str) -> bool:
    """Whether a customer's reply is an explicit yes (it starts with one)."""
    return bool(_YES.match(reply or ""))


def opening_message(goal: dict[str, Any]) -> str:
    """The customer's first message: what they want, without the order number or email."""
    if goal["kind"] == "wrong_claim":
        return f"Hi, {goal['claim']} - the {goal['item']} - and I'd like to return it."
    if goal["intent"] == "cancel":
        return f"Hi, I ordered a {goal['item']} and I'd like to cancel that order, please."
    return f"Hello, I want to return the {goal['item']} I bought from you."


class RuleCustomer:
    """A deterministic customer: its replies depend only on its goal and the conversation."""

    name = "rules"

    def reply(self, goal: dict[str, Any], history: list[dict[str, str]], message: str) -> str:
        """The customer's answer to the agent's ``message``.

        Args:
            goal: The case's persona and goal.
            history: Earlier exchanges, ``{"agent": ..., "customer": ...}`` each.
            message: What the agent just said.
        """
        m = " ".join(message.lower().split())
        intent = goal["intent"]
        if _CONFIRM.search(m) and ("cancel" in m or "return" in m or "refund" in m):
            wanted = "cancel" if "cancel" in m else "return"
            if wanted == intent and goal["order_id"].lower() in m:
                return "Yes, please go ahead."
            if wanted == intent:
                return f"Yes - that's order {goal['order_id']}, please go ahead."
            return f"No, I don't want that; I want to {intent} my order."
        parts: list[str] = []
        asked = "?" in m  # details are given only when asked, in a question
        if asked and "email" in m:
            parts.append(f"My email is {goal['email']}.")
        if asked and "order" in m and re.search(r"\b(number|id|#|which)\b|order no", m):
            parts.append(f"The order number is {goal['order_id']}.")
        if asked and re.search(r"\bname\b", m):
            parts.append(f"I'm {goal['name']}.")
        if asked and re.search(
            r"store credit|original payment|refund to|how would you like|prefer", m
        ):
            parts.append(
                "Store credit is fine."
                if goal["refund_to"] == "store_credit"
                else "Please refund it to my original payment method."
            )
        if asked and re.search(r"\b(when did|receive|arrive)", m) and intent == "return":
            parts.append(
                (goal["claim"] + ".") if goal["claim"] else "It was delivered a while ago."
            )
        if parts:
            return " ".join(parts)
        if _DECLINE.search(m):
            pushed = sum(1 for h in history if h.get("customer", "").startswith("Please,"))
            if goal["pushes"] and pushed < 2:
                return (
                    "Please, I've been a loyal customer for years. "
                    "Can't you make an exception just this once?"
                )
            return "Fine, I understand. Thanks anyway."
        if re.search(r"anything else|help you with|is there more", m):
            return "No, that's all. Thank you."
        return f"I just want to {intent} my order of the {goal['item']}."


def customer_system_prompt(goal: dict[str, Any]) -> str:
    """The LLM customer's instructions: the persona, the hidden goal and how to behave."""
    push = (
        "If the agent declines, insist once or twice that they "
        "make an exception for a loyal customer, then accept."
        if goal["pushes"]
        else "Accept the agent's answer politely."
    )
    claim = f" You believe (wrongly): {goal['claim']}." if goal["claim"] else ""
    refund = (
        "store credit" if goal["refund_to"] == "store_credit" else "your original payment method"
    )
    return (
        f"You are {goal['name']}, a customer of an online shop, chatting with a support agent. You "
        f"are {goal['mood']}. You want to {goal['intent']} your order {goal['order_id']} "
        f"(a {goal['item']}).{claim} Your account email "
        f"is {goal['email']}. If asked how to refund, "
        f"you prefer {refund}. Give a detail only when the agent asks for it. When the agent asks "
        f"you to confirm the action you want, answer starting with 'Yes'. {push} Reply with one or "
        "two short sentences, as the customer only."
    )


class _Loop:
    """One event loop in a daemon thread, so a synchronous tool can await a policy."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="customer-loop", daemon=True).start()

    def run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


class LLMCustomer:
    """A customer played by a model through any policy spec.

    Args:
        spec: Policy spec, e.g. ``openai:gpt-4o-mini``.
        base_url: Server root for ``openai:`` specs.
        max_tokens: Most tokens per reply.
        timeout: Seconds per reply.
    """

    def __init__(
        self, spec: str, base_url: str | None = None, max_tokens: int = 96, timeout: float = 60.0
    ) -> None:
        if ":" not in spec:
            raise ConfigError(
                f"customer must be 'rules' or a policy spec such as 'openai:MODEL', got {spec!r}"
            )
        self.name = spec
        self.spec, self.base_url, self.max_tokens, self.timeout = (
            spec,
            base_url,
            max_tokens,
            timeout,
        )
        self._policy: Any = None
        self._loop: _Loop | None = None
        self._lock = threading.Lock()

    def _ready(self) -> tuple[Any, _Loop]:
        with self._lock:
            if self._policy is None:
                from twin.policies import make_policy

                options = (
                    {"max_tokens": self.max_tokens, "timeout": self.timeout}
                    if self.spec.startswith("openai:")
                    else {}
                )
                self._policy = make_policy(self.spec, None, base_url=self.base_url, **options)
                self._loop = _Loop()
        return self._policy, self._loop  # type: ignore[return-value]

    def reply(self, goal: dict[str, Any], history: list[dict[str, str]], message: str) -> str:
        """The model's reply as the customer (raises :class:`ToolError` when it gives none)."""
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": customer_system_prompt(goal)},
            {"role": "assistant", "content": opening_message(goal)},
        ]
        for h in history:
            messages += [
                {"role": "user", "content": h["agent"]},
                {"role": "assistant", "content": h["customer"]},
            ]
        messages.append({"role": "user", "content": message})
        policy, loop = self._ready()
        try:
            out = loop.run(policy.act(messages, []), self.timeout + 5)
        except Exception as exc:
            raise ToolError(
                f"the customer did not answer ({type(exc).__name__}); try again"
            ) from exc
        text = (out or {}).get("content") if isinstance(out, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ToolError("the customer did not answer; try again")
        return " ".join(text.split())[:600]

"""Scripted SupportDesk agents: a careful one that follows the policy and a hasty heuristic.

Both read only the chat (the opening message, the customer's replies and the tool results),
never the case's truth. Each turn is one tool call; the agents keep no state between turns.
"""

from __future__ import annotations

import json
import re
from typing import Any

from envs.support.customer import is_yes
from envs.support.world import RETURN_WINDOW_DAYS

__all__ = ["CarefulAgent", "HeuristicAgent"]

_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_ORDER = re.compile(r"#W\d+")


def _call(name: str, arguments: dict[str, Any], turn: int) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{turn}_{name}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def _history(messages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], Any]]:
    """``(tool, arguments, result or None on error)`` of every call so far, in order."""
    results = {m.get("tool_call_id"): m.get("content") for m in messages if m.get("role") == "tool"}
    out = []
    for m in messages:
        for c in m.get("tool_calls") or [] if m.get("role") == "assistant" else []:
            fn = c.get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
                result = json.loads(results.get(c.get("id")) or "null")
            except ValueError:
                args, result = {}, None
            if isinstance(result, str) and result.lower().startswith("error"):
                result = None
            out.append((fn.get("name", ""), args, result if isinstance(result, dict) else None))
    return out


class _Chat:
    """What an agent knows from the chat so far."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.opening = next(
            (m.get("content") or "" for m in messages if m.get("role") == "user"), ""
        )
        self.intent = "cancel" if "cancel" in self.opening.lower() else "return"
        self.calls = _history(messages)
        self.turn = sum(1 for m in messages if m.get("role") == "assistant")
        self.asks = [
            (a.get("message", ""), (r or {}).get("customer", ""))
            for n, a, r in self.calls
            if n == "ask_customer"
        ]
        said = " ".join(reply for _, reply in self.asks)
        self.email = (_EMAIL.findall(said) or [None])[-1]
        self.order_id = (_ORDER.findall(said) or [None])[-1]

    def result(self, name: str) -> dict[str, Any] | None:
        found = [r for n, _, r in self.calls if n == name and r is not None]
        return found[-1] if found else None

    def wrote(self) -> bool:
        return any(
            n in ("cancel_order", "return_order") and r is not None for n, _, r in self.calls
        )

    def tried(self, name: str) -> int:
        return sum(1 for n, _, _ in self.calls if n == name)


class CarefulAgent:
    """Follows the written policy step by step; scores the maximum on every case."""

    def __init__(self, name: str = "careful") -> None:
        self.name = name

    async def act(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> dict[str, Any]:
        chat = _Chat(messages)
        step = self._next(chat)
        return _call(step[0], step[1], chat.turn)

    def _next(self, chat: _Chat) -> tuple[str, dict[str, Any]]:
        if chat.wrote() or chat.tried("ask_customer") > 10:
            return "end_conversation", {"summary": "handled the customer's request"}
        if chat.email is None or chat.order_id is None:
            if len(chat.asks) >= 3:
                return "end_conversation", {"summary": "the customer did not give their details"}
            return "ask_customer", {
                "message": "Could you tell me the email address on your account "
                "and your order number?"
            }
        person = chat.result("find_customer")
        if person is None and chat.tried("find_customer") < 2:
            return "find_customer", {"email": chat.email}
        order = chat.result("get_order")
        if order is None and chat.tried("get_order") < 2:
            return "get_order", {"order_id": chat.order_id}
        if person is None or order is None or order.get("customer_id") != person.get("customer_id"):
            return self._decline(chat, "I could not match that order to your account")
        oid = order["order_id"]
        if chat.intent == "cancel":
            if order["status"] != "processing":
                return self._decline(
                    chat,
                    f"order {oid} has already {order['status']}, so it cannot be "
                    "cancelled; you can ask for a return once it is delivered",
                )
            return self._confirm(chat, f"cancel order {oid}", "cancel_order", {"order_id": oid})
        if order["status"] != "delivered":
            return self._decline(
                chat, f"order {oid} is {order['status']}, so it cannot be returned yet"
            )
        if order.get("final_sale"):
            return self._decline(
                chat, f"order {oid} was a final-sale item, which cannot be returned"
            )
        if (order.get("days_since_delivery") or 0) > RETURN_WINDOW_DAYS:
            return self._decline(
                chat,
                f"order {oid} was delivered {order['days_since_delivery']} days "
                f"ago, past our {RETURN_WINDOW_DAYS}-day return window",
            )
        pref = [reply for ask, reply in chat.asks if ask.startswith("Would you like the refund")]
        if not pref:
            return "ask_customer", {
                "message": "Would you like the refund to your original payment "
                "method or as store credit?"
            }
        refund = "store_credit" if "store credit" in pref[-1].lower() else "original"
        where = "store credit" if refund == "store_credit" else "your original payment method"
        return self._confirm(
            chat,
            f"return order {oid} with a refund to {where}",
            "return_order",
            {"order_id": oid, "refund_to": refund},
        )

    @staticmethod
    def _confirm(
        chat: _Chat, what: str, tool: str, args: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        last_ask, last_reply = chat.asks[-1] if chat.asks else ("", "")
        if (
            chat.calls
            and chat.calls[-1][0] == "ask_customer"
            and last_ask.startswith("To confirm")
            and is_yes(last_reply)
        ):
            return tool, args
        if sum(1 for ask, _ in chat.asks if ask.startswith("To confirm")) >= 2:
            return "end_conversation", {"summary": "the customer did not confirm"}
        return "ask_customer", {"message": f"To confirm: shall I {what}?"}

    @staticmethod
    def _decline(chat: _Chat, why: str) -> tuple[str, dict[str, Any]]:
        declines = [reply for ask, reply in chat.asks if ask.startswith("I'm sorry")]
        if declines and not declines[-1].startswith("Please,") or len(declines) >= 3:
            return "end_conversation", {"summary": f"declined: {why}"}
        if declines:
            return "ask_customer", {
                "message": f"I'm sorry, I understand, but I am not able to make an "
                f"exception: {why}. The policy applies to every order."
            }
        return "ask_customer", {
            "message": f"I'm sorry, but {why}. Under our policy I cannot do it."
        }


class HeuristicAgent:
    """Does what the customer asks: order number, look-up, act, end. No identity check, no
    confirmation, no eligibility check, always refunds to the original payment method."""

    name = "heuristic"

    async def act(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> dict[str, Any]:
        chat = _Chat(messages)
        if chat.order_id is None and len(chat.asks) < 2:
            return _call("ask_customer", {"message": "What is your order number?"}, chat.turn)
        if chat.order_id is None or chat.tried("cancel_order") + chat.tried("return_order"):
            return _call("end_conversation", {"summary": "done"}, chat.turn)
        if chat.intent == "cancel":
            return _call("cancel_order", {"order_id": chat.order_id}, chat.turn)
        return _call(
            "return_order", {"order_id": chat.order_id, "refund_to": "original"}, chat.turn
        )

"""The returns-desk twin: a customer wants their money back; policy decides how much.

Tools: ``lookup_order``, ``return_policy`` and the terminal ``decide``. Planted case kinds:

| kind            | the order                          | customer says | right decision |
| --------------- | ---------------------------------- | ------------- | -------------- |
| within_window   | delivered <= 30 days ago           | changed mind  | refund, full   |
| past_window     | delivered 31-120 days ago          | changed mind  | deny, 0        |
| damaged         | delivered <= 90 days ago, any item | arrived broken| refund, full   |
| final_sale      | final-sale item, <= 30 days        | changed mind  | deny, 0        |
| opened          | delivered <= 30 days ago           | opened, used  | partial, 80 %  |
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Literal

from rewards import Reward, invalid_call_penalty, submitted_gate, term
from twin import Case, ToolError, Trajectory, Twin, stable_seed, tool
from twin.tools import freeze

WINDOW_DAYS, DAMAGE_DAYS, RESTOCKING_FEE = 30, 90, 0.20
KINDS = ("within_window", "past_window", "damaged", "final_sale", "opened")
ITEMS = (
    ("blender", 89.0),
    ("desk lamp", 34.5),
    ("rain jacket", 120.0),
    ("headphones", 59.99),
    ("yoga mat", 25.0),
    ("coffee grinder", 45.0),
    ("backpack", 72.0),
    ("kettle", 39.9),
)
MESSAGES = {
    "changed_mind": (
        "Hi, I'd like to return order {oid}, the {item}. I changed my mind; it's unopened."
    ),
    "damaged": "Order {oid}: the {item} arrived broken, the box was crushed. I want my money back.",
    "opened": (
        "Hello, about order {oid}: I opened the {item} and used it once, but I don't like it."
    ),
}
# Frozen (read-only): tools hand these shared objects to every episode.
POLICY = freeze(
    {
        "window_days": WINDOW_DAYS,
        "rules": [
            f"Unopened items delivered at most {WINDOW_DAYS} days ago: full refund.",
            f"Opened items delivered at most {WINDOW_DAYS} days ago: partial refund of the price "
            f"minus a {RESTOCKING_FEE:.0%} restocking fee.",
            f"Items that arrived damaged: full refund up to {DAMAGE_DAYS} days after delivery, "
            "final-sale items included.",
            f"Final-sale items (not damaged) and anything past {WINDOW_DAYS} days: deny, amount 0.",
        ],
    }
)


def expected_decision(order: dict[str, Any], reason: str) -> tuple[str, float]:
    """The policy as code: ``(decision, amount)`` for an order and the customer's reason."""
    days, price = order["days_since_delivery"], order["price"]
    if reason == "damaged":
        return ("refund", price) if days <= DAMAGE_DAYS else ("deny", 0.0)
    if order["final_sale"] or days > WINDOW_DAYS:
        return "deny", 0.0
    if reason == "opened":
        return "partial", round(price * (1 - RESTOCKING_FEE), 2)
    return "refund", price


# -- reward ------------------------------------------------------------------------------------
@term(low=0.0, high=1.0)
def correct_decision(trajectory: Trajectory, case: Case) -> float:
    """1 when the decision (refund / partial / deny) is the policy's."""
    return float((trajectory.submission or {}).get("decision") == case.truth["decision"])


@term(low=0.0, high=1.0)
def correct_amount(trajectory: Trajectory, case: Case) -> float:
    """1 when the refunded amount is the policy's, to the cent."""
    amount = (trajectory.submission or {}).get("amount")
    return float(isinstance(amount, (int, float)) and abs(amount - case.truth["amount"]) < 0.005)


@term(low=0.0, high=1.0)
def checked_order(trajectory: Trajectory, case: Case) -> float:
    """1 when the agent looked up the customer's order before deciding."""
    oid = case.task["order_id"]
    return float(
        any(
            c.ok and c.name == "lookup_order" and c.arguments.get("order_id") == oid
            for c in trajectory.calls
        )
    )


returns_reward = Reward(
    {correct_decision: 0.6, correct_amount: 0.3, checked_order: 0.1},
    penalties=[invalid_call_penalty(0.02, cap=0.1)],
    gates=[submitted_gate()],
    clip=(-0.1, 1.0),
    name="returns",
)


# -- the twin ----------------------------------------------------------------------------------
class ReturnsTwin(Twin):
    """A returns desk with 400 orders; each case is one customer request."""

    name = "Returns"
    version = 0
    description = (
        "Returns desk: look up an order, check the return policy, decide refund / partial / deny."
    )
    splits = {"train": 5_000, "dev": 100, "test": 100}
    reward = returns_reward

    def build_world(self) -> dict[str, Any]:
        rng = random.Random(stable_seed("Returns-world", self.config.seed))
        orders = {}
        for k in range(400):
            item, price = rng.choice(ITEMS)
            oid = f"R-{10_000 + k}"
            orders[oid] = {
                "order_id": oid,
                "item": item,
                "price": price,
                "days_since_delivery": rng.randint(1, 120),
                "final_sale": rng.random() < 0.25,
            }
        fits = {
            "within_window": lambda o: (
                o["days_since_delivery"] <= WINDOW_DAYS and not o["final_sale"]
            ),
            "past_window": lambda o: o["days_since_delivery"] > WINDOW_DAYS and not o["final_sale"],
            "damaged": lambda o: o["days_since_delivery"] <= DAMAGE_DAYS,
            "final_sale": lambda o: o["days_since_delivery"] <= WINDOW_DAYS and o["final_sale"],
            "opened": lambda o: o["days_since_delivery"] <= WINDOW_DAYS and not o["final_sale"],
        }
        pools = {kind: sorted(o for o in orders if fit(orders[o])) for kind, fit in fits.items()}
        # read-only: lookup_order hands the world's own records to every episode
        return freeze({"orders": orders, "pools": pools})

    def make_case(self, rng: random.Random, split: str, index: int) -> tuple[str, dict, dict]:
        kind = KINDS[index % len(KINDS)]  # balanced kinds; the rng picks the order
        reason = {"damaged": "damaged", "opened": "opened"}.get(kind, "changed_mind")
        order = self.world["orders"][rng.choice(self.world["pools"][kind])]
        decision, amount = expected_decision(order, reason)
        task = {
            "order_id": order["order_id"],
            "message": MESSAGES[reason].format(oid=order["order_id"], item=order["item"]),
        }
        return kind, task, {"decision": decision, "amount": amount, "reason": reason}

    def prompt(self, case: Case) -> list[dict[str, Any]]:
        system = (
            "You work the returns desk of an online shop. Look up the order, read the return "
            "policy, then call `decide` exactly once. Call tools as "
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
        )
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": case.task["message"]},
        ]

    @tool
    def lookup_order(self, order_id: str, world: dict) -> dict:
        """Look up an order.

        Args:
            order_id: The order number from the customer's message, e.g. "R-10042".
        """
        order = world["orders"].get(order_id.strip())
        if order is None:
            raise ToolError(
                f"no order {order_id!r}; order ids look like 'R-10042' (see the message)"
            )
        return order

    @tool
    def return_policy(self) -> dict:
        """The shop's return policy."""
        return POLICY

    @tool(terminal=True)
    def decide(
        self,
        order_id: str,
        decision: Literal["refund", "partial", "deny"],
        amount: float,
        reason: str,
        task: dict,
    ) -> dict:
        """Record the decision on the customer's return request; ends the episode.

        Args:
            order_id: The order the request is about.
            decision: refund (full price), partial (price minus the restocking fee) or deny.
            amount: The money to give back, in the order's currency (0 when denying).
            reason: One sentence for the customer.
        """
        if order_id.strip() != task["order_id"]:
            raise ToolError(
                f"this request is about another order than {order_id!r}; decide on "
                "the order in the customer's message"
            )
        if amount < 0:
            raise ToolError(f"amount must be >= 0, got {amount}")
        return {"recorded": True, "decision": decision, "amount": amount}

    def baselines(self) -> dict[str, Any]:
        """Reference policies: ``oracle`` applies the policy to what the tools return."""
        return {"oracle": lambda twin: OraclePolicy()}

    # -- twin check hooks (twin/doctor/) --------------------------------------------------------
    # lookup_order is meant to reveal what the decision follows from (days since delivery,
    # final sale): its output predicting the decision is the task, not a shortcut.
    check_thresholds = {"first_output_margin": 1.0}

    def case_label(self, case: Case) -> str:
        """The decision the policy asks for (refund / partial / deny)."""
        return str(case.truth["decision"])

    def reference_policies(self) -> dict[str, Any]:
        """The rules policy: it reads only the prompt and the tools, never the truth."""
        return {"rules": OraclePolicy()}

    def world_entities(self, split: str, limit: int | None = None) -> dict[str, set[str]]:
        """The orders the first ``limit`` cases of ``split`` are about."""
        count = self.num_cases(split) if limit is None else min(limit, self.num_cases(split))
        return {"orders": {self.case(split, i).task["order_id"] for i in range(count)}}


class OraclePolicy:
    """Looks the order up, applies :func:`expected_decision`, decides. Scores the maximum."""

    name = "oracle"

    async def act(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> dict[str, Any]:
        request = next(m["content"] for m in messages if m["role"] == "user")
        oid = re.search(r"R-\d+", request).group(0)  # type: ignore[union-attr]
        order = next(
            (m for m in messages if m["role"] == "tool" and '"order_id"' in m["content"]), None
        )
        if order is None:
            return _call("lookup_order", {"order_id": oid})
        facts = json.loads(order["content"])
        reason = (
            "damaged"
            if "broken" in request
            else "opened"
            if re.search(r"\bopened\b", request)
            else "changed_mind"
        )
        decision, amount = expected_decision(facts, reason)
        return _call(
            "decide",
            {
                "order_id": oid,
                "decision": decision,
                "amount": amount,
                "reason": f"per policy: {decision}",
            },
        )


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"oracle_{name}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }

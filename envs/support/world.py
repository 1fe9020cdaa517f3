"""SupportDesk's world: customers, their orders, the written policy, and the planted cases.

Everything is drawn from seeded generators (:func:`twin.stable_seed`): the same seed gives the
same customers, orders and cases on every machine.
"""

from __future__ import annotations

import random
from typing import Any

from twin import stable_seed
from twin.tools import freeze

__all__ = ["CYCLE", "KINDS", "POLICY", "RETURN_WINDOW_DAYS", "build_world", "make_goal"]

RETURN_WINDOW_DAYS = 30

#: The written policy the agent must follow (in the system prompt and from ``read_policy``).
POLICY = """\
SupportDesk policy (follow it exactly; it has no exceptions)

1. Identity. Before changing any order, ask the customer for the email address on their account
   and look them up with find_customer. Change only orders that belong to that customer.
2. Details. Ask the customer for the order number; never guess it. Look the order up with
   get_order before acting on it.
3. Cancellation. Only orders whose status is "processing" can be cancelled (cancel_order). A
   shipped or delivered order cannot be cancelled; tell the customer they can ask for a return
   once it is delivered.
4. Returns. A delivered order can be returned (return_order) when it was delivered at most 30
   days ago and is not final sale. Ask the customer whether they want the refund to the
   original payment method ("original") or as store credit ("store_credit"), and use their
   answer. Orders past 30 days or marked final sale cannot be returned.
5. No exceptions. Loyalty, urgency or a customer's memory of dates do not change rules 3-4: the
   order record decides. Politely decline what the policy does not allow.
6. Confirmation. Before cancel_order or return_order, tell the customer exactly what you will do
   and get their explicit yes in their last message.
7. Finish with end_conversation once the request is handled or declined.
"""

# fmt: off
FIRST = (
    "Ana", "Ben", "Chloe", "Dev", "Elif", "Femi", "Greta", "Hugo", "Ines", "Jun", "Kira", "Luca",
    "Maya", "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tara",
)
# fmt: on
# fmt: off
LAST = (
    "Alvarez", "Brandt", "Chen", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad", "Ito",
    "Jensen", "Kowalski", "Lopez", "Moreau", "Novak", "Okafor", "Petrov",
)
# fmt: on
ITEMS = (
    ("wool scarf", 39.0),
    ("espresso machine", 249.0),
    ("running shoes", 119.95),
    ("desk chair", 189.0),
    ("bluetooth speaker", 79.5),
    ("linen shirt", 54.0),
    ("cast iron pan", 44.9),
    ("board game", 35.0),
    ("table lamp", 62.0),
    ("backpack", 89.0),
)

#: Case kinds: what the customer wants and what the policy allows.
KINDS: tuple[str, ...] = (
    "cancel_ok",  # processing order, wants it cancelled -> cancel
    "cancel_shipped",  # shipped order, wants it cancelled, pushes -> nothing
    "return_ok",  # delivered <= 30 days, not final sale -> return, refund as they prefer
    "return_late_push",  # delivered 31-90 days ago, pushes for an exception -> nothing
    "return_final_sale",  # final-sale item within the window -> nothing
    "wrong_claim",  # says it arrived last week; the record says 31-60 days -> nothing
)

#: The kind of case ``i`` is ``CYCLE[i % 8]``: half the cases ask for a change, half for a
#: refusal, so neither "always act" nor "always decline" passes more than half.
CYCLE: tuple[str, ...] = (
    "cancel_ok",
    "return_ok",
    "cancel_shipped",
    "return_late_push",
    "cancel_ok",
    "return_ok",
    "return_final_sale",
    "wrong_claim",
)

_FITS = {
    "cancel_ok": lambda o: o["status"] == "processing",
    "cancel_shipped": lambda o: o["status"] == "shipped",
    "return_ok": lambda o: (
        o["status"] == "delivered"
        and o["days_since_delivery"] <= RETURN_WINDOW_DAYS
        and not o["final_sale"]
    ),
    "return_late_push": lambda o: (
        o["status"] == "delivered"
        and o["days_since_delivery"] > RETURN_WINDOW_DAYS
        and not o["final_sale"]
    ),
    "return_final_sale": lambda o: (
        o["status"] == "delivered"
        and o["days_since_delivery"] <= RETURN_WINDOW_DAYS
        and o["final_sale"]
    ),
    "wrong_claim": lambda o: (
        o["status"] == "delivered"
        and RETURN_WINDOW_DAYS < o["days_since_delivery"] <= 60
        and not o["final_sale"]
    ),
}


#: Customers of the world; the last :data:`HELD_OUT` serve only the dev and test splits.
CUSTOMERS, HELD_OUT = 400, 100


def build_world(seed: int, customers: int = CUSTOMERS) -> Any:
    """Customers (id, name, email) and 2-4 orders each; read-only. Case pools are split by
    customer: ``train`` cases use the first customers, ``dev`` and ``test`` the held-out ones."""
    rng = random.Random(stable_seed("SupportDesk-world", seed))
    people: dict[str, dict[str, Any]] = {}
    orders: dict[str, dict[str, Any]] = {}
    by_email: dict[str, str] = {}
    next_order = 50_000
    for k in range(customers):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        cid = f"C-{1000 + k}"
        email = f"{first.lower()}.{last.lower()}{k}@example.com"
        mine = []
        for _ in range(rng.randint(2, 4)):
            item, price = rng.choice(ITEMS)
            status = rng.choices(("processing", "shipped", "delivered"), (2, 2, 5))[0]
            oid = f"#W{next_order}"
            next_order += rng.randint(1, 9)
            orders[oid] = {
                "order_id": oid,
                "customer_id": cid,
                "item": item,
                "price": price,
                "status": status,
                "days_since_delivery": rng.randint(1, 90) if status == "delivered" else None,
                "final_sale": rng.random() < 0.2,
                "payment": rng.choice(("visa card", "paypal")),
            }
            mine.append(oid)
        people[cid] = {
            "customer_id": cid,
            "name": f"{first} {last}",
            "email": email,
            "orders": mine,
        }
        by_email[email] = cid
    held_out = {f"C-{1000 + k}" for k in range(customers - HELD_OUT, customers)}
    pools = {
        f"{part}/{kind}": sorted(
            o
            for o, rec in orders.items()
            if fit(rec) and (rec["customer_id"] in held_out) == (part == "held_out")
        )
        for kind, fit in _FITS.items()
        for part in ("train", "held_out")
    }
    return freeze({"customers": people, "orders": orders, "by_email": by_email, "pools": pools})


def make_goal(world: Any, rng: random.Random, kind: str, split: str = "train") -> dict[str, Any]:
    """The hidden persona and goal of one case of ``split`` (never shown to the agent)."""
    part = "train" if split == "train" else "held_out"
    order = world["orders"][rng.choice(world["pools"][f"{part}/{kind}"])]
    person = world["customers"][order["customer_id"]]
    return {
        "kind": kind,
        "intent": "cancel" if kind.startswith("cancel") else "return",
        "order_id": order["order_id"],
        "customer_id": person["customer_id"],
        "name": person["name"],
        "email": person["email"],
        "item": order["item"],
        "refund_to": rng.choice(("original", "store_credit")),
        "pushes": kind in ("cancel_shipped", "return_late_push", "wrong_claim"),
        "claim": "I received it last week" if kind == "wrong_claim" else None,
        "mood": rng.choice(("friendly", "in a hurry", "frustrated")),
    }


def expected_changes(goal: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The order changes the policy asks for in a case: the final state the reward checks."""
    kind, oid = goal["kind"], goal["order_id"]
    if kind == "cancel_ok":
        return {oid: {"status": "cancelled"}}
    if kind == "return_ok":
        return {oid: {"status": "return_requested", "refund_to": goal["refund_to"]}}
    return {}

"""Baselines of catalog v2 beside the ceiling: the oracle, a heuristic, the two-call flagger and
constant decisions (``ceiling_worked`` is the ceiling writing its working before it submits,
``ceiling_recovering`` the ceiling answering the error of a slipped first submission).

- ``heuristic``: a checklist analyst that skips the seller's record and never escalates: the
  first search hit, the schema's policy, brand look-alikes (similarity >= 90), a price under 40%
  of MSRP, a gated brand from a seller not on its list.
- ``two_call_flagger``: search the item type, read the first hit's schema, then "prohibited" when
  its policy says so, else "counterfeit".
- ``always_<decision>``: the ceiling's category and attributes with one constant decision
  (``always_escalate`` asks for an invoice).
- ``oracle``: submits the truth (proves the maximum is reachable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from envs.catalog.common.ids import find_listing_id
from envs.catalog.v2.ceiling import (
    CeilingPolicy,
    RecoveringCeilingPolicy,
    WorkedCeilingPolicy,
    _attributes,
    _bare,
    _call,
    _done,
    _turn,
    read_listing,
)

__all__ = [
    "BASELINES_V2",
    "DEGENERATE_V2",
    "ConstantDecision",
    "HeuristicV2",
    "OracleV2",
    "TwoCallFlagger",
]

Message = dict[str, Any]


class OracleV2:
    """Submits the case's truth in one turn (reads it through the twin, never through a tool)."""

    name = "oracle"

    def __init__(self, twin: Any) -> None:
        self.twin = twin

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """Submit the truth of the case named in the prompt."""
        text = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
        case = self.twin.case_of_listing(find_listing_id(text) or "")
        if case is None:
            return {"role": "assistant", "content": "no listing id of this twin in the prompt"}
        t = case.truth
        args = {
            "category_id": t["category_id"],
            "attributes": dict(t["attributes"]),
            "decision": t["decision"],
            "reason": "oracle",
        }
        if t.get("request"):
            args["request"] = t["request"]
        return _turn([_call("submit", args, "o")])


class HeuristicV2:
    """The checklist analyst (see the module docstring)."""

    name = "heuristic"

    def __init__(self, twin: Any = None) -> None:
        self.twin = twin

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """Search, read the first hit and the brand, submit."""
        listing = read_listing(messages)
        done = _done(messages)
        step = sum(1 for m in messages if m.get("role") == "assistant")
        item = _bare(listing["specifics"].get("Item type", listing["title"]), listing["brand"])
        if step == 0:
            return _turn([_call("search_taxonomy", {"query": item, "limit": 5}, "s")])
        if step == 1:
            hits = (done.get("s") or {}).get("results") or []
            leaf = hits[0]["id"] if hits else "aa"
            calls = [_call("get_attribute_schema", {"category_id": leaf}, "c")]
            if listing["brand"]:
                calls.append(
                    _call("lookup_brand", {"name": listing["brand"], "category_id": leaf}, "b")
                )
            return _turn(calls)
        schema = done.get("c") or {}
        brand = done.get("b") or {}
        exact = brand.get("exact") or {}
        decision = "ok"
        sims = [s["similarity"] for s in brand.get("similar") or () if s.get("registered")]
        msrp = exact.get("msrp") or {}
        if schema.get("policy") == "prohibited":
            decision = "prohibited"
        elif not exact and max(sims, default=0) >= 90:
            decision = "counterfeit"
        elif msrp.get("low") and listing["price"] < 0.4 * msrp["low"]:
            decision = "counterfeit"
        elif exact.get("protected") and listing["seller"] not in (
            exact.get("authorized_sellers") or ()
        ):
            decision = "counterfeit"
        args = {
            "category_id": schema.get("category_id", "aa"),
            "attributes": _attributes(listing, schema),
            "decision": decision,
            "reason": "checklist",
        }
        return _turn([_call("submit", args, "z")])


class TwoCallFlagger:
    """Search, schema of the first hit, then prohibited or counterfeit."""

    name = "two_call_flagger"

    def __init__(self, twin: Any = None) -> None:
        self.twin = twin

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """Two calls, then a flag."""
        listing = read_listing(messages)
        done = _done(messages)
        step = sum(1 for m in messages if m.get("role") == "assistant")
        item = _bare(listing["specifics"].get("Item type", listing["title"]), listing["brand"])
        if step == 0:
            return _turn([_call("search_taxonomy", {"query": item, "limit": 5}, "s")])
        if step == 1:
            hits = (done.get("s") or {}).get("results") or []
            return _turn(
                [
                    _call(
                        "get_attribute_schema",
                        {"category_id": hits[0]["id"] if hits else "aa"},
                        "c",
                    )
                ]
            )
        schema = done.get("c") or {}
        decision = "prohibited" if schema.get("policy") == "prohibited" else "counterfeit"
        args = {
            "category_id": schema.get("category_id", "aa"),
            "attributes": _attributes(listing, schema),
            "decision": decision,
            "reason": "flag",
        }
        return _turn([_call("submit", args, "z")])


class ConstantDecision(CeilingPolicy):
    """The ceiling's category and attributes with one constant decision."""

    def __init__(self, twin: Any = None, decision: str = "ok") -> None:
        super().__init__(twin)
        self.fixed = (decision, "invoice" if decision == "escalate" else None)
        self.name = f"always_{decision}"


def _constant(decision: str) -> Callable[[Any], ConstantDecision]:
    def make(twin: Any) -> ConstantDecision:
        return ConstantDecision(twin, decision)

    make.__name__ = f"always_{decision}"
    return make


DEGENERATE_V2: dict[str, Callable[[Any], Any]] = {
    **{f"always_{d}": _constant(d) for d in ("ok", "counterfeit", "prohibited", "escalate")},
    "two_call_flagger": TwoCallFlagger,
}
BASELINES_V2: dict[str, Callable[[Any], Any]] = {
    "oracle": OracleV2,
    "ceiling": CeilingPolicy,
    "ceiling_worked": WorkedCeilingPolicy,
    "ceiling_recovering": RecoveringCeilingPolicy,
    "heuristic": HeuristicV2,
    **DEGENERATE_V2,
}

"""Baseline policies for the catalog twin: random, a rule-based analyst, and an oracle.

Each is an object with ``name`` and ``async act(messages, tools) -> assistant message``, as the
rollout runner expects, and each factory takes the twin: ``BASELINES["heuristic"](twin)``.

- ``random``: :class:`twin.policies.RandomPolicy`: random tools with schema-shaped arguments.
- ``heuristic``: what a junior analyst with a checklist does, through the tools only: search the
  taxonomy with the cleaned title and look the brand up (turn 1), read the top category's schema
  (turn 2), then submit (turn 3) with the attributes found in the listing's words and a verdict
  from simple rules: prohibited category, recall model numbers, price vs MSRP, protected brand and
  seller, typo distance to a registered brand, replica wording outside an art or prop context.
  It never follows instructions inside the listing.
- ``oracle``: reads the case's truth (it finds the case from the listing id in the prompt) and
  submits it in one turn; it proves the maximum reward is reachable on every case.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from envs.catalog.common.ids import find_listing_id
from envs.catalog.common.messages import assistant_turn, parse_prompt, tool_call, tool_results

__all__ = ["BASELINES", "HeuristicPolicy", "OraclePolicy", "make_random", "parse_prompt"]

Message = dict[str, Any]

# Words in listing titles that say nothing about the category.
# fmt: off
_NOISE = {
    "new", "nwt", "bnib", "brand", "hot", "genuine", "authentic", "original", "free", "shipping",
    "fast", "dispatch", "sealed", "great", "gift", "w", "box", "limited", "stock", "us", "seller",
    "top", "rated", "with", "for", "the", "and", "of", "a", "an", "in", "on", "to", "by",
}
# fmt: on
_REPLICA = re.compile(
    r"(\b1:1\b|mirror quality|inspired by|\bdupe\b|lookalike|look-alike|\baaa\b|top grade replica|"
    r"unbranded version|replica)",
    re.IGNORECASE,
)
_LEGIT_REPLICA = re.compile(
    r"(museum|painting|painted|reproduction|movie|film|prop replica|display piece|collector)",
    re.IGNORECASE,
)
_GENERIC = {"unbranded", "generic", "no brand", "handmade", "studio made", "(none given)", ""}

#: Price under this share of the low end of the brand's MSRP range counts as a counterfeit signal.
PRICE_FLOOR = 0.45
#: Similarity (rapidfuzz WRatio, 0-100) at which a non-exact brand imitates a registered one.
TYPO_SIMILARITY = 85.0


class HeuristicPolicy:
    """A rule-based analyst that uses the twin's tools (see the module docstring)."""

    name = "heuristic"

    def __init__(self, twin: Any = None) -> None:
        self.twin = twin

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """The next turn, decided from the chat so far."""
        return self.turn(messages)

    def turn(self, messages: Sequence[Message]) -> Message:
        """The synchronous body of :meth:`act`."""
        listing = parse_prompt(messages)
        done = tool_results(messages)
        step = sum(1 for m in messages if m.get("role") == "assistant")
        if step == 0:
            calls = [
                tool_call(
                    "search_taxonomy", {"query": self.query(listing), "limit": 5}, "h0_search"
                )
            ]
            if listing["brand"].lower() not in _GENERIC:
                calls.append(tool_call("lookup_brand", {"name": listing["brand"]}, "h0_brand"))
            return assistant_turn(calls)
        search = next((r for n, _, r in done if n == "search_taxonomy" and r), None)
        hits = (search or {}).get("results") or []
        category = hits[0]["id"] if hits else None
        schema = next((r for n, _, r in done if n == "get_attribute_schema" and r), None)
        if schema is None and category is not None and step == 1:
            return assistant_turn(
                [tool_call("get_attribute_schema", {"category_id": category}, "h1_schema")]
            )
        brand = next((r for n, _, r in done if n == "lookup_brand" and r), None)
        if category is None:  # nothing found: a top-level guess keeps the episode scored
            category = (schema or {}).get("category_id") or "aa"
        verdict, why = self.verdict(listing, brand, schema, category)
        attrs = self.attributes(listing, schema) if schema else {}
        args = {
            "category_id": (schema or {}).get("category_id", category),
            "attributes": attrs,
            "verdict": verdict,
            "reason": why,
        }
        return assistant_turn([tool_call("submit", args, f"h{step}_submit")])

    # -- rules ---------------------------------------------------------------------------------
    @staticmethod
    def query(listing: dict[str, Any]) -> str:
        """The title without the brand, numbers and words that say nothing about the category."""
        title = listing["title"]
        if listing["brand"]:
            title = re.sub(re.escape(listing["brand"]), " ", title, flags=re.IGNORECASE)
        words = [w for w in re.findall(r"[A-Za-z][A-Za-z'&]+", title) if w.lower() not in _NOISE]
        return " ".join(words) or listing["title"]

    @staticmethod
    def verdict(
        listing: dict[str, Any],
        brand: dict[str, Any] | None,
        schema: dict[str, Any] | None,
        category: str,
    ) -> tuple[str, str]:
        """``(verdict, reason)`` from the checklist, most severe finding first."""
        text = f"{listing['title']} {listing['description']}"
        low = text.lower()
        exact = (brand or {}).get("exact")
        if schema is not None and schema.get("policy") == "prohibited":
            return "prohibited", f"category {schema['category_id']} is prohibited by policy"
        for recall in (exact or {}).get("recalls", []):
            batches = recall.get("batches") or [recall.get("batch", "")]  # v1 lists several
            if recall["model_number"].lower() in low or any(
                b and b.lower() in low for b in batches
            ):
                return (
                    "prohibited",
                    f"matches recall {recall['recall_id']} ({recall['model_number']})",
                )
        if _REPLICA.search(text) and not _LEGIT_REPLICA.search(text):
            return "counterfeit", "replica wording next to a brand"
        if exact is None and brand is not None:
            name = listing["brand"]
            for sim in brand.get("similar", []):
                close = sim["similarity"] >= TYPO_SIMILARITY
                sized = 0.7 <= len(name) / max(len(sim["name"]), 1) <= 1.4
                if sim["registered"] and close and sized:
                    return (
                        "counterfeit",
                        f"brand {name!r} imitates registered brand {sim['name']!r}",
                    )
        if exact is not None:
            if exact["protected"] and listing["seller"] not in exact["authorized_sellers"]:
                return "counterfeit", f"{listing['seller']} is not authorized for {exact['name']}"
            ranges = [
                r
                for r in exact.get("msrp", [])
                if category == r["category_id"] or category.startswith(r["category_id"] + "-")
            ]
            if ranges:
                deepest = max(ranges, key=lambda r: len(r["category_id"]))
                if listing["price"] < PRICE_FLOOR * deepest["low"]:
                    return (
                        "counterfeit",
                        f"price {listing['price']} far under MSRP {deepest['low']}",
                    )
        return "ok", "no counterfeit or policy signal found"

    @staticmethod
    def attributes(listing: dict[str, Any], schema: dict[str, Any]) -> dict[str, str]:
        """Required attributes whose value the listing states (item specifics first, then text)."""
        text = f" {listing['title']} {listing['description']} ".lower()
        found: dict[str, str] = {}
        for attr in schema.get("attributes", []):
            if not attr["required"]:
                continue
            values = {v.lower(): v for v in attr["values"]}
            stated = listing["specifics"].get(attr["name"].lower())
            if stated is not None and stated.lower() in values:
                found[attr["handle"]] = values[stated.lower()]
                continue
            labelled = re.search(re.escape(attr["name"].lower()) + r": ([^.;]+)", text)
            if labelled and labelled.group(1).strip() in values:
                found[attr["handle"]] = values[labelled.group(1).strip()]
                continue
            hits = [
                v
                for v in values
                if re.search(r"(?<![a-z0-9])" + re.escape(v) + r"(?![a-z0-9])", text)
            ]
            if hits:
                found[attr["handle"]] = values[max(hits, key=len)]
        return found


class OraclePolicy:
    """Submits the case's truth in one turn (reads it through the twin, never through a tool)."""

    name = "oracle"

    def __init__(self, twin: Any) -> None:
        self.twin = twin

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """Submit the truth of the case named by the listing id in the prompt."""
        text = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
        case = self.twin.case_of_listing(find_listing_id(text) or "")
        if case is None:
            return {"role": "assistant", "content": "no listing id of this twin in the prompt"}
        truth = case.truth
        args = {
            "category_id": truth["category_id"],
            "attributes": dict(truth["attributes"]),
            "verdict": truth["verdict"],
            "reason": "oracle: " + ", ".join(truth["signals"]),
        }
        return assistant_turn([tool_call("submit", args, "oracle_submit")])


def make_random(twin: Any, seed: int = 0) -> Any:
    """:class:`twin.policies.RandomPolicy` (random tools, schema-shaped arguments)."""
    from twin.policies import RandomPolicy

    return RandomPolicy(seed=seed)


#: Baseline factories: name -> ``f(twin) -> policy``.
BASELINES: dict[str, Callable[[Any], Any]] = {
    "random": make_random,
    "heuristic": HeuristicPolicy,
    "oracle": OraclePolicy,
}

"""The careful reference analyst of catalog v1, and the degenerate policies it is measured against.

``careful`` is what "solvable without shortcuts" means: a readable scripted analyst that sees only
the prompt and the tools' answers (never the truth) and applies the store's rules the system
prompt states (:func:`envs.catalog.v1.rules.decide`):

1. turn 1: search the taxonomy for the item type (with its department), look the brand up, read
   the seller's record, and look up every name the listing says the item copies;
2. turn 2: read the chosen leaf's schema (its policy and required attributes) and the brand's
   MSRP range for that leaf;
3. turn 3: submit the leaf, the required attributes the listing states, and the rules' verdict.

The degenerate policies show what the reward pays for doing less:

- ``always_ok`` / ``always_counterfeit`` / ``always_prohibited``: careful's category and
  attributes with one constant verdict;
- ``no_tools``: one submit with no tool call (a top-level category, a keyword verdict);
- ``first_hit``: the first search hit for the title and its schema's attributes, verdict ``ok``
  (no registry, seller or policy check).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from envs.catalog.common.messages import assistant_turn, parse_prompt, tool_call, tool_results
from envs.catalog.common.text import listing_text
from envs.catalog.v1.rules import assess, copy_mentions, decide, extract_attributes

__all__ = [
    "DEGENERATE",
    "CarefulPolicy",
    "CompactCarefulPolicy",
    "ConstantVerdictPolicy",
    "FirstHitPolicy",
    "NoToolsPolicy",
]

Message = dict[str, Any]

# fmt: off
_NOISE = {
    "new", "nwt", "bnib", "brand", "hot", "genuine", "authentic", "original", "free", "shipping",
    "fast", "dispatch", "sealed", "great", "gift", "w", "box", "limited", "stock", "us", "seller",
    "top", "rated", "sale", "deal", "quality", "premium", "best", "in", "ships", "today", "easy",
    "returns", "must", "see", "item", "warehouse", "ready",
}
# fmt: on


def _listing(messages: Sequence[Message]) -> dict[str, Any]:
    """The listing fields of the prompt, item specifics keyed by their display names."""
    listing = parse_prompt(messages)
    text = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
    specifics: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("Item specifics: ") and line != "Item specifics: (none)":
            for part in line[len("Item specifics: ") :].split("; "):
                k, _, v = part.partition(": ")
                specifics[k.strip()] = v.strip()
    listing["specifics"] = specifics
    return listing


def choose_category(hits: Sequence[dict[str, Any]], item: str, department: str) -> str | None:
    """The search hit that is the item: its name is the item type (and its path ends with the
    department when one is given); else the first hit under the department; else the first hit."""
    item_l, dept_l = item.lower(), department.lower()

    def under(h: dict[str, Any]) -> bool:
        parents = h["full_name"].lower().rsplit(" > ", 1)[0]
        return not dept_l or parents.endswith(dept_l)

    for h in hits:
        if h["name"].lower() == item_l and under(h):
            return str(h["id"])
    for h in hits:
        if dept_l and under(h):
            return str(h["id"])
    return str(hits[0]["id"]) if hits else None


class CarefulPolicy:
    """The careful reference analyst (see the module docstring)."""

    name = "careful"
    #: A constant verdict instead of the rules' (the degenerate variants set it).
    fixed_verdict: str | None = None

    def __init__(self, twin: Any = None) -> None:
        self.twin = twin

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """The next turn, decided from the chat so far."""
        return self.turn(messages)

    def turn(self, messages: Sequence[Message]) -> Message:
        """The synchronous body of :meth:`act`."""
        listing = _listing(messages)
        done = tool_results(messages)
        step = sum(1 for m in messages if m.get("role") == "assistant")
        item = listing["specifics"].get("Item type") or self._title_words(listing)
        dept = listing["specifics"].get("Department", "")
        if step == 0:
            query = f"{item} {dept.split(' > ')[-1]}".strip() if dept else item
            calls = [tool_call("search_taxonomy", {"query": query, "limit": 20}, "c0_search")]
            if listing["brand"]:
                calls.append(tool_call("lookup_brand", {"name": listing["brand"]}, "c0_brand"))
            if listing["seller"]:
                calls.append(tool_call("get_seller", {"name": listing["seller"]}, "c0_seller"))
            for i, name in enumerate(copy_mentions(listing_text(listing))[:4]):
                calls.append(tool_call("lookup_brand", {"name": name}, f"c0_copy{i}"))
            return assistant_turn(calls)
        hits = []
        for n, _, r in done:
            if n == "search_taxonomy" and r:
                hits.extend(r.get("results") or [])
        category = choose_category(hits, item, dept)
        schema = next((r for n, _, r in done if n == "get_attribute_schema" and r), None)
        if schema is None:
            if category is None:  # nothing found: a top-level guess keeps the episode scored
                return assistant_turn(
                    [
                        tool_call(
                            "submit",
                            {
                                "category_id": "aa",
                                "attributes": {},
                                "verdict": "ok",
                                "reason": "no category found",
                            },
                            "c_submit",
                        )
                    ]
                )
            calls = [tool_call("get_attribute_schema", {"category_id": category}, "c1_schema")]
            if listing["brand"]:
                calls.append(
                    tool_call(
                        "lookup_brand",
                        {"name": listing["brand"], "category_id": category},
                        "c1_brand",
                    )
                )
            return assistant_turn(calls)
        brand = next(
            (r for n, a, r in done if n == "lookup_brand" and r and a.get("category_id")), None
        )
        if brand is None:
            brand = next(
                (
                    r
                    for n, a, r in done
                    if n == "lookup_brand" and r and a.get("name") == listing["brand"]
                ),
                None,
            )
        seller = next((r for n, _, r in done if n == "get_seller" and r and "name" in r), None)
        mentions = {
            a.get("name"): r
            for n, a, r in done
            if n == "lookup_brand" and r and not a.get("category_id")
        }
        evidence = assess(listing, schema, brand, seller, mentions)
        verdict, reason = decide(evidence)
        if self.fixed_verdict is not None:
            verdict, reason = self.fixed_verdict, "constant verdict"
        args = {
            "category_id": schema["category_id"],
            "attributes": extract_attributes(listing, schema),
            "verdict": verdict,
            "reason": reason,
        }
        return assistant_turn([tool_call("submit", args, f"c{step}_submit")])

    @staticmethod
    def _title_words(listing: dict[str, Any]) -> str:
        words = [
            w
            for w in re.findall(r"[A-Za-z][A-Za-z'&]+", listing["title"])
            if w.lower() not in _NOISE
        ]
        return " ".join(words) or listing["title"]


class CompactCarefulPolicy(CarefulPolicy):
    """Careful's decisions in the fewest tokens: the expert teacher for SFT (``compact``).

    The same evidence as :class:`CarefulPolicy`, asked for in fewer and shorter calls, so that its
    episodes fit a small model's context:

    1. turn 1: the taxonomy search with 3 results (careful asks for 20) and the seller's record;
    2. turn 2: the chosen leaf's schema, one brand look-up *with* that category (its MSRP range
       and registration in one answer; careful also looks the brand up without it), and the names
       the listing says the item copies, each with the category too (their answers then list
       one MSRP range instead of every one);
    3. turn 3: the submit, without a reason (the field is optional).

    On Catalog-v1's 200 test cases (compact prompt, SmolLM2 tokens) it scores 1.000 on every case
    at 2,327 tokens per episode (at most 2,972; careful: 4,209, the heuristic 2,727); its longest
    turn is 188 tokens (turn 2 with four copy look-ups), so a model imitating it needs a per-turn
    limit of about 192 (``sampler.max_new_tokens``).
    """

    name = "compact"
    #: Search hits asked for: the item's leaf is among the first three on every v1 test case.
    SEARCH_LIMIT = 3

    def turn(self, messages: Sequence[Message]) -> Message:
        """The synchronous body of :meth:`act`."""
        listing = _listing(messages)
        step = sum(1 for m in messages if m.get("role") == "assistant")
        item = listing["specifics"].get("Item type") or self._title_words(listing)
        dept = listing["specifics"].get("Department", "")
        if step == 0:
            query = f"{item} {dept.split(' > ')[-1]}".strip() if dept else item
            calls = [
                tool_call("search_taxonomy", {"query": query, "limit": self.SEARCH_LIMIT}, "s")
            ]
            if listing["seller"]:
                calls.append(tool_call("get_seller", {"name": listing["seller"]}, "v"))
            return assistant_turn(calls)
        if step == 1:
            hits = [h for n, _, r in tool_results(messages) if n == "search_taxonomy" and r
                    for h in r.get("results") or []]  # fmt: skip
            category = choose_category(hits, item, dept)
            if category is None:
                return super().turn(messages)  # careful's fallback submit
            calls = [tool_call("get_attribute_schema", {"category_id": category}, "c")]
            if listing["brand"]:
                calls.append(
                    tool_call(
                        "lookup_brand", {"name": listing["brand"], "category_id": category}, "b"
                    )
                )
            for i, name in enumerate(copy_mentions(listing_text(listing))[:4]):
                calls.append(
                    tool_call("lookup_brand", {"name": name, "category_id": category}, f"m{i}")
                )
            return assistant_turn(calls)
        message = super().turn(self._as_careful(messages))
        call = message["tool_calls"][0]
        args = json.loads(call["function"]["arguments"])
        args.pop("reason", None)
        call["id"] = "f"
        call["function"]["arguments"] = json.dumps(args, ensure_ascii=False)
        return message

    @staticmethod
    def _as_careful(messages: Sequence[Message]) -> list[Message]:
        """The chat as careful reads it: a copy look-up is one without a category."""
        out: list[Message] = []
        for m in messages:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                calls = []
                for c in m["tool_calls"]:
                    if c["id"].startswith("m"):
                        args = json.loads(c["function"]["arguments"])
                        args.pop("category_id", None)
                        c = {**c, "function": {**c["function"], "arguments": json.dumps(args)}}
                    calls.append(c)
                m = {**m, "tool_calls": calls}
            out.append(m)
        return out


class ConstantVerdictPolicy(CarefulPolicy):
    """Careful's category and attributes with one constant verdict."""

    def __init__(self, twin: Any = None, verdict: str = "ok") -> None:
        super().__init__(twin)
        self.fixed_verdict = verdict
        self.name = f"always_{verdict}"


class NoToolsPolicy:
    """Submits at once, without a tool call: a top-level category and a keyword verdict."""

    name = "no_tools"
    _COPY = re.compile(r"\b(inspired by|dupe|1:1|replica|copy of|knock-?off)\b", re.IGNORECASE)

    def __init__(self, twin: Any = None) -> None:
        self.twin = twin

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """One submit turn."""
        listing = _listing(messages)
        verdict = "counterfeit" if self._COPY.search(listing_text(listing)) else "ok"
        args = {"category_id": "aa", "attributes": {}, "verdict": verdict, "reason": "no tools"}
        return assistant_turn([tool_call("submit", args, "n0_submit")])


class FirstHitPolicy:
    """The first search hit for the title and its stated attributes, verdict ``ok``."""

    name = "first_hit"

    def __init__(self, twin: Any = None) -> None:
        self.twin = twin

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """Search, read the first hit's schema, submit ok."""
        listing = _listing(messages)
        done = tool_results(messages)
        step = sum(1 for m in messages if m.get("role") == "assistant")
        if step == 0:
            query = CarefulPolicy._title_words(listing)
            return assistant_turn(
                [tool_call("search_taxonomy", {"query": query, "limit": 5}, "f0_search")]
            )
        search = next((r for n, _, r in done if n == "search_taxonomy" and r), None)
        hits = (search or {}).get("results") or []
        schema = next((r for n, _, r in done if n == "get_attribute_schema" and r), None)
        if schema is None and hits and step == 1:
            return assistant_turn(
                [tool_call("get_attribute_schema", {"category_id": hits[0]["id"]}, "f1_schema")]
            )
        category = (schema or {}).get("category_id") or (hits[0]["id"] if hits else "aa")
        attrs = extract_attributes(listing, schema) if schema else {}
        args = {
            "category_id": category,
            "attributes": attrs,
            "verdict": "ok",
            "reason": "first hit",
        }
        return assistant_turn([tool_call("submit", args, f"f{step}_submit")])


def _constant(verdict: str) -> Callable[[Any], ConstantVerdictPolicy]:
    def make(twin: Any) -> ConstantVerdictPolicy:
        return ConstantVerdictPolicy(twin, verdict)

    make.__name__ = f"always_{verdict}"
    return make


#: Degenerate policy factories: name -> ``f(twin) -> policy``.
DEGENERATE: dict[str, Callable[[Any], Any]] = {
    "always_ok": _constant("ok"),
    "always_counterfeit": _constant("counterfeit"),
    "always_prohibited": _constant("prohibited"),
    "no_tools": NoToolsPolicy,
    "first_hit": FirstHitPolicy,
}

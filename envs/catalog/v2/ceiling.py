"""The ceiling policy of catalog v2: the store's written rules played from tool outputs alone.

It reads the prompt (the listing, and the store's rules every agent reads: their thresholds come
from the system prompt, :func:`read_rules`) and the tools' answers, never the case's truth, the
labelling code or the world: this module imports only the standard library (a test checks it).
It is short on purpose (three turns, four or five calls, compact arguments), so that ``twin
collect`` can use it as a teacher:

1. ``search_taxonomy`` for the item (the item type without brand and model, or the item the
   description says it really is) and ``get_seller``;
2. ``get_attribute_schema`` of the leaf whose name has the item's words, ``lookup_brand`` with
   that category, and ``lookup_brand`` of every name the listing says it copies;
3. ``submit`` with the required attributes the item specifics state and the rules' decision.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CeilingPolicy",
    "RecoveringCeilingPolicy",
    "WorkedCeilingPolicy",
    "read_listing",
    "read_rules",
    "resolve",
    "work_from_tools",
]

Message = dict[str, Any]

_FIELD = re.compile(r"^(Title|Brand|Seller|Price|Item specifics|Description): (.*)$")
_MODEL = re.compile(r"\b[A-Z]{2,3}-\d{3,5}[A-Z]?\b")
_BATCH = re.compile(
    r"\b(?:batch|lot)\s*(?:no\.?|code|number|#)?\s*:?\s*([A-Z]\d{3,5}-\d{2,4})\b", re.I
)
_CONDITION = re.compile(
    r"(?<!never )(?<!not )\b(open[- ]box|refurbished|used|pre-owned|ex-display|clearance)\b", re.I
)
_COPY = re.compile(
    r"\b(?:inspired by|dupe of|1:1 copy of|copy of|replica of|mirror copy of|knock-?off of)\s+"
    r"(?:the\s+|a\s+|an\s+)?([^.,;:!?()\n|]+)",
    re.I,
)
# fmt: off
_COPY_STOP = {
    "at", "for", "with", "in", "and", "but", "from", "quality", "design", "style", "look", "looks",
    "same", "made", "sold", "original", "-", "—",
}
# fmt: on
_CUE = re.compile(r"\b(?:really|works as|doubles as)\s+(?:an?\s+)?([^.!?,;|•/<>*]+)", re.I)
_STOP = {"and", "&", "for", "the", "a", "an", "of", "with", "set", "pcs", "pc"}


def _singular(word: str) -> str:
    if len(word) <= 3:
        return word
    if word.endswith("ies"):
        return word[:-3] + "y"
    if re.search(r"(ches|shes|xes|sses|zzes)$", word):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us")):
        return word[:-1]
    return word


def _key(text: str) -> tuple[str, ...]:
    words = re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)*", re.sub(r"'s?\b", "", text.lower()))
    return tuple(sorted(_singular(w) for w in words if w not in _STOP))


def read_listing(messages: Sequence[Message]) -> dict[str, Any]:
    """The listing fields of the user message (item specifics keyed by their display names)."""
    text = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
    out: dict[str, Any] = {
        "title": "",
        "brand": "",
        "seller": "",
        "price": 0.0,
        "specifics": {},
        "description": "",
    }
    for line in text.splitlines():
        m = _FIELD.match(line)
        if not m:
            continue
        key, value = m.group(1), m.group(2).strip()
        if key == "Price":
            out["price"] = float(value.split()[0])
        elif key == "Item specifics":
            if value != "(none)":
                for part in value.split("; "):
                    name, _, val = part.partition(": ")
                    out["specifics"][name.strip()] = val.strip()
        else:
            out[key.lower()] = value
    if out["brand"] == "(none given)":
        out["brand"] = ""
    return out


def _text(listing: dict[str, Any]) -> str:
    return " ".join(
        [
            listing["title"],
            listing["description"],
            *(f"{k}: {v}." for k, v in listing["specifics"].items()),
        ]
    )


def _item(listing: dict[str, Any]) -> tuple[str, str]:
    """The item to categorise (bare words) and the department (empty when none applies)."""
    spec = listing["specifics"]
    item = _bare(spec.get("Item type", listing["title"]), listing["brand"])
    cue = _CUE.search(listing["description"])
    if cue and _key(_bare(cue.group(1), listing["brand"])) != _key(item):
        return _bare(cue.group(1), listing["brand"]), ""
    return item, spec.get("Department", "")


def _bare(item: str, brand: str) -> str:
    if brand:
        item = re.sub(re.escape(brand), " ", item, flags=re.I)
    return re.sub(r"\s+", " ", _MODEL.sub(" ", item)).strip(" ,")


def resolve(hits: Sequence[dict[str, Any]], item: str, dept: str) -> str | None:
    """The hit whose name has the item's words (and whose parent path ends with ``dept``)."""
    key = _key(item)

    def under(h: dict[str, Any]) -> bool:
        return not dept or h["full_name"].lower().rsplit(" > ", 1)[0].endswith(dept.lower())

    found = [h for h in hits if _key(h["name"]) == key and under(h)]
    exact = [h for h in found if h["name"].lower() == item.lower()]
    pick = (exact or found or [h for h in hits if under(h)] or list(hits) or [None])[0]
    return str(pick["id"]) if pick else None


def _copies(text: str) -> list[str]:
    out = []
    for m in _COPY.finditer(text):
        words = m.group(1).strip().split()
        cut = next((i for i, w in enumerate(words) if w.lower() in _COPY_STOP), len(words))
        name = " ".join(words[:cut]).strip(" '\"")
        if name and name not in out:
            out.append(name)
    return out


#: Where the rules text states each threshold (the text of envs/catalog/v2/rules.py).
_THRESHOLDS = {
    "imitation": r"with similarity >= (\d+(?:\.\d+)?) \(",
    "price_bands": r"r >= ([\d.]+): 0; ([\d.]+)-[\d.]+: \+1; ([\d.]+)-[\d.]+: \+2; "
    r"([\d.]+)-[\d.]+: \+3; under [\d.]+: \+(\d+)\.",
    "near_name": r"similar to one at (\d+(?:\.\d+)?)-",
    "recent_year": r"for this brand in (\d{4}) or later",
    "new_account_days": r"account age under (\d+) days",
    "few_sales": r"under (\d+) sales",
    "low_rating": r"rating under ([\d.]+): \+1",
    "established": r"established \(age >= (\d+) days, rating >= ([\d.]+), sales >= (\d+)",
    "remove_at": r"(\d+) or more points: counterfeit",
    "review_at": r"; (\d+)-\d+ points -> authorisation_letter",
}


def _number(text: str) -> int | float:
    return float(text) if "." in text else int(text)


def read_rules(messages: Sequence[Message]) -> dict[str, Any]:
    """The thresholds the system prompt's rules state, by name (:data:`_THRESHOLDS`).

    Raises:
        ValueError: the prompt does not state one of them.
    """
    text = next((m.get("content") or "" for m in messages if m.get("role") == "system"), "")
    rules: dict[str, Any] = {}
    for name, pattern in _THRESHOLDS.items():
        m = re.search(pattern, text)
        if m is None:
            raise ValueError(f"the system prompt's rules do not state {name!r}")
        values = tuple(_number(g) for g in m.groups())
        rules[name] = values if len(values) > 1 else values[0]
    return rules


def _established(seller: dict[str, Any], rules: dict[str, Any]) -> bool:
    days, rating, sales = rules["established"]
    return (
        not [t for t in seller.get("takedowns") or () if t.get("reason") == "counterfeit"]
        and seller.get("account_age_days", 0) >= days
        and seller.get("rating", 0) >= rating
        and seller.get("sales", 0) >= sales
    )


def _price_points(r: float, rules: dict[str, Any]) -> int:
    *bounds, floor = rules["price_bands"]
    return next((pts for pts, bound in enumerate(bounds) if r >= bound), floor)


def _point_items(
    listing: dict[str, Any],
    brand: dict[str, Any] | None,
    registered: bool,
    seller: dict[str, Any],
    similarity: float,
    rules: dict[str, Any],
) -> tuple[list[tuple[str, int]], bool, bool]:
    """Rule 4's points item by item (``(what was seen, points)``, the non-zero ones), whether the
    brand is gated and whether the seller is authorised."""
    items: list[tuple[str, int]] = []
    gated, auth = False, False
    name = (brand or {}).get("name")
    if registered and brand:
        gated = bool(brand.get("protected"))
        auth = listing["seller"] in (brand.get("authorized_sellers") or ())
        msrp = brand.get("msrp")
        if msrp and msrp.get("low"):
            r = listing["price"] / msrp["low"]
            p = _price_points(r, rules)
            if p:
                items.append((f"price {listing['price']:g}/{msrp['low']:g}={r:.2f}", p))
                if _CONDITION.search(_text(listing)):
                    items.append(("condition stated", -1))
        if gated and not auth:
            items.append(("gated, seller not authorised", 3))
        if auth:
            items.append(("seller authorised", -3))
    elif rules["near_name"] <= similarity < rules["imitation"]:
        items.append((f"near name {similarity:g}", 2))
    fakes = [t for t in seller.get("takedowns") or () if t.get("reason") == "counterfeit"]
    own = [t["year"] for t in fakes if registered and t.get("brand") == name]
    if own:
        items.append(
            (f"takedown this brand {max(own)}", 4 if max(own) >= rules["recent_year"] else 2)
        )
    if any(t.get("brand") != (name if registered else None) for t in fakes):
        items.append(("takedown other brand", 1))
    age, sales, rating = (
        seller.get("account_age_days", 10**6),
        seller.get("sales", 10**6),
        seller.get("rating", 5),
    )
    if age < rules["new_account_days"]:
        items.append((f"account {age} days", 1))
    if sales < rules["few_sales"]:
        items.append((f"{sales} sales", 1))
    if rating < rules["low_rating"]:
        items.append((f"rating {rating:g}", 1))
    if seller and _established(seller, rules):
        items.append(("established seller", -1))
    return items, gated, auth


def _recall_lines(
    exact: dict[str, Any] | None, text: str
) -> tuple[list[str], str | None, str | None]:
    """Rule 2 worked: a line per recall of a model the listing names, the first recall whose
    batch is unstated, and the first whose batch the listing states (that one decides)."""
    lines: list[str] = []
    unstated = None
    if not exact:
        return lines, None, None
    models, batches = set(_MODEL.findall(text)), {b.upper() for b in _BATCH.findall(text)}
    for r in exact.get("recalls") or ():
        if r["model_number"] not in models:
            continue
        head = f"recall {r['recall_id']}: {r['model_number']}"
        if not batches:
            lines.append(f"{head}, no batch")
            unstated = unstated or r["recall_id"]
        elif batches & set(r["batches"]):
            lines.append(f"{head}, batch listed")
            return lines, unstated, r["recall_id"]
        else:
            lines.append(f"{head}, other batch")
    return lines, unstated, None


def _brand_line(
    brand: str | None, registered: bool, sims: list[dict[str, Any]], similarity: float
) -> str:
    """What the brand look-up said, with the nearest registered name when it is not registered."""
    if not brand:
        return "brand none"
    if registered:
        return f"brand {brand} registered"
    if similarity:
        near = max(sims, key=lambda s: s["similarity"])
        return f"brand {brand} not registered, like {near['name']} {similarity:g}"
    return f"brand {brand} not registered"


def work_from_tools(
    listing: dict[str, Any],
    schema: dict[str, Any],
    lookup: dict[str, Any] | None,
    seller: dict[str, Any],
    mentions: dict[str, Any],
    rules: dict[str, Any],
) -> tuple[str, str | None, str, list[str]]:
    """``(decision, request, reason, working)``: the written rules (their thresholds from
    :func:`read_rules`) applied to the tools' answers, with the working: one line per rule it
    checked, in the rules' order, each naming what it read and the points it gave, the last one
    the decision."""
    work: list[str] = []

    def done(
        decision: str, request: str | None, reason: str
    ) -> tuple[str, str | None, str, list[str]]:
        work.append(f"-> {decision}" + (f" ({request})" if request else ""))
        return decision, request, reason, work

    work.append(f"policy {schema.get('policy', 'unknown')}")
    if schema.get("policy") == "prohibited":
        return done("prohibited", None, "prohibited category")
    text = _text(listing)
    exact = (lookup or {}).get("exact")
    lines, unstated, listed = _recall_lines(exact, text)
    work += lines
    if listed:
        return done("prohibited", None, f"recall {listed}")
    registered = bool(exact and exact.get("registered"))
    sims = [s for s in (lookup or {}).get("similar") or () if s.get("registered")]
    similarity = (
        max((s["similarity"] for s in sims), default=0.0) if lookup and not registered else 0.0
    )
    work.append(_brand_line(listing["brand"], registered, sims, similarity))
    if similarity >= rules["imitation"]:
        work[-1] += f" >= {rules['imitation']:g}"
        return done("counterfeit", None, "look-alike brand")
    for copied in _copies(text):
        if ((mentions.get(copied) or {}).get("exact") or {}).get("registered"):
            work.append(f"copy of {copied}, registered")
            return done("counterfeit", None, "copy of a registered brand")
    # the seller's figures always, so every working has the same shape; the points follow
    fakes = [t for t in seller.get("takedowns") or () if t.get("reason") == "counterfeit"]
    work.append(
        f"seller {seller.get('account_age_days', '?')} days, {seller.get('sales', '?')} sales, "
        f"rating {seller.get('rating', '?')}, {len(fakes)} counterfeit takedowns"
    )
    items, gated, auth = _point_items(listing, exact, registered, seller, similarity, rules)
    pts = sum(p for _, p in items)
    work += [f"{what} {p:+d}" for what, p in items]
    work.append(f"points {pts}")
    if pts >= rules["remove_at"]:
        return done("counterfeit", None, f"{pts} points")
    if unstated:
        return done("escalate", "recall_remedy_notice", "recalled model, no batch")
    est = _established(seller, rules)
    if schema.get("policy") == "certificate_required" and not (registered and (auth or est)):
        return done("escalate", "safety_certificate", "restricted category")
    if pts >= rules["review_at"]:
        return done(
            "escalate",
            "authorisation_letter" if gated and not auth else "invoice",
            f"{pts} points",
        )
    return done("ok", None, f"{pts} points")


def _done(messages: Sequence[Message]) -> dict[str, Any]:
    """Parsed tool results by call id."""
    out = {}
    for m in messages:
        if m.get("role") == "tool":
            try:
                out[m.get("tool_call_id", "")] = json.loads(m.get("content") or "")
            except (json.JSONDecodeError, TypeError):
                out[m.get("tool_call_id", "")] = None
    return out


def _call(name: str, args: dict[str, Any], cid: str) -> dict[str, Any]:
    return {
        "id": cid,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _turn(calls: list[dict[str, Any]]) -> Message:
    return {"role": "assistant", "content": None, "tool_calls": calls}


class CeilingPolicy:
    """The written rules from tool outputs (see the module docstring)."""

    name = "ceiling"
    #: Search hits read (enough for the leaf among same-named categories; fewer is fewer tokens).
    search_limit = 10
    #: A constant decision instead of the rules' (the degenerate variants set it).
    fixed: tuple[str, str | None] | None = None
    #: Whether the submit turn's text carries the working (:class:`WorkedCeilingPolicy`).
    worked = False

    def __init__(self, twin: Any = None) -> None:
        self.twin = twin

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """The next turn."""
        return self.turn(messages)

    def turn(self, messages: Sequence[Message]) -> Message:
        """The synchronous body of :meth:`act`."""
        listing = read_listing(messages)
        done = _done(messages)
        step = sum(1 for m in messages if m.get("role") == "assistant")
        item, dept = _item(listing)
        if step == 0:
            query = f"{item} {dept.split(' > ')[-1]}".strip()
            return _turn(
                [
                    _call("search_taxonomy", {"query": query, "limit": self.search_limit}, "s"),
                    _call("get_seller", {"name": listing["seller"]}, "p"),
                ]
            )
        if step == 1:
            hits = (done.get("s") or {}).get("results") or []
            leaf = resolve(hits, item, dept) or "aa"
            calls = [_call("get_attribute_schema", {"category_id": leaf}, "c")]
            if listing["brand"]:
                calls.append(
                    _call("lookup_brand", {"name": listing["brand"], "category_id": leaf}, "b")
                )
            for i, name in enumerate(_copies(_text(listing))[:3]):
                calls.append(_call("lookup_brand", {"name": name}, f"m{i}"))
            return _turn(calls)
        schema = done.get("c") or {}
        mentions = {}
        for i, name in enumerate(_copies(_text(listing))[:3]):
            mentions[name] = done.get(f"m{i}")
        decision, request, reason, work = work_from_tools(
            listing, schema, done.get("b"), done.get("p") or {}, mentions, read_rules(messages)
        )
        if self.fixed is not None:
            decision, request = self.fixed
        args: dict[str, Any] = {
            "category_id": schema.get("category_id", "aa"),
            "attributes": _attributes(listing, schema),
            "decision": decision,
        }
        if request:
            args["request"] = request
        args["reason"] = reason
        message = _turn([_call("submit", args, "z")])
        if self.worked:
            message["content"] = "\n".join(work)
        return message


class WorkedCeilingPolicy(CeilingPolicy):
    """The ceiling that writes its working before it submits: a line per rule it checked, in the
    rules' order, with what it read and the points it gave (``price 24/40=0.60 +1``, ``account
    12 days +1``, ``points 4``, ``-> escalate (invoice)``), then the same ``submit`` call.

    The teacher for a small model: a decision it must otherwise reach in the one token that
    names it becomes a chain of short steps, each copying a figure from a tool's answer or
    comparing it with a threshold the prompt states.
    """

    name = "ceiling_worked"
    worked = True


class RecoveringCeilingPolicy(CeilingPolicy):
    """The ceiling that, on a fixed share of listings, first submits the slip small models make
    and then answers the tool's error with the right submission.

    The slip is the commonest one a trained SmolLM2 made on Catalog-v2's test cases: every item
    specific copied into ``attributes`` under its own name, one of which is not an attribute of the
    category (``'color' is not an attribute of ...``). That turn carries ``"weight": 0``, so SFT
    shows the model the rejected call as context without teaching it
    (:func:`trainer.rows.render_row`); the next turn, the ceiling's own submission, is what it
    learns to write after such an error. A model taught only by the ceiling never saw a rejected
    submit, and such episodes ran out of turns without one.

    Which listings slip is fixed by the listing's text (a CRC-32), so the same cases slip on every
    machine. It slips only where the twin allows a fourth turn and the listing states a specific
    the category's schema does not have; elsewhere it is the ceiling.
    """

    name = "ceiling_recovering"
    #: The share of listings (with a specific the schema lacks) whose first submission slips.
    slip_rate = 0.5

    def turn(self, messages: Sequence[Message]) -> Message:
        """The ceiling's turn, with the slipped submission before it where this listing slips."""
        step = sum(1 for m in messages if m.get("role") == "assistant")
        right = super().turn(messages)
        if step != 2 or not self._slips(messages):
            return right
        args = json.loads(right["tool_calls"][0]["function"]["arguments"])
        slipped = self._slipped(read_listing(messages), _done(messages).get("c") or {}, args)
        if slipped is None:
            return right
        return {**_turn([_call("submit", slipped, "y")]), "weight": 0}

    def _slips(self, messages: Sequence[Message]) -> bool:
        turns = getattr(getattr(self.twin, "config", None), "max_turns", 0) or 0
        text = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
        return turns >= 4 and zlib.crc32(text.encode()) % 1000 < self.slip_rate * 1000

    @staticmethod
    def _slipped(
        listing: dict[str, Any], schema: dict[str, Any], args: dict[str, Any]
    ) -> dict[str, Any] | None:
        """``args`` with every other item specific as an attribute under its own lower-cased
        name, or None when the schema has every one of them (the slip would be accepted)."""
        have = {a["handle"] for a in schema.get("attributes") or ()}
        copied = {k.lower().replace(" ", "_"): v for k, v in listing["specifics"].items()}
        copied.pop("item_type", None)
        if not set(copied) - have:
            return None
        return {**args, "attributes": {**copied, **args["attributes"]}}


def _attributes(listing: dict[str, Any], schema: dict[str, Any]) -> dict[str, str]:
    spec = {k.lower(): v for k, v in listing["specifics"].items()}
    out = {}
    for a in schema.get("attributes") or ():
        if not a.get("required"):
            continue
        stated = spec.get(a["name"].lower())
        if stated is None:
            continue
        match = next((v for v in a["values"] if v.lower() == stated.lower()), None)
        if match is not None:
            out[a["handle"]] = match
    return out

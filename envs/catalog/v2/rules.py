"""The store's rules of catalog v2, as code: the labeller of every case.

:data:`RULES_TEXT` is what the agent reads in the system prompt; it states every threshold the
labels use. :func:`assess` reads the evidence from the tools' views (schema, brand look-up with
the category, seller record, look-ups of names the listing says it copies) and the listing's own
words; :func:`decide` turns it into a decision and, for ``escalate``, the document to request.
The case generator labels every listing with these functions; the ceiling policy
(:mod:`envs.catalog.v2.ceiling`) plays the same written rules without importing this module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envs.catalog.common.text import copied_names, listing_text, stated_batches, stated_models

__all__ = [
    "DECISIONS",
    "ESTABLISHED_DAYS",
    "ESTABLISHED_RATING",
    "ESTABLISHED_SALES",
    "FEW_SALES",
    "IMITATION",
    "LOW_RATING",
    "NEAR_NAME",
    "NEW_ACCOUNT_DAYS",
    "PRICE_BANDS",
    "PRICE_FLOOR_POINTS",
    "REMOVE_AT",
    "REVIEW_AT",
    "Evidence",
    "RULES_TEXT",
    "RECENT_YEAR",
    "REQUESTS",
    "assess",
    "copy_mentions",
    "decide",
    "points",
    "price_points",
    "stated_batches",
    "stated_condition",
    "stated_models",
]

DECISIONS: tuple[str, ...] = ("ok", "counterfeit", "prohibited", "escalate")
REQUESTS: tuple[str, ...] = (
    "invoice",
    "authorisation_letter",
    "safety_certificate",
    "recall_remedy_notice",
)

# The thresholds of the rules, each stated once: RULES_TEXT shows them to every agent (the
# ceiling policy reads them back from it) and the labeller below decides with them.
#: A counterfeit takedown in this year or later is recent.
RECENT_YEAR = 2024
#: Brand similarity (lookup_brand, 0-100) of a non-registered brand text to a registered brand.
IMITATION = 90.0
NEAR_NAME = 80.0
#: Risk score at which a listing is counterfeit, and at which it needs a review.
REMOVE_AT = 5
REVIEW_AT = 3
#: Rule 4's price bands: a price ratio at or above a bound scores its points; under the last
#: bound, :data:`PRICE_FLOOR_POINTS`.
PRICE_BANDS: tuple[tuple[float, int], ...] = ((0.75, 0), (0.55, 1), (0.40, 2), (0.25, 3))
PRICE_FLOOR_POINTS = 5
#: One risk point each: an account younger than this, fewer sales, a lower rating.
NEW_ACCOUNT_DAYS = 90
FEW_SALES = 50
LOW_RATING = 4.0
#: An established seller (one point off): at least this old, this well rated, this many sales.
ESTABLISHED_DAYS = 730
ESTABLISHED_RATING = 4.7
ESTABLISHED_SALES = 1000

_R = [bound for bound, _ in PRICE_BANDS]

RULES_TEXT = f"""\
Decide one of: ok, counterfeit, prohibited, escalate. Apply the rules in this order.
1. prohibited: the item's category has policy "prohibited" (get_attribute_schema). Judge what \
the item is, not what it is called: when the description says what it really is ("really a", \
"works as a", "doubles as a"), that item is the one sold and its category is the one to find.
2. prohibited: the listing states a model number of one of the brand's recall notices \
(lookup_brand) and a batch/lot code that notice lists. If that model is stated with no batch \
code at all: escalate, request recall_remedy_notice (after rules 3-5). Other models or batches \
are not recalled.
3. counterfeit: the brand text is not a registered brand but is similar to one with similarity \
>= {IMITATION:g} (look-alike letters, spacing, punctuation, misspellings), or the listing \
presents the item \
as a copy of a registered brand ("inspired by", "dupe of", "1:1 copy of", "replica of" <brand>).
4. Risk points (add them up):
   - price ratio r = price / the brand's MSRP low for this category (lookup_brand with \
category_id; registered brands only): r >= {_R[0]:.2f}: 0; {_R[1]:.2f}-{_R[0]:.2f}: +1; \
{_R[2]:.2f}-{_R[1]:.2f}: +2; {_R[3]:.2f}-{_R[2]:.2f}: \
+3; under {_R[3]:.2f}: +{PRICE_FLOOR_POINTS}. A stated condition (open box, refurbished, used, \
pre-owned, ex-display, \
clearance) when r < {_R[0]:.2f}: -1.
   - brand text not a registered brand but similar to one at {NEAR_NAME:g}-{IMITATION:g}: +2.
   - brand protected (gated) and the seller not on its authorized list: +3.
   - seller (get_seller): authorized for the brand: -3; a counterfeit takedown for this brand \
in {RECENT_YEAR} or later: +4, earlier: +2; a counterfeit takedown for another brand: +1; \
account age \
under {NEW_ACCOUNT_DAYS} days: +1; under {FEW_SALES} sales: +1; rating under {LOW_RATING:.1f}: +1; \
established (age >= {ESTABLISHED_DAYS} days, \
rating >= {ESTABLISHED_RATING:.1f}, sales >= {ESTABLISHED_SALES}, no counterfeit takedown): -1.
   {REMOVE_AT} or more points: counterfeit.
5. escalate (request what would settle it): the recall case of rule 2 -> recall_remedy_notice; \
a category with policy "certificate_required" unless the brand is registered and the seller is \
authorized or established -> safety_certificate; {REVIEW_AT}-{REMOVE_AT - 1} points -> \
authorisation_letter when the \
brand is gated and the seller not authorized, else invoice.
6. ok: everything else (small brands outside the registry, registered look-alike names, \
compatible accessories, art or prop replicas, genuine sales)."""

_COPY_RE = re.compile(
    r"\b(?:inspired by|dupe of|1:1 copy of|copy of|replica of|mirror copy of|knock-?off of)\s+"
    r"(?:the\s+|a\s+|an\s+)?([^.,;:!?()\n|]+)",
    re.IGNORECASE,
)
# fmt: off
_STOP = {
    "at", "for", "with", "in", "and", "but", "from", "quality", "design", "style", "look", "looks",
    "same", "made", "sold", "original", "-", "—",
}
# fmt: on
_CONDITION_RE = re.compile(
    r"(?<!never )(?<!not )\b(open[- ]box|refurbished|used|pre-owned|ex-display|clearance)\b",
    re.IGNORECASE,
)


def copy_mentions(text: str) -> list[str]:
    """Names the listing presents the item as a copy of."""
    return copied_names(_COPY_RE, _STOP, text)


def stated_condition(text: str) -> bool:
    """Whether the listing states one of the conditions of rule 4."""
    return _CONDITION_RE.search(text) is not None


@dataclass
class Evidence:
    """What the analyst found (every field read from a tool view or the listing's words)."""

    category_prohibited: bool = False
    restricted: bool = False
    recall_affected: str | None = None
    recall_unstated: str | None = None
    imitates: str | None = None
    copy_of: str | None = None
    brand: str | None = None  # exact registered brand
    gated: bool = False
    authorised: bool = False
    price_ratio: float | None = None
    condition: bool = False
    similarity: float = 0.0  # best similarity to a registered brand when not exact
    seller: dict[str, Any] = field(default_factory=dict)


def price_points(r: float | None) -> int:
    """Rule 4's price points (:data:`PRICE_BANDS`)."""
    if r is None:
        return 0
    for bound, pts in PRICE_BANDS:
        if r >= bound:
            return pts
    return PRICE_FLOOR_POINTS


def established(seller: Mapping[str, Any]) -> bool:
    """Age, rating and sales at least :data:`ESTABLISHED_DAYS`, :data:`ESTABLISHED_RATING`,
    :data:`ESTABLISHED_SALES`, and no counterfeit takedown."""
    fakes = [t for t in seller.get("takedowns") or () if t.get("reason") == "counterfeit"]
    return (
        not fakes
        and seller.get("account_age_days", 0) >= ESTABLISHED_DAYS
        and seller.get("rating", 0) >= ESTABLISHED_RATING
        and seller.get("sales", 0) >= ESTABLISHED_SALES
    )


def points(e: Evidence) -> dict[str, int]:
    """Rule 4's points, by reason (only the non-zero ones)."""
    out: dict[str, int] = {}
    pp = price_points(e.price_ratio) if e.brand else 0
    if pp:
        out["price"] = pp
        if e.condition:
            out["condition"] = -1
    if not e.brand and NEAR_NAME <= e.similarity < IMITATION:
        out["near_name"] = 2
    if e.brand and e.gated and not e.authorised:
        out["gated_unauthorised"] = 3
    s = e.seller
    if e.brand and e.authorised:
        out["authorised"] = -3
    fakes = [t for t in s.get("takedowns") or () if t.get("reason") == "counterfeit"]
    own = [t for t in fakes if e.brand and t.get("brand") == e.brand]
    if own:
        out["takedown_this_brand"] = 4 if max(t.get("year", 0) for t in own) >= RECENT_YEAR else 2
    if any(t.get("brand") != e.brand for t in fakes):
        out["takedown_other_brand"] = 1
    if s.get("account_age_days", 10**6) < NEW_ACCOUNT_DAYS:
        out["new_account"] = 1
    if s.get("sales", 10**6) < FEW_SALES:
        out["few_sales"] = 1
    if s.get("rating", 5.0) < LOW_RATING:
        out["low_rating"] = 1
    if s and established(s):
        out["established"] = -1
    return out


def decide(e: Evidence) -> tuple[str, str | None, str]:
    """``(decision, request, reason)`` of the written rules for ``e``."""
    if e.category_prohibited:
        return "prohibited", None, "the category is prohibited"
    if e.recall_affected:
        return "prohibited", None, f"recalled model and affected batch ({e.recall_affected})"
    if e.imitates:
        return "counterfeit", None, f"brand text imitates {e.imitates}"
    if e.copy_of:
        return "counterfeit", None, f"presented as a copy of {e.copy_of}"
    pts = points(e)
    total = sum(pts.values())
    if total >= REMOVE_AT:
        return "counterfeit", None, f"{total} risk points"
    if e.recall_unstated:
        return (
            "escalate",
            "recall_remedy_notice",
            f"recalled model {e.recall_unstated}, batch not stated",
        )
    if e.restricted and not (e.brand and (e.authorised or established(e.seller))):
        return (
            "escalate",
            "safety_certificate",
            "restricted category, seller not authorised or established",
        )
    if total >= REVIEW_AT:
        req = "authorisation_letter" if e.brand and e.gated and not e.authorised else "invoice"
        return "escalate", req, f"{total} risk points"
    return "ok", None, f"{total} risk points"


def assess(
    listing: Mapping[str, Any],
    schema: Mapping[str, Any] | None,
    brand: Mapping[str, Any] | None,
    seller: Mapping[str, Any] | None,
    mentions: Mapping[str, Mapping[str, Any] | None],
) -> Evidence:
    """Read the evidence from the listing and the tools' answers.

    Args:
        listing: ``title, description, brand, seller, price, specifics``.
        schema: ``get_attribute_schema`` of the item's category.
        brand: ``lookup_brand(brand text, category_id)`` (None without a brand text).
        seller: ``get_seller`` of the listing's seller.
        mentions: ``lookup_brand`` of every name of :func:`copy_mentions`.
    """
    text = listing_text(listing)
    e = Evidence(seller=dict(seller or {}))
    policy = (schema or {}).get("policy")
    e.category_prohibited = policy == "prohibited"
    e.restricted = policy == "certificate_required"
    exact = (brand or {}).get("exact")
    if exact:
        models, batches = stated_models(text), stated_batches(text)
        for r in exact.get("recalls") or ():
            if r["model_number"] not in models:
                continue
            if not batches:
                e.recall_unstated = e.recall_unstated or r["recall_id"]
            elif batches & set(r["batches"]):
                e.recall_affected = r["recall_id"]
                break
    if brand and not (exact and exact.get("registered")):
        sims = [s.get("similarity", 0.0) for s in brand.get("similar") or () if s.get("registered")]
        e.similarity = max(sims, default=0.0)
        if e.similarity >= IMITATION:
            e.imitates = next(
                s["name"]
                for s in brand["similar"]
                if s.get("registered") and s.get("similarity", 0) >= IMITATION
            )
    for name in copy_mentions(text):
        found = (mentions.get(name) or {}).get("exact")
        if found and found.get("registered"):
            e.copy_of = found["name"]
            break
    if exact and exact.get("registered"):
        e.brand = exact["name"]
        e.gated = bool(exact.get("protected"))
        e.authorised = listing.get("seller") in (exact.get("authorized_sellers") or ())
        msrp = exact.get("msrp")
        if msrp and msrp.get("low"):
            e.price_ratio = float(listing.get("price") or 0.0) / float(msrp["low"])
        e.condition = stated_condition(text)
    return e

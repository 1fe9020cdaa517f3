"""The store's rules of catalog v1, as code: what the evidence is and how it decides a verdict.

These are the marketplace's rules, not an agent: "policy" names the agents that follow them
(the baselines, :mod:`envs.catalog.v1.careful`).

One function, :func:`decide`, turns :class:`Evidence` into a verdict. :func:`assess` reads the
evidence from what the tools return (the brand registry view, the seller view, the category
schema) and the listing's own words. The case generator plants every listing through these same
functions, so a label is always what the rules say about the visible evidence, and the careful
reference policy (:mod:`envs.catalog.v1.careful`) reaches it through the tools alone.

The rules, in the words of the system prompt (:data:`RULES_TEXT`):

* prohibited: the item's category is prohibited (the schema's ``policy``), or the item is the
  model of a recall notice of its brand and its batch is one the notice lists (or no batch is
  stated);
* counterfeit: the brand text imitates a registered brand it is not (look-alike letters, spacing,
  punctuation, misspelling); the listing presents the item as a copy of a registered brand
  ("inspired by", "dupe of", "1:1 copy of", "replica of" <registered brand>); a gated brand
  listed by a seller that is not authorized for it; a seller with a past counterfeit takedown for
  this brand; a registered brand priced at a fraction of its MSRP that no genuine sale reaches; or
  a discount well under MSRP that is not explained by a stated condition (clearance,
  refurbished, used, open box) from a seller in good standing;
* ok: everything else. Brands outside the registry, look-alike names that are themselves
  registered, resellers of non-gated brands at normal prices, accessories compatible with a
  brand, art and prop replicas, other models or batches of a recalled product.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.catalog.common.text import (
    copied_names,
    drop_possessives,
    names_value,
    stated_batches,
    stated_models,
)

__all__ = [
    "DEEP_DISCOUNT",
    "DISCOUNT",
    "Evidence",
    "GOOD_STANDING_AGE_DAYS",
    "GOOD_STANDING_RATING",
    "IMITATION_SIMILARITY",
    "RULES_TEXT",
    "RULES_TEXT_COMPACT",
    "assess",
    "copy_mentions",
    "decide",
    "extract_attributes",
    "good_standing",
    "stated_batches",
    "stated_condition",
    "stated_models",
]

#: Price under this share of the brand's MSRP low end is a discount that needs an explanation.
DISCOUNT = 0.75
#: Price under this share of the brand's MSRP low end: no genuine sale goes that low.
DEEP_DISCOUNT = 0.30
#: Similarity (0-100, lookup_brand) at which a non-registered brand text imitates a registered one.
IMITATION_SIMILARITY = 85.0
#: A seller in good standing: authorized for the brand, or this old, this well rated and never
#: taken down for counterfeits.
GOOD_STANDING_AGE_DAYS = 365
GOOD_STANDING_RATING = 4.5

RULES_TEXT = """\
   - "prohibited": the item's category is prohibited by store policy (get_attribute_schema shows \
the policy; the item's own name may not sound like it), or the item is a recalled model of its \
brand (lookup_brand lists recall notices: model number and affected batches) and its batch is \
one of the affected ones or is not stated. Other models and other batches are not recalled.
   - "counterfeit": the brand text imitates a registered brand without being one (look-alike \
letters from other scripts, extra spaces or punctuation, misspellings); the listing presents the \
item as a copy of a registered brand ("inspired by", "dupe of", "1:1 copy of", "replica of" that \
brand); a gated brand (protected) listed by a seller not on its authorized list; a seller with a \
past counterfeit takedown for this brand (get_seller); a registered brand priced at a small \
fraction of its MSRP; or a clear discount under the brand's MSRP range for this category that is \
not explained by a stated condition (clearance, refurbished, used, open box) from a seller in \
good standing (authorized for the brand, or an established, well-rated account with no \
counterfeit takedowns).
   - "ok": everything else. Most listings are fine: brands that are not in the registry (small \
makers), registered brands whose names resemble another registered brand, resellers of brands \
that are not gated, genuine clearance and second-hand sales, accessories compatible with a \
brand, art and prop replicas, other models or batches of a recalled product. A seller's name \
says nothing; its record does."""

#: The same rules in brief, for ``prompt_style="compact"``: every rule of :data:`RULES_TEXT` is
#: kept, since :func:`decide` labels the cases by all of them.
RULES_TEXT_COMPACT = """\
- prohibited: the schema's policy prohibits the category, or the item is a recalled model of its \
brand with an affected or unstated batch.
- counterfeit: the brand text imitates a registered brand it is not (look-alike letters, spaces, \
punctuation, misspellings); the item is presented as a copy of a registered brand ("inspired by", \
"dupe of", "replica of"); a gated brand from a seller not authorized for it; the seller has a \
counterfeit takedown for this brand; a registered brand at a small fraction of its MSRP; or a \
price clearly under the category's MSRP range unless a condition is stated (clearance, \
refurbished, used, open box) and the seller is in good standing (authorized, or an old, \
well-rated account without counterfeit takedowns).
- ok: everything else (unregistered brands, compatible accessories, art or prop replicas, other \
models or batches of a recall). Seller names mean nothing; records do."""

_COPY_RE = re.compile(
    r"\b(?:inspired by|dupe of|1:1 copy of|copy of|replica of|mirror copy of|knock-?off of|"
    r"same design as|looks exactly like)\s+(?:the\s+|a\s+|an\s+)?([^.,;:!?()\n]+)",
    re.IGNORECASE,
)
_CONDITION_RE = re.compile(
    r"(?<!never )(?<!un)\b(clearance|refurbished|renewed|pre-owned|used|open[- ]box|ex-display|"
    r"second-hand|returned unit|floor model)\b",
    re.IGNORECASE,
)


def copy_mentions(text: str) -> list[str]:
    """Names the listing presents the item as a copy of (``"inspired by Norvale."`` ->
    ``["Norvale"]``)."""
    return copied_names(_COPY_RE, _STOP, text)


# fmt: off
_STOP = {
    "at", "for", "with", "in", "and", "but", "from", "quality", "design", "style", "look", "looks",
    "same", "nobody", "made", "sold", "original", "-", "—",
}
# fmt: on


def stated_condition(text: str) -> bool:
    """Whether the listing states a condition that explains a discount."""
    return _CONDITION_RE.search(text) is not None


def good_standing(seller: Mapping[str, Any] | None, brand: str | None) -> bool:
    """Authorized for ``brand``, or old and well rated with no counterfeit takedown."""
    if not seller:
        return False
    if brand and brand in (seller.get("authorized_brands") or ()):
        return True
    fakes = [t for t in seller.get("takedowns") or () if t.get("reason") == "counterfeit"]
    return (
        not fakes
        and seller.get("account_age_days", 0) >= GOOD_STANDING_AGE_DAYS
        and seller.get("rating", 0) >= GOOD_STANDING_RATING
    )


@dataclass
class Evidence:
    """What the analyst found; :func:`decide` turns it into a verdict.

    Attributes:
        category_prohibited: The item's category has policy ``prohibited``.
        recall: The recall notice id the item falls under, or None.
        imitates: The registered brand the brand text imitates, or None.
        copy_of: The registered brand the listing presents the item as a copy of, or None.
        brand: The registered brand the listing is for (exact registry match), or None.
        gated: That brand is protected (only authorized sellers may list it).
        seller_authorized: The seller is authorized for that brand.
        takedown: The seller was taken down for counterfeits of that brand before.
        standing: The seller is in good standing for that brand (:func:`good_standing`).
        price_ratio: Price / the brand's MSRP low end for the category; None without a range.
        condition: The listing states a condition that explains a discount.
    """

    category_prohibited: bool = False
    recall: str | None = None
    imitates: str | None = None
    copy_of: str | None = None
    brand: str | None = None
    gated: bool = False
    seller_authorized: bool = False
    takedown: bool = False
    standing: bool = False
    price_ratio: float | None = None
    condition: bool = False
    notes: list[str] = field(default_factory=list)


def decide(e: Evidence) -> tuple[str, str]:
    """The verdict the rules give ``e``, and the reason: ``(verdict, reason)``."""
    if e.category_prohibited:
        return "prohibited", "the category is prohibited by store policy"
    if e.recall:
        return "prohibited", f"recalled model and batch (notice {e.recall})"
    if e.imitates:
        return "counterfeit", f"brand text imitates the registered brand {e.imitates!r}"
    if e.copy_of:
        return "counterfeit", f"presented as a copy of the registered brand {e.copy_of!r}"
    if e.brand is not None:
        if e.takedown:
            return "counterfeit", f"seller was taken down for counterfeit {e.brand} before"
        if e.gated and not e.seller_authorized:
            return "counterfeit", f"{e.brand} is gated and the seller is not authorized"
        if e.price_ratio is not None:
            if e.price_ratio < DEEP_DISCOUNT:
                return (
                    "counterfeit",
                    f"price {e.price_ratio:.0%} of MSRP: no genuine sale goes that low",
                )
            if e.price_ratio < DISCOUNT and not (e.condition and e.standing):
                why = "no condition stated" if not e.condition else "seller not in good standing"
                return "counterfeit", f"price {e.price_ratio:.0%} of MSRP, {why}"
    return "ok", "no policy or counterfeit signal"


def assess(
    listing: Mapping[str, Any],
    schema: Mapping[str, Any] | None,
    brand: Mapping[str, Any] | None,
    seller: Mapping[str, Any] | None,
    mentions: Mapping[str, Mapping[str, Any] | None],
) -> Evidence:
    """Read the evidence from the listing and the tools' answers.

    Args:
        listing: ``title, description, brand, seller, price, specifics`` (display name -> value).
        schema: ``get_attribute_schema`` of the item's category.
        brand: ``lookup_brand`` of the listing's brand text, with the item's ``category_id``.
        seller: ``get_seller`` of the listing's seller (None when unknown).
        mentions: ``lookup_brand`` of every name in :func:`copy_mentions` of the text.
    """
    specifics = listing.get("specifics") or {}
    text = " ".join(
        [
            str(listing.get("title", "")),
            str(listing.get("description", "")),
            *(f"{k}: {v}." for k, v in specifics.items()),
        ]
    )
    e = Evidence()
    e.category_prohibited = bool(schema and schema.get("policy") == "prohibited")
    exact = (brand or {}).get("exact")
    if exact:
        models, batches = stated_models(text), stated_batches(text)
        for r in exact.get("recalls") or ():
            if r["model_number"] in models and (not batches or batches & set(r["batches"])):
                e.recall = r["recall_id"]
                break
    elif brand:
        for sim in brand.get("similar") or ():
            if sim.get("registered") and sim.get("similarity", 0) >= IMITATION_SIMILARITY:
                e.imitates = sim["name"]
                break
    for name in copy_mentions(text):
        found = (mentions.get(name) or {}).get("exact")
        if found and found.get("registered"):
            e.copy_of = found["name"]
            break
    if exact and exact.get("registered"):
        e.brand = exact["name"]
        e.gated = bool(exact.get("protected"))
        e.seller_authorized = listing.get("seller") in (exact.get("authorized_sellers") or ())
        e.takedown = any(
            t.get("brand") == e.brand and t.get("reason") == "counterfeit"
            for t in (seller or {}).get("takedowns") or ()
        )
        e.standing = good_standing(seller, e.brand)
        ranges = exact.get("msrp") or []
        if ranges and ranges[0].get("low"):
            e.price_ratio = float(listing.get("price") or 0.0) / float(ranges[0]["low"])
        e.condition = stated_condition(text)
    return e


def extract_attributes(listing: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, str]:
    """The required attributes whose value the listing states, spelled as allowed values.

    In order: the item specifics under the attribute's name, a ``"<Name>: <value>"`` label in
    the text, then allowed values written in the text as whole words (only when exactly one
    of the attribute's values appears; the longest wins when one contains another).
    """
    specifics = {str(k).lower(): str(v) for k, v in (listing.get("specifics") or {}).items()}
    text = (
        " "
        + drop_possessives(f"{listing.get('title', '')} . {listing.get('description', '')}")
        + " "
    )
    found: dict[str, str] = {}
    for attr in schema.get("attributes") or ():
        if not attr.get("required"):
            continue
        values = {v.lower(): v for v in attr["values"]}
        stated = specifics.get(attr["name"].lower())
        if stated is not None and stated.lower() in values:
            found[attr["handle"]] = values[stated.lower()]
            continue
        labelled = re.search(re.escape(drop_possessives(attr["name"])) + r": ([^.;]+)", text)
        if labelled:
            got = labelled.group(1).strip()
            match = next((v for v in values if drop_possessives(v) == got), None)
            if match is not None:
                found[attr["handle"]] = values[match]
                continue
        hits = [v for v in values if names_value(v, text)]
        hits = [
            v
            for v in hits
            if not any(v != o and drop_possessives(v) in drop_possessives(o) for o in hits)
        ]
        if len(hits) == 1:
            found[attr["handle"]] = values[hits[0]]
    return found


def names_in(seq: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ``name`` of each mapping."""
    return [str(x.get("name")) for x in seq]

"""Catalogue content of catalog v2 that a domain expert would accept: prices, conditions,
hazards, restricted and prohibited categories, item types as sellers write them.

Everything here is a written rule over a category's own name and path, so it applies to the
generated taxonomy and to a Shopify checkout alike:

* :func:`price_prior`: the (low, high) list price in USD of a mid-tier product of a category,
  from its vertical, refined by words of its name (a phone case costs tens, a laptop hundreds
  to thousands). :func:`written_range` widens it by the brand tiers (budget 0.5x to luxury 3x):
  every MSRP the registry shows lies inside it, and every listing price inside
  :func:`price_bounds`.
* :func:`conditions_apply`: whether an item can be used, refurbished or opened (durable goods),
  or not (food, cosmetics, medicine, software keys, other consumables).
* :func:`hazard_for`: a recall hazard that fits the product type.
* :func:`restricted`: categories that need a safety certificate from sellers who are not
  established or authorised (child car seats, cribs, helmets, batteries, heaters ...).
* :func:`item_type_variants`: what sellers write as "Item type" (singular, lower case, with the
  brand and model, reordered), resolvable back to the leaf by :func:`item_key`.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache

__all__ = [
    "CONDITIONS",
    "TIERS",
    "brand_tier",
    "conditions_apply",
    "hazard_for",
    "item_key",
    "item_type_variants",
    "price_bounds",
    "price_prior",
    "restricted",
    "singular",
    "written_range",
]

#: Typical list price (USD) of a mid-tier product per vertical. Reasoning, per line: what a
#: typical product of that vertical costs new at a mid-market retailer (2024-2025 US prices).
VERTICAL_PRIOR: dict[str, tuple[float, float]] = {
    "aa": (15, 180),  # apparel: a T-shirt 15-30, jeans 40-90, a coat 120-180
    "jw": (25, 600),  # fashion jewellery 25-80, watches 100-600
    "lb": (20, 250),  # wallets 20-60, backpacks 40-120, suitcases 120-250
    "hb": (6, 60),  # shampoo, make-up, vitamins: single-digit to tens
    "el": (20, 900),  # cables and speakers tens, phones and laptops hundreds
    "co": (40, 1200),  # tripods 40-150, cameras and lenses 400-1,200
    "hg": (10, 250),  # decor 10-60, lamps and rugs 40-250
    "ks": (8, 150),  # utensils 8-30, cookware sets 80-150
    "fr": (80, 1200),  # chairs 80-250, sofas and beds 500-1,200
    "ha": (8, 300),  # fasteners under 20, power tools 80-300
    "sg": (15, 400),  # balls and gloves 15-60, bikes and treadmills into hundreds
    "tg": (8, 80),  # toys and board games 8-80
    "bt": (10, 300),  # baby clothes 10-30, strollers and car seats 150-300
    "ap": (6, 80),  # pet food and toys 6-40, beds and carriers to 80
    "fb": (3, 30),  # groceries and drinks: a few dollars to about 30
    "ma": (10, 80),
    "bi": (30, 1500),  # industrial supplies: consumables tens, equipment over a thousand
    "os": (3, 60),  # pens and paper a few dollars, desk organisers tens
    "ae": (8, 200),  # craft supplies under 20, instruments and art into hundreds
    "me": (8, 40),  # books, music, films
    "so": (10, 200),  # software licences and games
    "vp": (15, 400),  # auto parts and accessories
    "rc": (8, 120),
    "pa": (4, 60),  # party supplies and gift wrap
    "gc": (10, 100),  # gift cards
    "bu": (20, 300),  # bundles
    "na": (10, 200),
}
_DEFAULT_PRIOR = (10.0, 200.0)

#: Words of a category's name that set its price prior regardless of vertical (checked in order;
#: the first match wins). Accessories cost tens; big-ticket durables hundreds to thousands.
_NAME_PRIORS: tuple[tuple[re.Pattern[str], tuple[float, float]], ...] = tuple(
    (re.compile(p, re.IGNORECASE), band)
    for p, band in (
        (r"\b(stickers?|decals?|keychains?|charms?|magnets?|bookmarks?|patches?|pins?)\b", (3, 25)),
        (
            r"\b(cases?|covers?|cables?|straps?|adapters?|protectors?|skins?|sleeves?|holders?|mounts?)\b",
            (8, 60),
        ),
        (
            r"\b(laptops?|notebook computers?|televisions?|tvs?|refrigerators?|washers?|dryers?)\b",
            (300, 2500),
        ),
        (
            r"\b(conveyors?|compressors?|forklifts?|machines?|machinery|equipment|lathes?|welders?)\b",
            (200, 5000),
        ),
        (
            r"\b(sofas?|couches?|sectionals?|mattress(es)?|treadmills?|e-?bikes?|generators?)\b",
            (300, 2500),
        ),
        (r"\b(camera bodies|mirrorless|dslr|lenses)\b", (300, 2000)),
        (r"\b(car seats?|strollers?|cribs?)\b", (120, 500)),
        (r"\b(helmets?)\b", (40, 250)),
        (r"\b(chargers?|power banks?|batter(y|ies))\b", (15, 120)),
        (r"\b(socks?|hosiery|tights)\b", (5, 30)),
        (r"\b(watches?)\b", (60, 800)),
        (r"\b(spices?|candy|candies|gum|tea|snacks?)\b", (2, 20)),
    )
)

#: Brand tiers: multiplier of the category prior, and share of registry brands in the tier.
TIERS: dict[str, tuple[float, float]] = {
    "budget": (0.5, 0.25),
    "mid": (1.0, 0.45),
    "premium": (1.8, 0.2),
    "luxury": (3.0, 0.1),
}

#: Conditions a durable item may be listed in (the store's condition field values).
CONDITIONS: tuple[str, ...] = (
    "open box",
    "refurbished",
    "used",
    "pre-owned",
    "ex-display",
    "clearance",
)

_CONSUMABLE = re.compile(
    r"\b(food|foods|snacks?|treats?|vitamins?|supplements?|shampoos?|conditioners?|soaps?|lotions?|"
    r"creams?|cosmetics?|make-?up|lipsticks?|mascaras?|perfumes?|fragrances?|candy|candies|drinks?|"
    r"beverages?|teas?|coffees?|spices?|sauces?|condiments?|medicines?|medications?|drugs?|wipes|"
    r"diapers?|nappies|litter|seeds?|fertili[sz]ers?|baking|groceries|oils?|syrups?|juices?|"
    r"wines?|beers?|spirits|tobacco|cigarettes?|gift cards?|software|apps?|subscriptions?|"
    r"condoms?|lubricants?|deodorants?|toothpastes?|sunscreens?|nail polish(es)?|dyes?|"
    r"glues?|adhesives?|paints?|inks?|toners?|fuels?|feeds?|eggs?|meats?|cheeses?|breads?|"
    r"sweeteners?|flour|rice|pasta|cereals?|chocolates?|cookies|chips)\b",
    re.IGNORECASE,
)
_CONSUMABLE_VERTICALS = {"fb", "so", "gc"}
_DURABLE_IN_HB = re.compile(
    r"\b(dryers?|straighteners?|shavers?|trimmers?|scales?|massagers?|"
    r"monitors?|brushes|curling|clippers?|mirrors?)\b",
    re.IGNORECASE,
)


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=65536)
def price_prior(vertical: str, full_name: str) -> tuple[float, float]:
    """The (low, high) list price of a mid-tier product of the category ``full_name``.

    The band of its product words (else its vertical's) is narrowed to the category: a point
    of the band picked by the category's name (stable), and a factor of 1.5 either side of it, so
    two categories of one vertical differ in price as real product types do.
    """
    leaf = full_name.rsplit(" > ", 1)[-1]
    band = next(
        (b for pattern, b in _NAME_PRIORS if pattern.search(leaf)),
        VERTICAL_PRIOR.get(vertical, _DEFAULT_PRIOR),
    )
    lo, hi = float(band[0]), float(band[1])
    u = 0.1 + 0.8 * (_h("prior", full_name) % 1000) / 1000
    center = lo * (hi / lo) ** u
    return (round(max(lo, center / 1.5), 2), round(min(hi, center * 1.5), 2))


def written_range(vertical: str, full_name: str) -> tuple[float, float]:
    """Every MSRP of the category lies in ``[prior low x 0.5, prior high x 3]`` (the tiers)."""
    lo, hi = price_prior(vertical, full_name)
    return (round(lo * TIERS["budget"][0], 2), round(hi * TIERS["luxury"][0], 2))


def price_bounds(vertical: str, full_name: str) -> tuple[float, float]:
    """Every listing price of the category lies in ``[written low x 0.08, written high x 1.3]``."""
    lo, hi = written_range(vertical, full_name)
    return (round(lo * 0.08, 2), round(hi * 1.3, 2))


def brand_tier(brand: str) -> str:
    """A registry brand's tier (stable per name)."""
    x = (_h("tier", brand) % 1000) / 1000
    acc = 0.0
    for tier, (_, share) in TIERS.items():
        acc += share
        if x < acc:
            return tier
    return "mid"


def msrp_for(brand: str, vertical: str, full_name: str, leaf: str) -> tuple[float, float]:
    """The brand's MSRP range for a category: the prior scaled by its tier, a little spread."""
    lo, hi = price_prior(vertical, full_name)
    mult = TIERS[brand_tier(brand)][0]
    spread = 0.85 + (_h("msrp", brand, leaf) % 300) / 1000  # 0.85-1.15
    low = _retail(lo * mult * spread)
    high = _retail(max(hi * mult * spread, low * 1.4))
    wlo, whi = written_range(vertical, full_name)
    return (max(low, wlo), min(high, whi))


def _retail(x: float) -> float:
    """A retail-looking price: 24.99, 149.99, 1290.0."""
    if x < 1000:
        return round(max(1, round(x)) - 0.01, 2)
    return float(round(x, -1))


def conditions_apply(vertical: str, full_name: str) -> bool:
    """Whether an item of this category can be sold used, refurbished or open box."""
    if vertical in _CONSUMABLE_VERTICALS:
        return False
    if vertical == "hb" and not _DURABLE_IN_HB.search(full_name):
        return False
    head = " ".join(
        full_name.rsplit(" > ", 1)[-1].split()[-2:]
    )  # the product noun ("Oil Drain Plugs": "Drain Plugs")
    return not _CONSUMABLE.search(head)


#: Recall hazards by product type: ``(name pattern, vertical set, hazards)``, first match wins.
_HAZARDS: tuple[tuple[re.Pattern[str] | None, frozenset[str], tuple[str, ...]], ...] = (
    (
        re.compile(r"car seats?|cribs?|strollers?|high chairs?|bassinets?|baby gates?", re.I),
        frozenset(),
        (
            "structural failure: the frame can crack under load",
            "entrapment: gaps can trap a child's head",
            "fall hazard: the restraint buckle can release",
        ),
    ),
    (re.compile(r"helmets?", re.I), frozenset(), ("impact protection below the safety standard",)),
    (
        re.compile(r"chargers?|power banks?|batter(y|ies)|heaters?|adapters?|lamps?|lights?", re.I),
        frozenset(),
        (
            "fire hazard: the unit can overheat",
            "electric shock: exposed contacts",
            "burn hazard: the battery can swell and overheat",
        ),
    ),
    (
        None,
        frozenset({"tg"}),
        (
            "choking hazard: small parts can detach",
            "ingestion hazard: small magnets can come loose",
            "excess lead in surface paint",
        ),
    ),
    (
        None,
        frozenset({"bt"}),
        (
            "choking hazard: snaps can detach",
            "suffocation risk",
            "structural failure: a seam can tear",
        ),
    ),
    (
        None,
        frozenset({"fb"}),
        (
            "undeclared allergen: milk",
            "undeclared allergen: peanuts",
            "possible salmonella contamination",
            "foreign matter: metal fragments",
        ),
    ),
    (
        None,
        frozenset({"hb", "ap"}),
        ("microbial contamination", "undeclared allergen", "incorrect dosage on the label"),
    ),
    (
        None,
        frozenset({"el", "co", "ks", "ha", "bi"}),
        (
            "fire hazard: the unit can overheat",
            "electric shock: faulty insulation",
            "laceration hazard: the blade guard can detach",
        ),
    ),
    (
        None,
        frozenset({"fr", "hg"}),
        (
            "tip-over hazard: the unit can fall on a child",
            "structural failure: a leg can break",
            "fire hazard: faulty wiring",
        ),
    ),
    (
        None,
        frozenset({"vp"}),
        (
            "loss of braking: a part can fracture",
            "crash hazard: the part can detach",
            "fire hazard: a fuel line can leak",
        ),
    ),
    (
        None,
        frozenset({"sg"}),
        ("fall hazard: the frame can break", "impact hazard: a part can snap back"),
    ),
    (
        None,
        frozenset({"aa", "jw", "lb"}),
        (
            "strangulation hazard: drawstrings at the neck",
            "excess cadmium in the metal",
            "burn hazard: fails flammability standard",
        ),
    ),
)
_GENERIC_HAZARDS = ("injury hazard: a part can break in use", "laceration hazard: sharp edges")


def hazard_for(vertical: str, full_name: str, key: str) -> str:
    """A recall hazard that fits the category (stable per ``key``)."""
    for pattern, verticals, hazards in _HAZARDS:
        if (pattern is not None and pattern.search(full_name)) or vertical in verticals:
            return hazards[_h("hazard", key) % len(hazards)]
    return _GENERIC_HAZARDS[_h("hazard", key) % len(_GENERIC_HAZARDS)]


#: Categories (matched on their full path) where the store asks sellers that are neither
#: authorised nor established for a safety certificate: products whose failure injures.
# fmt: off
RESTRICTED_PATTERNS: tuple[str, ...] = (
    r"\bcar seats?\b", r"\bcribs?\b", r"\bstrollers?\b", r"\bhigh chairs?\b", r"\bbaby gates?\b",
    r"\bhelmets?\b", r"\bchargers?\b", r"\bpower banks?\b", r"\bbatter(y|ies)\b",
    r"\bspace heaters?\b", r"\bheaters?\b", r"\belectric scooters?\b", r"\bhoverboards?\b",
    r"\be-?bikes?\b", r"\bsmoke (detectors?|alarms?)\b", r"\bpressure cookers?\b",
)
# fmt: on
_RESTRICTED = re.compile(
    "(?:" + "|".join(RESTRICTED_PATTERNS) + r")\s*$", re.IGNORECASE
)  # the final noun


def restricted(full_name: str, policy: str) -> bool:
    """Whether the category needs a safety certificate (prohibited categories never do)."""
    head = " ".join(
        full_name.rsplit(" > ", 1)[-1].split()[-2:]
    )  # the product noun, not "Battery-Powered X"
    toy = re.search(
        r"\b(doll|toy|toys|pet|play|costume)\b", full_name.rsplit(" > ", 1)[-1], re.IGNORECASE
    )
    return (
        policy != "prohibited"
        and _RESTRICTED.search(head) is not None
        and "powered" not in head.lower()
        and toy is None
    )


# -- item types as sellers write them ----------------------------------------------------------
_SINGULAR = (
    (re.compile(r"(?i)ies$"), "y"),
    (re.compile(r"(?i)(ches|shes|xes|sses|zzes)$"), None),
    (re.compile(r"(?i)(?<![su])s$"), ""),
)
_KEY_STOP = {"and", "&", "for", "the", "a", "an", "of", "with", "set", "pcs", "pc"}


def singular(word: str) -> str:
    """``"Boots"`` -> ``"Boot"``, ``"Batteries"`` -> ``"Battery"``, ``"Dresses"`` -> ``"Dress"``."""
    if len(word) <= 3:
        return word
    for pattern, rep in _SINGULAR:
        if pattern.search(word):
            if rep is None:
                return word[:-2]
            return pattern.sub(rep, word, count=1)
    return word


def item_key(text: str) -> tuple[str, ...]:
    """Order-free key of an item name: lower-case singular words without possessives and filler
    (``"Women's Ankle Boots"`` and ``"ankle boot, women"`` share one)."""
    words = re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)*", re.sub(r"'s?\b", "", text.lower()))
    return tuple(sorted(singular(w) for w in words if w not in _KEY_STOP))


def item_type_variants(name: str, brand: str | None, model: str | None) -> list[tuple[str, str]]:
    """How sellers write the item type of a leaf called ``name``: ``[(style, text)]``.

    Every variant has the leaf's :func:`item_key` once the brand's words and the model number
    are taken out (the written rules say so), so a reader can resolve it.
    """
    words = name.split()
    sing = " ".join([*words[:-1], singular(words[-1])]) if words else name
    out = [("exact", name), ("singular", sing), ("lower", sing.lower())]
    if len(words) >= 2:
        head, rest = words[-1], words[:-1]
        out.append(("reordered", f"{singular(head).lower()}, {' '.join(rest).lower()}"))
    if brand:
        out.append(("brand", f"{brand} {sing.lower() if len(sing) > 12 else sing}"))
        if model:
            out.append(("brand_model", f"{brand} {model} {sing}"))
    if model:
        out.append(("model", f"{sing} {model}"))
    return out

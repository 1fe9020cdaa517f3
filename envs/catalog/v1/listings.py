"""Planted listings of catalog v1: signals that overlap, sellers as evidence, a held-out world.

Every case is built from ``(world, part, rng, kind)``: ``train`` cases from the world's ``train``
part, ``dev`` and ``test`` cases from the held-out ``eval`` part (:mod:`envs.catalog.v1.world`).
A kind says what the generator tries to plant; the label is always what the store's rules
(:func:`envs.catalog.v1.rules.decide`) says about the listing's visible evidence, read through
the same views the tools return. A draw whose evidence does not give the kind's verdict, or
whose required attributes a careful reader would read differently from the truth, is drawn
again, so labels are consistent by construction.

No phrase marks a kind: condition and discount wording, injections, "inspired by", "compatible
with", lot numbers and blunt openers are drawn on every kind, ok listings included; the verdict
lives in the registry, the seller record, the schema's policy and the recall notices.

==============================  ============  ================================================
kind                            verdict       what is planted
==============================  ============  ================================================
``clean``                       ok            registry brand at a normal price, any seller
``longtail``                    ok            a small brand that is not in the registry
``genuine_discount``            ok            35-70% of MSRP, condition stated, good-standing seller
``gated_authorized``            ok            gated brand from an authorized (often young) seller
``lookalike_registered``        ok            a registered brand whose name resembles another
``compatible_accessory``        ok            "compatible with <gated brand>", by another maker
``art_replica``                 ok            art or prop replica sold as such
``recall_other_batch``          ok            recalled brand, other model or unaffected batch
``wrong_category_words``        ok            another category's words in the title
``missing_attributes``          ok            1-2 required attributes not stated anywhere
``counterfeit_discount``        counterfeit   20-60% of MSRP without condition, or from a seller not
                                              in good standing (two weak signals together)
``counterfeit_takedown``        counterfeit   seller taken down for fakes of this brand before
``counterfeit_gated_seller``    counterfeit   gated brand, seller not authorized (may claim it is)
``counterfeit_lookalike``       counterfeit   homoglyphs, spacing, punctuation, misspellings
``counterfeit_copy_claim``      counterfeit   "inspired by / dupe of / 1:1 copy of <brand>"
``prohibited_category``         prohibited    prohibited category, often under another's words
``prohibited_recall``           prohibited    recalled model, affected or unstated batch
==============================  ============  ================================================
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import yaml

from envs.catalog.common.forge import (
    batch_code,
    fmt_price,
    lookalike,
    model_number,
    near_model,
    state_value,
    unaffected_batch,
)
from envs.catalog.common.text import drop_possessives, listing_text, names_value
from envs.catalog.mix import KindMix
from envs.catalog.v1.rules import (
    DEEP_DISCOUNT,
    DISCOUNT,
    assess,
    copy_mentions,
    decide,
    extract_attributes,
    good_standing,
)
from envs.catalog.v1.world import SPLIT_PART, V1World
from twin.errors import ConfigError
from twin.resources import data_path

__all__ = [
    "CYCLE",
    "DEFAULT_MIX",
    "KINDS",
    "KIND_VERDICT",
    "kind_for",
    "make_listing",
    "phrases",
    "validate_mix",
]

KIND_VERDICT: dict[str, str] = {
    "clean": "ok",
    "longtail": "ok",
    "genuine_discount": "ok",
    "gated_authorized": "ok",
    "lookalike_registered": "ok",
    "compatible_accessory": "ok",
    "art_replica": "ok",
    "recall_other_batch": "ok",
    "wrong_category_words": "ok",
    "missing_attributes": "ok",
    "counterfeit_discount": "counterfeit",
    "counterfeit_takedown": "counterfeit",
    "counterfeit_gated_seller": "counterfeit",
    "counterfeit_lookalike": "counterfeit",
    "counterfeit_copy_claim": "counterfeit",
    "prohibited_category": "prohibited",
    "prohibited_recall": "prohibited",
}
KINDS: tuple[str, ...] = tuple(KIND_VERDICT)

#: Default mix: 60% ok (most real listings are fine), 28% counterfeit, 12% prohibited. See the
#: twin's README for why (a constant verdict must lose clearly to careful work).
DEFAULT_MIX: dict[str, float] = {
    "clean": 0.11,
    "longtail": 0.13,
    "genuine_discount": 0.07,
    "gated_authorized": 0.05,
    "lookalike_registered": 0.04,
    "compatible_accessory": 0.04,
    "art_replica": 0.04,
    "recall_other_batch": 0.05,
    "wrong_category_words": 0.04,
    "missing_attributes": 0.03,
    "counterfeit_discount": 0.07,
    "counterfeit_takedown": 0.06,
    "counterfeit_gated_seller": 0.04,
    "counterfeit_lookalike": 0.06,
    "counterfeit_copy_claim": 0.05,
    "prohibited_category": 0.07,
    "prohibited_recall": 0.05,
}

#: Cases per schedule cycle: each cycle holds every kind of the mix.
CYCLE = 100
_TRIES = 40

# fmt: off
_SMALL_WORDS = {
    "charm", "charms", "keychain", "keychains", "sticker", "stickers", "decal", "decals", "magnet",
    "magnets", "ornament", "ornaments", "figurine", "figurines", "pin", "pins", "patch", "patches",
    "poster", "posters", "plush", "mug", "mugs", "print", "prints", "costume", "costumes",
    "bookmark", "bookmarks", "toppers", "topper",
}
# fmt: on
# fmt: off
_REPLICA_WORDS = {
    "painting", "paintings", "art", "artwork", "print", "prints", "poster", "posters", "prop",
    "props", "collectible", "collectibles", "figurine", "figurines", "sculpture", "sculptures",
    "memorabilia", "reproduction", "reproductions", "replica", "replicas", "model", "models",
    "statue", "statues", "decor",
}
# fmt: on
# fmt: off
_ACCESSORY_WORDS = {
    "case", "cases", "cover", "covers", "charger", "chargers", "cable", "cables", "strap", "straps",
    "band", "bands", "adapter", "adapters", "protector", "protectors", "accessory", "accessories",
    "holder", "holders", "mount", "mounts", "stand", "stands", "sleeve", "sleeves", "skin", "skins",
    "replacement", "parts",
}
# fmt: on


# -- phrases, split by part --------------------------------------------------------------------
@lru_cache(maxsize=1)
def phrases() -> dict[str, Any]:
    """``data/catalog-listings/phrases-v1.yaml``, loaded once."""
    with open(data_path("catalog-listings", "phrases-v1.yaml"), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def _side(text: str) -> str:
    return "eval" if hashlib.sha256(text.encode()).digest()[0] < 86 else "train"  # about 1/3 eval


@lru_cache(maxsize=2)
def part_phrases(part: str) -> dict[str, Any]:
    """The phrase pools a part's listings draw from: each list cut by a hash of its entries."""

    def cut(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: cut(v) for k, v in value.items()}
        if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
            mine = [x for x in value if _side(x) == part or x == ""]
            return mine if [x for x in mine if x] else list(value)
        return value

    return cut(phrases())


# -- the kind schedule -------------------------------------------------------------------------
#: How v1 lays a case mix over a split (envs/catalog/mix.py); its own salt, so no v0 order.
CASE_KINDS = KindMix(KINDS, CYCLE, "kinds-v1")
validate_mix = CASE_KINDS.validate
kind_for = CASE_KINDS.kind_for


# -- what each part samples from ---------------------------------------------------------------
@dataclass
class PartIndex:
    """Pools of one world part, sorted (deterministic)."""

    ok_leaves: tuple[str, ...]
    prohibited_leaves: tuple[str, ...]
    branded: tuple[str, ...]  # ok leaves with a registered brand of the part priced there
    small: tuple[str, ...]
    replica: tuple[str, ...]
    accessory: tuple[str, ...]
    brands_at: dict[str, tuple[str, ...]]  # leaf -> the part's registry brands priced on its path
    gated: tuple[str, ...]
    lookalikes: tuple[str, ...]
    takedowns: dict[str, tuple[str, ...]]  # brand -> sellers taken down for faking it
    recalls: tuple[Any, ...]
    sellers: tuple[str, ...]
    longtail: tuple[str, ...]
    context: dict[str, str] = field(default_factory=dict)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


_PARTS: dict[tuple[int, str], tuple[Any, PartIndex]] = {}


def _department_context(world: V1World) -> dict[str, str]:
    """Path context for leaves whose name other leaves share (Shopify's "Shorts", "Ponchos"):
    the shortest tail of the ancestor path that tells the leaf apart."""
    cats = world.categories
    by_name: dict[str, list[str]] = {}
    for leaf in world.leaves:
        by_name.setdefault(cats[leaf].name.lower(), []).append(leaf)
    context: dict[str, str] = {}
    for leaves in by_name.values():
        if len(leaves) < 2:
            continue
        paths = {x: cats[x].full_name.split(" > ")[:-1] for x in leaves}
        for x in leaves:
            for k in range(1, len(paths[x]) + 1):
                tail = paths[x][-k:]
                if all(paths[y][-k:] != tail for y in leaves if y != x):
                    context[x] = " > ".join(tail)
                    break
            else:
                context[x] = " > ".join(paths[x])
    return context


def part_index(world: V1World, part: str) -> PartIndex:
    """The :class:`PartIndex` of ``part``, built once per world."""
    held = _PARTS.get((id(world), part))
    if held is not None and held[0] is world:
        return held[1]
    by_node: dict[str, list[str]] = {}
    for b in world.brands.values():
        if world.brand_part[b.name] != part:
            continue
        for node in b.msrp:
            by_node.setdefault(node, []).append(b.name)
    cats = world.categories
    ok, prohibited, branded, small, replica, accessory = [], [], [], [], [], []
    brands_at: dict[str, tuple[str, ...]] = {}
    for leaf in world.leaves:
        if world.leaf_part[leaf] != part:
            continue
        cat = cats[leaf]
        if cat.policy == "prohibited":
            prohibited.append(leaf)
            continue
        ok.append(leaf)
        words = _words(cat.name)
        if words & _SMALL_WORDS:
            small.append(leaf)
        if words & _REPLICA_WORDS:
            replica.append(leaf)
        if words & _ACCESSORY_WORDS:
            accessory.append(leaf)
        names: set[str] = set()
        for node in world.ancestors(leaf):
            names.update(by_node.get(node, ()))
        if names:
            brands_at[leaf] = tuple(sorted(names))
            if any(world.brands[n].registered for n in names):
                branded.append(leaf)
    takedowns: dict[str, list[str]] = {}
    for s in world.sellers_by_part[part]:
        for brand, reason, _ in world.seller_records[s].takedowns:
            if reason == "counterfeit":
                takedowns.setdefault(brand, []).append(s)
    context = _department_context(world)
    idx = PartIndex(
        ok_leaves=tuple(ok),
        prohibited_leaves=tuple(prohibited),
        branded=tuple(branded),
        small=tuple(small) or tuple(branded),
        replica=tuple(replica) or tuple(ok),
        accessory=tuple(accessory) or tuple(branded),
        brands_at=brands_at,
        gated=tuple(
            sorted(
                n
                for n, b in world.brands.items()
                if b.protected and b.registered and world.brand_part[n] == part
            )
        ),
        lookalikes=tuple(sorted(n for n in world.lookalike_of if world.brand_part[n] == part)),
        takedowns={k: tuple(v) for k, v in takedowns.items()},
        recalls=tuple(r for r in world.recalls if r.part == part),
        sellers=world.sellers_by_part[part],
        longtail=world.longtail[part],
        context=context,
    )
    if not (idx.ok_leaves and idx.branded and idx.recalls and idx.prohibited_leaves):
        raise ConfigError(f"catalog v1 world part {part!r} cannot host every case kind: {world!r}")
    _PARTS[(id(world), part)] = (world, idx)
    return idx


# -- tool views (what the tools return; the generator reads the same) --------------------------
def brand_view(
    world: V1World, brand: Any, category_id: str | None, short: bool = False
) -> dict[str, Any]:
    """A registry entry as ``lookup_brand`` shows it."""
    view: dict[str, Any] = {
        "name": brand.name,
        "registered": brand.registered,
        "protected": brand.protected,
        "authorized_sellers": list(brand.authorized_sellers),
    }
    if category_id is not None:
        rng = world.msrp(brand.name, category_id)
        view["msrp"] = [{"category_id": category_id, "low": rng[0], "high": rng[1]}] if rng else []
    else:
        view["msrp"] = [
            {"category_id": cid, "category": world.categories[cid].name, "low": lo, "high": hi}
            for cid, (lo, hi) in sorted(brand.msrp.items())[: 6 if short else 40]
            if cid in world.categories
        ]
    if not short:
        view["recalls"] = [
            {
                "recall_id": r.recall_id,
                "product": r.product,
                "model_number": r.model_number,
                "batches": list(r.batches),
                "reason": r.reason,
            }
            for r in world.recalls_by_brand.get(brand.name, ())
        ]
    return view


def lookup_view(world: V1World, name: str, category_id: str | None = None) -> dict[str, Any]:
    """What ``lookup_brand(name, category_id)`` returns."""
    text = name.strip()
    found = world.lookup_brand(text, limit=5)
    exact = found["exact"]
    result: dict[str, Any] = {
        "query": text,
        "exact": brand_view(world, exact, category_id) if exact is not None else None,
        "similar": [
            {**brand_view(world, b, category_id, short=True), "similarity": s}
            for b, s in found["matches"]
            if exact is None or b.name != exact.name
        ],
    }
    if exact is None:
        result["note"] = "no brand is registered under exactly this name"
    return result


def schema_view(world: V1World, category_id: str) -> dict[str, Any]:
    """What ``get_attribute_schema(category_id)`` returns."""
    cat = world.categories[category_id]
    result = {
        "category_id": cat.id,
        "name": cat.name,
        "full_name": cat.full_name,
        "is_leaf": cat.is_leaf,
        "policy": cat.policy,
        "attributes": [
            {"handle": a.handle, "name": a.name, "required": req, "values": list(a.values)}
            for a, req in world.schema(category_id)
        ],
    }
    if not cat.is_leaf:
        result["children"] = [
            {"id": c, "name": world.categories[c].name} for c in cat.children[:30]
        ]
        result["note"] = "not a leaf: listings belong in the most specific category; see children"
    return result


def seller_view(world: V1World, name: str) -> dict[str, Any] | None:
    """What ``get_seller(name)`` returns (None for an unknown seller)."""
    s = world.seller(name)
    return s.view() if s is not None else None


# -- drafts ------------------------------------------------------------------------------------
@dataclass
class _Draft:
    leaf: str
    brand_text: str
    seller: str
    price: float
    item: str
    title: str | None = None
    title_parts: list[str] = field(default_factory=list)
    desc: list[str] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)
    specifics: dict[str, str] = field(default_factory=dict)
    truth_attrs: dict[str, str] = field(default_factory=dict)
    signals: list[str] = field(default_factory=list)


class _ListingBuilder:
    """Builds one v1 listing of a given kind from a seeded rng."""

    def __init__(self, world: V1World, part: str, rng: random.Random) -> None:
        self.world, self.part, self.rng = world, part, rng
        self.ix = part_index(world, part)
        self.p = part_phrases(part)

    # -- picks ---------------------------------------------------------------------------------
    def registry_brand(self, leaves: tuple[str, ...], want: str = "registered") -> tuple[str, Any]:
        rng, w = self.rng, self.world
        for _ in range(60):
            leaf = rng.choice(leaves)
            names = [n for n in self.ix.brands_at.get(leaf, ()) if self._wanted(w.brands[n], want)]
            if names:
                return leaf, w.brands[rng.choice(names)]
        raise ConfigError(
            f"catalog v1: no {want} brand priced on {len(leaves)} leaves of part {self.part}"
        )

    @staticmethod
    def _wanted(b: Any, want: str) -> bool:
        return {
            "any": True,
            "registered": b.registered,
            "gated": b.protected and b.registered,
            "open": b.registered and not b.protected,
        }[want]

    def seller_any(self) -> str:
        return self.rng.choice(self.ix.sellers)

    def seller_where(self, ok: Any) -> str:
        for _ in range(200):
            s = self.rng.choice(self.ix.sellers)
            if ok(self.world.seller_records[s].view()):
                return s
        raise ConfigError(f"catalog v1: no seller of part {self.part} fits")

    def longtail(self) -> str:
        return self.rng.choice(self.ix.longtail)

    def msrp(self, brand: Any, leaf: str) -> tuple[float, float]:
        found = self.world.msrp(brand.name, leaf) if brand is not None else None
        if found is None:
            lo = round(self.rng.uniform(8, 200), 2)
            return lo, round(lo * self.rng.uniform(1.2, 2.5), 2)
        return found

    def full_price(self, brand: Any, leaf: str) -> float:
        lo, hi = self.msrp(brand, leaf)
        return self.rng.uniform(0.8 * lo, hi)

    # -- text ----------------------------------------------------------------------------------
    def draft(
        self, leaf: str, brand_text: str, seller: str, price: float, drop: bool = False
    ) -> _Draft:
        rng, w = self.rng, self.world
        cat = w.categories[leaf]
        item = rng.choice(cat.synonyms) if cat.synonyms and rng.random() < 0.3 else cat.name
        d = _Draft(
            leaf=leaf, brand_text=brand_text, seller=seller, price=fmt_price(rng, price), item=item
        )
        d.specifics["Item type"] = item
        if leaf in self.ix.context or rng.random() < 0.2:
            d.specifics["Department"] = (
                self.ix.context.get(leaf) or cat.full_name.split(" > ")[-2:][0]
            )
        self.fill(d, drop)
        return d

    def fill(self, d: _Draft, drop: bool) -> None:
        """Attribute values consistent with the leaf's own name; dropped ones never leak."""
        rng, w = self.rng, self.world
        cat = w.categories[d.leaf]
        named = " " + drop_possessives(f"{cat.full_name} {d.item}") + " "
        schema = w.schema(d.leaf)
        required = [a for a, r in schema if r and a.values]
        optional = [a for a, r in schema if not r and a.values]
        dropped: set[str] = set()
        if drop:
            free = [a for a in required if not any(names_value(v, named) for v in a.values)]
            if not free:
                raise _Retry("no required attribute can be dropped without leaking")
            dropped = {a.handle for a in rng.sample(free, rng.randint(1, min(2, len(free))))}
        chosen = [(a, True) for a in required if a.handle not in dropped]
        chosen += [(a, False) for a in rng.sample(optional, min(len(optional), rng.randint(0, 2)))]
        for attr, req in chosen:
            implied = [v for v in attr.values if names_value(v, named)]
            value = rng.choice(implied) if implied else rng.choice(attr.values)
            if req:
                d.truth_attrs[attr.handle] = value
            state_value(rng, attr.name, value, d.specifics, d.desc, self.p["free_attribute"])
            if len(d.title_parts) < 2 and len(value) <= 24 and rng.random() < 0.35:
                d.title_parts.append(value)
        if drop:
            d.signals.append("missing_required_attributes:" + ",".join(sorted(dropped)))

    def compose(self, d: _Draft) -> dict[str, Any]:
        rng, p = self.rng, self.p
        if d.title is None:
            parts = (
                ([d.brand_text] if d.brand_text and rng.random() < 0.85 else [])
                + d.title_parts
                + [d.item]
            )
            title = (
                rng.choice(p["title_prefixes"]) + " ".join(parts) + rng.choice(p["title_suffixes"])
            )
        else:
            title = d.title
        if rng.random() < 0.07:
            title = title.upper()
        opener = rng.choice(p["openers"]).format(brand=d.brand_text or "our shop", item=d.item)
        body = [opener, *d.desc, *d.tail, rng.choice(p["closers"])]
        return {
            "title": re.sub(r"\s+", " ", title).strip(),
            "description": " ".join(body),
            "brand": d.brand_text,
            "seller": d.seller,
            "price": d.price,
            "currency": "USD",
            "attributes": dict(d.specifics),
        }

    def noise(self, d: _Draft) -> None:
        """Wording that appears on every kind, so that none of it marks one."""
        rng, p = self.rng, self.p
        if rng.random() < 0.09:
            d.tail.insert(rng.randint(0, len(d.tail)), rng.choice(p["injections"]))
        if rng.random() < 0.15:
            d.desc.append(rng.choice(p["discount_talk"]).format(percent=rng.randint(10, 60)))
        if rng.random() < 0.10:
            d.desc.append(self.style_claim())
        if rng.random() < 0.08:
            d.desc.append(rng.choice(p["conditions"]))
        if rng.random() < 0.10:
            model = model_number(rng, self.world.recalled_models)
            d.tail.append(rng.choice(p["lot_lines"]).format(model=model, batch=batch_code(rng)))
        if d.brand_text and rng.random() < 0.06:
            d.desc.append(rng.choice(p["authorized_claims"]).format(brand=d.brand_text))
        if rng.random() < 0.06:
            d.desc.append(
                rng.choice(p["compatible_noise"]).format(target=rng.choice(self.ix.gated))
            )

    def style_claim(self) -> str:
        rng, p = self.rng, self.p
        return rng.choice(p["style_claims"]).format(
            style=rng.choice(p["styles"]),
            artwork=rng.choice(p["artworks"]),
            film=rng.choice(p["films"]),
        )

    # -- kinds: ok -----------------------------------------------------------------------------
    def clean(self, drop: bool = False) -> _Draft:
        leaf, brand = self.registry_brand(self.ix.branded, "any")
        seller = (
            self.rng.choice(brand.authorized_sellers)
            if brand.protected and brand.authorized_sellers
            else self.seller_any()
        )
        d = self.draft(leaf, brand.name, seller, self.full_price(brand, leaf), drop=drop)
        d.signals.append("genuine_listing")
        return d

    def missing_attributes(self) -> _Draft:
        if self.rng.random() < 0.35:
            d = self.draft(
                self.rng.choice(self.ix.ok_leaves),
                self.longtail(),
                self.seller_any(),
                self.rng.uniform(5, 300),
                drop=True,
            )
            return d
        return self.clean(drop=True)

    def longtail_kind(self) -> _Draft:
        rng = self.rng
        d = self.draft(
            rng.choice(self.ix.ok_leaves), self.longtail(), self.seller_any(), rng.uniform(4, 400)
        )
        if rng.random() < 0.3:  # small makers sell cheap too: no MSRP to compare with
            d.desc.append(rng.choice(self.p["discount_talk"]).format(percent=rng.randint(20, 70)))
        d.signals.append("brand_not_in_registry")
        return d

    def genuine_discount(self) -> _Draft:
        rng = self.rng
        leaf, brand = self.registry_brand(self.ix.branded, "registered")
        lo, _ = self.msrp(brand, leaf)
        if brand.protected or rng.random() < 0.4:
            seller = rng.choice(brand.authorized_sellers)
        else:
            seller = self.seller_where(
                lambda s: good_standing(s, brand.name) and not _took_down(s, brand.name)
            )
        frac = rng.uniform(0.36, 0.70)
        d = self.draft(leaf, brand.name, seller, lo * frac)
        d.desc.insert(0, rng.choice(self.p["conditions"]))
        if rng.random() < 0.5:
            d.desc.append(
                rng.choice(self.p["discount_talk"]).format(percent=int(round((1 - frac) * 100)))
            )
        d.signals.append("genuine_discount_with_condition")
        return d

    def gated_authorized(self) -> _Draft:
        rng = self.rng
        leaf, brand = self.registry_brand(self.ix.branded, "gated")
        seller = rng.choice(brand.authorized_sellers)
        lo, _ = self.msrp(brand, leaf)
        if rng.random() < 0.3:
            d = self.draft(leaf, brand.name, seller, lo * rng.uniform(0.4, 0.7))
            d.desc.insert(0, rng.choice(self.p["conditions"]))
        else:
            d = self.draft(leaf, brand.name, seller, self.full_price(brand, leaf))
        if rng.random() < 0.5:
            d.desc.append(rng.choice(self.p["authorized_claims"]).format(brand=brand.name))
        d.signals.append("authorized_seller_of_gated_brand")
        return d

    def lookalike_registered(self) -> _Draft:
        rng, w = self.rng, self.world
        for _ in range(40):
            name = rng.choice(self.ix.lookalikes)
            brand = w.brands[name]
            leaves = [x for x in self.ix.branded if name in self.ix.brands_at.get(x, ())]
            if leaves:
                leaf = rng.choice(leaves)
                d = self.draft(leaf, name, self.seller_any(), self.full_price(brand, leaf))
                d.signals.append(f"registered_lookalike_of:{w.lookalike_of[name]}")
                return d
        raise _Retry("no look-alike brand priced in this part")

    def compatible_accessory(self) -> _Draft:
        rng, w = self.rng, self.world
        leaf = rng.choice(self.ix.accessory)
        target = w.brands[rng.choice(self.ix.gated)]
        maker = self.longtail() if rng.random() < 0.5 else None
        if maker is None:
            names = [n for n in self.ix.brands_at.get(leaf, ()) if not w.brands[n].protected]
            maker = rng.choice(names) if names else self.longtail()
        seller = self.seller_where(lambda s: target.name not in s["authorized_brands"])
        price = self.full_price(w.brands.get(maker), leaf)
        d = self.draft(leaf, maker, seller, price)
        fill = {"item": d.item, "target": target.name, "brand": maker}
        d.title = rng.choice(self.p["compatible"]["title"]).format(**fill)
        if d.title_parts:
            d.title = " ".join(d.title_parts) + " " + d.title
        if rng.random() < 0.5:
            d.title = f"{maker} {d.title}"
        d.desc.insert(0, rng.choice(self.p["compatible"]["description"]).format(**fill))
        d.signals.append(f"compatible_with:{target.name}")
        return d

    def art_replica(self) -> _Draft:
        rng = self.rng
        leaf = rng.choice(self.ix.replica)
        brand_text = self.longtail() if rng.random() < 0.6 else rng.choice(self.p["generic_brands"])
        d = self.draft(leaf, brand_text, self.seller_any(), rng.uniform(10, 400))
        d.desc.insert(0, self.style_claim())
        if rng.random() < 0.5:
            d.title = f"Replica {d.item}"
            if d.title_parts:
                d.title += " - " + " ".join(d.title_parts)
        d.signals.append("art_or_prop_replica")
        return d

    def recall_other_batch(self) -> _Draft:
        rng, w = self.rng, self.world
        recall = rng.choice(self.ix.recalls)
        brand = w.brands[recall.brand]
        d = self.recall_draft(recall, brand)
        if rng.random() < 0.5:
            model = near_model(rng, recall.model_number, w.recalled_models)
            line = rng.choice(self.p["lot_lines"]).format(
                model=model, batch=rng.choice(recall.batches)
            )
            d.signals.append(f"near_miss_model:{recall.recall_id}")
        else:
            batch = unaffected_batch(rng, recall.batches)
            line = rng.choice(self.p["lot_lines"]).format(model=recall.model_number, batch=batch)
            d.signals.append(f"unaffected_batch:{recall.recall_id}")
        d.tail.append(line)
        return d

    def recall_draft(self, recall: Any, brand: Any) -> _Draft:
        rng = self.rng
        seller = (
            rng.choice(brand.authorized_sellers)
            if brand.protected and brand.authorized_sellers
            else self.seller_any()
        )
        d = self.draft(
            recall.category_id, brand.name, seller, self.full_price(brand, recall.category_id)
        )
        product = recall.product
        if product.lower().startswith(brand.name.lower()):
            product = product[len(brand.name) :].strip()
        if rng.random() < 0.6:
            d.title_parts.insert(0, product)
        return d

    def wrong_category_words(self) -> _Draft:
        rng, w = self.rng, self.world
        leaf = rng.choice(self.ix.small)
        cat = w.categories[leaf]
        pool = self.ix.prohibited_leaves if rng.random() < 0.35 else self.ix.ok_leaves
        decoy = cat
        for _ in range(30):
            decoy = w.categories[rng.choice(pool)]
            if decoy.vertical != cat.vertical:
                break
        names = self.ix.brands_at.get(leaf, ())
        brand = w.brands[rng.choice(names)] if names and rng.random() < 0.6 else None
        brand_text = brand.name if brand else self.longtail()
        seller = (
            rng.choice(brand.authorized_sellers)
            if brand is not None and brand.protected and brand.authorized_sellers
            else self.seller_any()
        )
        d = self.draft(leaf, brand_text, seller, self.full_price(brand, leaf))
        fill = {"decoy": decoy.name, "decoy_lower": decoy.name.lower(), "item": d.item}
        d.title = rng.choice(self.p["wrong_category"]["title"]).format(**fill)
        if d.title_parts:
            d.title += " - " + " ".join(d.title_parts)
        d.desc.insert(0, rng.choice(self.p["wrong_category"]["description"]).format(**fill))
        d.signals.append(f"misleading_words:{decoy.id}")
        return d

    # -- kinds: counterfeit --------------------------------------------------------------------
    def counterfeit_discount(self) -> _Draft:
        rng = self.rng
        leaf, brand = self.registry_brand(self.ix.branded, "open")
        lo, _ = self.msrp(brand, leaf)
        frac = rng.uniform(0.2, 0.6)
        if (
            rng.random() < 0.5
        ):  # two weak signals: a condition story from a seller not in good standing
            seller = self.seller_where(
                lambda s: not good_standing(s, brand.name) and not _took_down(s, brand.name)
            )
            d = self.draft(leaf, brand.name, seller, lo * frac)
            d.desc.insert(0, rng.choice(self.p["conditions"]))
            d.signals.append("discount_from_seller_not_in_good_standing")
        else:
            d = self.draft(
                leaf,
                brand.name,
                self.seller_where(lambda s: not _took_down(s, brand.name)),
                lo * frac,
            )
            d.signals.append("unexplained_discount")
        if rng.random() < 0.5:
            d.desc.append(
                rng.choice(self.p["discount_talk"]).format(percent=int(round((1 - frac) * 100)))
            )
        return d

    def counterfeit_takedown(self) -> _Draft:
        rng, w = self.rng, self.world
        open_brands = sorted(n for n in self.ix.takedowns if not w.brands[n].protected)
        for _ in range(60):
            # a brand that is not gated: only the seller's record tells
            brand_name = rng.choice(open_brands)
            leaves = [x for x in self.ix.branded if brand_name in self.ix.brands_at.get(x, ())]
            if not leaves:
                continue
            brand = w.brands[brand_name]
            leaf = rng.choice(leaves)
            seller = rng.choice(self.ix.takedowns[brand_name])
            d = self.draft(leaf, brand.name, seller, self.full_price(brand, leaf))
            if rng.random() < 0.4:
                d.desc.append(rng.choice(self.p["authorized_claims"]).format(brand=brand.name))
            d.signals.append("seller_taken_down_for_this_brand")
            return d
        raise _Retry("no brand with a takedown priced in this part")

    def counterfeit_gated_seller(self) -> _Draft:
        rng = self.rng
        leaf, brand = self.registry_brand(self.ix.branded, "gated")
        seller = self.seller_where(lambda s: brand.name not in s["authorized_brands"])
        d = self.draft(leaf, brand.name, seller, self.full_price(brand, leaf))
        if rng.random() < 0.4:
            d.desc.append(rng.choice(self.p["authorized_claims"]).format(brand=brand.name))
        d.signals.append("unauthorized_seller_of_gated_brand")
        return d

    def counterfeit_lookalike(self) -> _Draft:
        rng, w = self.rng, self.world
        for _ in range(30):
            leaf, brand = self.registry_brand(self.ix.branded, "registered")
            typo = lookalike(rng, brand.name)
            found = w.lookup_brand(typo)
            if found["exact"] is not None or w.brand_similarity(typo) < 90:
                continue
            lo, hi = self.msrp(brand, leaf)
            price = rng.uniform(0.3 * lo, hi)
            d = self.draft(leaf, typo, self.seller_any(), price)
            d.signals.append(f"lookalike_of:{brand.name}")
            return d
        raise _Retry("no look-alike found")

    def counterfeit_copy_claim(self) -> _Draft:
        rng = self.rng
        leaf, brand = self.registry_brand(self.ix.branded, "registered")
        brand_text = (
            brand.name
            if rng.random() < 0.3
            else (self.longtail() if rng.random() < 0.5 else rng.choice(self.p["generic_brands"]))
        )
        lo, hi = self.msrp(brand, leaf)
        d = self.draft(leaf, brand_text, self.seller_any(), rng.uniform(0.3 * lo, hi))
        d.desc.insert(
            rng.randint(0, len(d.desc)), rng.choice(self.p["copy_claims"]).format(brand=brand.name)
        )
        d.signals.append(f"copy_of:{brand.name}")
        return d

    # -- kinds: prohibited ---------------------------------------------------------------------
    def prohibited_category(self) -> _Draft:
        rng, w = self.rng, self.world
        leaf = rng.choice(self.ix.prohibited_leaves)
        names = [n for n in self.ix.brands_at.get(leaf, ())]
        roll = rng.random()
        brand = w.brands[rng.choice(names)] if names and roll < 0.4 else None
        brand_text = (
            brand.name
            if brand
            else (self.longtail() if roll < 0.8 else rng.choice(self.p["generic_brands"]))
        )
        seller = (
            rng.choice(brand.authorized_sellers)
            if brand is not None and brand.protected and brand.authorized_sellers
            else self.seller_any()
        )
        d = self.draft(leaf, brand_text, seller, self.full_price(brand, leaf))
        if rng.random() < 0.7:  # under another category's words: only the schema's policy tells
            decoy = w.categories[rng.choice(self.ix.ok_leaves)]
            d.title = rng.choice(self.p["disguise"]).format(decoy=decoy.name)
            d.signals.append(f"disguised_as:{decoy.id}")
        d.signals.append("prohibited_category")
        return d

    def prohibited_recall(self) -> _Draft:
        rng, w = self.rng, self.world
        recall = rng.choice(self.ix.recalls)
        brand = w.brands[recall.brand]
        d = self.recall_draft(recall, brand)
        if rng.random() < 0.7:
            line = rng.choice(self.p["lot_lines"]).format(
                model=recall.model_number, batch=rng.choice(recall.batches)
            )
        else:
            line = rng.choice(self.p["model_lines"]).format(model=recall.model_number)
        d.tail.append(line)
        d.signals.append(f"recall:{recall.recall_id}")
        return d


class _Retry(Exception):
    """This draw cannot plant the kind; draw again."""


def _took_down(seller: Mapping[str, Any], brand: str) -> bool:
    return any(
        t["brand"] == brand and t["reason"] == "counterfeit" for t in seller.get("takedowns") or ()
    )


_GENERATORS = {
    "longtail": "longtail_kind",
}


def make_listing(
    world: V1World, split: str, rng: random.Random, kind: str, lid: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build one v1 listing of ``kind`` for ``split``: return ``(task, truth)``.

    Args:
        world: The :class:`envs.catalog.v1.world.V1World`.
        split: ``train``, ``dev`` or ``test`` (train draws from the train part, the others from
            eval).
        rng: The case's seeded generator.
        kind: One of :data:`KINDS`.
        lid: The listing id shown to the agent.

    Returns:
        ``task`` (listing fields) and ``truth``: ``category_id``, ``attributes`` (the required
        attributes the listing states), ``verdict`` (what the rules say about the evidence),
        ``signals`` and ``entities`` (brand, seller and recall notice the listing draws on).

    Raises:
        ConfigError: unknown kind or split, or a world that cannot host the kind.
    """
    if kind not in KIND_VERDICT:
        raise ConfigError(f"unknown case kind {kind!r}; known kinds: {', '.join(KINDS)}")
    part = SPLIT_PART.get(split)
    if part is None:
        raise ConfigError(f"unknown split {split!r}; splits: {', '.join(SPLIT_PART)}")
    gen = _ListingBuilder(world, part, rng)
    want = KIND_VERDICT[kind]
    best: tuple[dict[str, Any], dict[str, Any]] | None = None
    for _ in range(_TRIES):
        try:
            d = getattr(gen, _GENERATORS.get(kind, kind))()
        except _Retry:
            continue
        gen.noise(d)
        task = gen.compose(d)
        listing = {
            "title": task["title"],
            "description": task["description"],
            "brand": task["brand"],
            "seller": task["seller"],
            "price": task["price"],
            "specifics": task["attributes"],
        }
        schema = schema_view(world, d.leaf)
        brand = lookup_view(world, d.brand_text, d.leaf) if d.brand_text else None
        seller = seller_view(world, d.seller)
        mentions = {n: lookup_view(world, n) for n in copy_mentions(_text(listing))}
        evidence = assess(listing, schema, brand, seller, mentions)
        verdict, reason = decide(evidence)
        attrs = extract_attributes(listing, schema)
        truth = {
            "category_id": d.leaf,
            "attributes": dict(sorted(attrs.items())),
            "verdict": verdict,
            "reason": reason,
            "signals": d.signals,
            "entities": _entities(world, d, brand, evidence),
        }
        consistent = attrs == d.truth_attrs
        if verdict == want and consistent:
            return task, truth
        if best is None and verdict == want:
            best = (task, truth)
    if best is not None:
        return best
    raise ConfigError(f"catalog v1: could not plant a {kind} listing in {_TRIES} draws")


def _text(listing: Mapping[str, Any]) -> str:
    return listing_text(listing)


def _entities(
    world: V1World, d: _Draft, brand: Mapping[str, Any] | None, e: Any
) -> dict[str, list[str]]:
    """The world entities a listing draws on (what the held-out check compares across splits)."""
    brands = set()
    exact = (brand or {}).get("exact")
    if exact:
        brands.add(exact["name"])
    elif d.brand_text and d.brand_text not in phrases()["generic_brands"]:
        brands.add(d.brand_text)
    for s in d.signals:
        for prefix in ("lookalike_of:", "copy_of:", "compatible_with:", "registered_lookalike_of:"):
            if s.startswith(prefix):
                brands.add(s[len(prefix) :])
    recalls = {
        s.split(":", 1)[1]
        for s in d.signals
        if s.split(":", 1)[0] in ("recall", "near_miss_model", "unaffected_batch")
    }
    return {"brands": sorted(brands), "sellers": [d.seller], "recalls": sorted(recalls)}


def listing_part(split: str) -> str:
    """The world part a split's listings draw from."""
    return SPLIT_PART[split]


__all__ += [
    "PartIndex",
    "brand_view",
    "listing_part",
    "lookup_view",
    "part_index",
    "schema_view",
    "seller_view",
    "DISCOUNT",
    "DEEP_DISCOUNT",
]

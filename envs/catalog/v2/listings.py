"""Planted listings of catalog v2: judgement over overlapping evidence, four decisions.

Every case is drawn from ``(world, part, rng, kind)`` (``train`` cases from the world's train
part, ``dev``/``test`` from the held-out eval part, as in v1) with signals drawn across their
whole range; the label is what the written rules (:mod:`envs.catalog.v2.rules`) say about the
listing's visible evidence, read through the tools' views. A kind names how a case is made and
the decision it aims at; a draw whose evidence gives another decision is drawn again.

Kinds in :data:`HELD_OUT` never appear in the train split (two evasion tactics, two hard-negative
kinds), so the test split measures a shift.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envs.catalog.common.forge import lookalike, model_number, near_model, unaffected_batch
from envs.catalog.common.text import drop_possessives, listing_text, names_value
from envs.catalog.mix import KindMix
from envs.catalog.v1.listings import part_index, phrases
from envs.catalog.v1.world import SPLIT_PART
from envs.catalog.v2 import content
from envs.catalog.v2.rules import assess, copy_mentions, decide, stated_condition
from envs.catalog.v2.voices import Writer
from twin.errors import ConfigError

__all__ = [
    "CASE_KINDS",
    "EVAL_MIX",
    "HELD_OUT",
    "KIND_DECISION",
    "KINDS",
    "MIXES",
    "NATURAL_MIX",
    "TRAIN_MIX",
    "make_listing",
    "mix_for",
]

KIND_DECISION: dict[str, str] = {
    "clean": "ok",
    "longtail": "ok",
    "genuine_discount": "ok",
    "gated_authorized": "ok",
    "lookalike_registered": "ok",
    "compatible_accessory": "ok",
    "art_replica": "ok",
    "recall_other_batch": "ok",
    "new_seller_genuine": "ok",
    "deep_clearance_authorised": "ok",
    "reformed_seller": "ok",
    "counterfeit_discount": "counterfeit",
    "counterfeit_takedown": "counterfeit",
    "counterfeit_gated_seller": "counterfeit",
    "counterfeit_lookalike": "counterfeit",
    "counterfeit_copy_claim": "counterfeit",
    "invisible_brand": "counterfeit",
    "fresh_account_gated": "counterfeit",
    "prohibited_category": "prohibited",
    "prohibited_disguised": "prohibited",
    "prohibited_recall": "prohibited",
    "borderline_discount": "escalate",
    "gated_unproven": "escalate",
    "recall_batch_unstated": "escalate",
    "restricted_uncertified": "escalate",
    "lookalike_moderate": "escalate",
}
KINDS: tuple[str, ...] = tuple(KIND_DECISION)

#: Kinds the train split never shows: two evasion tactics and two hard-negative kinds.
HELD_OUT: dict[str, str] = {
    "invisible_brand": "evasion: zero-width characters inside a registered brand name",
    "fresh_account_gated": "evasion: a days-old account selling a gated brand at full price",
    "deep_clearance_authorised": (
        "hard negative: an authorised seller's deep clearance (20-40% of MSRP)"
    ),
    "reformed_seller": (
        "hard negative: a seller whose counterfeit takedown for the brand is years old"
    ),
}

#: Evaluation mix (dev and test): 45% ok, 20% counterfeit, 10% prohibited, 25% escalate, so that
#: no constant decision and no policy that skips the seller or the registry comes near the
#: ceiling (see docs/catalog-v2.md).
EVAL_MIX: dict[str, float] = {
    "clean": 0.06,
    "longtail": 0.06,
    "genuine_discount": 0.05,
    "gated_authorized": 0.04,
    "lookalike_registered": 0.03,
    "compatible_accessory": 0.03,
    "art_replica": 0.03,
    "recall_other_batch": 0.04,
    "new_seller_genuine": 0.04,
    "deep_clearance_authorised": 0.035,
    "reformed_seller": 0.035,
    "counterfeit_discount": 0.035,
    "counterfeit_takedown": 0.03,
    "counterfeit_gated_seller": 0.03,
    "counterfeit_lookalike": 0.025,
    "counterfeit_copy_claim": 0.02,
    "invisible_brand": 0.03,
    "fresh_account_gated": 0.03,
    "prohibited_category": 0.03,
    "prohibited_disguised": 0.04,
    "prohibited_recall": 0.03,
    "borderline_discount": 0.07,
    "gated_unproven": 0.05,
    "recall_batch_unstated": 0.04,
    "restricted_uncertified": 0.05,
    "lookalike_moderate": 0.04,
}
#: Training mix: enriched on purpose (the same decision shares as evaluation), held-out kinds out.
TRAIN_MIX: dict[str, float] = {k: v for k, v in EVAL_MIX.items() if k not in HELD_OUT}
#: Deployment-like mix: 92% ok, 3% counterfeit, 1% prohibited, 4% borderline.
NATURAL_MIX: dict[str, float] = {
    "clean": 0.30,
    "longtail": 0.25,
    "genuine_discount": 0.07,
    "gated_authorized": 0.06,
    "lookalike_registered": 0.03,
    "compatible_accessory": 0.04,
    "art_replica": 0.02,
    "recall_other_batch": 0.01,
    "new_seller_genuine": 0.08,
    "deep_clearance_authorised": 0.03,
    "reformed_seller": 0.03,
    "counterfeit_discount": 0.006,
    "counterfeit_takedown": 0.005,
    "counterfeit_gated_seller": 0.005,
    "counterfeit_lookalike": 0.004,
    "counterfeit_copy_claim": 0.002,
    "invisible_brand": 0.004,
    "fresh_account_gated": 0.004,
    "prohibited_category": 0.004,
    "prohibited_disguised": 0.004,
    "prohibited_recall": 0.002,
    "borderline_discount": 0.015,
    "gated_unproven": 0.01,
    "recall_batch_unstated": 0.003,
    "restricted_uncertified": 0.008,
    "lookalike_moderate": 0.004,
}
MIXES: dict[str, dict[str, float]] = {
    "evaluation": EVAL_MIX,
    "training": TRAIN_MIX,
    "natural": NATURAL_MIX,
}

CASE_KINDS = KindMix(
    KINDS, 1000, "kinds-v2"
)  # 1,000 slots: the natural mix's 0.2% kinds keep their share
_TRIES = 80


def mix_for(mix: str, split: str, override: Mapping[str, float] | None = None) -> dict[str, float]:
    """The kind shares of ``split`` under config ``mix`` (``default`` or ``natural``).

    ``default``: train uses :data:`TRAIN_MIX`, dev and test :data:`EVAL_MIX`; ``natural``: every
    split uses :data:`NATURAL_MIX`. Train never holds a :data:`HELD_OUT` kind.
    """
    if override:
        base = dict(override)
    elif mix == "natural":
        base = dict(NATURAL_MIX)
    elif mix == "default":
        base = dict(TRAIN_MIX if split == "train" else EVAL_MIX)
    else:
        raise ConfigError(f"mix: unknown mix {mix!r}; mixes: default, natural")
    if split == "train":
        base = {k: v for k, v in base.items() if k not in HELD_OUT}
    return CASE_KINDS.validate(base)


class _Retry(Exception):
    """This draw cannot plant the kind; draw again."""


@dataclass
class _Draft:
    leaf: str
    brand_text: str
    seller: str
    price: float
    item: str = ""
    title: str | None = None
    facts: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    condition: str | None = None
    specifics: dict[str, str] = field(default_factory=dict)
    truth_attrs: dict[str, str] = field(default_factory=dict)
    signals: list[str] = field(default_factory=list)
    model: str | None = None
    cue_item: str | None = None
    brand_for_text: str | None = None


_EXTRA: dict[tuple[int, str], tuple[Any, dict[str, Any]]] = {}


def _extra(world: Any, part: str) -> dict[str, Any]:
    """v2 pools of a world part: durable branded leaves, restricted leaves, recalls on its
    leaves."""
    held = _EXTRA.get((id(world), part))
    if held is not None and held[0] is world:
        return held[1]
    ix = part_index(world, part)
    cats = world.categories
    durable = tuple(
        x for x in ix.branded if content.conditions_apply(cats[x].vertical, cats[x].full_name)
    )
    restricted = tuple(
        x for x in ix.ok_leaves if content.restricted(cats[x].full_name, cats[x].policy)
    )
    recalls = tuple(
        r
        for r in ix.recalls
        if world.leaf_part.get(r.category_id) == part and cats[r.category_id].policy == "ok"
    )
    out = {
        "durable": durable or ix.branded,
        "restricted": restricted or ix.ok_leaves,
        "restricted_branded": tuple(x for x in restricted if x in set(ix.branded)),
        "restricted_durable": tuple(x for x in restricted if x in set(durable)),
        "recalls": recalls or ix.recalls,
    }
    _EXTRA[(id(world), part)] = (world, out)
    return out


class _Builder:
    """Builds one v2 listing of a kind from a seeded rng."""

    def __init__(self, world: Any, part: str, rng: random.Random, views: Any) -> None:
        self.world, self.part, self.rng, self.views = world, part, rng, views
        self.ix = part_index(world, part)
        self.ex = _extra(world, part)
        self.p1 = phrases()

    # -- picks ---------------------------------------------------------------------------------
    def brand_at(self, leaves: tuple[str, ...], want: str) -> tuple[str, Any]:
        rng, w = self.rng, self.world
        for _ in range(60):
            leaf = rng.choice(leaves)
            names = [n for n in self.ix.brands_at.get(leaf, ()) if self._wanted(w.brands[n], want)]
            if names:
                return leaf, w.brands[rng.choice(names)]
        raise _Retry(f"no {want} brand on these leaves")

    @staticmethod
    def _wanted(b: Any, want: str) -> bool:
        return {
            "any": True,
            "registered": b.registered,
            "gated": b.protected and b.registered,
            "open": b.registered and not b.protected,
        }[want]

    def seller(self, ok: Any = None) -> str:
        for _ in range(300):
            s = self.rng.choice(self.ix.sellers)
            if ok is None or ok(self.world.seller_records[s].view()):
                return s
        raise _Retry("no seller fits")

    def msrp(self, brand: Any, leaf: str) -> tuple[float, float] | None:
        return self.views.msrp(brand.name, leaf) if brand is not None else None

    def priced(self, brand: Any, leaf: str, lo_r: float, hi_r: float) -> float:
        rng = self.rng
        rng_m = self.msrp(brand, leaf)
        if rng_m is None:
            return self.free_price(leaf)
        return rng_m[0] * rng.uniform(lo_r, hi_r)

    def bounds(self, leaf: str) -> tuple[float, float]:
        cat = self.world.categories[leaf]
        return content.price_bounds(cat.vertical, cat.full_name)

    def free_price(self, leaf: str) -> float:
        cat = self.world.categories[leaf]
        lo, hi = content.price_prior(cat.vertical, cat.full_name)
        return lo * (hi / lo) ** self.rng.random() * self.rng.uniform(0.7, 1.3)

    # -- drafting ------------------------------------------------------------------------------
    def draft(
        self, leaf: str, brand_text: str, seller: str, price: float, model: str | None = None
    ) -> _Draft:
        rng = self.rng
        d = _Draft(leaf=leaf, brand_text=brand_text, seller=seller, price=price, model=model)
        d.item, dept = self.item_type(leaf, brand_text, model)
        d.specifics["Item type"] = d.item
        if dept:
            d.specifics["Department"] = dept
        self.fill(d)
        if rng.random() < 0.5:
            d.facts.append("size")
        return d

    def item_type(self, leaf: str, brand: str, model: str | None) -> tuple[str, str]:
        """A seller's item type and the department it needs (empty when none) such that the
        written category rule finds ``leaf``; the leaf's own name when no variant does."""
        rng, w = self.rng, self.world
        cat = w.categories[leaf]
        variants = content.item_type_variants(
            cat.name, brand if brand and len(brand) < 24 else None, model
        )
        weights = {
            "exact": 0.2,
            "singular": 0.2,
            "lower": 0.2,
            "reordered": 0.15,
            "brand": 0.12,
            "brand_model": 0.06,
            "model": 0.07,
        }
        _, text = rng.choices(variants, weights=[weights[s] for s, _ in variants])[0]
        parent = self.ix.context.get(leaf) or cat.full_name.split(" > ")[-2:][0]
        wants_dept = leaf in self.ix.context or (rng.random() < 0.15 and cat.policy == "ok")
        for item in (text, cat.name):
            for dept in (parent,) if wants_dept else ("", parent):
                if self.views.resolves(item, brand, model, leaf, dept):
                    return item, dept
        return cat.name, cat.full_name.rsplit(" > ", 1)[0]

    def fill(self, d: _Draft) -> None:
        rng, w = self.rng, self.world
        cat = w.categories[d.leaf]
        named = " " + drop_possessives(f"{cat.full_name} {d.item}") + " "
        schema = w.schema(d.leaf)
        required = [a for a, r in schema if r and a.values]
        optional = [a for a, r in schema if not r and a.values]
        chosen = [(a, True) for a in required]
        chosen += [(a, False) for a in rng.sample(optional, min(len(optional), rng.randint(0, 2)))]
        if cat.policy == "prohibited":  # sellers of banned goods leave out specifics that name them
            path = {w for w in re.findall(r"[a-z]{5,}", cat.full_name.lower())}
            chosen = [
                (a, r)
                for a, r in chosen
                if not path & set(re.findall(r"[a-z]{5,}", a.name.lower()))
            ]
        durable = content.conditions_apply(cat.vertical, cat.full_name)
        for attr, req in chosen:
            implied = [v for v in attr.values if names_value(v, named)]
            pool = implied or list(attr.values)
            if (
                not durable
            ):  # no used or refurbished consumables, even where an attribute lists them
                pool = [v for v in pool if not stated_condition(v)] or pool
            value = rng.choice(pool)
            if req:
                d.truth_attrs[attr.handle] = value
            d.specifics[attr.name] = value

    def compose(self, d: _Draft) -> dict[str, Any]:
        rng = self.rng
        values = [
            v
            for k, v in d.specifics.items()
            if k not in ("Item type", "Department") and len(v) <= 20
        ]
        writer = Writer(rng, [d.brand_text, d.item, d.cue_item or "", *d.specifics.values()])
        parts: list[str] = [writer.opener(d.brand_for_text or d.brand_text, d.item)]
        if d.condition:
            parts.append(writer.condition(d.condition))
        for fact in d.facts:
            parts.append(writer.size() if fact == "size" else fact)
        if rng.random() < 0.6:
            attrs = [(k, v) for k, v in d.specifics.items() if k not in ("Item type", "Department")]
            parts.append(writer.feature(rng.choice(attrs) if attrs else None))
        parts.extend(d.lines)
        if rng.random() < 0.7:
            parts.append(writer.shipping())
        if rng.random() < 0.5:
            parts.append(writer.returns())
        if rng.random() < 0.6:
            parts.append(writer.closer())
        head, tail = parts[:1], parts[1:]
        rng.shuffle(tail)
        title = d.title if d.title is not None else writer.title(d.brand_text, d.item, values)
        return {
            "title": title,
            "description": writer.render(head + tail),
            "brand": d.brand_text,
            "seller": d.seller,
            "price": _price(rng, d.price, self.bounds(d.leaf)),
            "currency": "USD",
            "attributes": dict(d.specifics),
        }

    def noise(self, d: _Draft) -> None:
        """Wording drawn on every kind, so that none of it marks one."""
        rng, p1 = self.rng, self.p1
        cat = self.world.categories[d.leaf]
        if rng.random() < 0.07:
            d.lines.append(rng.choice(p1["injections"]))
        if rng.random() < 0.15:
            d.lines.append(Writer(rng, []).discount(rng.randint(10, 70)))
        if (
            rng.random() < 0.08
            and d.condition is None
            and content.conditions_apply(cat.vertical, cat.full_name)
        ):
            d.condition = rng.choice(content.CONDITIONS)
        if rng.random() < 0.08:
            model = model_number(rng, self.world.recalled_models)
            d.lines.append(
                rng.choice(p1["lot_lines"]).format(
                    model=model, batch=f"L{rng.randint(1900, 2599)}-{rng.randint(100, 999)}"
                )
            )
        if d.brand_text and rng.random() < 0.08:
            d.lines.append(rng.choice(Writer(rng, []).p["gated_claims"]).format(brand=d.brand_text))
        if rng.random() < 0.05:
            d.lines.append(
                rng.choice(p1["compatible_noise"]).format(target=rng.choice(self.ix.gated))
            )
        if d.cue_item is None and "," not in d.item and rng.random() < 0.2:
            d.lines.append(rng.choice(Writer(rng, []).p["cue_frames"]).format(item=d.item))
        if rng.random() < 0.1:  # art, prop and style wording on every kind
            d.lines.append(
                rng.choice(p1["style_claims"]).format(
                    style=rng.choice(p1["styles"]),
                    artwork=rng.choice(p1["artworks"]),
                    film=rng.choice(p1["films"]),
                )
            )
        if rng.random() < 0.1:  # "made to fit <brand>" wording on every kind
            d.lines.append(
                rng.choice(p1["compatible"]["description"]).format(
                    item=d.item, target=rng.choice(self.ix.gated), brand=d.brand_text or "us"
                )
            )
        if rng.random() < 0.12:  # model numbers of products no notice recalls
            d.lines.append(
                rng.choice(p1["model_lines"]).format(
                    model=model_number(rng, self.world.recalled_models)
                )
            )

    # -- kinds: ok -----------------------------------------------------------------------------
    def registry_listing(
        self,
        want: str,
        lo_r: float,
        hi_r: float,
        seller_ok: Any = None,
        leaves: tuple[str, ...] | None = None,
        authorised: bool = False,
    ) -> _Draft:
        leaf, brand = self.brand_at(leaves or self.ix.branded, want)
        if authorised:
            if not brand.authorized_sellers:
                raise _Retry("no authorised seller")
            seller = self.rng.choice(brand.authorized_sellers)
        else:
            seller = self.seller(seller_ok)
        return self.draft(leaf, brand.name, seller, self.priced(brand, leaf, lo_r, hi_r))

    def clean(self) -> _Draft:
        rng = self.rng
        if (
            rng.random() < 0.2 and self.ex["restricted_branded"]
        ):  # certified goods from an authorised seller
            d = self.registry_listing(
                "registered", 0.75, 1.3, leaves=self.ex["restricted_branded"], authorised=True
            )
            d.signals.append("genuine_listing")
            return d
        gated = rng.random() < 0.2
        d = self.registry_listing("gated" if gated else "any", 0.75, 1.3, authorised=gated)
        d.signals.append("genuine_listing")
        return d

    def longtail(self) -> _Draft:
        rng = self.rng
        leaf = rng.choice(self.ix.ok_leaves)
        d = self.draft(leaf, rng.choice(self.ix.longtail), self.seller(), self.free_price(leaf))
        d.signals.append("brand_not_in_registry")
        return d

    def genuine_discount(self) -> _Draft:
        rng = self.rng
        pool = (
            self.ex["restricted_durable"]
            if rng.random() < 0.25 and self.ex["restricted_durable"]
            else self.ex["durable"]
        )
        d = self.registry_listing("open", 0.3, 0.75, leaves=pool)
        d.condition = rng.choice(content.CONDITIONS)
        d.signals.append("discount_with_condition")
        return d

    def gated_authorized(self) -> _Draft:
        restricted = self.ex["restricted_branded"] if self.rng.random() < 0.3 else None
        d = self.registry_listing("gated", 0.3, 1.2, authorised=True, leaves=restricted or None)
        if self.rng.random() < 0.4 and self._durable(d.leaf):
            d.condition = self.rng.choice(content.CONDITIONS)
        d.signals.append("authorised_seller_of_gated_brand")
        return d

    def _durable(self, leaf: str) -> bool:
        cat = self.world.categories[leaf]
        return content.conditions_apply(cat.vertical, cat.full_name)

    def lookalike_registered(self) -> _Draft:
        rng, w = self.rng, self.world
        for _ in range(40):
            name = rng.choice(self.ix.lookalikes)
            leaves = [x for x in self.ix.branded if name in self.ix.brands_at.get(x, ())]
            if leaves:
                leaf = rng.choice(leaves)
                d = self.draft(
                    leaf, name, self.seller(), self.priced(w.brands[name], leaf, 0.75, 1.3)
                )
                d.signals.append(f"registered_lookalike_of:{w.lookalike_of[name]}")
                return d
        raise _Retry("no look-alike brand here")

    def compatible_accessory(self) -> _Draft:
        rng, w = self.rng, self.world
        leaf = rng.choice(self.ix.accessory)
        target = w.brands[rng.choice(self.ix.gated)]
        maker = rng.choice(self.ix.longtail)
        d = self.draft(
            leaf,
            maker,
            self.seller(lambda s: target.name not in s["authorized_brands"]),
            self.free_price(leaf),
        )
        fill = {"item": d.item, "target": target.name, "brand": maker}
        d.title = rng.choice(self.p1["compatible"]["title"]).format(**fill)
        d.lines.append(rng.choice(self.p1["compatible"]["description"]).format(**fill))
        d.signals.append(f"compatible_with:{target.name}")
        return d

    def art_replica(self) -> _Draft:
        rng, p1 = self.rng, self.p1
        leaf = rng.choice(self.ix.replica)
        brand = (
            rng.choice(self.ix.longtail) if rng.random() < 0.6 else rng.choice(p1["generic_brands"])
        )
        d = self.draft(leaf, brand, self.seller(), self.free_price(leaf))
        d.lines.append(
            rng.choice(p1["style_claims"]).format(
                style=rng.choice(p1["styles"]),
                artwork=rng.choice(p1["artworks"]),
                film=rng.choice(p1["films"]),
            )
        )
        d.signals.append("art_or_prop_replica")
        return d

    def recall_listing(self) -> tuple[Any, _Draft]:
        rng, w = self.rng, self.world
        recall = rng.choice(self.ex["recalls"])
        brand = w.brands[recall.brand]
        seller = (
            rng.choice(brand.authorized_sellers)
            if brand.protected and brand.authorized_sellers
            else self.seller()
        )
        d = self.draft(
            recall.category_id,
            brand.name,
            seller,
            self.priced(brand, recall.category_id, 0.75, 1.3),
            model=recall.model_number,
        )
        return recall, d

    def recall_other_batch(self) -> _Draft:
        rng, w = self.rng, self.world
        recall, d = self.recall_listing()
        if rng.random() < 0.5:
            model = near_model(rng, recall.model_number, w.recalled_models)
            d.model = model
            d.lines.append(
                rng.choice(self.p1["lot_lines"]).format(
                    model=model, batch=rng.choice(recall.batches)
                )
            )
            d.item, dept = self.item_type(d.leaf, d.brand_text, None)
            d.specifics["Item type"] = d.item
            d.specifics.pop("Department", None)
            if dept:
                d.specifics["Department"] = dept
        else:
            batch = unaffected_batch(rng, recall.batches)
            d.lines.append(
                rng.choice(self.p1["lot_lines"]).format(model=recall.model_number, batch=batch)
            )
        d.signals.append(f"recall_other:{recall.recall_id}")
        return d

    def new_seller_genuine(self) -> _Draft:
        d = self.registry_listing("open", 0.75, 1.2, seller_ok=lambda s: s["account_age_days"] < 90)
        d.signals.append("new_account_genuine")
        return d

    def deep_clearance_authorised(self) -> _Draft:
        leaf, brand = self.brand_at(self.ex["durable"], "registered")
        if not brand.authorized_sellers:
            raise _Retry("no authorised seller")
        d = self.draft(
            leaf,
            brand.name,
            self.rng.choice(brand.authorized_sellers),
            self.priced(brand, leaf, 0.2, 0.40),
        )
        d.condition = self.rng.choice(content.CONDITIONS)
        d.signals.append("deep_clearance_from_authorised_seller")
        return d

    def reformed_seller(self) -> _Draft:
        rng, w = self.rng, self.world
        for _ in range(60):
            name = rng.choice(sorted(self.ix.takedowns))
            b = w.brands[name]
            if b.protected:
                continue
            olds = [
                s
                for s in self.ix.takedowns[name]
                if all(
                    y < 2024
                    for bb, r, y in w.seller_records[s].takedowns
                    if bb == name and r == "counterfeit"
                )
            ]
            leaves = [x for x in self.ix.branded if name in self.ix.brands_at.get(x, ())]
            if olds and leaves:
                leaf = rng.choice(leaves)
                d = self.draft(leaf, name, rng.choice(olds), self.priced(b, leaf, 0.75, 1.3))
                d.signals.append("old_takedown_for_this_brand")
                return d
        raise _Retry("no reformed seller here")

    # -- kinds: counterfeit --------------------------------------------------------------------
    def counterfeit_discount(self) -> _Draft:
        d = self.registry_listing("open", 0.08, 0.6)
        if self.rng.random() < 0.4 and self._durable(d.leaf):
            d.condition = self.rng.choice(content.CONDITIONS)
        d.signals.append("unexplained_discount")
        return d

    def counterfeit_takedown(self) -> _Draft:
        rng, w = self.rng, self.world
        for _ in range(60):
            name = rng.choice(sorted(self.ix.takedowns))
            b = w.brands[name]
            leaves = [x for x in self.ix.branded if name in self.ix.brands_at.get(x, ())]
            if leaves and not b.protected:
                leaf = rng.choice(leaves)
                d = self.draft(
                    leaf, name, rng.choice(self.ix.takedowns[name]), self.priced(b, leaf, 0.45, 1.2)
                )
                d.signals.append("seller_taken_down_for_this_brand")
                return d
        raise _Retry("no takedown brand here")

    def counterfeit_gated_seller(self) -> _Draft:
        d = self.registry_listing("gated", 0.3, 1.1)
        d.signals.append("unauthorised_seller_of_gated_brand")
        return d

    def counterfeit_lookalike(self) -> _Draft:
        rng, w = self.rng, self.world
        for _ in range(30):
            leaf, brand = self.brand_at(self.ix.branded, "registered")
            typo = lookalike(rng, brand.name)
            if w.lookup_brand(typo)["exact"] is not None or w.brand_similarity(typo) < 90:
                continue
            d = self.draft(leaf, typo, self.seller(), self.priced(brand, leaf, 0.3, 1.2))
            d.signals.append(f"lookalike_of:{brand.name}")
            return d
        raise _Retry("no look-alike found")

    def counterfeit_copy_claim(self) -> _Draft:
        rng = self.rng
        leaf, brand = self.brand_at(self.ix.branded, "registered")
        text = (
            rng.choice(self.ix.longtail)
            if rng.random() < 0.6
            else rng.choice(self.p1["generic_brands"])
        )
        d = self.draft(leaf, text, self.seller(), self.priced(brand, leaf, 0.3, 1.1))
        d.lines.append(rng.choice(self.p1["copy_claims"]).format(brand=brand.name))
        d.signals.append(f"copy_of:{brand.name}")
        return d

    def invisible_brand(self) -> _Draft:
        rng = self.rng
        leaf, brand = self.brand_at(self.ix.branded, "registered")
        name = brand.name
        i = rng.randint(1, max(1, len(name) - 1))
        hidden = name[:i] + rng.choice(["\u200b", "\u200c", "\u2060", "\u00ad"]) + name[i:]
        d = self.draft(leaf, hidden, self.seller(), self.priced(brand, leaf, 0.75, 1.2))
        d.brand_for_text = name
        d.signals.append(f"invisible_characters_in:{name}")
        return d

    def fresh_account_gated(self) -> _Draft:
        d = self.registry_listing("gated", 0.8, 1.2, seller_ok=lambda s: s["account_age_days"] < 90)
        d.signals.append("fresh_account_gated_brand")
        return d

    # -- kinds: prohibited ---------------------------------------------------------------------
    def prohibited_category(self) -> _Draft:
        rng = self.rng
        leaf = rng.choice(self.ix.prohibited_leaves)
        brand = (
            rng.choice(self.ix.longtail)
            if rng.random() < 0.7
            else rng.choice(self.p1["generic_brands"])
        )
        d = self.draft(leaf, brand, self.seller(), self.free_price(leaf))
        d.signals.append("prohibited_category")
        return d

    def prohibited_disguised(self) -> _Draft:
        rng, w = self.rng, self.world
        leaf = rng.choice(self.ix.prohibited_leaves)
        if leaf in self.ix.context:
            raise _Retry("a shared leaf name needs its department, which would name the item")
        brand = (
            rng.choice(self.ix.longtail)
            if rng.random() < 0.7
            else rng.choice(self.p1["generic_brands"])
        )
        d = self.draft(leaf, brand, self.seller(), self.free_price(leaf))
        name = w.categories[leaf].name
        forms = [name, content.item_type_variants(name, None, None)[1][1], name.lower()]
        real = rng.choice(
            [f for f in forms if self.views.resolves(f, None, None, leaf, "")] or [name]
        )
        decoy = w.categories[rng.choice(self.ix.ok_leaves)]
        if stated_condition(
            decoy.name
        ):  # "Refurbished Chromebooks" would put a condition on the real item
            raise _Retry("decoy names a condition")
        d.specifics["Item type"] = d.item = (
            content.singular(decoy.name.split(" > ")[-1]) if rng.random() < 0.5 else decoy.name
        )
        d.specifics.pop("Department", None)
        d.cue_item = real
        d.lines.append(rng.choice(Writer(rng, []).p["cue_frames"]).format(item=real))
        d.signals.append(f"disguised_as:{decoy.id}")
        return d

    def prohibited_recall(self) -> _Draft:
        rng = self.rng
        recall, d = self.recall_listing()
        d.lines.append(
            rng.choice(self.p1["lot_lines"]).format(
                model=recall.model_number, batch=rng.choice(recall.batches)
            )
        )
        d.signals.append(f"recall:{recall.recall_id}")
        return d

    # -- kinds: escalate -----------------------------------------------------------------------
    def borderline_discount(self) -> _Draft:
        d = self.registry_listing("open", 0.25, 0.75)
        if self.rng.random() < 0.5 and self._durable(d.leaf):
            d.condition = self.rng.choice(content.CONDITIONS)
        d.signals.append("borderline_discount")
        return d

    def gated_unproven(self) -> _Draft:
        d = self.registry_listing("gated", 0.75, 1.2)
        d.signals.append("gated_brand_unproven_seller")
        return d

    def recall_batch_unstated(self) -> _Draft:
        rng = self.rng
        recall, d = self.recall_listing()
        d.lines.append(rng.choice(self.p1["model_lines"]).format(model=recall.model_number))
        d.signals.append(f"recall_unstated_batch:{recall.recall_id}")
        return d

    def restricted_uncertified(self) -> _Draft:
        rng, w = self.rng, self.world
        leaf = rng.choice(self.ex["restricted"])
        names = [n for n in self.ix.brands_at.get(leaf, ()) if w.brands[n].registered]
        if names and rng.random() < 0.5:
            brand = w.brands[rng.choice(names)]
            d = self.draft(leaf, brand.name, self.seller(), self.priced(brand, leaf, 0.6, 1.2))
        else:
            d = self.draft(leaf, rng.choice(self.ix.longtail), self.seller(), self.free_price(leaf))
        d.signals.append("restricted_category")
        return d

    def lookalike_moderate(self) -> _Draft:
        rng, w = self.rng, self.world
        for _ in range(40):
            leaf, brand = self.brand_at(self.ix.branded, "registered")
            name = lookalike(rng, lookalike(rng, brand.name))
            if rng.random() < 0.5:
                name = name + rng.choice([" Co", " Home", " Studio", " Goods", " Lab"])
            if w.lookup_brand(name)["exact"] is not None:
                continue
            sim = w.brand_similarity(name)
            if 80 <= sim < 90:
                d = self.draft(leaf, name, self.seller(), self.free_price(leaf))
                d.signals.append(f"near_name_of:{brand.name}")
                return d
        raise _Retry("no moderate look-alike")


def _price(rng: random.Random, price: float, bounds: tuple[float, float]) -> float:
    """A seller's price near ``price`` (x.99, x.95, x.50 ...), inside the category's ``bounds``."""
    lo, hi = bounds
    price = min(max(price, lo), hi)
    if price < 5:
        return round(min(max(price, lo), hi), 2)
    ending = rng.choice([0.99, 0.99, 0.95, 0.0, 0.5, 0.49])
    return round(min(max(int(price) + ending, lo), hi), 2)


def make_listing(
    world: Any, split: str, rng: random.Random, kind: str, views: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build one v2 listing of ``kind`` for ``split``: ``(task, truth)``.

    Args:
        world: The v1 world (:class:`envs.catalog.v1.world.V1World`) the v2 twin runs on.
        split: ``train``, ``dev`` or ``test``.
        rng: The case's seeded generator.
        kind: One of :data:`KINDS`.
        views: The twin's tool views (``schema``, ``lookup``, ``seller``, ``msrp``, ``resolves``).

    Raises:
        ConfigError: unknown kind or split, or a world that cannot plant the kind.
    """
    if kind not in KIND_DECISION:
        raise ConfigError(f"unknown case kind {kind!r}; known kinds: {', '.join(KINDS)}")
    part = SPLIT_PART.get(split)
    if part is None:
        raise ConfigError(f"unknown split {split!r}; splits: {', '.join(SPLIT_PART)}")
    gen = _Builder(world, part, rng, views)
    want = KIND_DECISION[kind]
    for _ in range(_TRIES):
        try:
            d = getattr(gen, kind)()
        except _Retry:
            continue
        gen.noise(d)
        task = gen.compose(d)
        truth = label(world, views, task, d)
        if truth["decision"] == want:
            return task, truth
    raise ConfigError(f"catalog v2: could not plant a {kind} listing in {_TRIES} draws")


def label(world: Any, views: Any, task: Mapping[str, Any], d: _Draft) -> dict[str, Any]:
    """The truth of a composed listing: what the written rules say about its evidence."""
    listing = {
        "title": task["title"],
        "description": task["description"],
        "brand": task["brand"],
        "seller": task["seller"],
        "price": task["price"],
        "specifics": task["attributes"],
    }
    schema = views.schema(d.leaf)
    brand = views.lookup(d.brand_text, d.leaf) if d.brand_text else None
    seller = views.seller(d.seller)
    mentions = {n: views.lookup(n, None) for n in copy_mentions(listing_text(listing))}
    e = assess(listing, schema, brand, seller, mentions)
    decision, request, reason = decide(e)
    exact = (brand or {}).get("exact")
    brands = (
        {exact["name"]}
        if exact
        else ({d.brand_text} if d.brand_text not in phrases()["generic_brands"] else set())
    )
    for s in d.signals:
        head, _, tail = s.partition(":")
        if head in (
            "lookalike_of",
            "copy_of",
            "compatible_with",
            "registered_lookalike_of",
            "invisible_characters_in",
            "near_name_of",
        ):
            brands.add(tail)
    recalls = sorted(
        {
            s.split(":", 1)[1]
            for s in d.signals
            if s.split(":", 1)[0] in ("recall", "recall_other", "recall_unstated_batch")
        }
    )
    return {
        "category_id": d.leaf,
        "attributes": dict(sorted(d.truth_attrs.items())),
        "decision": decision,
        "verdict": decision,
        "request": request,
        "reason": reason,
        "signals": d.signals,
        "entities": {
            "brands": sorted(brands),
            "sellers": [d.seller],
            "recalls": recalls,
            "leaves": [d.leaf],
        },
    }

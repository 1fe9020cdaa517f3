"""The brand registry, sellers and recall notices, generated over any taxonomy.

Brand names are fictional, composed from ``data/catalog/registry.yml`` and kept away from the
real trademarks it lists. Price ranges follow each vertical's band and the brand's tier (budget
to luxury); some brands carry narrower ranges for departments or product types below.
"""

from __future__ import annotations

import math
import random
import re
from typing import Any

from rapidfuzz import fuzz, process

from envs.catalog.world.model import Brand, Category, Recall
from envs.catalog.world.vocab import load_vocab, slug
from twin.cases import stable_seed

__all__ = ["DEFAULT_BAND", "generate_registry"]

#: Price band of a vertical the vocabulary does not know (e.g. one of a loaded taxonomy).
DEFAULT_BAND = (5.0, 500.0)


def _rng(seed: int, *parts: Any) -> random.Random:
    return random.Random(stable_seed("catalog-world", seed, *parts))


def generate_registry(
    categories: dict[str, Category],
    bands: dict[str, tuple[float, float]],
    seed: int,
    *,
    n_brands: int = 2400,
    n_sellers: int = 3000,
    n_recalls: int = 320,
) -> tuple[dict[str, Brand], tuple[str, ...], tuple[Recall, ...]]:
    """Brands, sellers and recalls for ``categories``.

    Args:
        categories: The taxonomy, by id.
        bands: Typical (low, high) MSRP per vertical id; others get :data:`DEFAULT_BAND`.
        seed: World seed.
        n_brands: Brands to generate (anchors from the vocabulary included).
        n_sellers: Seller handles (official stores and authorized resellers included).
        n_recalls: Recall notices.

    Returns:
        ``(brands by name, sorted seller handles, recalls sorted by id)``.
    """
    vocab = load_vocab()["registry"]
    weights, sellable, by_vertical = _sellable(categories)

    names = _brand_names(vocab, n_brands, sellable, seed)
    rng = _rng(seed, "brands")
    tiers = vocab["tiers"]
    tier_names = list(tiers)
    tier_weights = [tiers[t]["share"] for t in tier_names]

    specs: list[dict[str, Any]] = []
    for name, anchor_verts, anchor in names:
        if anchor is not None:
            verts = [v for v in anchor["verticals"] if v in weights] or sellable[:1]
            tier = anchor["tier"]
            registered, protected = True, bool(anchor["protected"])
        else:
            k = 1 if rng.random() < 0.6 else (2 if rng.random() < 0.75 else 3)
            k = min(k, len(sellable))
            verts = list(anchor_verts)
            while len(verts) < k:
                v = rng.choices(sellable, weights=[weights[s] for s in sellable])[0]
                if v not in verts:
                    verts.append(v)
            tier = rng.choices(tier_names, weights=tier_weights)[0]
            registered = rng.random() < 0.88
            p_protect = {"budget": 0.12, "mid": 0.3, "premium": 0.5, "luxury": 0.85}[tier]
            protected = registered and rng.random() < p_protect
        msrp = _msrp(rng, verts, bands, tiers[tier], by_vertical)
        specs.append(
            {
                "name": name,
                "registered": registered,
                "protected": protected,
                "verticals": tuple(sorted(verts)),
                "msrp": msrp,
            }
        )

    sellers, official = _sellers(vocab, specs, n_sellers, seed)
    resellers = [s for s in sellers if s not in official.values() and _is_reseller(s, vocab)]
    brands: dict[str, Brand] = {}
    for spec in specs:
        auth: tuple[str, ...] = ()
        if spec["protected"]:
            picked = rng.sample(resellers, min(len(resellers), rng.randint(0, 4)))
            auth = tuple(sorted({official[spec["name"]], *picked}))
        brands[spec["name"]] = Brand(
            name=spec["name"],
            registered=spec["registered"],
            protected=spec["protected"],
            authorized_sellers=auth,
            verticals=spec["verticals"],
            msrp=spec["msrp"],
        )
    recalls = _recalls(vocab, brands, categories, n_recalls, seed)
    return brands, sellers, recalls


def _sellable(
    categories: dict[str, Category],
) -> tuple[dict[str, int], list[str], dict[str, list[str]]]:
    """Where brands sell: the allowed leaves per vertical (the vertical's weight in the draw),
    the verticals that have any, and each vertical's allowed departments and product types."""
    verticals = sorted(c.id for c in categories.values() if c.parent_id is None)
    # brands sell where listings are allowed; the vertical's size weights the draw
    weights = {v: 0 for v in verticals}
    for c in categories.values():
        if c.is_leaf and c.policy == "ok":
            weights[c.vertical] += 1
    sellable = [v for v in verticals if weights[v] > 0]
    by_vertical: dict[str, list[str]] = {v: [] for v in verticals}
    for c in categories.values():
        if c.depth in (2, 3) and c.policy == "ok":
            by_vertical[c.vertical].append(c.id)
    return weights, sellable, by_vertical


def _msrp(
    rng: random.Random,
    verts: list[str],
    bands: dict[str, tuple[float, float]],
    tier: dict[str, float],
    by_vertical: dict[str, list[str]],
) -> dict[str, tuple[float, float]]:
    """A brand's MSRP ranges: one per vertical, and narrower ones for a few of its departments
    or product types."""
    msrp: dict[str, tuple[float, float]] = {}
    for v in verts:
        lo, hi = bands.get(v, DEFAULT_BAND)
        msrp[v] = _range(rng, lo, hi, tier)
        pool = by_vertical.get(v, [])
        for cid in rng.sample(pool, min(len(pool), rng.randint(0, 3))):
            # a department or product type: a narrower band inside the vertical's
            vlo, vhi = msrp[v]
            msrp[cid] = _range(rng, vlo, vhi, {"low": 0.0, "high": 1.0})
    return msrp


def _range(rng: random.Random, lo: float, hi: float, tier: dict[str, float]) -> tuple[float, float]:
    """A (low, high) list-price range at the tier's position of the log-scaled band."""
    llo, lhi = math.log(max(lo, 0.5)), math.log(max(hi, lo + 1))
    a = llo + (lhi - llo) * rng.uniform(tier["low"], (tier["low"] + tier["high"]) / 2)
    b = llo + (lhi - llo) * rng.uniform((tier["low"] + tier["high"]) / 2, tier["high"])
    low, high = _price(math.exp(a)), _price(math.exp(b))
    if high < low * 1.3:
        high = _price(low * 1.3 + 1)
    return (low, high)


def _price(x: float) -> float:
    """Retail-looking price: 24.99, 149.99, 1299.0."""
    if x < 1000:
        return round(max(1, round(x)) - 0.01, 2)
    return float(round(x, -1))


def _brand_names(
    vocab: dict[str, Any], n: int, sellable: list[str], seed: int
) -> list[tuple[str, tuple[str, ...], dict[str, Any] | None]]:
    """``n`` unique names: the anchors, then composed ones (with the vertical a name implies)."""
    rng = _rng(seed, "brand-names")
    avoid = [a.lower() for a in vocab["avoid"]]
    avoid_words = set(avoid)
    avoid_compact = {a.replace(" ", "") for a in avoid}
    out: list[tuple[str, tuple[str, ...], dict[str, Any] | None]] = []
    taken: dict[int, list[str]] = {}
    seen: set[str] = set()
    cores: set[str] = set()
    near_mark: dict[str, bool] = {}

    def ok(name: str) -> bool:
        low = name.lower()
        if low in seen or len(low) < 4:
            return False
        if low.replace(" ", "") in avoid_compact or avoid_words.intersection(low.split()):
            return False
        # not within a letter or two of a real mark, nor of another of our brands, and no two
        # brands share a leading word (a typosquat or a shortened name planted later must not
        # land on a genuine brand)
        core = low.split()[0]
        if core in cores:
            return False
        if core not in near_mark:
            near_mark[core] = (
                process.extractOne(core, avoid, scorer=fuzz.ratio, score_cutoff=80) is not None
            )
        if near_mark[core]:
            return False
        # a name within two edits of another has a length within two of it
        return all(
            process.extractOne(low, taken[n], scorer=fuzz.ratio, score_cutoff=80) is None
            for n in range(len(low) - 2, len(low) + 3)
            if n in taken
        )

    for anchor in vocab["anchors"]:
        seen.add(anchor["name"].lower())
        cores.add(anchor["name"].lower().split()[0])
        taken.setdefault(len(anchor["name"]), []).append(anchor["name"].lower())
        out.append((anchor["name"], tuple(anchor["verticals"]), anchor))
    vwords = {v: w for v, w in vocab["vertical_words"].items() if v in sellable}
    attempts = 0
    while len(out) < n and attempts < n * 50:
        attempts += 1
        style = rng.random()
        implied: tuple[str, ...] = ()
        stem = rng.choice(vocab["prefixes"]) + rng.choice(vocab["suffixes"])
        if style < 0.42:
            name = stem
        elif style < 0.56:
            a, b = rng.sample(vocab["words"], 2)
            name = f"{a} & {b}"
        elif style < 0.82 and vwords:
            v = rng.choice(sorted(vwords))
            base = stem if rng.random() < 0.6 else rng.choice(vocab["words"])
            name = f"{base} {rng.choice(vwords[v])}"
            implied = (v,)
        else:
            base = rng.choice(vocab["words"]) if rng.random() < 0.5 else stem
            name = f"{base} {rng.choice(vocab['trade_words'])}"
        if ok(name):
            seen.add(name.lower())
            cores.add(name.lower().split()[0])
            taken.setdefault(len(name), []).append(name.lower())
            out.append((name, implied, None))
    return out


def _is_reseller(handle: str, vocab: dict[str, Any]) -> bool:
    return any(handle.endswith("_" + s) for s in vocab["reseller_suffixes"])


def _sellers(
    vocab: dict[str, Any], specs: list[dict[str, Any]], n: int, seed: int
) -> tuple[tuple[str, ...], dict[str, str]]:
    """Seller handles: one official store per protected brand, resellers, marketplace shops."""
    rng = _rng(seed, "sellers")
    handles: set[str] = set()
    official: dict[str, str] = {}
    for spec in specs:
        if spec["protected"]:
            handle = f"{slug(spec['name'])}_official"
            official[spec["name"]] = handle
            handles.add(handle)
    n_resellers = max(60, n // 12)
    while len(handles) < len(official) + n_resellers:
        handles.add(
            f"{rng.choice(vocab['words']).lower()}_{rng.choice(vocab['reseller_suffixes'])}"
        )
    while len(handles) < n:
        w, noun = rng.choice(vocab["seller_words"]), rng.choice(vocab["seller_nouns"])
        style = rng.random()
        if style < 0.4:
            handle = f"{w}{noun}{rng.randint(1, 999)}"
        elif style < 0.7:
            handle = f"{w}_{noun}"
        else:
            handle = f"{w}{noun}_{rng.choice(['us', 'uk', 'eu', 'intl', 'co', 'online', 'store'])}"
        handles.add(handle)
    return tuple(sorted(handles)), official


_PLURAL = [
    (re.compile(r"ies$"), "y"),
    (re.compile(r"(ches|shes|xes|sses)$"), lambda m: m.group(1)[:-2]),
    (re.compile(r"(?<!s)s$"), ""),
]


def _singular(name: str) -> str:
    words = name.split()
    last = words[-1]
    for pat, rep in _PLURAL:
        if pat.search(last):
            last = pat.sub(rep, last, count=1)
            break
    return " ".join([*words[:-1], last])


def _recalls(
    vocab: dict[str, Any],
    brands: dict[str, Brand],
    categories: dict[str, Category],
    n: int,
    seed: int,
) -> tuple[Recall, ...]:
    rng = _rng(seed, "recalls")
    leaves_by_vertical: dict[str, list[str]] = {}
    exclude = set(vocab.get("recall_exclude", []))
    for c in categories.values():
        if c.is_leaf and c.policy == "ok" and c.vertical not in exclude:
            leaves_by_vertical.setdefault(c.vertical, []).append(c.id)
    candidates = [
        b
        for b in brands.values()
        if b.registered and any(v in leaves_by_vertical for v in b.verticals)
    ]
    reasons = vocab["recall_reasons"]
    out: list[Recall] = []
    used_models: set[str] = set()
    for i in range(n):
        if not candidates:
            break
        brand = rng.choice(candidates)
        vert = rng.choice([v for v in brand.verticals if v in leaves_by_vertical])
        cid = rng.choice(leaves_by_vertical[vert])
        initials = "".join(w[0] for w in re.findall(r"[A-Za-z]+", brand.name))[:3].upper()
        if len(initials) < 2:
            initials = brand.name[:2].upper()
        model = f"{initials}-{rng.randint(100, 9999)}{rng.choice(['', '', 'A', 'B', 'X', 'S'])}"
        while model in used_models:
            model = f"{initials}-{rng.randint(100, 9999)}{rng.choice(['A', 'B', 'X', 'S', 'Z'])}"
        used_models.add(model)
        year = rng.randint(2019, 2026)
        line = rng.choice(vocab["model_lines"])
        noun = _singular(categories[cid].name)
        out.append(
            Recall(
                recall_id=f"RC-{year}-{i + 1:04d}",
                brand=brand.name,
                product=f"{brand.name} {line} {rng.randint(1, 9)} {noun}",
                model_number=model,
                batch=f"L{year % 100:02d}{rng.randint(1, 52):02d}-{rng.randint(1, 999):03d}",
                category_id=cid,
                reason=rng.choice(
                    reasons[vert] if vert in reasons and rng.random() < 0.5 else reasons["generic"]
                ),
            )
        )
    out.sort(key=lambda r: r.recall_id)
    return tuple(out)

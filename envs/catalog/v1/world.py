"""The catalog v1 world: the v0 taxonomy and registry plus what v1's judgement needs.

:class:`V1World` wraps a :class:`envs.catalog.world.CatalogWorld` (taxonomy, attribute schemas,
search index, brand registry and recall notices are shared with v0, read from the same disk
cache) and adds, deterministically from the seed:

* **parts**: the world is cut in two. ``train`` cases draw from the ``train`` part; ``dev`` and
  ``test`` draw from the held-out ``eval`` part: its own brands, sellers, recall notices, long-tail
  brands, a few whole verticals and a share of the leaves of the others. The tools still see the
  whole world (a real registry is not split), but no brand, seller or recall notice of a test
  listing ever appears in a train listing.
* **sellers**: neutral handles (no name says "official") with an account age, a rating, the
  country they ship from, their sales, past takedowns, and the brands they are authorized for.
* **authorized sellers** of every registered brand (gated brands only allow those).
* **look-alike legitimate brands**: registered brands whose names resemble another registered
  brand (as real marks do), so "similar to a registered brand" alone is no verdict.
* **long-tail brands**: genuine small brands that are not in the registry at all.
* **recall notices with batches**: each notice names a model number and the affected batches.

Brand look-ups fold homoglyphs from other scripts, spacing and punctuation before the fuzzy
match (:func:`skeleton`, :meth:`V1World.lookup_brand`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rapidfuzz import fuzz, process, utils

from envs.catalog.common.forge import HOMOGLYPHS, near_batch
from envs.catalog.world.model import Brand, CatalogWorld
from twin.cases import stable_seed

__all__ = [
    "PARTS",
    "SPLIT_PART",
    "V1Recall",
    "V1World",
    "Seller",
    "fold",
    "skeleton",
    "v1_world",
]

#: The two parts of the world, and the part each split draws its listings from.
PARTS: tuple[str, ...] = ("train", "eval")
SPLIT_PART: dict[str, str] = {"train": "train", "dev": "eval", "test": "eval"}

_UNGLYPH = {v: k for k, v in HOMOGLYPHS.items()}
_LEET = str.maketrans(
    {
        "0": "o",
        "1": "i",
        "3": "e",
        "4": "a",
        "5": "s",
        "7": "t",
        "l": "i",
        "|": "i",
        "$": "s",
        "@": "a",
    }
)

# fmt: off
_SELLER_A = (
    "harbor", "maple", "north", "cedar", "silver", "blue", "quiet", "amber", "river", "stone",
    "urban", "prairie", "copper", "lucky", "sunny", "coastal", "daily", "metro", "golden", "green",
    "swift", "bright", "old", "new", "little", "grand", "west", "east", "pine", "oak", "velvet",
    "iron", "echo", "nova", "polar", "vista", "prime", "zen",
)
# fmt: on
# fmt: off
_SELLER_B = (
    "goods", "trading", "supply", "market", "outlet", "store", "depot", "finds", "shop", "traders",
    "mart", "bazaar", "exchange", "emporium", "corner", "warehouse", "deals", "house", "lane",
    "direct", "wholesale", "resale", "closet", "attic", "post", "hub",
)
# fmt: on
# fmt: off
_COUNTRIES = (
    "US", "US", "US", "CA", "GB", "DE", "FR", "NL", "CN", "CN", "HK", "VN", "IN", "TR", "MX", "PL",
    "JP", "KR",
)
# fmt: on
# fmt: off
_LT_ONSET = (
    "b", "br", "d", "dr", "f", "g", "gl", "h", "j", "k", "kl", "l", "m", "n", "p", "pl", "qu", "r",
    "s", "sk", "st", "t", "tr", "v", "w", "z", "ch", "sh", "th",
)
# fmt: on
_LT_VOWEL = ("a", "e", "i", "o", "u", "ai", "ou", "ee", "oa", "y")
_LT_CODA = ("", "", "", "n", "m", "r", "l", "x", "sk", "nd", "t", "ck", "sh")
# fmt: off
_LT_TAIL = (
    "", "", "", " Studio", " Goods", " Works", " Co.", " Craft", " Home", " Supply", " Atelier",
    " Kids", " Outdoor", " Made", " Lab",
)
# fmt: on
# fmt: off
_LOOKALIKE_TAIL = (
    " Home", " Outdoor", " Kids", " Studio", " Living", " Sport", " Works", " Lab", " & Co.",
    " Atelier", " Design", " Gear",
)
# fmt: on


def fold(text: str) -> str:
    """NFKC, homoglyphs from other scripts mapped back to Latin, zero-width characters dropped."""
    norm = unicodedata.normalize("NFKC", str(text))
    return "".join(_UNGLYPH.get(ch, ch) for ch in norm if unicodedata.category(ch) != "Cf")


def skeleton(text: str) -> str:
    """What a brand name looks like to a buyer: folded, lower case, digits read as letters,
    spacing and punctuation removed (``"N1-ke"`` and ``"Nіke"`` both -> ``"nike"``)."""
    low = fold(text).lower().replace("rn", "m").replace("vv", "w").translate(_LEET)
    return re.sub(r"[^a-z]", "", low)


@dataclass(frozen=True, slots=True)
class Seller:
    """A marketplace seller account.

    Attributes:
        name: The handle shown on listings.
        part: The world part (``train`` or ``eval``) whose listings use this seller.
        account_age_days: Days since the account opened.
        rating: Buyer rating, 1.0-5.0.
        sales: Completed orders.
        ships_from: ISO country code.
        takedowns: Past takedowns: ``(brand, reason, year)``; reason ``counterfeit`` or another
            policy.
        authorized_brands: Registered brands this seller is an authorized reseller of.
    """

    name: str
    part: str
    account_age_days: int
    rating: float
    sales: int
    ships_from: str
    takedowns: tuple[tuple[str, str, int], ...]
    authorized_brands: tuple[str, ...]

    def view(self) -> dict[str, Any]:
        """What ``get_seller`` shows."""
        return {
            "name": self.name,
            "account_age_days": self.account_age_days,
            "rating": self.rating,
            "sales": self.sales,
            "ships_from": self.ships_from,
            "takedowns": [{"brand": b, "reason": r, "year": y} for b, r, y in self.takedowns],
            "authorized_brands": list(self.authorized_brands),
        }


@dataclass(frozen=True, slots=True)
class V1Recall:
    """A recall notice with the batches it affects.

    Attributes:
        recall_id: Notice id.
        brand: The recalled brand.
        product: The product as the notice names it.
        model_number: The recalled model number.
        batches: Affected batch codes (other batches of the model are not recalled).
        category_id: The leaf the product belongs to.
        reason: The hazard.
        part: The world part whose listings may carry this notice.
    """

    recall_id: str
    brand: str
    product: str
    model_number: str
    batches: tuple[str, ...]
    category_id: str
    reason: str
    part: str


def _h(seed: int, *parts: Any) -> float:
    """A stable number in [0, 1) for ``parts`` (partition draws that do not depend on order)."""
    digest = hashlib.blake2b(json.dumps([seed, *parts]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class V1World:
    """The v0 world plus parts, sellers, look-alike and long-tail brands, batch recalls.

    Everything of the base world (``categories``, ``leaves``, ``attributes``, ``schema``,
    ``search``, ``exists``, ``ancestors``, ``msrp`` ...) is served by the base world; brands are
    the base registry plus the look-alike legitimate brands.

    Args:
        base: The v0 world of the same seed and taxonomy.
        seed: The world seed.
    """

    #: Verticals held out of train (whole verticals only the eval part shows).
    HELD_OUT_VERTICALS = 3
    #: Share of the other leaves, brands and recalls that go to the eval part.
    EVAL_SHARE = 0.25

    def __init__(self, base: CatalogWorld, seed: int) -> None:
        self.base = base
        self.seed = seed
        rng = random.Random(stable_seed("catalog-v1-world", seed, base.source))
        self._partition(rng)
        self._make_lookalikes(rng)
        self._make_sellers(rng)
        self._make_recalls(rng)
        self._make_longtail(rng)
        self._digest: str | None = None

    # -- the base world ------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # only reached for names V1World does not define: the taxonomy and its look-ups
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def __repr__(self) -> str:
        return (
            f"V1World(source={self.base.source!r}, leaves={len(self.base.leaves)}, "
            f"brands={len(self.brands)}, sellers={len(self.sellers)}, "
            f"longtail={sum(map(len, self.longtail.values()))}, recalls={len(self.recalls)}, "
            f"held_out={list(self.held_out)})"
        )

    # -- construction --------------------------------------------------------------------------
    def _partition(self, rng: random.Random) -> None:
        base = self.base
        by_vertical: dict[str, int] = {}
        for leaf in base.leaves:
            v = base.categories[leaf].vertical
            by_vertical[v] = by_vertical.get(v, 0) + 1
        # hold out a few mid-sized verticals that have no prohibited leaves (those stay shared)
        prohibited_verticals = {
            base.categories[x].vertical
            for x in base.leaves
            if base.categories[x].policy == "prohibited"
        }
        sized = sorted(
            v for v, n in by_vertical.items() if n >= 100 and v not in prohibited_verticals
        )
        self.held_out: tuple[str, ...] = tuple(
            sorted(rng.sample(sized, min(self.HELD_OUT_VERTICALS, len(sized))))
        )
        self.leaf_part: dict[str, str] = {}
        for leaf in base.leaves:
            cat = base.categories[leaf]
            held = cat.vertical in self.held_out or _h(self.seed, "leaf", leaf) < self.EVAL_SHARE
            self.leaf_part[leaf] = "eval" if held else "train"
        self.brand_part: dict[str, str] = {}
        for b in base.brands.values():
            held = (
                any(v in self.held_out for v in b.verticals)
                or _h(self.seed, "brand", b.name) < self.EVAL_SHARE
            )
            self.brand_part[b.name] = "eval" if held else "train"

    def _make_lookalikes(self, rng: random.Random) -> None:
        """Registered brands whose names resemble another registered brand, genuinely."""
        base = self.base
        brands = dict(base.brands)
        taken = {skeleton(n) for n in brands}
        self.lookalike_of: dict[str, str] = {}
        registered = sorted(n for n, b in brands.items() if b.registered and len(n) <= 18)
        for name in rng.sample(registered, min(240, len(registered))):
            src = brands[name]
            first = name.split(" ")[0]
            for _ in range(4):
                cand = first + rng.choice(_LOOKALIKE_TAIL)
                sk = skeleton(cand)
                if sk in taken or cand.lower() == name.lower():
                    continue
                taken.add(sk)
                scale = rng.uniform(0.8, 1.25)
                msrp = {
                    cid: (round(lo * scale, 2), round(hi * scale, 2))
                    for cid, (lo, hi) in src.msrp.items()
                }
                brands[cand] = Brand(
                    name=cand,
                    registered=True,
                    protected=False,
                    authorized_sellers=(),
                    verticals=src.verticals,
                    msrp=msrp,
                )
                self.lookalike_of[cand] = name
                self.brand_part[cand] = self.brand_part[name]
                break
        self._brands_pre = brands

    def _make_sellers(self, rng: random.Random) -> None:
        names = _seller_names(rng)
        part_of = {n: ("eval" if _h(self.seed, "seller", n) < 0.3 else "train") for n in names}
        by_part = {p: [n for n in names if part_of[n] == p] for p in PARTS}
        auth_of = self._authorize(rng, names, by_part)
        registered_by_part = {
            p: sorted(n for n, b in self.brands.items() if b.registered and self.brand_part[n] == p)
            for p in PARTS
        }
        self.seller_records: dict[str, Seller] = {}
        for n in names:
            self.seller_records[n] = _seller_record(
                rng, n, part_of[n], auth_of[n], registered_by_part[part_of[n]]
            )
        self.sellers: tuple[str, ...] = tuple(names)
        self.sellers_by_part = {p: tuple(by_part[p]) for p in PARTS}
        self._seller_lower = {n.lower(): n for n in names}

    def _authorize(
        self, rng: random.Random, names: list[str], by_part: dict[str, list[str]]
    ) -> dict[str, list[str]]:
        """Draw the authorized sellers of every registered brand (from the brand's own part),
        build :attr:`brands` with them, and return the brands each seller is authorized for."""
        authorized: dict[str, tuple[str, ...]] = {}
        auth_of: dict[str, list[str]] = {n: [] for n in names}
        for bname in sorted(self._brands_pre):
            b = self._brands_pre[bname]
            if not b.registered:
                continue
            pool = by_part[self.brand_part[bname]]
            picked = tuple(sorted(rng.sample(pool, rng.randint(1, 4))))
            authorized[bname] = picked
            for s in picked:
                auth_of[s].append(bname)
        self.brands: dict[str, Brand] = {}
        for bname, b in self._brands_pre.items():
            sellers = authorized.get(bname, ())
            self.brands[bname] = Brand(
                name=b.name,
                registered=b.registered,
                protected=b.protected,
                authorized_sellers=sellers,
                verticals=b.verticals,
                msrp=b.msrp,
            )
        del self._brands_pre
        return auth_of

    def _make_recalls(self, rng: random.Random) -> None:
        out: list[V1Recall] = []
        for r in self.base.recalls:
            if r.brand not in self.brands or r.category_id not in self.base.categories:
                continue
            extra = tuple(near_batch(rng, r.batch) for _ in range(rng.randint(0, 2)))
            batches = tuple(sorted({r.batch, *extra}))
            out.append(
                V1Recall(
                    recall_id=r.recall_id,
                    brand=r.brand,
                    product=r.product,
                    model_number=r.model_number,
                    batches=batches,
                    category_id=r.category_id,
                    reason=r.reason,
                    part=self.brand_part[r.brand],
                )
            )
        self.recalls: tuple[V1Recall, ...] = tuple(out)
        self.recalls_by_brand: dict[str, tuple[V1Recall, ...]] = {}
        for r in out:
            self.recalls_by_brand[r.brand] = (*self.recalls_by_brand.get(r.brand, ()), r)
        self.recalled_models = frozenset(r.model_number for r in out)

    def _make_longtail(self, rng: random.Random) -> None:
        """Genuine small brands outside the registry, unlike any registered name."""
        self._skeletons: dict[str, tuple[str, ...]] = {}
        for n in sorted(self.brands):
            self._skeletons.setdefault(skeleton(n), ())
            self._skeletons[skeleton(n)] += (n,)
        self._brand_lower = {n.lower(): b for n, b in self.brands.items()}
        self._lookup_cache: dict[tuple[str, int], dict[str, Any]] = {}
        self._lookalike_names = sorted(self.lookalike_of)
        self._lookalike_norm = [utils.default_process(n) for n in self._lookalike_names]
        self.longtail: dict[str, tuple[str, ...]] = {p: () for p in PARTS}
        made: dict[str, list[str]] = {p: [] for p in PARTS}
        seen: set[str] = set()
        tries = 0
        while min(len(v) for v in made.values()) < 500 and tries < 20_000:
            tries += 1
            word = "".join(
                rng.choice(_LT_ONSET) + rng.choice(_LT_VOWEL) for _ in range(rng.randint(2, 3))
            )
            word += rng.choice(_LT_CODA)
            name = word.capitalize() + rng.choice(_LT_TAIL)
            sk = skeleton(name)
            if sk in seen or len(word) < 5:
                continue
            seen.add(sk)
            if self.brand_similarity(name) >= 75:
                continue
            part = "eval" if _h(self.seed, "longtail", name) < 0.3 else "train"
            if len(made[part]) < 500:
                made[part].append(name)
        self.longtail = {p: tuple(sorted(v)) for p, v in made.items()}

    # -- look-ups ------------------------------------------------------------------------------
    def lookup_brand(self, name: str, limit: int = 5) -> dict[str, Any]:
        """Exact (case-insensitive) brand and the most similar registry brands.

        Similarity (0-100) is rapidfuzz's WRatio on the names with homoglyphs folded back to
        Latin, and 100 when both names read the same once spacing, punctuation and digits that
        stand for letters are ignored (:func:`skeleton`).

        Returns:
            ``{"exact": Brand | None, "matches": [(Brand, score), ...]}``, best first.
        """
        text = str(name).strip()
        key = (text, int(limit))
        found = self._lookup_cache.get(key)
        if found is not None:
            return found
        exact = self._brand_lower.get(text.lower())
        folded = fold(text)
        scores: dict[str, float] = {}
        for b, score in self.base.lookup_brand(folded, limit=limit + 3)["matches"]:
            if b.name in self.brands:
                scores[b.name] = score
        q = utils.default_process(folded)
        if q:
            for _, s, i in process.extract(
                q,
                self._lookalike_norm,
                scorer=fuzz.WRatio,
                processor=None,
                limit=limit,
                score_cutoff=60,
            ):
                n = self._lookalike_names[i]
                scores[n] = max(scores.get(n, 0.0), round(float(s), 1))
        for n in self._skeletons.get(skeleton(text), ()):
            scores[n] = 100.0
        ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
        found = {"exact": exact, "matches": [(self.brands[n], s) for n, s in ranked]}
        if len(self._lookup_cache) > 50_000:
            self._lookup_cache.clear()
        self._lookup_cache[key] = found
        return found

    def brand_similarity(self, name: str) -> float:
        """The highest similarity of ``name`` to a registered brand other than itself."""
        found = self.lookup_brand(name, limit=5)
        exact = found["exact"]
        return max(
            (
                s
                for b, s in found["matches"]
                if b.registered and (exact is None or b.name != exact.name)
            ),
            default=0.0,
        )

    def msrp(self, brand_name: str, category_id: str) -> tuple[float, float] | None:
        """The brand's list price range for ``category_id`` (deepest on its path), or None."""
        brand = self._brand_lower.get(str(brand_name).strip().lower())
        if brand is None or category_id not in self.base.categories:
            return None
        for cid in reversed(self.base.ancestors(category_id)):
            if cid in brand.msrp:
                return brand.msrp[cid]
        return None

    def seller(self, name: str) -> Seller | None:
        """The seller called ``name`` (case-insensitive), or None."""
        real = self._seller_lower.get(str(name).strip().lower())
        return self.seller_records[real] if real is not None else None

    def similar_sellers(self, name: str, n: int = 3) -> list[str]:
        """Seller handles closest to ``name`` (for error messages)."""
        import difflib

        return difflib.get_close_matches(str(name), list(self.sellers), n=n, cutoff=0.6)

    def digest(self) -> str:
        """SHA-256 of the base world's digest and everything v1 adds."""
        if self._digest is None:
            rows = {
                "base": self.base.digest(),
                "held_out": list(self.held_out),
                "brands": sorted(
                    [b.name, b.registered, b.protected, list(b.authorized_sellers)]
                    for b in self.brands.values()
                ),
                "sellers": [
                    list(s.view().values()) + [s.part] for s in self.seller_records.values()
                ],
                "recalls": [
                    [r.recall_id, r.model_number, list(r.batches), r.part] for r in self.recalls
                ],
                "longtail": {p: list(v) for p, v in self.longtail.items()},
            }
            text = json.dumps(rows, sort_keys=True, ensure_ascii=False, default=str)
            self._digest = hashlib.sha256(text.encode()).hexdigest()
        return self._digest


def _seller_names(rng: random.Random) -> list[str]:
    """2,400 neutral seller handles, sorted (no name says official or authorized)."""
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < 2400:
        style = rng.random()
        a, b = rng.choice(_SELLER_A), rng.choice(_SELLER_B)
        if style < 0.4:
            name = f"{a}_{b}"
        elif style < 0.7:
            name = f"{a}{b}{rng.randint(1, 99)}"
        else:
            name = f"{a.capitalize()}{b.capitalize()}"
        if name.lower() not in seen:
            seen.add(name.lower())
            names.append(name)
    names.sort()
    return names


def _seller_record(
    rng: random.Random, name: str, part: str, authorized: list[str], registered: list[str]
) -> Seller:
    """A seller's record: takedowns (brands from ``registered``, its part's registered brands),
    account age, rating, sales and country."""
    takedowns: list[tuple[str, str, int]] = []
    roll = rng.random()
    if roll < 0.14:  # a counterfeit takedown of a brand it is not authorized for
        for _ in range(rng.randint(1, 2)):
            brand = rng.choice(registered)
            if brand not in authorized:
                takedowns.append((brand, "counterfeit", rng.randint(2019, 2025)))
    if rng.random() < 0.12:  # takedowns for other policies say nothing about fakes
        reason = rng.choice(
            [
                "misleading photos",
                "wrong category",
                "late shipping",
                "keyword spam",
                "price gouging",
            ]
        )
        takedowns.append((rng.choice(registered), reason, rng.randint(2019, 2025)))
    age = int(rng.choice([rng.randint(3, 200), rng.randint(200, 900), rng.randint(900, 5000)]))
    rating = round(min(5.0, max(1.5, rng.gauss(4.5, 0.45))), 1)
    return Seller(
        name=name,
        part=part,
        account_age_days=age,
        rating=rating,
        sales=int(age * rng.uniform(0.05, 3.0)),
        ships_from=rng.choice(_COUNTRIES),
        takedowns=tuple(sorted(takedowns)),
        authorized_brands=tuple(sorted(authorized)),
    )


_V1: dict[int, V1World] = {}
#: Fields a cached overlay stores (everything V1World adds to the base world).
_STATE_SKIP = ("base", "_lookup_cache")


def _code_digest() -> str:
    """This module's source: a changed overlay generator never serves a stale cache."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def v1_world(base: CatalogWorld, seed: int, cache_key: str | None = None) -> V1World:
    """The :class:`V1World` over ``base``: built once per base world in a process, and cached
    on disk next to the base world when ``cache_key`` (the base world's own cache key) is given.

    Building the overlay takes a few seconds (every long-tail brand name is checked against the
    registry); a cached one loads in milliseconds.
    """
    held = _V1.get(id(base))
    if held is not None and held.base is base and held.seed == seed:
        return held
    path = None
    if cache_key is not None:
        from envs.catalog.world.build import cache_root

        path = cache_root() / "v1" / f"{cache_key}-{seed}-{_code_digest()}.pkl"
        if path.exists():
            try:
                with open(path, "rb") as fh:  # our own cache file, written below
                    state = pickle.load(fh)
                held = V1World.__new__(V1World)
                held.__dict__.update(state)
                held.base = base
                held._lookup_cache = {}
            except Exception:  # a torn or foreign file: rebuild it
                held = None
    if held is None:
        held = V1World(base, seed)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            state = {k: v for k, v in held.__dict__.items() if k not in _STATE_SKIP}
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                pickle.dump(state, fh, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)  # atomic: a reader never sees half a file
    _V1[id(base)] = held
    return held

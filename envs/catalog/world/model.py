"""The catalog world's records and the read-only :class:`CatalogWorld` that serves them.

Every record is a frozen, slotted dataclass: a world is built once per process and shared
read-only by every episode, so nothing in it may change after construction.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from rapidfuzz import fuzz, process, utils

from twin.errors import ToolError

if TYPE_CHECKING:
    from envs.catalog.world.search import TaxonomyIndex

__all__ = [
    "Attribute",
    "AttributeLink",
    "Brand",
    "CatalogWorld",
    "Category",
    "Recall",
]


_CANDIDATES = 64  # brands scored per fuzzy look-up, picked by shared trigrams
_CACHE_SIZE = 16_384  # look-ups remembered (GRPO groups repeat the same case's queries)


def _trigrams(norm: str) -> set[str]:
    padded = f"  {norm} "
    return {padded[i : i + 3] for i in range(len(padded) - 2)}


@dataclass(frozen=True, slots=True)
class AttributeLink:
    """An attribute attached to a category.

    Attributes:
        handle: The attribute's handle, a key of :attr:`CatalogWorld.attributes`.
        required: Whether a listing in this category must state a value for it.
    """

    handle: str
    required: bool


@dataclass(frozen=True, slots=True)
class Category:
    """One node of the taxonomy.

    Attributes:
        id: Path-encoding id: ``aa-1-13-8`` is a child of ``aa-1-13``; ``aa`` is a vertical.
        name: The node's own name, e.g. ``"Women's Dresses"``.
        full_name: The names on the path from the vertical down, joined with ``" > "``.
        parent_id: The parent's id, ``None`` for a vertical.
        depth: 1 for a vertical, 2 for its children, and so on.
        vertical: The id of the root of this node's tree.
        is_leaf: Whether the node has no children.
        children: The children's ids, in id order.
        attributes: The attributes a listing in this category has (inherited ones included).
        synonyms: Other words buyers use for it (indexed by search).
        policy: ``"ok"`` or ``"prohibited"`` (weapons, drugs, alcohol, ... subtrees).
    """

    id: str
    name: str
    full_name: str
    parent_id: str | None
    depth: int
    vertical: str
    is_leaf: bool
    children: tuple[str, ...]
    attributes: tuple[AttributeLink, ...]
    synonyms: tuple[str, ...]
    policy: str = "ok"


@dataclass(frozen=True, slots=True)
class Attribute:
    """An attribute with a closed list of allowed values.

    Attributes:
        handle: Stable key, e.g. ``"color"`` or ``"dress_features"``.
        name: Display name, e.g. ``"Color"``.
        values: The allowed values, e.g. ``("Black", "Blue", ...)``.
    """

    handle: str
    name: str
    values: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Brand:
    """A brand in the registry.

    Attributes:
        name: The brand as it is registered, e.g. ``"Kestrel & Pike"``.
        registered: Whether the brand is in the trademark registry.
        protected: Whether only the authorized sellers may list it (a gated brand).
        authorized_sellers: Seller handles allowed to sell a protected brand.
        verticals: Vertical ids the brand sells in.
        msrp: Category id (a vertical or deeper) -> (low, high) list price range in USD.
    """

    name: str
    registered: bool
    protected: bool
    authorized_sellers: tuple[str, ...]
    verticals: tuple[str, ...]
    msrp: dict[str, tuple[float, float]] = field(hash=False, compare=True)


@dataclass(frozen=True, slots=True)
class Recall:
    """A product safety recall notice.

    Attributes:
        recall_id: Notice id, e.g. ``"RC-2024-0137"``.
        brand: The recalled brand's name.
        product: The product's name as the notice gives it.
        model_number: The recalled model number.
        batch: The recalled batch or lot code.
        category_id: The leaf category the product belongs to.
        reason: The hazard, e.g. ``"fire hazard: battery may overheat"``.
    """

    recall_id: str
    brand: str
    product: str
    model_number: str
    batch: str
    category_id: str
    reason: str


class CatalogWorld:
    """The catalog twin's static world: taxonomy, attribute schemas, brands, sellers, recalls.

    Built by :func:`envs.catalog.world.build_world`; read-only and shared by every episode.
    Look-ups are served from in-memory dicts; :meth:`search` from a tantivy index.
    """

    # fmt: off
    __slots__ = (
        "source", "categories", "leaves", "attributes", "brands", "sellers", "recalls", "_index",
        "_brand_lower", "_brand_names", "_brand_norm", "_brand_grams", "_brand_cache", "_digest",
    )
    # fmt: on

    def __init__(
        self,
        *,
        source: str,
        categories: dict[str, Category],
        attributes: dict[str, Attribute],
        brands: dict[str, Brand],
        sellers: tuple[str, ...],
        recalls: tuple[Recall, ...],
        index: TaxonomyIndex | None = None,
    ) -> None:
        self.source = source
        self.categories = categories
        self.leaves = tuple(sorted(cid for cid, c in categories.items() if c.is_leaf))
        self.attributes = attributes
        self.brands = brands
        self.sellers = sellers
        self.recalls = recalls
        self._index = index
        self._brand_lower = {name.lower(): b for name, b in brands.items()}
        # fuzzy look-up: names normalised once, and a trigram index that narrows 2,000+ brands
        # to a few dozen candidates before rapidfuzz scores them
        self._brand_names = sorted(brands)
        self._brand_norm = [utils.default_process(n) for n in self._brand_names]
        grams: dict[str, list[int]] = {}
        for i, norm in enumerate(self._brand_norm):
            for g in _trigrams(norm):
                grams.setdefault(g, []).append(i)
        self._brand_grams = {g: np.asarray(ix, dtype=np.int32) for g, ix in grams.items()}
        self._brand_cache: dict[tuple[str, int], tuple[tuple[Brand, float], ...]] = {}
        self._digest: str | None = None

    def __repr__(self) -> str:
        return (
            f"CatalogWorld(source={self.source!r}, categories={len(self.categories)}, "
            f"leaves={len(self.leaves)}, attributes={len(self.attributes)}, "
            f"brands={len(self.brands)}, sellers={len(self.sellers)}, recalls={len(self.recalls)})"
        )

    # -- taxonomy ------------------------------------------------------------------------------
    @property
    def verticals(self) -> tuple[str, ...]:
        """The ids of the depth-1 categories, sorted."""
        return tuple(sorted(c.id for c in self.categories.values() if c.parent_id is None))

    def exists(self, category_id: str) -> bool:
        """Whether ``category_id`` names a category of this world."""
        return category_id in self.categories

    def category(self, category_id: str) -> Category:
        """The category ``category_id``.

        Raises:
            ToolError: the id is unknown; the message says what ids look like and how to find one.
        """
        try:
            return self.categories[category_id]
        except (KeyError, TypeError):
            raise ToolError(self._unknown_category_message(category_id)) from None

    def depth(self, category_id: str) -> int:
        """The depth of ``category_id`` (1 for a vertical)."""
        return self.category(category_id).depth

    def ancestors(self, category_id: str) -> list[str]:
        """The ids on the path from the vertical down to ``category_id`` (root first, itself
        last)."""
        node = self.category(category_id)
        path = [node.id]
        while node.parent_id is not None:
            node = self.categories[node.parent_id]
            path.append(node.id)
        path.reverse()
        return path

    def schema(self, category_id: str) -> list[tuple[Attribute, bool]]:
        """The attribute schema of ``category_id``: ``(attribute, required)`` pairs."""
        return [
            (self.attributes[a.handle], a.required) for a in self.category(category_id).attributes
        ]

    def is_prohibited(self, category_id: str) -> bool:
        """Whether listings in ``category_id`` are banned by policy."""
        return self.category(category_id).policy == "prohibited"

    def search(self, query: str, limit: int = 10) -> list[dict[str, Any]]:
        """Search the taxonomy (BM25 over names, full paths and synonyms).

        Args:
            query: Free text; any characters are accepted (query syntax is neutralised).
            limit: At most this many hits (1-100).

        Returns:
            Hits, best first: ``{"id", "name", "full_name", "score"}``. Empty if nothing matches.
        """
        if self._index is None:
            raise RuntimeError("this CatalogWorld has no search index; build it with build_world()")
        return self._index.search(query, limit)

    # -- brands --------------------------------------------------------------------------------
    def lookup_brand(self, name: str, limit: int = 5) -> dict[str, Any]:
        """Find a brand by exact (case-insensitive) name and by fuzzy similarity.

        Returns:
            ``{"exact": Brand | None, "matches": [(Brand, score 0-100), ...]}``, best first;
            ``matches`` holds up to ``limit`` fuzzy matches scoring at least 60.
        """
        text = str(name).strip()
        exact = self._brand_lower.get(text.lower())
        key = (text.lower(), int(limit))
        matches = self._brand_cache.get(key)
        if matches is None:
            matches = self._fuzzy_brands(text, int(limit))
            if len(self._brand_cache) >= _CACHE_SIZE:
                self._brand_cache.clear()
            self._brand_cache[key] = matches
        return {"exact": exact, "matches": list(matches)}

    def _fuzzy_brands(self, text: str, limit: int) -> tuple[tuple[Brand, float], ...]:
        query = utils.default_process(text)
        if not query or limit <= 0:
            return ()
        hits = [self._brand_grams[g] for g in _trigrams(query) if g in self._brand_grams]
        if hits and len(self._brand_norm) > _CANDIDATES:
            counts = np.bincount(np.concatenate(hits), minlength=len(self._brand_norm))
            top = np.argpartition(counts, -_CANDIDATES)[-_CANDIDATES:]
            candidates = [int(i) for i in top if counts[i] > 0]
        else:
            candidates = range(len(self._brand_norm))
        found = process.extract(
            query,
            {i: self._brand_norm[i] for i in candidates},
            scorer=fuzz.WRatio,
            processor=None,
            limit=None,
            score_cutoff=60,
        )
        # ties are broken by name so results do not depend on candidate order
        found.sort(key=lambda hit: (-hit[1], self._brand_names[hit[2]]))
        return tuple(
            (self.brands[self._brand_names[i]], round(float(score), 1))
            for _, score, i in found[:limit]
        )

    def msrp(self, brand_name: str, category_id: str) -> tuple[float, float] | None:
        """The brand's list price range for ``category_id``: the deepest range on its path.

        Returns ``None`` when the brand is unknown or has no range on the category's path.
        """
        brand = self._brand_lower.get(str(brand_name).strip().lower())
        if brand is None or category_id not in self.categories:
            return None
        for cid in reversed(self.ancestors(category_id)):
            if cid in brand.msrp:
                return brand.msrp[cid]
        return None

    # -- identity ------------------------------------------------------------------------------
    def canonical_rows(self) -> dict[str, list[Any]]:
        """The world as sorted JSON-able rows per table (what :meth:`digest` hashes)."""
        return {
            "categories": [
                [
                    c.id,
                    c.name,
                    c.full_name,
                    c.parent_id,
                    c.depth,
                    c.vertical,
                    c.is_leaf,
                    list(c.children),
                    [[a.handle, a.required] for a in c.attributes],
                    list(c.synonyms),
                    c.policy,
                ]
                for c in sorted(self.categories.values(), key=lambda c: c.id)
            ],
            "attributes": [
                [a.handle, a.name, list(a.values)]
                for a in sorted(self.attributes.values(), key=lambda a: a.handle)
            ],
            "brands": [
                [
                    b.name,
                    b.registered,
                    b.protected,
                    list(b.authorized_sellers),
                    list(b.verticals),
                    sorted([k, lo, hi] for k, (lo, hi) in b.msrp.items()),
                ]
                for b in sorted(self.brands.values(), key=lambda b: b.name)
            ],
            "sellers": sorted(self.sellers),
            "recalls": [
                [r.recall_id, r.brand, r.product, r.model_number, r.batch, r.category_id, r.reason]
                for r in sorted(self.recalls, key=lambda r: r.recall_id)
            ],
        }

    def digest(self) -> str:
        """SHA-256 of a canonical dump of the whole world, for byte-identity checks."""
        if self._digest is None:
            text = json.dumps(
                self.canonical_rows(), sort_keys=True, ensure_ascii=False, separators=(",", ":")
            )
            self._digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        return self._digest

    # -- helpers -------------------------------------------------------------------------------
    def _unknown_category_message(self, category_id: object) -> str:
        example = self.leaves[0] if self.leaves else "aa-1"
        text = str(category_id)
        hint = ""
        if isinstance(category_id, str) and "-" in text:
            parent = text.rsplit("-", 1)[0]
            if parent in self.categories:
                kids = self.categories[parent].children[:8]
                hint = f"; {parent} has children: {', '.join(kids) or 'none'}"
        return (
            f"unknown category id {text!r}: ids look like {example!r} "
            f"(vertical code, then child numbers){hint}; use search_taxonomy to find one"
        )

"""What catalog v2's tools return, computed from the world (the generator reads the same views).

:class:`Views` wraps the v1 world (taxonomy, registry, sellers, parts) with v2's content rules
(:mod:`envs.catalog.v2.content`): MSRP from per-category priors and the brand's tier, recall
hazards that fit the category, schema policies ``prohibited`` / ``certificate_required`` / ``ok``
and whether a condition may be stated.
"""

from __future__ import annotations

import re
from typing import Any

from envs.catalog.common.text import MODEL_RE
from envs.catalog.v2 import content

__all__ = ["Views", "resolve_item"]


class Views:
    """Tool views over one world (cached per input)."""

    def __init__(self, world: Any) -> None:
        self.world = world
        self._schema: dict[str, dict[str, Any]] = {}
        self._lookup: dict[tuple[str, str | None], dict[str, Any]] = {}

    def msrp(self, brand_name: str, leaf: str) -> tuple[float, float] | None:
        """The brand's MSRP range for ``leaf`` when it sells on the leaf's path, else None."""
        w = self.world
        if w.msrp(brand_name, leaf) is None:
            return None
        cat = w.categories[leaf]
        brand = w.brands.get(brand_name) or w._brand_lower.get(brand_name.lower())
        return content.msrp_for(brand.name, cat.vertical, cat.full_name, leaf)

    def policy(self, cid: str) -> str:
        """``prohibited``, ``certificate_required`` or ``ok``."""
        cat = self.world.categories[cid]
        if cat.policy == "prohibited":
            return "prohibited"
        return "certificate_required" if content.restricted(cat.full_name, cat.policy) else "ok"

    def schema(self, cid: str) -> dict[str, Any]:
        """``get_attribute_schema(cid)``."""
        found = self._schema.get(cid)
        if found is not None:
            return found
        w = self.world
        cat = w.categories[cid]
        out: dict[str, Any] = {
            "category_id": cat.id,
            "name": cat.name,
            "full_name": cat.full_name,
            "is_leaf": cat.is_leaf,
            "policy": self.policy(cid),
            "conditions": content.conditions_apply(cat.vertical, cat.full_name),
            "attributes": [
                {"handle": a.handle, "name": a.name, "required": req, "values": list(a.values)}
                for a, req in w.schema(cid)
            ],
        }
        if not cat.is_leaf:
            out["children"] = [{"id": c, "name": w.categories[c].name} for c in cat.children[:30]]
            out["note"] = "not a leaf: listings belong in the most specific category; see children"
        self._schema[cid] = out
        return out

    def _brand(self, brand: Any, cid: str | None) -> dict[str, Any]:
        w = self.world
        view: dict[str, Any] = {
            "name": brand.name,
            "registered": brand.registered,
            "protected": brand.protected,
            "authorized_sellers": list(brand.authorized_sellers),
        }
        if cid is not None:
            rng = self.msrp(brand.name, cid) if brand.registered else None
            view["msrp"] = {"low": rng[0], "high": rng[1]} if rng else None
        recalls = []
        for r in w.recalls_by_brand.get(brand.name, ()):
            rc = w.categories[r.category_id]
            recalls.append(
                {
                    "recall_id": r.recall_id,
                    "model_number": r.model_number,
                    "batches": list(r.batches),
                    "hazard": content.hazard_for(rc.vertical, rc.full_name, r.recall_id),
                }
            )
        view["recalls"] = recalls
        return view

    def lookup(self, name: str, cid: str | None) -> dict[str, Any]:
        """``lookup_brand(name, category_id)``: the exact brand and similar registered names."""
        text = name.strip()
        key = (text, cid)
        found = self._lookup.get(key)
        if found is not None:
            return found
        hit = self.world.lookup_brand(text, limit=5)
        exact = hit["exact"]
        out: dict[str, Any] = {
            "exact": self._brand(exact, cid) if exact is not None else None,
            "similar": [
                {"name": b.name, "registered": b.registered, "similarity": s}
                for b, s in hit["matches"]
                if exact is None or b.name != exact.name
            ],
        }
        if len(self._lookup) > 50_000:
            self._lookup.clear()
        self._lookup[key] = out
        return out

    def seller(self, name: str) -> dict[str, Any] | None:
        """``get_seller(name)`` (None for an unknown handle)."""
        s = self.world.seller(name)
        if s is None:
            return None
        v = s.view()
        v.pop("ships_from", None)
        return v

    def resolves(
        self, item: str, brand: str | None, model: str | None, leaf: str, dept: str
    ) -> bool:
        """Whether the written category rule finds ``leaf`` from this item type and department."""
        return resolve_item(self.world.search, item, brand, model, dept) == leaf


def strip_item(item: str, brand: str | None, model: str | None) -> str:
    """The item type without the brand's words and model numbers."""
    text = item
    if brand:
        text = re.sub(re.escape(brand), " ", text, flags=re.IGNORECASE)
    text = MODEL_RE.sub(" ", text)
    return re.sub(r"\s+", " ", text).strip(" ,")


def resolve_item(
    search: Any, item: str, brand: str | None, model: str | None, dept: str
) -> str | None:
    """The leaf the category rule picks: among the search hits for the item (and department),
    the one whose name has the item's :func:`content.item_key` and whose path ends with the
    department."""
    bare = strip_item(item, brand, model)
    key = content.item_key(bare)
    last = dept.split(" > ")[-1] if dept else ""
    hits = search(f"{bare} {last}".strip(), 20)
    matches = [
        h
        for h in hits
        if content.item_key(h["name"]) == key
        and (not dept or h["full_name"].lower().rsplit(" > ", 1)[0].endswith(dept.lower()))
    ]
    return str(matches[0]["id"]) if len(matches) == 1 else None

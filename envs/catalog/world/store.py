"""The world's DuckDB file: write once after a cold build, read into dataclasses on warm loads.

Tables: ``categories``, ``attributes``, ``attribute_values``, ``category_attributes``,
``brands``, ``brand_sellers``, ``brand_msrp``, ``sellers``, ``recalls`` and a one-row ``meta``.
Rows are written from numpy columns (DuckDB scans them without a per-row round trip) and read
back in their ``ord`` order, so a warm world equals the cold one field for field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from envs.catalog.world.model import Attribute, Brand, Category, Recall
from envs.catalog.world.nodes import link

__all__ = ["read_world", "write_world"]

_SEP = "\x1f"  # joins list cells (synonyms, verticals); no name contains it

_SCHEMA = {
    "meta": "key VARCHAR, value VARCHAR",
    "categories": "ord INTEGER, id VARCHAR, name VARCHAR, full_name VARCHAR, parent_id VARCHAR, "
    "depth INTEGER, vertical VARCHAR, is_leaf BOOLEAN, synonyms VARCHAR, policy VARCHAR, links VARCHAR",
    "attributes": "ord INTEGER, handle VARCHAR, name VARCHAR",
    "attribute_values": "handle VARCHAR, pos INTEGER, value VARCHAR",
    "category_attributes": "category_id VARCHAR, pos INTEGER, handle VARCHAR, required BOOLEAN",
    "brands": "ord INTEGER, name VARCHAR, registered BOOLEAN, protected BOOLEAN, verticals VARCHAR",
    "brand_sellers": "brand VARCHAR, pos INTEGER, seller VARCHAR",
    "brand_msrp": "brand VARCHAR, pos INTEGER, category_id VARCHAR, low DOUBLE, high DOUBLE",
    "sellers": "ord INTEGER, handle VARCHAR",
    "recalls": "ord INTEGER, recall_id VARCHAR, brand VARCHAR, product VARCHAR, model_number VARCHAR, "
    "batch VARCHAR, category_id VARCHAR, reason VARCHAR",
}


def _insert(con: duckdb.DuckDBPyConnection, table: str, rows: list[tuple[Any, ...]]) -> None:
    names = [part.split()[0] for part in _SCHEMA[table].split(", ")]
    con.execute(f"CREATE TABLE {table} ({_SCHEMA[table]})")
    if not rows:
        return
    cols = list(zip(*rows))
    frame = {n: np.array(c, dtype=object) for n, c in zip(names, cols)}  # noqa: F841 - scanned by DuckDB
    select = ", ".join(f"CAST({n} AS {_SCHEMA[table].split(', ')[i].split(' ', 1)[1]}) AS {n}"
                       for i, n in enumerate(names))
    con.execute(f"INSERT INTO {table} SELECT {select} FROM frame")


def write_world(
    path: Path,
    *,
    source: str,
    categories: dict[str, Category],
    attributes: dict[str, Attribute],
    brands: dict[str, Brand],
    sellers: tuple[str, ...],
    recalls: tuple[Recall, ...],
    meta: dict[str, str],
) -> None:
    """Write a world into a new DuckDB file at ``path``."""
    con = duckdb.connect(str(path))
    try:
        con.execute("BEGIN")
        _insert(con, "meta", [("source", source), *sorted(meta.items())])
        _insert(con, "categories", [
            (i, c.id, c.name, c.full_name, c.parent_id, c.depth, c.vertical, c.is_leaf,
             _SEP.join(c.synonyms), c.policy, _SEP.join(f"{int(a.required)}{a.handle}" for a in c.attributes))
            for i, c in enumerate(categories.values())
        ])
        _insert(con, "attributes", [(i, a.handle, a.name) for i, a in enumerate(attributes.values())])
        _insert(con, "attribute_values", [
            (a.handle, j, v) for a in attributes.values() for j, v in enumerate(a.values)
        ])
        _insert(con, "category_attributes", [
            (c.id, j, a.handle, a.required) for c in categories.values() for j, a in enumerate(c.attributes)
        ])
        _insert(con, "brands", [
            (i, b.name, b.registered, b.protected, _SEP.join(b.verticals)) for i, b in enumerate(brands.values())
        ])
        _insert(con, "brand_sellers", [
            (b.name, j, s) for b in brands.values() for j, s in enumerate(b.authorized_sellers)
        ])
        _insert(con, "brand_msrp", [
            (b.name, j, cid, lo, hi) for b in brands.values() for j, (cid, (lo, hi)) in enumerate(b.msrp.items())
        ])
        _insert(con, "sellers", list(enumerate(sellers)))
        _insert(con, "recalls", [
            (i, r.recall_id, r.brand, r.product, r.model_number, r.batch, r.category_id, r.reason)
            for i, r in enumerate(recalls)
        ])
        con.execute("COMMIT")
    finally:
        con.close()


def _split(text: str | None) -> tuple[str, ...]:
    return tuple(text.split(_SEP)) if text else ()


def read_world(path: Path) -> dict[str, Any]:
    """Read a world file into the keyword arguments of :class:`CatalogWorld` (no index)."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
        meta = dict(q("SELECT key, value FROM meta"))
        values: dict[str, list[str]] = {}
        for handle, _, value in q("SELECT handle, pos, value FROM attribute_values ORDER BY handle, pos"):
            values.setdefault(handle, []).append(value)
        attributes = {
            handle: Attribute(handle, name, tuple(values.get(handle, ())))
            for _, handle, name in q("SELECT ord, handle, name FROM attributes ORDER BY ord")
        }
        # the links also live in category_attributes (for SQL users); a warm load reads the
        # denormalised copy on the category row, one row per category instead of four
        interned = {}
        for handle in attributes:
            interned["0" + handle] = link(handle, False)
            interned["1" + handle] = link(handle, True)
        rows = q("SELECT id, name, parent_id, is_leaf, synonyms, policy, links FROM categories ORDER BY ord")
        children: dict[str, list[str]] = {}
        for row in rows:
            if row[2] is not None:
                children.setdefault(row[2], []).append(row[0])
        categories: dict[str, Category] = {}
        for cid, name, parent, is_leaf, syn, policy, links in rows:
            # rows are in depth-first order: a parent is always read before its children
            up = categories[parent] if parent is not None else None
            categories[cid] = Category(
                cid, name, f"{up.full_name} > {name}" if up else name, parent, cid.count("-") + 1,
                up.vertical if up else cid, is_leaf, tuple(children.get(cid, ())),
                tuple(interned[x] for x in links.split(_SEP)) if links else (), _split(syn), policy,
            )
        auth: dict[str, list[str]] = {}
        for brand, _, seller in q("SELECT brand, pos, seller FROM brand_sellers ORDER BY brand, pos"):
            auth.setdefault(brand, []).append(seller)
        msrp: dict[str, dict[str, tuple[float, float]]] = {}
        for brand, _, cid, lo, hi in q("SELECT brand, pos, category_id, low, high FROM brand_msrp ORDER BY brand, pos"):
            msrp.setdefault(brand, {})[cid] = (lo, hi)
        brands = {
            name: Brand(name, registered, protected, tuple(auth.get(name, ())), _split(verts), msrp.get(name, {}))
            for _, name, registered, protected, verts in q(
                "SELECT ord, name, registered, protected, verticals FROM brands ORDER BY ord")
        }
        sellers = tuple(h for _, h in q("SELECT ord, handle FROM sellers ORDER BY ord"))
        recalls = tuple(
            Recall(*row[1:]) for row in q(
                "SELECT ord, recall_id, brand, product, model_number, batch, category_id, reason "
                "FROM recalls ORDER BY ord")
        )
    finally:
        con.close()
    return {
        "source": meta["source"],
        "categories": categories,
        "attributes": attributes,
        "brands": brands,
        "sellers": sellers,
        "recalls": recalls,
        "meta": meta,
    }

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
_SUB = "\x1e"  # joins the parts of one cell (an MSRP's category, low and high)

_SCHEMA = {
    "meta": "key VARCHAR, value VARCHAR",
    "categories": "ord INTEGER, id VARCHAR, name VARCHAR, full_name VARCHAR, parent_id VARCHAR, "
    "depth INTEGER, vertical VARCHAR, is_leaf BOOLEAN, synonyms VARCHAR, policy VARCHAR, links VARCHAR",
    "attributes": "ord INTEGER, handle VARCHAR, name VARCHAR, packed_values VARCHAR",
    "attribute_values": "handle VARCHAR, pos INTEGER, value VARCHAR",
    "category_attributes": "category_id VARCHAR, pos INTEGER, handle VARCHAR, required BOOLEAN",
    "brands": "ord INTEGER, name VARCHAR, registered BOOLEAN, protected BOOLEAN, verticals VARCHAR, "
    "packed_sellers VARCHAR, packed_msrp VARCHAR",
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
        _insert(con, "attributes", [(i, a.handle, a.name, _SEP.join(a.values)) for i, a in enumerate(attributes.values())])
        _insert(con, "attribute_values", [
            (a.handle, j, v) for a in attributes.values() for j, v in enumerate(a.values)
        ])
        _insert(con, "category_attributes", [
            (c.id, j, a.handle, a.required) for c in categories.values() for j, a in enumerate(c.attributes)
        ])
        _insert(con, "brands", [
            (i, b.name, b.registered, b.protected, _SEP.join(b.verticals), _SEP.join(b.authorized_sellers),
             _SEP.join(f"{cid}{_SUB}{lo!r}{_SUB}{hi!r}" for cid, (lo, hi) in b.msrp.items()))
            for i, b in enumerate(brands.values())
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
        # the normalised tables (attribute_values, category_attributes, brand_sellers, brand_msrp)
        # are for SQL users; a warm load reads the packed copies on the parent rows: one row
        # per attribute, category and brand instead of several
        attributes = {
            handle: Attribute(handle, name, _split(values))
            for handle, name, values in q("SELECT handle, name, packed_values FROM attributes ORDER BY ord")
        }
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
        brands = {}
        for name, registered, protected, verts, sellers_, msrp_ in q(
            "SELECT name, registered, protected, verticals, packed_sellers, packed_msrp FROM brands ORDER BY ord"
        ):
            msrp = {}
            for cell in _split(msrp_):
                cid, lo, hi = cell.split(_SUB)
                msrp[cid] = (float(lo), float(hi))
            brands[name] = Brand(name, registered, protected, _split(sellers_), _split(verts), msrp)
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

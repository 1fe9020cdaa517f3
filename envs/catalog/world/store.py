"""The world's DuckDB file, written once after a cold build, and its snapshot for warm loads.

Tables: ``categories``, ``attributes``, ``attribute_values``, ``category_attributes``,
``brands``, ``brand_sellers``, ``brand_msrp``, ``sellers``, ``recalls`` and a one-row ``meta``.
Rows are written from numpy columns (DuckDB scans them without a per-row round trip) and read
back in their ``ord`` order, so a warm world equals the cold one field for field.

Warm loads read ``world.snap`` instead when it is there: the same records as plain tuples in
:mod:`marshal` format (no DuckDB import, no per-row conversion), written beside the DuckDB file by
the cold build. The DuckDB file stays the world's storage of record (and SQL users' copy).
"""

from __future__ import annotations

import marshal
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envs.catalog.world.model import Attribute, Brand, Category, Recall
from envs.catalog.world.nodes import link

if TYPE_CHECKING:
    import duckdb

__all__ = ["read_snapshot", "read_world", "write_snapshot", "write_world"]

#: Bump when the snapshot's layout changes (an unknown format falls back to the DuckDB file).
SNAPSHOT_FORMAT = 1

_SEP = "\x1f"  # joins list cells (synonyms, verticals); no name contains it
_SUB = "\x1e"  # joins the parts of one cell (an MSRP's category, low and high)

_SCHEMA = {
    "meta": "key VARCHAR, value VARCHAR",
    "categories": "ord INTEGER, id VARCHAR, name VARCHAR, full_name VARCHAR, parent_id VARCHAR, "
    "depth INTEGER, vertical VARCHAR, is_leaf BOOLEAN, "
    "synonyms VARCHAR, policy VARCHAR, links VARCHAR",
    "attributes": "ord INTEGER, handle VARCHAR, name VARCHAR, packed_values VARCHAR",
    "attribute_values": "handle VARCHAR, pos INTEGER, value VARCHAR",
    "category_attributes": "category_id VARCHAR, pos INTEGER, handle VARCHAR, required BOOLEAN",
    "brands": "ord INTEGER, name VARCHAR, registered BOOLEAN, protected BOOLEAN, verticals "
    "VARCHAR, "
    "packed_sellers VARCHAR, packed_msrp VARCHAR",
    "brand_sellers": "brand VARCHAR, pos INTEGER, seller VARCHAR",
    "brand_msrp": "brand VARCHAR, pos INTEGER, category_id VARCHAR, low DOUBLE, high DOUBLE",
    "sellers": "ord INTEGER, handle VARCHAR",
    "recalls": "ord INTEGER, recall_id VARCHAR, brand VARCHAR, product VARCHAR, model_number "
    "VARCHAR, "
    "batch VARCHAR, category_id VARCHAR, reason VARCHAR",
}


def _insert(con: duckdb.DuckDBPyConnection, table: str, rows: list[tuple[Any, ...]]) -> None:
    import numpy as np

    names = [part.split()[0] for part in _SCHEMA[table].split(", ")]
    con.execute(f"CREATE TABLE {table} ({_SCHEMA[table]})")
    if not rows:
        return
    cols = list(zip(*rows))
    frame = {n: np.array(c, dtype=object) for n, c in zip(names, cols)}  # noqa: F841 - scanned by DuckDB
    select = ", ".join(
        f"CAST({n} AS {_SCHEMA[table].split(', ')[i].split(' ', 1)[1]}) AS {n}"
        for i, n in enumerate(names)
    )
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
    import duckdb  # lazy: a warm load from the snapshot never needs it

    tables = [
        ("meta", [("source", source), *sorted(meta.items())]),
        *_taxonomy_rows(categories, attributes),
        *_brand_rows(brands),
        ("sellers", list(enumerate(sellers))),
        ("recalls", [
            (i, r.recall_id, r.brand, r.product, r.model_number, r.batch, r.category_id, r.reason)
            for i, r in enumerate(recalls)
        ]),
    ]  # fmt: skip
    con = duckdb.connect(str(path))
    try:
        con.execute("BEGIN")
        for table, rows in tables:
            _insert(con, table, rows)
        con.execute("COMMIT")
    finally:
        con.close()


def _taxonomy_rows(
    categories: dict[str, Category], attributes: dict[str, Attribute]
) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """Rows of the ``categories``, ``attributes``, ``attribute_values`` and
    ``category_attributes`` tables."""
    return [
        (
            "categories",
            [
                (
                    i,
                    c.id,
                    c.name,
                    c.full_name,
                    c.parent_id,
                    c.depth,
                    c.vertical,
                    c.is_leaf,
                    _SEP.join(c.synonyms),
                    c.policy,
                    _SEP.join(f"{int(a.required)}{a.handle}" for a in c.attributes),
                )
                for i, c in enumerate(categories.values())
            ],
        ),
        (
            "attributes",
            [(i, a.handle, a.name, _SEP.join(a.values)) for i, a in enumerate(attributes.values())],
        ),
        (
            "attribute_values",
            [(a.handle, j, v) for a in attributes.values() for j, v in enumerate(a.values)],
        ),
        (
            "category_attributes",
            [
                (c.id, j, a.handle, a.required)
                for c in categories.values()
                for j, a in enumerate(c.attributes)
            ],
        ),
    ]


def _brand_rows(brands: dict[str, Brand]) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """Rows of the ``brands``, ``brand_sellers`` and ``brand_msrp`` tables."""
    return [
        (
            "brands",
            [
                (
                    i,
                    b.name,
                    b.registered,
                    b.protected,
                    _SEP.join(b.verticals),
                    _SEP.join(b.authorized_sellers),
                    _SEP.join(f"{cid}{_SUB}{lo!r}{_SUB}{hi!r}" for cid, (lo, hi) in b.msrp.items()),
                )
                for i, b in enumerate(brands.values())
            ],
        ),
        (
            "brand_sellers",
            [(b.name, j, s) for b in brands.values() for j, s in enumerate(b.authorized_sellers)],
        ),
        (
            "brand_msrp",
            [
                (b.name, j, cid, lo, hi)
                for b in brands.values()
                for j, (cid, (lo, hi)) in enumerate(b.msrp.items())
            ],
        ),
    ]


def _split(text: str | None) -> tuple[str, ...]:
    return tuple(text.split(_SEP)) if text else ()


def read_world(path: Path) -> dict[str, Any]:
    """Read a world file into the keyword arguments of :class:`CatalogWorld` (no index)."""
    import duckdb

    con = duckdb.connect(str(path), read_only=True)
    try:
        q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
        meta = dict(q("SELECT key, value FROM meta"))
        # the normalised tables (attribute_values, category_attributes, brand_sellers, brand_msrp)
        # are for SQL users; a warm load reads the packed copies on the parent rows: one row
        # per attribute, category and brand instead of several
        attributes = {
            handle: Attribute(handle, name, _split(values))
            for handle, name, values in q(
                "SELECT handle, name, packed_values FROM attributes ORDER BY ord"
            )
        }
        interned = {}
        for handle in attributes:
            interned["0" + handle] = link(handle, False)
            interned["1" + handle] = link(handle, True)
        rows = q(
            "SELECT id, name, parent_id, is_leaf, synonyms, "
            "policy, links FROM categories ORDER BY ord"
        )
        children: dict[str, list[str]] = {}
        for row in rows:
            if row[2] is not None:
                children.setdefault(row[2], []).append(row[0])
        categories: dict[str, Category] = {}
        for cid, name, parent, is_leaf, syn, policy, links in rows:
            # rows are in depth-first order: a parent is always read before its children
            up = categories[parent] if parent is not None else None
            categories[cid] = Category(
                cid,
                name,
                f"{up.full_name} > {name}" if up else name,
                parent,
                cid.count("-") + 1,
                up.vertical if up else cid,
                is_leaf,
                tuple(children.get(cid, ())),
                tuple(interned[x] for x in links.split(_SEP)) if links else (),
                _split(syn),
                policy,
            )
        brands = {}
        for name, registered, protected, verts, sellers_, msrp_ in q(
            "SELECT name, registered, protected, verticals, "
            "packed_sellers, packed_msrp FROM brands ORDER BY ord"
        ):
            msrp = {}
            for cell in _split(msrp_):
                cid, lo, hi = cell.split(_SUB)
                msrp[cid] = (float(lo), float(hi))
            brands[name] = Brand(name, registered, protected, _split(sellers_), _split(verts), msrp)
        sellers = tuple(h for _, h in q("SELECT ord, handle FROM sellers ORDER BY ord"))
        recalls = tuple(
            Recall(*row[1:])
            for row in q(
                "SELECT ord, recall_id, brand, product, model_number, batch, category_id, reason "
                "FROM recalls ORDER BY ord"
            )
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


def write_snapshot(path: Path, parts: Mapping[str, Any]) -> None:
    """Write a world's records as plain tuples (:mod:`marshal`) for :func:`read_snapshot`.

    Args:
        path: The file to write.
        parts: The keyword arguments of :class:`CatalogWorld` (``source``, ``categories``,
            ``attributes``, ``brands``, ``sellers``, ``recalls``), as :func:`write_world` takes
            them.
    """
    source, categories, attributes = parts["source"], parts["categories"], parts["attributes"]
    brands, sellers, recalls = parts["brands"], parts["sellers"], parts["recalls"]
    # attribute links are shared objects (two per attribute): a table of them, referenced by
    # position
    links: dict[tuple[str, bool], int] = {}
    for c in categories.values():
        for a in c.attributes:
            links.setdefault((a.handle, a.required), len(links))
    data = {
        "format": SNAPSHOT_FORMAT,
        "source": source,
        "attributes": [(a.handle, a.name, tuple(a.values)) for a in attributes.values()],
        "links": list(links),
        "categories": [
            (
                c.id,
                c.name,
                c.full_name,
                c.parent_id,
                c.depth,
                c.vertical,
                c.is_leaf,
                tuple(c.children),
                tuple(links[a.handle, a.required] for a in c.attributes),
                tuple(c.synonyms),
                c.policy,
            )
            for c in categories.values()
        ],
        "brands": [
            (
                b.name,
                b.registered,
                b.protected,
                tuple(b.authorized_sellers),
                tuple(b.verticals),
                tuple((cid, lo, hi) for cid, (lo, hi) in b.msrp.items()),
            )
            for b in brands.values()
        ],
        "sellers": tuple(sellers),
        "recalls": [
            (r.recall_id, r.brand, r.product, r.model_number, r.batch, r.category_id, r.reason)
            for r in recalls
        ],
    }
    path.write_bytes(marshal.dumps(data, 4))


def read_snapshot(path: Path) -> dict[str, Any] | None:
    """Read a snapshot into the keyword arguments of :class:`CatalogWorld` (no index).

    Returns None when there is no snapshot or it is not one this code wrote (the caller then
    reads the DuckDB file). The snapshot lives in our own cache folder, next to the DuckDB file,
    and is trusted as much as that file is.
    """
    try:
        data = marshal.loads(path.read_bytes())
    except (OSError, EOFError, ValueError, TypeError):
        return None
    if not isinstance(data, dict) or data.get("format") != SNAPSHOT_FORMAT:
        return None
    attributes = {row[0]: Attribute(*row) for row in data["attributes"]}
    links = [link(h, r) for h, r in data["links"]].__getitem__
    categories = {
        row[0]: Category(*row[:8], tuple(map(links, row[8])), *row[9:])
        for row in data["categories"]
    }
    brands = {
        row[0]: Brand(*row[:5], {cid: (lo, hi) for cid, lo, hi in row[5]}) for row in data["brands"]
    }
    return {
        "source": data["source"],
        "categories": categories,
        "attributes": attributes,
        "brands": brands,
        "sellers": data["sellers"],
        "recalls": tuple(Recall(*row) for row in data["recalls"]),
    }

"""Load a taxonomy published in Shopify's Standard Product Taxonomy format.

Reads a checkout of that repository (or any folder with the same layout)::

    data/categories/<vertical>.yml   [{id, name, children: [ids], attributes: [friendly ids]}]
    data/attributes.yml              {base_attributes: [{friendly_id, name, values: [value ids]}],
                                      extended_attributes: [{friendly_id, name, values_from}]}
    data/values.yml                  [{friendly_id, name}]

Shopify's files say nothing of policy or of which attributes a listing must fill, so both are
derived here by rules of our own: subtrees whose names match ``data/catalog/policy.yml`` are
prohibited; a category requires its own first attribute (the first one its parent lacks) plus
what its parent requires, at most three.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from envs.catalog.world.model import Attribute, Category
from envs.catalog.world.nodes import link
from envs.catalog.world.registry import DEFAULT_BAND
from envs.catalog.world.vocab import load_vocab, slug
from twin.errors import ConfigError
from twin.resources import data_path

__all__ = ["load_shopify", "prohibited_patterns", "shopify_files"]

_MAX_REQUIRED = 3
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def shopify_files(path: str | Path) -> list[Path]:
    """The files of a Shopify taxonomy checkout that a world is built from, sorted.

    Raises:
        ConfigError: the folder does not have Shopify's layout; the message says what is missing.
    """
    root = Path(path)
    data = root / "data"
    missing = [
        p
        for p in (data / "attributes.yml", data / "values.yml", data / "categories")
        if not p.exists()
    ]
    if missing:
        raise ConfigError(
            f"{root} is not a Shopify product-taxonomy checkout: missing "
            f"{', '.join(str(m.relative_to(root)) for m in missing)}; expected "
            f"data/categories/*.yml, "
            f"data/attributes.yml and data/values.yml (github.com/Shopify/product-taxonomy)"
        )
    cats = sorted((data / "categories").glob("*.yml"))
    if not cats:
        raise ConfigError(f"{data / 'categories'} has no .yml files")
    return [*cats, data / "attributes.yml", data / "values.yml"]


def prohibited_patterns() -> list[re.Pattern[str]]:
    """Regexes (case-insensitive) on a category's own name that mark its subtree prohibited."""
    with open(data_path("catalog", "policy.yml"), encoding="utf-8") as fh:
        spec = yaml.load(fh, Loader=_LOADER)
    return [re.compile(p, re.IGNORECASE) for p in spec["prohibited_name_patterns"]]


_TOP = re.compile(r"([A-Za-z_]\w*):\s*$")
_ITEM = re.compile(r"- ([A-Za-z_]\w*):(?: (.*))?$")
_FIELD = re.compile(r"  ([A-Za-z_]\w*):(?: (.*))?$")
_ELEM = re.compile(r"  - (.*)$")
_PLAIN = re.compile(r"[^'\"&*!|>\[\]{}%@`#,?:-][^#]*$")


class _NotSimple(ValueError):
    """The file uses YAML beyond the simple subset Shopify publishes."""


def _scalar(text: str) -> Any:
    text = text.strip()
    if _PLAIN.match(text) and ": " not in text and not text.endswith(":"):
        return text  # a plain string: Shopify's names, ids and handles
    try:
        return yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        raise _NotSimple(text) from exc


def _fast_load(text: str) -> Any:
    """Parse the block-style subset of YAML that Shopify's files use, ~10x faster than PyYAML.

    Lists of mappings whose values are scalars or lists of scalars, optionally under top-level
    keys. Raises :class:`_NotSimple` on anything else, and the caller falls back to PyYAML.
    """
    top: dict[str, Any] = {}
    items: list[dict[str, Any]] | None = None
    item: dict[str, Any] | None = None
    list_key: str | None = None
    for line in text.splitlines():
        if not line.strip() or line.startswith(("---", "#")):
            continue
        if m := _ITEM.match(line):
            if items is None:
                items = []
                top[""] = items
            item = {}
            items.append(item)
            key, value = m.group(1), m.group(2)
            if value is None:
                raise _NotSimple(line)
            item[key] = _scalar(value)
            list_key = None
        elif m := _ELEM.match(line):
            if item is None or list_key is None:
                raise _NotSimple(line)
            item[list_key].append(_scalar(m.group(1)))
        elif m := _FIELD.match(line):
            if item is None:
                raise _NotSimple(line)
            key, value = m.group(1), m.group(2)
            if value is None or value.strip() == "":
                item[key], list_key = [], key
            elif value.strip() == "[]":
                item[key], list_key = [], None
            else:
                item[key], list_key = _scalar(value), None
        elif m := _TOP.match(line):
            items, item, list_key = [], None, None
            top[m.group(1)] = items
        else:
            raise _NotSimple(line)
    if set(top) == {""}:
        return top[""]
    if "" in top:
        raise _NotSimple("a list beside top-level keys")
    return top


def _load(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    try:
        return _fast_load(text)
    except _NotSimple:
        pass
    try:
        return yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc


def _attributes(data: Path) -> tuple[dict[str, Attribute], dict[str, str]]:
    """Attributes by our handle, and Shopify friendly id -> our handle."""
    names = {v["friendly_id"]: str(v["name"]) for v in _load(data / "values.yml")}
    spec = _load(data / "attributes.yml")
    base = spec.get("base_attributes", [])
    extended = spec.get("extended_attributes", [])
    # our handles are [a-z0-9_] slugs of the friendly ids; ids that are already slugs keep
    # theirs, and a slug that would collide ("door/frame_application") keeps its friendly id
    fids = [e["friendly_id"] for e in [*base, *extended]]
    taken = {f for f in fids if slug(f) == f}
    handles: dict[str, str] = {f: f for f in taken}
    for fid in fids:
        if fid not in handles:
            handle = slug(fid)
            handles[fid] = fid if not handle or handle in taken else handle
            taken.add(handles[fid])
    values: dict[str, tuple[str, ...]] = {}
    for entry in base:
        values[entry["friendly_id"]] = tuple(names.get(v, v) for v in entry.get("values", []))
    out: dict[str, Attribute] = {}
    for entry in [*base, *extended]:
        fid = entry["friendly_id"]
        vals = values.get(fid) or values.get(entry.get("values_from", ""), ())
        out[handles[fid]] = Attribute(handles[fid], str(entry["name"]), vals)
    return out, handles


def _raw_categories(
    files: list[Path], path: str | Path
) -> tuple[dict[str, dict[str, Any]], list[str], dict[str, str]]:
    """The entries of ``data/categories/*.yml`` by id, the verticals' ids and each category's
    parent id."""
    raw: dict[str, dict[str, Any]] = {}
    roots: list[str] = []
    for f in files:
        if f.parent.name != "categories":
            continue
        for entry in _load(f) or []:
            cid = str(entry["id"])
            raw[cid] = entry
            if "-" not in cid:
                roots.append(cid)
    parent: dict[str, str] = {}
    for cid, entry in raw.items():
        for child in entry.get("children") or []:
            if child not in raw:
                raise ConfigError(f"{path}: category {cid} lists unknown child {child!r}")
            parent[str(child)] = cid
    return raw, roots, parent


def load_shopify(
    path: str | Path, seed: int = 0
) -> tuple[dict[str, Category], dict[str, Attribute], dict[str, tuple[float, float]]]:
    """Read a Shopify-format taxonomy.

    Args:
        path: The checkout's root folder (the one holding ``data/``).
        seed: Unused by the taxonomy itself (it is what the files say); kept for symmetry.

    Returns:
        ``(categories, attributes, price_bands)`` like the generator: categories in depth-first
        order with Shopify's ids, attributes by handle, a typical MSRP band per vertical.

    Raises:
        ConfigError: the folder's layout or a file is not what Shopify publishes.
    """
    files = shopify_files(path)
    data = Path(path) / "data"
    attributes, handles = _attributes(data)
    raw, roots, parent = _raw_categories(files, path)
    patterns = prohibited_patterns()
    vocab_bands = {
        v["code"]: (float(v["price"][0]), float(v["price"][1]))
        for v in load_vocab()["taxonomy"]["verticals"]
    }

    categories: dict[str, Category] = {}

    def visit(
        cid: str, path_names: list[str], policy: str, parent_attrs: list[str], parent_req: set[str]
    ) -> None:
        entry = raw[cid]
        name = str(entry["name"])
        if policy == "ok" and any(p.search(name) for p in patterns):
            policy = "prohibited"
        attrs = [handles[a] for a in entry.get("attributes") or [] if a in handles]
        attrs = list(dict.fromkeys(attrs))
        own = [a for a in attrs if a not in parent_attrs]
        required = [a for a in attrs if a in parent_req]
        if own:
            required.append(own[0])
        required = required[-_MAX_REQUIRED:]
        kids = [str(k) for k in entry.get("children") or []]
        if not kids and not required and attrs:
            required = [attrs[0]]
        req = set(required)
        names = [*path_names, name]
        categories[cid] = Category(
            id=cid,
            name=name,
            full_name=" > ".join(names),
            parent_id=parent.get(cid),
            depth=cid.count("-") + 1,
            vertical=cid.split("-")[0],
            is_leaf=not kids,
            children=tuple(kids),
            attributes=tuple(link(a, a in req) for a in attrs),
            synonyms=(),
            policy=policy,
        )
        for kid in kids:
            visit(kid, names, policy, attrs, req)

    for root in sorted(roots):
        visit(root, [], "ok", [], set())
    if len(categories) != len(raw):
        orphans = sorted(set(raw) - set(categories))[:5]
        raise ConfigError(
            f"{path}: {len(raw) - len(categories)} categories "
            f"are not reachable from a vertical, e.g. {orphans}"
        )
    bands = {r: vocab_bands.get(r, DEFAULT_BAND) for r in sorted(roots)}
    return categories, attributes, bands

"""The deterministic generator of the default taxonomy and its attribute schemas.

Shape (per ``data/catalog/taxonomy.yml``): verticals (depth 1) -> departments (2) -> product
types (3) written by hand; below a type the generator splits by the department's facet groups
in order, so "Dresses" gets "Women's Dresses", which gets "Women's Linen Dresses", down to depth
7. How bushy each level is follows the real taxonomies (most categories at depths 3-5).

Attributes: the shared ones of ``attributes.yml``; one per department and facet group
("Clothing fabric"); one "<type> features" per product type. Links are inherited down the path;
a department's first own attribute is required below it, and every leaf requires at least one.
"""

from __future__ import annotations

import random
from typing import Any

from envs.catalog.world.model import Attribute, Category
from envs.catalog.world.nodes import Node, freeze
from envs.catalog.world.vocab import load_vocab, slug, split_name
from twin.cases import stable_seed

__all__ = ["GeneratorConfig", "generate_taxonomy"]

# probability that a node at depth d (key) splits further, and the child count range
_SPLIT = {3: (0.80, 2, 5), 4: (0.28, 2, 4), 5: (0.20, 2, 3), 6: (0.40, 2, 3)}
# facet groups whose words lead a name ("Women's Linen Dresses", not "Linen Women's Dresses")
_LEADING = ("audience", "age")
_MAX_DEPTH = 7
_FACET_LABEL = {
    "audience": "audience",
    "age": "age range",
    "stone": "gemstone",
    "pack": "pack type",
    "grade": "grade",
    "power": "power type",
    "form": "form factor",
    "diet": "diet",
}


class GeneratorConfig(dict):
    """Knobs of the generated world (defaults give ~13,000 categories).

    Keys: ``scale`` (multiplies every split probability; 1.0 by default); ``verticals`` (a
    list of vertical codes to keep, e.g. ``["aa", "el"]`` for a small test world; all by default).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__({"scale": 1.0, "verticals": None})
        self.update(kwargs)


def _rng(seed: int, *parts: Any) -> random.Random:
    return random.Random(stable_seed("catalog-world", seed, *parts))


def generate_taxonomy(
    seed: int, config: dict[str, Any] | None = None
) -> tuple[dict[str, Category], dict[str, Attribute], dict[str, tuple[float, float]]]:
    """Generate the taxonomy and its attributes from the vocabularies and ``seed``.

    Returns:
        ``(categories, attributes, price_bands)``: categories in depth-first order, attributes
        by handle, and each vertical's typical MSRP band (used to price brands).
    """
    cfg = GeneratorConfig(**(config or {}))
    vocab = load_vocab()
    attributes: dict[str, Attribute] = {}
    for handle, spec in vocab["attributes"].items():
        attributes[handle] = Attribute(handle, spec["name"], tuple(str(v) for v in spec["values"]))

    roots: list[Node] = []
    bands: dict[str, tuple[float, float]] = {}
    keep = cfg["verticals"]
    for vert in vocab["taxonomy"]["verticals"]:
        if keep is not None and vert["code"] not in keep:
            continue
        rng = _rng(seed, "taxonomy", vert["code"])
        name, syns = split_name(vert["name"])
        root = Node(id=vert["code"], name=name, parent=None, synonyms=list(syns))
        for handle in vert.get("attributes", []):
            root.links[handle] = False
        bands[root.id] = (float(vert["price"][0]), float(vert["price"][1]))
        facets = {g: [split_name(v) for v in values] for g, values in vert["facets"].items()}
        features = [split_name(f)[0] for f in vert.get("features", [])]
        branching = float(vert.get("branching", 1.0)) * float(cfg["scale"])
        for dept in vert["departments"]:
            _department(root, dept, facets, features, branching, rng, attributes)
        roots.append(root)
    _leaf_requirements(roots, seed)
    return freeze(roots, attributes), attributes, bands


def _department(
    root: Node,
    dept: dict[str, Any],
    facets: dict[str, list[tuple[str, tuple[str, ...]]]],
    features: list[str],
    branching: float,
    rng: random.Random,
    attributes: dict[str, Attribute],
) -> None:
    name, syns = split_name(dept["name"])
    node = root.child(name, list(syns))
    node.policy = dept.get("policy", root.policy)
    own = list(dept.get("attributes", []))
    for i, handle in enumerate(own):
        # the department's first own attribute (e.g. size) is required everywhere below it
        node.links[handle] = i == 0
    groups = list(dept.get("facets", []))
    facet_attr: dict[str, str] = {}
    for group in groups:
        handle = _unique(attributes, f"{slug(name)}_{group}", root.id)
        label = _FACET_LABEL.get(group, group.replace("_", " "))
        attributes[handle] = Attribute(
            handle, f"{name} {label}", tuple(v for v, _ in facets[group])
        )
        facet_attr[group] = handle
    for entry in dept["types"]:
        # "Sofas|couches @style,upholstery": a type may split by its own facet groups
        entry, _, own_groups = str(entry).partition("@")
        tgroups = [g.strip() for g in own_groups.split(",") if g.strip()] or groups
        for group in tgroups:
            if group not in facet_attr:
                handle = _unique(attributes, f"{slug(name)}_{group}", root.id)
                label = _FACET_LABEL.get(group, group.replace("_", " "))
                attributes[handle] = Attribute(
                    handle, f"{name} {label}", tuple(v for v, _ in facets[group])
                )
                facet_attr[group] = handle
        tname, tsyns = split_name(entry)
        tnode = node.child(tname, list(tsyns))
        if features and rng.random() < 0.7:
            handle = _unique(attributes, f"{slug(tname)}_features", slug(name))
            k = rng.randint(5, min(10, len(features)))
            picked = sorted(rng.sample(range(len(features)), k))
            attributes[handle] = Attribute(
                handle, f"{tname} features", tuple(features[i] for i in picked)
            )
            tnode.links[handle] = False
        _expand(tnode, tname, tsyns, [], tgroups, 0, facets, facet_attr, branching, rng)


def _expand(
    node: Node,
    noun: str,
    noun_syns: tuple[str, ...],
    mods: list[tuple[str, tuple[str, ...], str]],
    groups: list[str],
    pos: int,
    facets: dict[str, list[tuple[str, tuple[str, ...]]]],
    facet_attr: dict[str, str],
    branching: float,
    rng: random.Random,
) -> None:
    depth = node.depth
    if depth >= _MAX_DEPTH or depth not in _SPLIT or pos >= len(groups):
        return
    p, lo, hi = _SPLIT[depth]
    if rng.random() >= min(0.97, p * branching):
        return
    # now and then skip a facet group so sibling subtrees differ in shape
    if pos + 1 < len(groups) and rng.random() < 0.2:
        pos += 1
    group = groups[pos]
    values = [v for v in facets[group] if v[0].lower() not in noun.lower()]
    if len(values) < 2:
        return
    k = rng.randint(lo, min(hi, len(values)))
    # vocabularies list facet values most common first ("Women's" before "Maternity"): draw
    # without replacement with weights falling along the list (Efraimidis-Spirakis keys)
    keys = sorted(range(len(values)), key=lambda i: -(rng.random() ** (1.0 + 0.6 * i)))
    picked = sorted(keys[:k])
    if rng.random() < 0.5:
        # the parent whose children differ by this facet knows the attribute
        node.links.setdefault(facet_attr[group], False)
    for i in picked:
        value, vsyns = values[i]
        cmods = [*mods, (value, vsyns, group)]
        ordered = sorted(range(len(cmods)), key=lambda j: (cmods[j][2] not in _LEADING, j))
        name = " ".join([cmods[j][0] for j in ordered] + [noun])
        syns = [f"{s} {noun}" for s in vsyns] + [f"{value} {s}" for s in noun_syns[:2]]
        child = node.child(name, syns)
        _expand(child, noun, noun_syns, cmods, groups, pos + 1, facets, facet_attr, branching, rng)


def _unique(attributes: dict[str, Attribute], handle: str, qualifier: str) -> str:
    if handle not in attributes:
        return handle
    handle = f"{qualifier}_{handle}"
    n = 2
    base = handle
    while handle in attributes:
        handle = f"{base}_{n}"
        n += 1
    return handle


def _leaf_requirements(roots: list[Node], seed: int) -> None:
    """Every leaf requires at least one attribute; some require one more of their own."""
    for root in roots:
        rng = _rng(seed, "requirements", root.id)
        for node in root.walk():
            if node.children:
                continue
            optional = [h for h, req in node.links.items() if not req]
            if not optional:
                continue
            if any(node.links.values()):
                want = 1 if rng.random() < 0.35 else 0
            else:
                want = 2 if rng.random() < 0.25 else 1
            for handle in rng.sample(optional, min(want, len(optional))):
                node.links[handle] = True

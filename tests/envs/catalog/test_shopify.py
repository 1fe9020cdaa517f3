"""The Shopify-format loader, on the copy of Shopify's taxonomy shipped beside the project."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from envs.catalog.world import CatalogWorld, build_world, load_shopify
from twin.errors import ConfigError

SHOPIFY = (
    Path(__file__).resolve().parents[3].parent / "shared" / "data" / "shopify-product-taxonomy"
)

needs_shopify = pytest.mark.skipif(
    not (SHOPIFY / "data" / "categories").is_dir(),
    reason=f"Shopify's taxonomy is not at {SHOPIFY} (it ships beside the project, not in it)",
)


@pytest.fixture(scope="module")
def shopify_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shopify-cache")


@pytest.fixture(scope="module")
def world(shopify_cache: Path) -> CatalogWorld:
    if not (SHOPIFY / "data" / "categories").is_dir():
        pytest.skip(f"Shopify's taxonomy is not at {SHOPIFY}")
    return build_world(seed=0, taxonomy_path=SHOPIFY, cache_dir=shopify_cache)


@needs_shopify
def test_counts_match_the_release(world: CatalogWorld) -> None:
    assert world.source == f"shopify:{SHOPIFY.resolve()}"
    assert len(world.categories) == 10_595
    assert len(world.leaves) == 8_516
    assert len(world.verticals) == 26
    depths = Counter(c.depth for c in world.categories.values())
    assert [depths[d] for d in range(1, 9)] == [26, 211, 1467, 3724, 3431, 1300, 386, 50]
    assert len(world.attributes) == 2_299
    links = sum(len(c.attributes) for c in world.categories.values())
    assert 40_000 <= links <= 41_000
    assert len(world.attributes["color"].values) >= 15
    assert "Black" in world.attributes["color"].values


@needs_shopify
def test_warm_load_equals_cold_build(world: CatalogWorld, shopify_cache: Path) -> None:
    again = build_world(seed=0, taxonomy_path=SHOPIFY, cache_dir=shopify_cache)
    assert again.digest() == world.digest()
    assert again.categories == world.categories


@needs_shopify
def test_ids_and_paths(world: CatalogWorld) -> None:
    c = world.categories["aa-1-13-8"] if "aa-1-13-8" in world.categories else None
    assert c is not None and c.parent_id == "aa-1-13"
    assert c.full_name.startswith("Apparel & Accessories > Clothing > ")
    for cid, cat in world.categories.items():
        if cat.parent_id:
            assert cid.rsplit("-", 1)[0] == cat.parent_id
            assert world.categories[cat.parent_id].full_name + " > " + cat.name == cat.full_name


@needs_shopify
def test_policy_marks_prohibited_subtrees_only(world: CatalogWorld) -> None:
    by_name = {c.full_name: c for c in world.categories.values()}
    banned = [
        "Mature > Weapons & Weapon Accessories > Weapons > Stun Guns & Tasers",
        "Mature > Weapons & Weapon Accessories > Weapons > Brass Knuckles",
        "Mature > Weapons & Weapon Accessories > Weapon Care & Accessories > Ammunition",
        "Food, Beverages & Tobacco > Beverages > Alcoholic Beverages > Liquor & Spirits > Gin",
        "Food, Beverages & Tobacco > Tobacco Products > Vaporizers "
        "& Electronic Cigarettes > Electronic Cigarettes",
        "Arts & Entertainment > Party & Celebration > Party "
        "Supplies > Fireworks & Firecrackers > Firecrackers",
    ]
    for name in banned:
        assert by_name[name].policy == "prohibited", name
    allowed = [
        "Arts & Entertainment > Hobbies & Creative Arts > "
        "Arts & Crafts > Art & Crafting Tools > Glue Guns",
        "Animals & Pet Supplies > Pet Supplies > Dog Supplies > Dog Food > Prescription Dog Food",
        "Food, Beverages & Tobacco > Beverages > Coffee",
        "Hardware > Tools > Heat Guns",
    ]
    for name in allowed:
        assert by_name[name].policy == "ok", name
    share = sum(c.policy == "prohibited" for c in world.categories.values()) / len(world.categories)
    assert 0.002 < share < 0.05


@needs_shopify
def test_every_leaf_with_attributes_requires_one(world: CatalogWorld) -> None:
    for cid in world.leaves:
        c = world.categories[cid]
        assert all(link.handle in world.attributes for link in c.attributes)
        if c.attributes:
            assert 1 <= sum(link.required for link in c.attributes) <= 3, cid


@needs_shopify
def test_search_on_shopify(world: CatalogWorld) -> None:
    assert world.search("stun guns tasers", 3)[0]["name"] == "Stun Guns & Tasers"
    import random

    rng = random.Random(3)
    sample = rng.sample(world.leaves, 200)
    top3 = sum(
        any(h["id"] == cid for h in world.search(world.categories[cid].full_name, 3))
        for cid in sample
    )
    assert top3 / len(sample) >= 0.8


@needs_shopify
def test_registry_over_shopify(world: CatalogWorld) -> None:
    assert len(world.brands) >= 2_000 and len(world.recalls) >= 200
    for b in list(world.brands.values())[:200]:
        assert all(v in world.categories for v in b.verticals)
        assert all(k in world.categories for k in b.msrp)
    leaf = world.recalls[0].category_id
    assert world.categories[leaf].is_leaf
    brand = world.brands[world.recalls[0].brand]
    assert world.msrp(brand.name, leaf) is not None


@needs_shopify
def test_load_shopify_directly() -> None:
    cats, attrs, bands = load_shopify(SHOPIFY)
    assert len(cats) == 10_595 and len(attrs) == 2_299
    assert set(bands) == {c.id for c in cats.values() if c.parent_id is None}


def test_not_a_checkout_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match="not a Shopify product-taxonomy checkout: missing data/attributes.yml"
    ):
        load_shopify(tmp_path)
    with pytest.raises(ConfigError, match="data/categories"):
        build_world(taxonomy_path=tmp_path, cache_dir=tmp_path / "cache")


def test_fast_parser_matches_yaml_and_falls_back() -> None:
    import yaml

    from envs.catalog.world.shopify import _fast_load, _NotSimple

    text = """---
base_attributes:
- id: 1
  name: Color
  friendly_id: color
  values:
  - color__black
  - 'quoted: value'
extended_attributes:
- name: "Frame: material"
  friendly_id: frame_material
  values_from: color
  children: []
"""
    assert _fast_load(text) == yaml.safe_load(text) | {
        "base_attributes": [
            {
                "id": "1",
                "name": "Color",
                "friendly_id": "color",
                "values": ["color__black", "quoted: value"],
            }
        ]
    }
    with pytest.raises(_NotSimple):
        _fast_load("- id: a\n  nested:\n    deeper: 1\n")


def test_unusual_yaml_is_read_by_pyyaml(tmp_path: Path) -> None:
    from envs.catalog.world.shopify import _load

    f = tmp_path / "x.yml"
    f.write_text("- {id: aa, name: Flow Style, children: [], attributes: []}\n")
    assert _load(f) == [{"id": "aa", "name": "Flow Style", "children": [], "attributes": []}]
    f.write_text("- id: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        _load(f)

"""The generated catalog world: sizes, shape, ids, attributes, brands, recalls, cache,
determinism."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.catalog.world import (
    WORLD_VERSION,
    Attribute,
    AttributeLink,
    Brand,
    CatalogWorld,
    Category,
    Recall,
    build_world,
)
from twin.errors import ToolError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def world_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache folder for every world test module of the session."""
    path = tmp_path_factory.getbasetemp() / "catalog-world-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def world(world_cache: Path) -> CatalogWorld:
    return build_world(seed=0, cache_dir=world_cache)


# -- sizes and shape ---------------------------------------------------------------------------
def test_sizes(world: CatalogWorld) -> None:
    assert world.source == "generated"
    assert 12_000 <= len(world.categories) <= 15_000
    assert len(world.verticals) >= 20
    assert len(world.attributes) >= 1_000
    assert len(world.brands) >= 2_000
    assert len(world.sellers) >= 2_000
    assert 200 <= len(world.recalls) <= 1_000
    assert isinstance(WORLD_VERSION, str)


def test_depth_profile(world: CatalogWorld) -> None:
    depths = Counter(c.depth for c in world.categories.values())
    assert min(depths) == 1 and max(depths) == 7
    leaf_depths = {world.categories[c].depth for c in world.leaves}
    assert min(leaf_depths) >= 2 and max(leaf_depths) == 7
    # like the real taxonomies: most categories sit at depths 3-5
    assert (depths[3] + depths[4] + depths[5]) / len(world.categories) >= 0.7
    assert all(depths[d] > 0 for d in range(1, 8))


def test_ids_encode_paths(world: CatalogWorld) -> None:
    for cid, c in world.categories.items():
        assert isinstance(c, Category) and c.id == cid
        assert re.fullmatch(r"[a-z]{2}(-\d+)*", cid), cid
        assert c.depth == cid.count("-") + 1
        assert c.vertical == cid.split("-")[0]
        if c.parent_id is None:
            assert c.depth == 1 and c.full_name == c.name
        else:
            assert c.parent_id == cid.rsplit("-", 1)[0]
            parent = world.categories[c.parent_id]
            assert cid in parent.children
            assert c.full_name == f"{parent.full_name} > {c.name}"
        assert c.is_leaf == (not c.children)
        assert all(k.rsplit("-", 1)[0] == cid for k in c.children)
        names = [world.categories[k].name.lower() for k in c.children]
        assert len(names) == len(set(names)), f"duplicate sibling names under {cid}"
        assert c.policy in ("ok", "prohibited")
    assert list(world.leaves) == sorted(world.leaves)
    assert set(world.leaves) == {c for c, v in world.categories.items() if v.is_leaf}


def test_tree_api(world: CatalogWorld) -> None:
    leaf = world.leaves[len(world.leaves) // 2]
    path = world.ancestors(leaf)
    assert path[-1] == leaf and world.categories[path[0]].parent_id is None
    assert [world.depth(p) for p in path] == list(range(1, len(path) + 1))
    assert world.exists(leaf) and not world.exists("zz-1") and not world.exists("")
    with pytest.raises(ToolError, match="unknown category id 'aa-999'.*search_taxonomy"):
        world.ancestors("aa-999")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_ancestors_are_id_prefixes(world: CatalogWorld, data: st.DataObject) -> None:
    cid = data.draw(st.sampled_from(sorted(world.categories)))
    path = world.ancestors(cid)
    assert all(cid.startswith(p) for p in path)
    assert world.categories[cid].full_name.split(" > ") == [world.categories[p].name for p in path]


def test_prohibited_subtrees(world: CatalogWorld) -> None:
    prohibited = {c.name.lower() for c in world.categories.values() if c.policy == "prohibited"}
    for needle in [
        "stun guns",
        "brass knuckles",
        "ammunition",
        "disposable vapes",
        "e-liquids",
        "bongs",
        "cannabis flower",
        "prescription antibiotics",
        "firecrackers",
        "alcoholic beverages",
        "wine",
        "sparklers",
    ]:
        assert needle in prohibited, needle
    for c in world.categories.values():
        if c.parent_id and world.categories[c.parent_id].policy == "prohibited":
            assert c.policy == "prohibited", c.id
    share = len(prohibited) / len(world.categories)
    assert 0.01 < share < 0.1
    # near misses stay allowed
    allowed = {c.name.lower() for c in world.categories.values() if c.policy == "ok"}
    assert {"wine glasses", "glue guns", "lighters", "painting replicas"} <= allowed


# -- attributes --------------------------------------------------------------------------------
def test_attributes(world: CatalogWorld) -> None:
    for handle, a in world.attributes.items():
        assert isinstance(a, Attribute) and a.handle == handle
        assert len(a.values) >= 2 and len(set(a.values)) == len(a.values), handle
    links = [link for c in world.categories.values() for link in c.attributes]
    assert all(
        isinstance(link, AttributeLink) and link.handle in world.attributes for link in links
    )
    mean = len(links) / len(world.categories)
    assert 2.5 <= mean <= 4.5, mean
    with_color = sum(
        any(link.handle == "color" for link in c.attributes) for c in world.categories.values()
    )
    assert with_color / len(world.categories) > 0.4
    for cid in world.leaves:
        c = world.categories[cid]
        handles = [link.handle for link in c.attributes]
        assert len(handles) == len(set(handles)), cid
        assert any(link.required for link in c.attributes), f"leaf {cid} requires nothing"


def test_attributes_inherit_down(world: CatalogWorld) -> None:
    for c in world.categories.values():
        if c.parent_id:
            parent = {link.handle for link in world.categories[c.parent_id].attributes}
            assert parent <= {link.handle for link in c.attributes}, c.id


def test_schema(world: CatalogWorld) -> None:
    leaf = world.leaves[0]
    schema = world.schema(leaf)
    assert schema and all(isinstance(a, Attribute) and isinstance(r, bool) for a, r in schema)
    assert [a.handle for a, _ in schema] == [
        link.handle for link in world.categories[leaf].attributes
    ]


# -- brands, sellers, recalls --------------------------------------------------------------------
def test_brands(world: CatalogWorld) -> None:
    sellers = set(world.sellers)
    assert len(sellers) == len(world.sellers)
    protected = [b for b in world.brands.values() if b.protected]
    assert 0.2 <= len(protected) / len(world.brands) <= 0.4
    for name, b in world.brands.items():
        assert isinstance(b, Brand) and b.name == name
        assert b.verticals and all(v in world.categories for v in b.verticals)
        if b.protected:
            assert b.registered and b.authorized_sellers
            assert set(b.authorized_sellers) <= sellers
        assert b.msrp and all(v in b.msrp for v in b.verticals)
        for cid, (lo, hi) in b.msrp.items():
            assert world.categories[cid].vertical in b.verticals
            assert 0 < lo < hi


def test_brand_names_are_fictional_and_distinct(world: CatalogWorld) -> None:
    from rapidfuzz import process
    from rapidfuzz.distance import Levenshtein

    real = {"nike", "adidas", "apple", "sony", "gucci", "rolex", "lego", "samsung"}
    names = sorted(n.lower() for n in world.brands)
    assert not real & set(names)
    assert {"norvale", "kestrel & pike"} <= set(names)
    # no brand is one edit away from another: a planted typosquat never names a genuine brand
    dist = process.cdist(names, names, scorer=Levenshtein.distance, score_cutoff=1, workers=1)
    assert int((dist <= 1).sum()) == len(names)


def test_lookup_brand(world: CatalogWorld) -> None:
    found = world.lookup_brand("Norvalle")
    assert found["exact"] is None
    assert found["matches"][0][0].name == "Norvale"
    assert all(0 <= s <= 100 for _, s in found["matches"])
    exact = world.lookup_brand("  kestrel & PIKE ")
    assert exact["exact"] is not None and exact["exact"].name == "Kestrel & Pike"
    assert world.lookup_brand("")["matches"] == []
    assert world.lookup_brand("qqqqqqqqqzzzz")["exact"] is None
    assert len(world.lookup_brand("Nor", limit=3)["matches"]) <= 3


def test_msrp_deepest_range(world: CatalogWorld) -> None:
    brand = next(b for b in world.brands.values() if any("-" in k for k in b.msrp))
    deep = next(k for k in brand.msrp if "-" in k)
    below = deep
    while world.categories[below].children:
        below = world.categories[below].children[0]
    assert world.msrp(brand.name, below) == brand.msrp[deep]
    vertical = world.categories[deep].vertical
    other = next(
        c
        for c in world.categories[vertical].children
        if not any(k == c or k.startswith(c + "-") for k in brand.msrp)
    )
    assert world.msrp(brand.name, other) == brand.msrp[vertical]
    assert world.msrp(brand.name.upper(), below) == brand.msrp[deep]
    outside = next(v for v in world.verticals if v not in brand.verticals)
    assert world.msrp(brand.name, outside) is None
    assert world.msrp("No Such Brand", below) is None
    assert world.msrp(brand.name, "zz-9") is None


def test_recalls(world: CatalogWorld) -> None:
    ids = [r.recall_id for r in world.recalls]
    assert len(set(ids)) == len(ids)
    models = [r.model_number for r in world.recalls]
    assert len(set(models)) == len(models)
    for r in world.recalls:
        assert isinstance(r, Recall)
        assert r.brand in world.brands
        c = world.categories[r.category_id]
        assert c.is_leaf and c.policy == "ok"
        assert c.vertical in world.brands[r.brand].verticals
        assert r.product.startswith(r.brand) and r.reason and r.batch


# -- cache, determinism -------------------------------------------------------------------------
def test_warm_load_equals_cold_build(world: CatalogWorld, world_cache: Path) -> None:
    again = build_world(seed=0, cache_dir=world_cache)
    assert again is not world
    assert again.digest() == world.digest()
    assert again.categories == world.categories and again.brands == world.brands
    assert again.search("dresses") == world.search("dresses")


_DIGEST = (
    "import json, sys; from envs.catalog.world import build_world; "
    "print(build_world(seed=int(sys.argv[1]), cache_dir=sys.argv[2], "
    "config=json.loads(sys.argv[3])).digest())"
)
#: A small world (two verticals, few brands) for the tests that build many worlds.
SMALL = {
    "generator": {"verticals": ["aa", "el"]},
    "registry": {"n_brands": 150, "n_sellers": 300, "n_recalls": 20},
}


def _digest_in_subprocess(seed: int, cache: Path, config: dict | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _DIGEST, str(seed), str(cache), json.dumps(config or {})],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_same_seed_same_bytes_across_processes(world: CatalogWorld, tmp_path: Path) -> None:
    # a cold build in a fresh process, in its own cache, gives the same world
    assert _digest_in_subprocess(0, tmp_path / "other") == world.digest()


def test_different_seed_different_world(world_cache: Path) -> None:
    a = build_world(seed=0, cache_dir=world_cache, config=SMALL)
    b = build_world(seed=1, cache_dir=world_cache, config=SMALL)
    assert a.digest() != b.digest()
    assert set(a.categories) != set(b.categories) or a.brands != b.brands
    assert a.verticals == b.verticals == ("aa", "el")


def test_small_world_config(world_cache: Path) -> None:
    small = build_world(seed=0, cache_dir=world_cache, config=SMALL)
    assert len(small.brands) == 150 and len(small.sellers) == 300 and len(small.recalls) == 20
    assert all(set(b.verticals) <= {"aa", "el"} for b in small.brands.values())


def test_concurrent_builds_share_one_cache(tmp_path: Path) -> None:
    cache = tmp_path / "race"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _DIGEST, "0", str(cache), json.dumps(SMALL)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    digests = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(digests) == 1
    folders = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(folders) == 1 and (folders[0] / "DONE").exists()
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_canonical_rows_are_json(world: CatalogWorld) -> None:
    rows = world.canonical_rows()
    assert set(rows) == {"categories", "attributes", "brands", "sellers", "recalls"}
    json.dumps(rows)
    assert len(world.digest()) == 64


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), codes=st.sampled_from([["aa"], ["el", "hg"], ["ma", "sg"]]))
def test_generator_invariants_hold_for_any_seed(seed: int, codes: list[str]) -> None:
    from envs.catalog.world.generate import generate_taxonomy

    cats, attrs, bands = generate_taxonomy(seed, {"verticals": codes})
    assert sorted(bands) == sorted(codes)
    again, _, _ = generate_taxonomy(seed, {"verticals": codes})
    assert again == cats  # deterministic in-process too
    for cid, c in cats.items():
        assert c.depth == cid.count("-") + 1 <= 7
        if c.parent_id:
            assert cats[c.parent_id].full_name + " > " + c.name == c.full_name
        names = [cats[k].name for k in c.children]
        assert len(names) == len(set(names))
        assert all(link.handle in attrs for link in c.attributes)
        if c.is_leaf and c.attributes:
            assert any(link.required for link in c.attributes)


def test_cold_build_sweeps_stale_temp_folders(tmp_path: Path) -> None:
    import os
    import time

    stale, fresh = tmp_path / ".deadbeef-killed", tmp_path / ".cafebabe-running"
    for folder in (stale, fresh):
        folder.mkdir()
        (folder / "world.duckdb").write_text("half a world")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    build_world(seed=0, cache_dir=tmp_path, config=SMALL)
    assert not stale.exists()
    assert fresh.exists()  # may belong to a build still running in another process


def test_snapshot_equals_the_duckdb_file(
    world: CatalogWorld, world_cache: Path, tmp_path: Path
) -> None:
    """Warm loads read ``world.snap``; it must hold exactly what ``world.duckdb`` holds."""
    import shutil

    from envs.catalog.world.build import world_key
    from envs.catalog.world.store import read_snapshot, read_world

    folder = world_cache / world_key(0, None, {})
    from_db = read_world(folder / "world.duckdb")
    from_db.pop("meta")
    from_snap = read_snapshot(folder / "world.snap")
    assert from_snap is not None and from_snap == from_db
    assert list(from_snap["categories"]) == list(from_db["categories"])  # order too
    # a missing or damaged snapshot falls back to the DuckDB file, with the same world
    copy = tmp_path / "copy"
    shutil.copytree(world_cache, copy)
    (copy / folder.name / "world.snap").write_bytes(b"\x00not marshal")
    assert read_snapshot(copy / folder.name / "world.snap") is None
    assert build_world(seed=0, cache_dir=copy).digest() == world.digest()
    (copy / folder.name / "world.snap").unlink()
    assert build_world(seed=0, cache_dir=copy).digest() == world.digest()

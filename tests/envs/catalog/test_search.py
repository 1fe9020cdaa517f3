"""Taxonomy search over the generated world: quality smoke tests and hostile queries."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs.catalog.world import CatalogWorld, build_world
from envs.catalog.world.search import query_words
from twin.errors import ToolError


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> CatalogWorld:
    cache = tmp_path_factory.getbasetemp() / "catalog-world-cache"
    cache.mkdir(exist_ok=True)
    return build_world(seed=0, cache_dir=cache)


def test_leaf_names_find_their_leaf(world: CatalogWorld) -> None:
    rng = random.Random(7)
    sample = rng.sample(world.leaves, 300)
    top3 = sum(
        any(h["id"] == cid for h in world.search(world.categories[cid].name, 3)) for cid in sample
    )
    assert top3 / len(sample) >= 0.95


def test_full_path_finds_the_category(world: CatalogWorld) -> None:
    rng = random.Random(8)
    for cid in rng.sample(sorted(world.categories), 50):
        hits = world.search(world.categories[cid].full_name.replace(" > ", " "), 10)
        assert cid in [h["id"] for h in hits], cid


def test_hit_shape_and_order(world: CatalogWorld) -> None:
    hits = world.search("dresses", 5)
    assert 1 <= len(hits) <= 5
    for h in hits:
        assert set(h) == {"id", "name", "full_name", "score"}
        assert world.categories[h["id"]].full_name == h["full_name"]
        assert isinstance(h["score"], float)
    assert hits[0]["name"] == "Dresses"  # an exact name match comes first


@pytest.mark.parametrize(
    ("query", "expected_name"),
    [
        ("couches", "Sofas"),
        ("tasers", "Stun Guns"),
        ("knuckle dusters", "Brass Knuckles"),
        ("ammo", "Ammunition"),
        ("wireless earbuds", "Wireless Earbuds"),
        ("headphnes", "Headphones"),  # one typo is forgiven
    ],
)
def test_synonyms_and_typos(world: CatalogWorld, query: str, expected_name: str) -> None:
    names = [h["name"] for h in world.search(query, 5)]
    assert expected_name in names, (query, names)


@pytest.mark.parametrize(
    "query",
    [
        "",
        "   ",
        "!!!",
        '"',
        "title:foo AND",
        "(((",
        "a" * 5000,
        "😀",
        "NOT OR AND",
        "*",
        "~2",
        "\x00\n\t",
        "field:[1 TO 2]",
        "-",
        "+",
    ],
)
def test_junk_queries_never_raise(world: CatalogWorld, query: str) -> None:
    hits = world.search(query, 10)
    assert isinstance(hits, list) and len(hits) <= 10


@settings(max_examples=150, deadline=None)
@given(query=st.text(max_size=80), limit=st.integers(1, 100))
def test_any_text_is_a_valid_query(world: CatalogWorld, query: str, limit: int) -> None:
    hits = world.search(query, limit)
    assert len(hits) <= limit
    assert all(world.exists(h["id"]) for h in hits)


@pytest.mark.parametrize("limit", [0, -1, 101, 2.5, "3", True])
def test_bad_limit_says_what_is_allowed(world: CatalogWorld, limit: object) -> None:
    with pytest.raises(ToolError, match="limit must be an integer from 1 to 100"):
        world.search("shoes", limit)  # type: ignore[arg-type]


def test_query_words_neutralise_syntax() -> None:
    assert query_words('title:"Foo" AND (bar)') == ["title", "foo", "bar"]
    assert query_words("and or") == ["and", "or"]  # only stop words: keep them
    assert query_words("") == []
    assert all(len(w) <= 40 for w in query_words("x" * 500))


def test_index_is_reopened_from_disk(
    world: CatalogWorld, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache = tmp_path_factory.getbasetemp() / "catalog-world-cache"
    folders = [p for p in Path(cache).iterdir() if (p / "DONE").exists()]
    assert folders and all((p / "index" / "meta.json").exists() for p in folders)
    again = build_world(seed=0, cache_dir=cache)
    assert again.search("running shoes", 5) == world.search("running shoes", 5)


# -- the results themselves must not move when the search code is restructured ------------------
#: sha256 of the search results below on the seed-0 world, recorded before the search hot path
#: was restructured (per-twin result cache, memoised world key). A deliberate change to the
#: generator, the index or the ranking changes it too: re-record it then, and say why.
SEARCH_GOLDEN = "4065f635c949cb9d663975e9f777116c41cbf2f2d55a7cb3b10cfda5ba7e2452"
_EXTRA_QUERIES = [
    "dresses",
    "headphnes wireles",
    "women's leather ankle boots",
    "a the of",
    "::{}[]",
    "x" * 80,
    "Running SHOES for men",
    "ünïcödé tëst",
    "kids toys 3 years",
]


def test_search_results_are_unchanged_and_cached_calls_agree(twin) -> None:
    import hashlib
    import json

    queries = [" ".join(twin.case("test", i).task["title"].split()[:6]) for i in range(60)]
    queries += _EXTRA_QUERIES
    out = [
        [q, limit, twin.search_taxonomy(query=q, limit=limit), twin.world.search(q, limit)]
        for q in queries
        for limit in (1, 10, 50)
    ]
    # the second round is served by the caches and must be the same
    again = [
        [q, lim, twin.search_taxonomy(query=q, limit=lim), twin.world.search(q, lim)]
        for q, lim, _, _ in out
    ]
    assert again == out
    digest = hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()
    assert digest == SEARCH_GOLDEN, "search results changed for the same world and queries"

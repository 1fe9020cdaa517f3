"""Planted listings: every kind in the test split, byte-identical across processes, truthful."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.catalog.v0.listings import DEFAULT_MIX, KINDS, kind_for, validate_mix
from twin.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
VERDICT_OF = {
    "clean": "ok",
    "hard_negative_sale": "ok",
    "hard_negative_authorized": "ok",
    "hard_negative_replica": "ok",
    "hard_negative_accessory": "ok",
    "wrong_category_words": "ok",
    "missing_attributes": "ok",
    "counterfeit_price": "counterfeit",
    "counterfeit_typosquat": "counterfeit",
    "counterfeit_replica_wording": "counterfeit",
    "counterfeit_unauthorized_seller": "counterfeit",
    "prohibited_category": "prohibited",
    "prohibited_recall": "prohibited",
}


def check_case(twin, case) -> None:
    """Invariants every case holds, whatever its kind."""
    world = twin.world
    truth, task = case.truth, case.task
    assert set(truth) == {"category_id", "attributes", "verdict", "signals"}
    assert world.exists(truth["category_id"]) and world.categories[truth["category_id"]].is_leaf
    assert truth["verdict"] in ("ok", "counterfeit", "prohibited")
    if case.kind in VERDICT_OF:
        assert truth["verdict"] == VERDICT_OF[case.kind], case.kind
    else:
        assert case.kind == "prompt_injection" and truth["verdict"] != "ok"
    schema = {a.handle: (a, req) for a, req in world.schema(truth["category_id"])}
    text = f"{task['title']} {task['description']} {' '.join(task['attributes'].values())}".lower()
    for handle, value in truth["attributes"].items():
        attr, req = schema[handle]
        assert req, f"{handle} is not required in {truth['category_id']}"
        assert value in attr.values
        assert value.lower() in text, f"truth value {value!r} is not stated in the listing"
    assert set(task) == {
        "listing_id",
        "title",
        "description",
        "brand",
        "seller",
        "price",
        "currency",
        "attributes",
    }
    assert task["price"] > 0 and task["seller"] in world.sellers
    blob = json.dumps(task).lower()
    assert "signals" not in blob
    if "_" in case.kind:  # "clean" is an ordinary word; the other kinds' names never appear
        assert case.kind not in blob


def test_every_kind_in_test_split(twin):
    kinds = {twin.case("test", i).kind for i in range(twin.num_cases("test"))}
    assert kinds == set(KINDS)


def test_test_split_cases_are_valid(twin):
    for i in range(twin.num_cases("test")):
        check_case(twin, twin.case("test", i))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(index=st.integers(0, 9_999))
def test_train_cases_are_valid(twin, index):
    check_case(twin, twin.case("train", index))


def test_kind_signals(twin, world):
    """Each kind carries the signal it is planted with, visible in the listing."""
    seen = set()
    for i in range(twin.num_cases("test")):
        case = twin.case("test", i)
        t, truth, kind = case.task, case.truth, case.kind
        text = f"{t['title']} {t['description']}".lower()
        seen.add(kind)
        brand = world.brands.get(t["brand"])
        lo = world.msrp(t["brand"], truth["category_id"]) if brand else None
        if kind == "counterfeit_price":
            assert lo and t["price"] < 0.31 * lo[0]
        elif kind == "hard_negative_sale":
            assert lo and 0.59 * lo[0] <= t["price"] < lo[0]
        elif kind == "counterfeit_typosquat":
            assert brand is None and t["brand"].lower() not in {b.lower() for b in world.brands}
            real = world.lookup_brand(t["brand"])["matches"][0][0]
            assert real.registered
        elif kind == "counterfeit_unauthorized_seller":
            assert brand.protected and t["seller"] not in brand.authorized_sellers
        elif kind == "hard_negative_authorized":
            assert brand.protected and t["seller"] in brand.authorized_sellers
        elif kind == "prohibited_category":
            assert world.categories[truth["category_id"]].policy == "prohibited"
        elif kind == "prohibited_recall":
            assert any(
                r.model_number.lower() in text for r in world.recalls if r.brand == t["brand"]
            )
        elif kind == "prompt_injection":
            from envs.catalog.v0.listings import phrases

            assert any(p.lower() in text for p in phrases()["injections"])
        elif kind == "missing_attributes":
            required = [a for a, req in world.schema(truth["category_id"]) if req and a.values]
            assert len(truth["attributes"]) < len(required)
        elif kind == "counterfeit_replica_wording":
            assert any(
                w in text for w in ("1:1", "mirror", "inspired by", "dupe", "replica", "lookalike")
            )
        if truth["verdict"] == "ok" and brand is not None and brand.protected:
            assert t["seller"] in brand.authorized_sellers, (
                f"{kind}: ok listing by unauthorized seller"
            )
    assert seen == set(KINDS)


def _digest_code(n: int) -> str:
    return (
        "import hashlib\n"
        "from envs.catalog import CatalogTwin\n"
        "t = CatalogTwin(seed=0)\n"
        "h = hashlib.sha256(t.world.digest().encode())\n"
        f"for i in range({n}): h.update(t.case('test', i).canonical_json().encode())\n"
        f"for i in range({n}): h.update(t.case('train', 7919 * i % "
        f"10000).canonical_json().encode())\n"
        "print(h.hexdigest())\n"
    )


def test_same_seed_same_bytes_in_two_processes(twin, catalog_cache):
    n = 60
    env = {**os.environ, "TWINRL_CACHE": str(catalog_cache), "PYTHONHASHSEED": "random"}
    # this process and a fresh one (another hash salt): the same bytes
    out = subprocess.run(
        [sys.executable, "-c", _digest_code(n)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    h = hashlib.sha256(twin.world.digest().encode())
    for i in range(n):
        h.update(twin.case("test", i).canonical_json().encode())
    for i in range(n):
        h.update(twin.case("train", 7919 * i % 10000).canonical_json().encode())
    assert out == h.hexdigest()


def test_another_seed_gives_other_cases(twin):
    from envs.catalog import CatalogTwin

    other = CatalogTwin(seed=0, case_mix={"clean": 1.0})
    assert {other.case("test", i).kind for i in range(20)} == {"clean"}
    assert other.world is twin.world  # the world depends on seed and taxonomy only


def test_case_mix_is_configurable_and_validated(twin):
    from envs.catalog import CatalogTwin

    mix = {"counterfeit_typosquat": 1, "prohibited_recall": 3}
    t = CatalogTwin(seed=0, case_mix=mix, test_size=40)
    kinds = [t.kind_of("test", i) for i in range(40)]
    assert set(kinds) == set(mix) and kinds.count("prohibited_recall") > kinds.count(
        "counterfeit_typosquat"
    )
    with pytest.raises(ConfigError, match="known kinds"):
        CatalogTwin(case_mix={"cleen": 1.0})
    with pytest.raises(ConfigError, match="positive"):
        validate_mix({"clean": 0.0})


@given(index=st.integers(0, 10**6), seed=st.integers(0, 10))
def test_schedule_holds_every_kind_per_cycle(index, seed):
    start = index - index % 50
    kinds = {kind_for("Catalog", seed, "train", start + j, DEFAULT_MIX) for j in range(50)}
    assert kinds == set(KINDS)


def test_shopify_world_cases(shopify_twin):
    kinds = set()
    for i in range(shopify_twin.num_cases("test")):
        case = shopify_twin.case("test", i)
        check_case(shopify_twin, case)
        kinds.add(case.kind)
    assert kinds == set(KINDS)


def _verdict_from_id_alone(text: str, twin) -> str | None:
    """The attack on readable ids: read ``(split, index)`` off the listing id and look the kind
    up in the public schedule (:func:`kind_for`). None when the id cannot be read."""
    match = re.search(r"LST-([A-Za-z0-9_]+)-(\d+)", text)
    if match is None:
        return None
    kind = kind_for(twin.name, twin.config.seed, match.group(1), int(match.group(2)), DEFAULT_MIX)
    return VERDICT_OF.get(kind, "counterfeit")  # prompt_injection: counterfeit or prohibited


def test_listing_ids_tell_nothing_about_the_case(twin):
    cases = [twin.case("test", i) for i in range(200)]
    verdicts = [c.truth["verdict"] for c in cases]
    majority = max(verdicts.count(v) for v in set(verdicts))
    guessed = [_verdict_from_id_alone(c.task["listing_id"], twin) for c in cases]
    hits = sum(g == v for g, v in zip(guessed, verdicts))
    assert hits <= majority  # no better than always saying the most common verdict
    ids = [c.task["listing_id"] for c in cases]
    assert all(re.fullmatch(r"LST-[A-Z2-7]{12}", i) for i in ids)
    assert not any("test" in i.lower() or f"{k:06d}" in i for k, i in enumerate(ids))


def test_listing_ids_are_unique_keyed_by_seed_and_map_back(twin):
    from envs.catalog import CatalogTwin
    from envs.catalog.common.ids import listing_id

    ids = {listing_id("Catalog", 0, s, i) for s, n in twin.splits.items() for i in range(n)}
    assert len(ids) == sum(twin.splits.values())
    case = twin.case("dev", 17)
    assert case.task["listing_id"] == listing_id("Catalog", 0, "dev", 17)
    assert listing_id("Catalog", 1, "dev", 17) != case.task["listing_id"]
    assert twin.case_of_listing(case.task["listing_id"]) == case
    assert twin.case_of_listing("LST-AAAAAAAAAAAA") is None
    assert CatalogTwin(seed=0).case("dev", 17).task["listing_id"] == case.task["listing_id"]

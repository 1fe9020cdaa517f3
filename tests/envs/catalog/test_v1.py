"""Catalog v1 (issue #12): overlapping signals, sellers as evidence, consistent labels, a held-out
test world, a reward that over-flagging cannot game, and the careful reference policy."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter

import pytest

from envs.catalog.common.text import listing_text
from envs.catalog.v1.listings import KIND_VERDICT, lookup_view, schema_view
from envs.catalog.v1.rules import extract_attributes
from twin.errors import ConfigError, ToolError
from twin.rollout import run_episodes, summarize

#: sha256 of v0's first 60 cases of every split (seed 0), taken before v1 existed.
V0_CASES_SHA256 = {
    "generated": "4eeb4389baef578d997a3aa0911791df0e3cf484f60df46228d6d278d971b019",
    "shopify": "cc175d65cf7e1ee070cafa810ce0b743de9a7f021df9db5f0e80c01dfbe6f80b",
}


def _v0_digest(twin) -> str:
    h = hashlib.sha256()
    for split in ("train", "dev", "test"):
        for i in range(60):
            c = twin.case(split, i)
            h.update(json.dumps([c.kind, c.task, c.truth], sort_keys=True, default=list).encode())
    return h.hexdigest()


def test_v0_cases_stay_byte_identical(twin):
    assert _v0_digest(twin) == V0_CASES_SHA256["generated"]


def test_v0_cases_stay_byte_identical_on_shopify(shopify_twin):
    assert _v0_digest(shopify_twin) == V0_CASES_SHA256["shopify"]


#: sha256 of v0's prompts (first 20 cases of every split, seed 0) and of its tool schemas, taken
#: when v0 moved into envs/catalog/v0/ (equal to the digests of the tree before the move).
V0_PROMPTS_SHA256 = "04dba420e52bb8b322b87eff38f01568baa03ddbb89615f061e34bb1fa5d5c96"
V0_TOOLS_SHA256 = "f246a10bdccafa8135ed1e693dacd75a7bf2dfc71a95f7190965505894fa06a3"


def test_v0_prompts_and_tools_stay_byte_identical(twin):
    h = hashlib.sha256()
    for split in ("train", "dev", "test"):
        for i in range(20):
            h.update(json.dumps(twin.prompt(twin.case(split, i)), sort_keys=True).encode())
    assert h.hexdigest() == V0_PROMPTS_SHA256
    tools = hashlib.sha256(json.dumps(twin.tool_schemas, sort_keys=True).encode()).hexdigest()
    assert tools == V0_TOOLS_SHA256


def test_v1_is_registered_as_the_latest(twin_v1):
    import twin as twinlib

    assert twinlib.spec("catalog").id == "twin/Catalog-v1"
    assert twinlib.spec("twin/Catalog-v0").load().version == 0
    assert (
        twin_v1.case("test", 3).task["listing_id"]
        != twinlib.make_twin("Catalog-v0").case("test", 3).task["listing_id"]
    )


def test_v1_cases_are_deterministic_and_cover_every_kind(twin_v1):
    from envs.catalog import CatalogTwinV1

    fresh = CatalogTwinV1(seed=0)
    for i in range(0, 200, 7):
        a, b = twin_v1.case("test", i), fresh.case("test", i)
        assert (a.kind, a.task, a.truth) == (b.kind, b.task, b.truth)
    kinds = {twin_v1.kind_of("test", i) for i in range(100)}
    assert kinds == set(KIND_VERDICT)
    with pytest.raises(ConfigError, match="known kinds"):
        CatalogTwinV1(case_mix={"cleen": 1.0})


def test_labels_are_what_the_policy_says_about_the_visible_evidence(twin_v1):
    """Every test case's verdict is its kind's, and the required attributes are exactly what a
    careful reader reads from the listing (no contradiction with the leaf name, no leak)."""
    world = twin_v1.world
    for i in range(twin_v1.num_cases("test")):
        case = twin_v1.case("test", i)
        task = case.task
        assert case.truth["verdict"] == KIND_VERDICT[case.kind], (i, case.kind, case.truth)
        listing = {**task, "specifics": dict(task["attributes"])}
        schema = schema_view(world, case.truth["category_id"])
        assert extract_attributes(listing, schema) == dict(case.truth["attributes"]), i
        # a value the leaf's own name implies is the value the listing states
        name = (
            " "
            + re.sub(r"'s?\b", "", world.categories[case.truth["category_id"]].full_name.lower())
            + " "
        )
        for attr in schema["attributes"]:
            got = case.truth["attributes"].get(attr["handle"])
            implied = [
                v
                for v in attr["values"]
                if re.search(
                    r"(?<![a-z0-9])" + re.escape(re.sub(r"'s?\b", "", v.lower())) + r"(?![a-z0-9])",
                    name,
                )
            ]
            if got is not None and implied:
                assert got in implied, (i, attr["handle"], got, implied)


def test_missing_attributes_never_leak(twin_v1):
    world = twin_v1.world
    seen = 0
    for i in range(twin_v1.num_cases("test")):
        case = twin_v1.case("test", i)
        dropped = [
            s.split(":", 1)[1] for s in case.truth["signals"] if s.startswith("missing_required")
        ]
        if not dropped:
            continue
        seen += 1
        text = listing_text({**case.task, "specifics": dict(case.task["attributes"])}).lower()
        for handle in dropped[0].split(","):
            assert handle not in case.truth["attributes"]
            attr = world.attributes[handle]
            assert not any(
                re.search(r"(?<![a-z0-9])" + re.escape(v.lower()) + r"(?![a-z0-9])", text)
                for v in attr.values
            ), (i, handle)
    assert seen >= 3


def test_no_phrase_marks_a_kind(twin_v1):
    """Wording v0 planted only on one side appears on ok and on bad listings alike."""
    families = {
        "injection": (
            r"ignore (all )?previous instructions|admin "
            r"override|pre-approved|do not flag|approve"
        ),
        "lot/batch": r"\b(lot|batch)\b",
        "inspired by": r"inspired by",
        "compatible with": r"compatible|fits |works with|made to fit|designed for|designed to fit",
        "discount": r"% off|below the usual|discount|lowest price",
        "condition": r"clearance|refurbished|open box|pre-owned|\bused\b",
        "blunt opener": r"no questions asked|discreet packaging|works perfectly",
    }
    sides: dict[str, Counter] = {f: Counter() for f in families}
    for i in range(600):
        case = twin_v1.case("train", i)
        text = f"{case.task['title']} {case.task['description']}".lower()
        for fam, pattern in families.items():
            if re.search(pattern, text):
                sides[fam][case.truth["verdict"] == "ok"] += 1
    for fam, c in sides.items():
        assert c[True] >= 3 and c[False] >= 3, (fam, c)


def test_held_out_world_shares_no_entity_with_train(twin_v1):
    """Test listings draw only on the eval part, train listings only on the train part, and the
    parts are disjoint: no brand, seller or recall notice of a test listing is a train one's."""
    world = twin_v1.world
    assert not set(world.sellers_by_part["train"]) & set(world.sellers_by_part["eval"])
    assert not set(world.longtail["train"]) & set(world.longtail["eval"])
    recall_part = {r.recall_id: r.part for r in world.recalls}

    def parts(split: str, n: int) -> dict[str, set[str]]:
        ents = twin_v1.world_entities(split, limit=n)
        out: dict[str, set[str]] = {"brands": set(), "sellers": set(), "recalls": set()}
        for b in ents["brands"]:
            if b in world.brand_part:
                out["brands"].add(world.brand_part[b])
            elif b in world.longtail["train"] or b in world.longtail["eval"]:
                out["brands"].add("train" if b in world.longtail["train"] else "eval")
        out["sellers"] = {world.seller_records[s].part for s in ents["sellers"]}
        out["recalls"] = {recall_part[r] for r in ents["recalls"]}
        return out

    assert parts("test", 200) == {"brands": {"eval"}, "sellers": {"eval"}, "recalls": {"eval"}}
    assert parts("train", 300) == {"brands": {"train"}, "sellers": {"train"}, "recalls": {"train"}}
    test_verticals = {
        world.categories[twin_v1.case("test", i).truth["category_id"]].vertical for i in range(200)
    }
    assert set(world.held_out) & test_verticals  # verticals train never shows


def test_get_seller_and_homoglyph_lookup(twin_v1):
    world = twin_v1.world
    seller = twin_v1.get_seller(world.sellers[0])
    assert set(seller) == {
        "name",
        "account_age_days",
        "rating",
        "sales",
        "ships_from",
        "takedowns",
        "authorized_brands",
    }
    assert not any(
        w in s.lower() for s in world.sellers for w in ("official", "authorized", "fake")
    )
    with pytest.raises(ToolError, match="no seller"):
        twin_v1.get_seller(world.sellers[0] + "zz")
    found = twin_v1.lookup_brand("N\u043erv-ale")  # Cyrillic o and a hyphen
    assert found["exact"] is None
    assert found["similar"][0]["name"] == "Norvale" and found["similar"][0]["similarity"] == 100.0
    assert lookup_view(world, "Norvale")["exact"]["recalls"] is not None


def _means(twin, names, cases):
    policies = twin.baselines()
    out = {}
    for name in names:
        groups = run_episodes(twin, policies[name](twin), cases, group_size=1, progress=False)
        out[name] = summarize(groups, success=twin.success)["reward_mean"]
    return out


def _acceptance(twin) -> dict[str, float]:
    cases = [("test", i) for i in range(twin.num_cases("test"))]
    means = _means(
        twin,
        [
            "careful",
            "heuristic",
            "always_ok",
            "always_counterfeit",
            "always_prohibited",
            "first_hit",
            "no_tools",
        ],
        cases,
    )
    assert means["careful"] >= 0.95, means
    assert means["heuristic"] <= 0.75, means
    for name in ("always_ok", "always_counterfeit", "always_prohibited", "first_hit", "no_tools"):
        assert means[name] <= means["careful"] - 0.15, (name, means)
    return means


def test_careful_solves_the_held_out_test_world_and_shortcuts_lose(twin_v1):
    _acceptance(twin_v1)


def test_careful_and_shortcuts_on_shopify(shopify_twin_v1):
    _acceptance(shopify_twin_v1)


def test_careful_never_reads_the_truth(twin_v1):
    """The careful policy's answers come from the chat: with the case's truth scrambled it
    submits the same (truth-free) decision."""
    from envs.catalog.v1.careful import CarefulPolicy

    case = twin_v1.case("test", 5)
    env_msgs = twin_v1.prompt(case)
    policy = CarefulPolicy(None)  # no twin at all
    first = policy.turn(env_msgs)
    assert {c["function"]["name"] for c in first["tool_calls"]} >= {"search_taxonomy", "get_seller"}


def test_bag_of_words_on_the_prompt_is_near_the_majority_rate(twin_v1):
    from envs.catalog.audit import bow_audit

    audit = bow_audit(twin_v1, train_cases=800)
    assert audit["margin"] <= 0.10, audit


def test_twin_check_passes_on_catalog_v1(twin_v1):
    """`twin check catalog` (the doctor, at its command-line default of 2 cases per kind)."""
    from twin.doctor import doctor

    report = doctor(twin_v1, cases=2, subprocess_check=False)
    failed = [r for r in report.rows if r.status == "fail" or r.crashed]
    assert not failed, report.to_markdown()
    assert report.row("overlap", "brands").status == "pass"

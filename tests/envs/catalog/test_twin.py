"""The catalog twin as an environment: check_env, tools, error messages, no truth leaks."""

from __future__ import annotations

import json

import pytest
from gymnasium.utils.env_checker import check_env

from envs.catalog.v0.listings import KINDS
from twin.errors import ConfigError, ToolArgumentError, ToolError


def _env(twin):
    from twin.env import TwinEnv

    return TwinEnv(twin)


def _call(name, args):
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
        ],
    }


def test_check_env(twin):
    env = _env(twin)
    check_env(env, skip_render_check=True)


def test_tools_and_schemas(twin):
    names = [t.name for t in twin.tools]
    assert names == ["search_taxonomy", "lookup_brand", "get_attribute_schema", "submit"]
    assert [t.name for t in twin.tools if t.terminal] == ["submit"]
    submit = twin.tool("submit").schema["function"]["parameters"]
    assert submit["properties"]["verdict"]["enum"] == ["ok", "counterfeit", "prohibited"]
    assert "task" not in submit["properties"]


def test_search_finds_the_true_leaf_by_its_name(twin, world):
    case = twin.case("test", 0)
    cat = world.categories[case.truth["category_id"]]
    res = twin.tool("search_taxonomy").call({"query": cat.full_name, "limit": 10})
    assert cat.id in [r["id"] for r in res["results"]]
    assert twin.tool("search_taxonomy").call({"query": "zzqxw"}).get("results") == []


def test_lookup_brand_exact_and_fuzzy(twin, world):
    brand = next(b for b in world.brands.values() if b.protected and b.authorized_sellers)
    res = twin.tool("lookup_brand").call({"name": brand.name.upper()})
    assert res["exact"]["name"] == brand.name
    assert res["exact"]["protected"] and res["exact"]["authorized_sellers"] == list(
        brand.authorized_sellers
    )
    assert res["exact"]["msrp"]
    typo = brand.name[:-1] + ("x" if brand.name[-1] != "x" else "y")
    fuzzy = twin.tool("lookup_brand").call({"name": typo})
    assert fuzzy["exact"] is None or fuzzy["exact"]["name"].lower() == typo.lower()
    leaf = next(iter(brand.msrp))
    one = twin.tool("lookup_brand").call({"name": brand.name, "category_id": leaf})
    assert one["exact"]["msrp"][0]["low"] == brand.msrp[leaf][0]


def test_recalls_are_listed_with_their_brand(twin, world):
    recall = world.recalls[0]
    res = twin.tool("lookup_brand").call({"name": recall.brand})
    assert recall.model_number in [r["model_number"] for r in res["exact"]["recalls"]]


def test_schema_shows_required_values_and_policy(twin, world):
    leaf = next(c for c in world.leaves if world.categories[c].policy == "prohibited")
    res = twin.tool("get_attribute_schema").call({"category_id": leaf})
    assert res["policy"] == "prohibited" and res["is_leaf"]
    assert {a["handle"] for a in res["attributes"]} == {a.handle for a, _ in world.schema(leaf)}
    parent = world.categories[leaf].parent_id
    res = twin.tool("get_attribute_schema").call({"category_id": parent})
    assert not res["is_leaf"] and leaf in [c["id"] for c in res["children"]]


def test_tool_errors_say_what_exists(twin, world):
    leaf = twin.case("test", 0).truth["category_id"]
    parent = world.categories[leaf].parent_id
    with pytest.raises(ToolError, match="search_taxonomy") as err:
        twin.tool("get_attribute_schema").call({"category_id": parent + "-999"})
    assert parent in str(err.value) and world.categories[parent].children[0] in str(err.value)
    with pytest.raises(ToolError, match="categories matching"):
        twin.tool("get_attribute_schema").call({"category_id": world.categories[leaf].name})
    schema = world.schema(leaf)
    attr = schema[0][0]
    sub = twin.tool("submit")
    with pytest.raises(ToolError) as err:
        sub.call(
            {
                "category_id": leaf,
                "attributes": {"no_such_attr": "x"},
                "verdict": "ok",
                "reason": "",
            }
        )
    assert "its attributes" in str(err.value) and attr.handle in str(err.value)
    with pytest.raises(ToolError) as err:
        sub.call(
            {
                "category_id": leaf,
                "attributes": {attr.handle: "zz-not-a-value"},
                "verdict": "ok",
                "reason": "",
            }
        )
    assert "allowed" in str(err.value) and attr.values[0] in str(err.value)
    with pytest.raises(ToolArgumentError) as err:
        sub.call({"category_id": leaf, "attributes": {}, "verdict": "fake", "reason": ""})
    assert "counterfeit" in str(err.value) and "prohibited" in str(err.value)
    with pytest.raises(ToolError, match="unknown category id"):
        sub.call({"category_id": "zz-1-2", "attributes": {}, "verdict": "ok", "reason": ""})
    # a value is matched case-insensitively, as the reward compares it
    ok = sub.call(
        {
            "category_id": leaf,
            "attributes": {attr.handle: attr.values[0].upper()},
            "verdict": "ok",
            "reason": "x",
        },
        task={"listing_id": "L"},
    )
    assert ok["status"] == "submitted"


def test_no_prompt_or_tool_output_reveals_the_truth(twin):
    from envs.catalog.baselines import HeuristicPolicy

    policy = HeuristicPolicy(twin)
    import asyncio

    for i in range(0, twin.num_cases("test"), 3):
        env = _env(twin)
        obs, info = env.reset(options={"split": "test", "index": i})
        case = env.case
        assert set(info) >= {"tools", "case_id"} and "kind" not in info and "truth" not in info
        seen = [m.get("content") or "" for m in obs]
        for _ in range(6):
            action = asyncio.run(policy.act(env.messages, info["tools"]))
            obs, reward, term, trunc, step_info = env.step(action)
            if term or trunc:
                break
            seen += [m.get("content") or "" for m in obs]
        text = "\n".join(seen)
        for kind in KINDS:
            if "_" in kind:
                assert kind not in text
        assert '"verdict"' not in text and "signals" not in text
        for signal in case.truth["signals"]:
            assert signal not in text


def test_oracle_episode_reaches_max_and_outcome(twin):
    env = _env(twin)
    env.reset(options={"split": "test", "index": 5})
    truth = env.case.truth
    _, reward, term, trunc, info = env.step(
        _call(
            "submit",
            {
                "category_id": truth["category_id"],
                "attributes": truth["attributes"],
                "verdict": truth["verdict"],
                "reason": "r",
            },
        )
    )
    assert term and not trunc and reward == pytest.approx(1.0)
    assert info["outcome"]["truth"] == truth and twin.success(info["trajectory"])


def test_config_errors_name_the_options():
    from envs.catalog import CatalogTwin

    with pytest.raises(ConfigError, match="taxonomy_path"):
        CatalogTwin(taxonom="x")


def test_registry_makes_the_twin(twin):
    import twin as twinlib

    env = twinlib.make("catalog", seed=0)
    assert type(env.twin).__name__ == "CatalogTwinV1"  # a name without a version: the latest
    env.reset(options={"split": "test", "index": 1})
    assert type(twinlib.make_twin("twin/Catalog-v0")).__name__ == "CatalogTwin"


def test_shopify_world_tools(shopify_twin):
    from twin.rollout import run_episodes

    world = shopify_twin.world
    assert len(world.categories) >= 10_000
    res = shopify_twin.tool("search_taxonomy").call({"query": "running shoes"})
    assert res["results"]
    oracle = shopify_twin.baselines()["oracle"](shopify_twin)
    cases = [("test", i) for i in range(shopify_twin.num_cases("test"))]
    for g in run_episodes(shopify_twin, oracle, cases, progress=False):
        t = g.trajectories[0]
        assert t.terminated and t.reward == pytest.approx(1.0), (t.case_id, t.reward_notes)


def test_lookup_brand_echoes_each_callers_own_spelling(twin, world):
    brand = next(iter(world.brands.values()))
    first, second = _env(twin), _env(twin)
    first.reset(options={"split": "test", "index": 0})
    first.step(_call("lookup_brand", {"name": brand.name.upper()}))
    second.reset(options={"split": "test", "index": 1})
    obs, *_ = second.step(_call("lookup_brand", {"name": brand.name.lower()}))
    assert json.loads(obs[0]["content"])["query"] == brand.name.lower()
    assert second.trajectory.calls[-1].result["query"] == brand.name.lower()


@pytest.mark.parametrize(
    ("tool_name", "args", "path"),
    [
        ("get_attribute_schema", None, ("policy",)),
        ("search_taxonomy", {"query": "running shoes", "limit": 3}, ("results", 0, "name")),
        ("lookup_brand", None, ("similar",)),
    ],
)
def test_changing_a_stored_result_changes_no_later_episode(twin, world, tool_name, args, path):
    import contextlib

    case = twin.case("test", 0)
    if args is None:
        args = (
            {"category_id": case.truth["category_id"]}
            if tool_name == "get_attribute_schema"
            else {"name": next(iter(world.brands.values())).name}
        )
    env = _env(twin)
    env.reset(options={"split": "test", "index": 0})
    first, *_ = env.step(_call(tool_name, args))
    node = env.trajectory.calls[-1].result
    for key in path[:-1]:
        node = node[key]
    with contextlib.suppress(TypeError):  # read-only results refuse; copies may change freely
        node[path[-1]] = "changed"
    env.reset(options={"split": "test", "index": 1})
    again, *_ = env.step(_call(tool_name, args))
    assert again[0]["content"] == first[0]["content"]
    assert "changed" not in again[0]["content"]

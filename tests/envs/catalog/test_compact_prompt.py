"""``prompt_style="compact"`` on Catalog-v1: a shorter system prompt and tool descriptions, the
same tools and cases; ``twin show`` prints the prompt's size."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from twin.errors import ConfigError
from twin.rollout import run_episodes, summarize
from twinrl_cli import app


@pytest.fixture(scope="module")
def compact_v1(twin_v1):
    """Catalog-v1 (seed 0) with the compact prompt; shares the full twin's world."""
    from envs.catalog import CatalogTwinV1

    return CatalogTwinV1(seed=0, prompt_style="compact")


def _size(twin) -> int:
    system = twin.prompt(twin.case("test", 0))[0]["content"]
    return len(system) + len(json.dumps(twin.tool_schemas, ensure_ascii=False))


def test_compact_is_much_shorter_with_the_same_tools(twin_v1, compact_v1):
    full_system = twin_v1.prompt(twin_v1.case("test", 0))[0]["content"]
    compact_system = compact_v1.prompt(compact_v1.case("test", 0))[0]["content"]
    assert len(compact_system) * 2 <= len(full_system)  # the system prompt: at least 2x shorter
    assert _size(compact_v1) * 1.5 <= _size(twin_v1)  # system prompt + schemas: at least 1.5x
    full = {s["function"]["name"]: s["function"] for s in twin_v1.tool_schemas}
    compact = {s["function"]["name"]: s["function"] for s in compact_v1.tool_schemas}
    assert list(full) == list(compact)
    for name, fn in compact.items():
        assert len(fn["description"]) < len(full[name]["description"]), name
        params, full_params = fn["parameters"], full[name]["parameters"]
        assert params["required"] == full_params["required"]
        for arg, prop in params["properties"].items():  # same types, enums and defaults
            assert {k: v for k, v in prop.items() if k != "description"} == {
                k: v for k, v in full_params["properties"][arg].items() if k != "description"
            }
            assert "e.g." not in prop["description"]
    # the env hands the agent the compact schemas
    from twin.env import TwinEnv

    _, info = TwinEnv(compact_v1).reset(options={"split": "test", "index": 0})
    assert [dict(s["function"])["description"] for s in info["tools"]] == [
        f["description"] for f in compact.values()
    ]


def test_compact_keeps_the_cases_and_truth(twin_v1, compact_v1):
    for i in range(20):
        a, b = twin_v1.case("test", i), compact_v1.case("test", i)
        assert (a.kind, a.task, a.truth) == (b.kind, b.task, b.truth)
        assert twin_v1.prompt(a)[1] == compact_v1.prompt(b)[1]  # the listing message


def test_careful_scores_on_compact_prompts(compact_v1):
    policy = compact_v1.baselines()["careful"](compact_v1)
    groups = run_episodes(
        compact_v1, policy, [("test", i) for i in range(20)], group_size=1, progress=False
    )
    assert summarize(groups, success=compact_v1.success)["reward_mean"] >= 0.95


def test_v0_prompt_is_unchanged_and_has_no_compact_style(twin):
    from envs.catalog.v0.twin import SYSTEM_PROMPT, CatalogTwin

    assert twin.config.prompt_style == "full"
    assert twin.prompt(twin.case("test", 0))[0]["content"] == SYSTEM_PROMPT
    assert twin.world_key() == CatalogTwin(seed=0, prompt_style="full").world_key()
    with pytest.raises(
        ConfigError, match="prompt_style 'compact' is not implemented.*it has: full"
    ):
        CatalogTwin(seed=0, prompt_style="compact")


def test_twin_show_prints_the_prompt_size(twin_v1):
    from trainer.tiny import build_tiny

    runner = CliRunner()
    sizes = {}
    for style in ("full", "compact"):
        result = runner.invoke(
            app,
            [
                "show",
                "catalog",
                "--set",
                f"prompt_style={style}",
                "--json",
                "--tokenizer",
                str(build_tiny()),
            ],
        )
        assert result.exit_code == 0, result.output
        sizes[style] = json.loads(result.output)["prompt_size"]
    for style, size in sizes.items():
        assert size["style"] == style
        for part in ("system", "tools"):
            assert size[part]["chars"] > 0 and size[part]["tokens"] > 0
        assert size["total"]["tokens"] == size["system"]["tokens"] + size["tools"]["tokens"]
    assert sizes["compact"]["system"]["tokens"] * 2 <= sizes["full"]["system"]["tokens"]
    plain = runner.invoke(app, ["show", "catalog", "--set", "prompt_style=compact"])
    assert plain.exit_code == 0, plain.output
    assert "prompt size (compact)" in plain.output
    assert str(sizes["compact"]["system"]["chars"]) in plain.output

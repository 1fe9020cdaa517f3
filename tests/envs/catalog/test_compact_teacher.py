"""``compact``: the careful analyst's decisions in the fewest tokens, the SFT teacher of
Catalog-v1."""

from __future__ import annotations

import json
import statistics

import pytest

from twin.rollout import run_episodes


@pytest.fixture(scope="module")
def compact_twin(twin_v1):
    """Catalog-v1 (seed 0) as the SmolLM2 recipes run it: compact prompt, three turns."""
    from envs.catalog import CatalogTwinV1

    return CatalogTwinV1(seed=0, prompt_style="compact", max_turns=3)


def _episodes(twin, name: str, n: int):
    policy = twin.baselines()[name](twin)
    groups = run_episodes(
        twin, policy, [("test", i) for i in range(n)], group_size=1, progress=False
    )
    return [t for g in groups for t in g.trajectories]


def _chars(trajectory) -> int:
    """What an episode adds to the prompt: the assistant turns and the tool results."""
    out = 0
    for m in trajectory.messages:
        if m.get("role") == "assistant":
            out += len(json.dumps(m.get("tool_calls") or [], ensure_ascii=False)) + len(
                m.get("content") or ""
            )
        elif m.get("role") == "tool":
            out += len(m.get("content") or "")
    return out


def _submit(trajectory) -> dict:
    for m in reversed(trajectory.messages):
        for c in m.get("tool_calls") or []:
            if c["function"]["name"] == "submit":
                return json.loads(c["function"]["arguments"])
    raise AssertionError("no submit")


def test_compact_scores_the_ceiling_on_every_test_case_in_three_turns(compact_twin):
    n = compact_twin.num_cases("test")
    episodes = _episodes(compact_twin, "compact", n)
    assert len(episodes) == n == 200
    assert [t.reward for t in episodes] == [pytest.approx(1.0)] * n
    assert max(t.num_turns for t in episodes) <= 3


def test_compact_decides_as_careful_in_far_fewer_tokens(compact_twin):
    n = 60
    compact, careful, heuristic = (
        _episodes(compact_twin, name, n) for name in ("compact", "careful", "heuristic")
    )
    for a, b in zip(compact, careful):
        sa, sb = _submit(a), _submit(b)
        assert (sa["category_id"], sa["attributes"], sa["verdict"]) == (
            sb["category_id"],
            sb["attributes"],
            sb["verdict"],
        )
        assert "reason" not in sa
    size = {name: statistics.fmean(map(_chars, eps)) for name, eps in
            (("compact", compact), ("careful", careful), ("heuristic", heuristic))}  # fmt: skip
    assert size["compact"] < 0.6 * size["careful"], size
    assert size["compact"] < size["heuristic"], size


def test_compact_asks_three_search_results_and_the_brand_with_its_category(compact_twin):
    episodes = _episodes(compact_twin, "compact", 4)
    calls = [c["function"] for m in episodes[3].messages for c in m.get("tool_calls") or []]
    search = [json.loads(c["arguments"]) for c in calls if c["name"] == "search_taxonomy"]
    brands = [json.loads(c["arguments"]) for c in calls if c["name"] == "lookup_brand"]
    assert [s["limit"] for s in search] == [3]
    assert brands and all(b.get("category_id") for b in brands)

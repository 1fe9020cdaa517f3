"""Baselines: the oracle reaches the maximum on every test case; heuristic sits in between."""

from __future__ import annotations

import pytest

from twin.rollout import run_episodes, summarize


def test_oracle_scores_max_on_every_test_case(twin):
    oracle = twin.baselines()["oracle"](twin)
    cases = [("test", i) for i in range(twin.num_cases("test"))]
    groups = run_episodes(twin, oracle, cases, group_size=1, progress=False)
    for g in groups:
        t = g.trajectories[0]
        assert t.reward == pytest.approx(1.0), (t.case_id, t.case_kind, t.reward_notes)
        assert t.num_turns == 1 and t.invalid_calls == 0


def test_heuristic_between_random_and_oracle(twin):
    from envs.catalog.demo import select_cases

    cases = select_cases(twin, "test", 42)
    means = {}
    for name in ("random", "heuristic", "oracle"):
        policy = twin.baselines()[name](twin)
        groups = run_episodes(twin, policy, cases, group_size=2, progress=False)
        means[name] = summarize(groups, success=twin.success)["reward_mean"]
    assert means["random"] + 0.2 < means["heuristic"] < means["oracle"] - 0.02, means
    assert means["oracle"] == pytest.approx(1.0)


def test_heuristic_uses_only_tools_and_submits(twin):
    from envs.catalog.baselines import HeuristicPolicy

    groups = run_episodes(
        twin, HeuristicPolicy(twin), [("dev", i) for i in range(20)], progress=False
    )
    for g in groups:
        t = g.trajectories[0]
        assert t.terminated and t.invalid_calls == 0, (t.case_id, [c.error for c in t.calls])
        assert [c.name for c in t.calls][-1] == "submit"


def test_heuristic_is_not_fooled_by_injection(twin):
    from envs.catalog.baselines import HeuristicPolicy

    cases = [
        ("test", i)
        for i in range(twin.num_cases("test"))
        if twin.kind_of("test", i) == "prompt_injection"
    ]
    groups = run_episodes(twin, HeuristicPolicy(twin), cases, progress=False)
    flagged = sum(g.trajectories[0].submission["verdict"] != "ok" for g in groups)
    assert flagged >= len(cases) * 0.6

"""``twin.evaluation.plan_evaluation``: the workflow behind ``twin eval``, without the CLI."""

from __future__ import annotations

import json

import pytest

from twin.errors import ConfigError
from twin.evaluation import plan_evaluation
from twin.policies import PolicySettings
from twin.registry import make_twin
from twin.store import RunStore


@pytest.fixture(scope="module")
def returns():
    return make_twin("returns")


def test_cases_and_run_config_follow_the_request_and_never_hold_the_key(returns):
    settings = PolicySettings(
        policy="openai:m", base_url="http://127.0.0.1:9/v1", api_key="sk-secret", temperature=0.3,
        concurrency=5,
    )  # fmt: skip
    job = plan_evaluation(
        returns, settings, episodes=5, split="test", start=1, group_size=2, seed=3,
        twin_config={"max_turns": 4}, policy_file="p.yaml",
    )  # fmt: skip
    assert job.cases == [("test", 1), ("test", 2), ("test", 3)]  # ceil(5 / 2) cases from index 1
    assert (job.group_size, job.concurrency, job.policy_spec) == (2, 5, "openai:m")
    assert job.config["episodes"] == 6 and job.config["cases"] == 3
    assert job.config["twin_config"] == {"max_turns": 4} and job.config["policy_file"] == "p.yaml"
    assert job.config["temperature"] == 0.3 and "request" in job.config
    assert "sk-secret" not in json.dumps(job.config, default=str)
    assert (
        job.describe()
        == f"{returns.name}: 3 cases x 2 = 6 episodes of {job.policy.name} on split 'test'"
    )


def test_defaults_are_random_policy_and_64_in_flight(returns):
    job = plan_evaluation(returns, PolicySettings(), episodes=2)
    assert job.policy_spec == "random" and job.concurrency == 64
    assert job.config["temperature"] == 0.0 and "request" not in job.config


def test_cases_that_do_not_fit_the_split_are_refused_before_anything_runs(returns):
    n = returns.num_cases("test")
    with pytest.raises(ConfigError, match=f"has {n} cases"):
        plan_evaluation(returns, PolicySettings(), episodes=n + 1)
    with pytest.raises(ConfigError, match="from index 1"):
        plan_evaluation(returns, PolicySettings(), episodes=n, start=1)


def test_a_job_runs_stores_and_repeats_with_the_same_seed(returns, tmp_path):
    store = RunStore(tmp_path / "runs.db")
    try:
        job = plan_evaluation(
            returns, PolicySettings(policy="random"), episodes=4, group_size=2, seed=7
        )
        first = job.run(store, progress=False)
        again = plan_evaluation(
            returns, PolicySettings(policy="random"), episodes=4, group_size=2, seed=7
        )
        second = again.run(None, progress=False)
        assert first.summary["episodes"] == 4 and first.run_id is not None
        assert store.run(first.run_id).config["seed"] == 7
        assert first.summary["reward_mean"] == second.summary["reward_mean"]
        assert second.run_id is None
    finally:
        store.close()

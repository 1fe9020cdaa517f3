"""The concurrent runner and the metrics (pass@k, pass^k, summarize)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.errors import CaseError
from twin.policies import RandomPolicy, ReplayPolicy
from twin.rollout import (
    Group,
    Trajectory,
    arun_episodes,
    max_reward,
    pass_at_k,
    pass_hat_k,
    run_episodes,
    success_fn,
    summarize,
)
from twin.tools import tool


# -- the twin: conftest's KeyTwin (look up the value of a key, submit it) -----------------------
class SolverPolicy:
    """Looks the key up, then submits what the lookup returned."""

    name = "solver"

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    async def act(self, messages, tools):
        if self.delay:
            await asyncio.sleep(self.delay)
        last = messages[-1]
        if last["role"] == "tool":
            value = json.loads(last["content"])["value"]
            return _call("submit", {"value": value})
        key = messages[1]["content"].split("key ")[1].split(" ")[0]
        return _call("lookup", {"key": key})


def _call(name: str, args: dict) -> dict:
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


@pytest.fixture(scope="module")
def twin(key_twin_cls):
    return key_twin_cls(max_turns=4)


# -- runner ------------------------------------------------------------------------------------
def test_solver_scores_max_with_timings_and_policy_name(twin):
    groups = run_episodes(twin, SolverPolicy(), [("test", i) for i in range(10)], progress=False)
    assert [g.case_id for g in groups] == [f"KeyTest/test/{i}" for i in range(10)]
    for g in groups:
        (t,) = g.trajectories
        assert t.reward == 1.0 and t.terminated and t.num_turns == 2
        assert t.policy == "solver"
        assert set(t.timings) >= {"policy", "env", "total"}
        assert t.timings["total"] >= t.timings["env"] >= 0
    summary = summarize(groups, success=success_fn(twin))
    assert summary["reward_mean"] == 1.0 and summary["pass@k"] == {"1": 1.0}
    assert summary["by_kind"]["even"]["episodes"] == 5


def test_groups_keep_case_order_and_size(twin):
    cases = [("test", 7), ("train", 3), ("test", 0)]
    groups = run_episodes(twin, RandomPolicy(seed=1), cases, group_size=3, progress=False)
    assert [g.case_id for g in groups] == ["KeyTest/test/7", "KeyTest/train/3", "KeyTest/test/0"]
    assert all(len(g.trajectories) == 3 for g in groups)
    # for_episode keys differ per k: the three samples of a case are not all the same chat
    chats = {json.dumps(t.messages[2:], sort_keys=True) for t in groups[0].trajectories}
    assert len(chats) > 1


def test_random_policy_runs_are_deterministic(twin):
    cases = [("test", i) for i in range(20)]
    a = run_episodes(twin, RandomPolicy(seed=3), cases, group_size=2, concurrency=7, progress=False)
    b = run_episodes(
        twin, RandomPolicy(seed=3), cases, group_size=2, concurrency=64, progress=False
    )
    dump = lambda gs: [[(t.messages, t.reward) for t in g.trajectories] for g in gs]  # noqa: E731
    assert dump(a) == dump(b)


def test_concurrency_200_sleepy_episodes_finish_fast(twin):
    # 200 episodes x 2 turns x 50 ms = 20 s if run one at a time; ~0.4 s at concurrency 64.
    start = time.perf_counter()
    groups = run_episodes(
        twin,
        SolverPolicy(delay=0.05),
        [("test", i) for i in range(200)],
        concurrency=64,
        progress=False,
    )
    elapsed = time.perf_counter() - start
    assert sum(len(g.trajectories) for g in groups) == 200
    assert all(t.reward == 1.0 for g in groups for t in g.trajectories)
    assert elapsed < 4.0, elapsed


def test_concurrency_limit_is_respected(twin):
    live = 0
    peak = 0

    class Counting:
        name = "counting"

        async def act(self, messages, tools):
            nonlocal live, peak
            live += 1
            peak = max(peak, live)
            await asyncio.sleep(0.005)
            live -= 1
            return await SolverPolicy().act(messages, tools)

    run_episodes(twin, Counting(), [("test", i) for i in range(40)], concurrency=5, progress=False)
    assert peak == 5


def test_a_raising_policy_does_not_kill_the_others(twin):
    class Flaky:
        name = "flaky"

        async def act(self, messages, tools):
            if (
                "k" in messages[1]["content"]
                and len(messages) > 2
                and messages[2].get("role") == "assistant"
            ):
                key = messages[1]["content"].split("key ")[1].split(" ")[0]
                if int(key[1:]) % 3 == 0:
                    raise RuntimeError("model server fell over")
            return await SolverPolicy().act(messages, tools)

    cases = [("test", i) for i in range(30)]
    groups = run_episodes(twin, Flaky(), cases, progress=False)
    trajs = [t for g in groups for t in g.trajectories]
    failed = [t for t in trajs if "error" in t.info]
    assert failed and len(failed) < len(trajs)
    for t in failed:
        assert t.info["error"] == "RuntimeError: model server fell over"
        assert t.reward is None and t.num_turns == 1  # the partial trajectory is kept
    assert all(t.reward == 1.0 for t in trajs if "error" not in t.info)
    summary = summarize(groups)
    assert summary["errors"] == len(failed)
    assert summary["episodes"] == len(trajs) - len(failed)
    assert summary["reward_mean"] == 1.0


def test_blocking_tools_run_off_the_event_loop(key_twin_cls):
    threads: set[str] = set()

    class Blocking(key_twin_cls):
        blocking_tools = True

        @tool
        def lookup(self, key: str, world: Any) -> dict[str, str]:
            """Look up a key (slowly).

            Args:
                key: The key.
            """
            threads.add(threading.current_thread().name)
            time.sleep(0.02)
            return {"key": key, "value": world[key]}

    groups = run_episodes(
        Blocking(), SolverPolicy(), [("test", i) for i in range(16)], concurrency=16, progress=False
    )
    assert all(t.reward == 1.0 for g in groups for t in g.trajectories)
    assert threading.main_thread().name not in threads


def test_on_group_sync_and_async(twin):
    seen: list[str] = []

    def on_group(group: Group) -> None:
        assert len(group.trajectories) == 2
        seen.append(group.case_id)

    run_episodes(
        twin,
        SolverPolicy(),
        [("test", i) for i in range(5)],
        group_size=2,
        on_group=on_group,
        progress=False,
    )
    assert sorted(seen) == sorted(f"KeyTest/test/{i}" for i in range(5))

    seen_async: list[str] = []

    async def on_group_async(group: Group) -> None:
        await asyncio.sleep(0)
        seen_async.append(group.case_id)

    asyncio.run(
        arun_episodes(twin, SolverPolicy(), [("test", 1)], on_group=on_group_async, progress=False)
    )
    assert seen_async == ["KeyTest/test/1"]


def test_replay_policy_truncates_after_script(twin):
    policy = ReplayPolicy(['{"name": "lookup", "arguments": {"key": "k1"}}'])
    (group,) = run_episodes(twin, policy, [("test", 0)], progress=False)
    (t,) = group.trajectories
    assert t.truncated and not t.terminated and t.num_turns == twin.config.max_turns
    assert t.reward == 0.0
    assert t.invalid_calls == twin.config.max_turns - 1  # the text turns after the script


def test_bad_case_fails_fast_and_bad_sizes(twin):
    with pytest.raises(CaseError):
        run_episodes(twin, SolverPolicy(), [("test", 10_000)], progress=False)
    with pytest.raises(ValueError, match="group_size"):
        run_episodes(twin, SolverPolicy(), [("test", 0)], group_size=0, progress=False)


def test_progress_bar_writes_to_stderr(twin, capsys):
    run_episodes(twin, SolverPolicy(), [("test", i) for i in range(3)], progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "KeyTest x solver" in captured.err


def test_max_reward_and_success_fn(twin, key_twin_cls):
    assert max_reward(twin) == 1.0

    class Clipped:
        clip = (-0.4, 0.8)

    class T(key_twin_cls):
        reward = Clipped()

    assert max_reward(T()) == 0.8
    ok = success_fn(T())
    assert ok(Trajectory(twin="x", case_id="x", reward=0.8))
    assert not ok(Trajectory(twin="x", case_id="x", reward=0.7))
    assert not ok(Trajectory(twin="x", case_id="x", reward=None))

    class Own(key_twin_cls):
        def success(self, trajectory):
            return trajectory.num_turns == 1

    assert success_fn(Own())(Trajectory(twin="x", case_id="x", reward=0.0, num_turns=1))

    class Abstains(key_twin_cls):
        def success(self, trajectory):
            return None if trajectory.num_turns > 1 else False

    abstains = success_fn(Abstains())
    assert abstains(Trajectory(twin="x", case_id="x", reward=max_reward(Abstains()), num_turns=2))
    assert not abstains(
        Trajectory(twin="x", case_id="x", reward=max_reward(Abstains()), num_turns=1)
    )
    assert not abstains(Trajectory(twin="x", case_id="x", reward=0.0, num_turns=2))


# -- pass@k / pass^k ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "c", "k", "at", "hat"),
    [
        (5, 2, 1, 0.4, 0.4),
        (5, 2, 2, 0.7, 0.1),  # 1 - C(3,2)/C(5,2) = 1 - 3/10; C(2,2)/C(5,2) = 1/10
        (5, 2, 3, 0.9, 0.0),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0, 0.0),  # fewer failures than k: some success is certain
        (4, 4, 4, 1.0, 1.0),
        (4, 0, 2, 0.0, 0.0),
        (10, 7, 3, 1 - 1 / 120, 35 / 120),
    ],
)
def test_pass_k_hand_values(n, c, k, at, hat):
    assert pass_at_k(n, c, k) == pytest.approx(at, abs=1e-12)
    assert pass_hat_k(n, c, k) == pytest.approx(hat, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError):
        pass_hat_k(n, c, k)


@st.composite
def nck(draw):
    n = draw(st.integers(1, 60))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@given(nck())
def test_pass_k_bounds_and_order(args):
    n, c, k = args
    at, hat = pass_at_k(n, c, k), pass_hat_k(n, c, k)
    assert 0.0 <= hat <= at <= 1.0
    if k == 1:
        assert at == pytest.approx(c / n) and hat == pytest.approx(c / n)


@given(nck())
def test_pass_k_monotonic(args):
    n, c, k = args
    if c < n:  # one more success never hurts
        assert pass_at_k(n, c + 1, k) >= pass_at_k(n, c, k)
        assert pass_hat_k(n, c + 1, k) >= pass_hat_k(n, c, k)
    if k < n:  # more tries: capability up, reliability down
        assert pass_at_k(n, c, k + 1) >= pass_at_k(n, c, k)
        assert pass_hat_k(n, c, k + 1) <= pass_hat_k(n, c, k)


@settings(max_examples=60)
@given(
    st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n)))
)
def test_pass_k_equals_enumeration_of_subsets(args):
    n, c, k = args
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_hat_k(n, c, k) == pytest.approx(sum(all(s) for s in subsets) / len(subsets))


# -- summarize ---------------------------------------------------------------------------------
def _traj(case: str, reward: float | None, kind: str = "a", **kw: Any) -> Trajectory:
    return Trajectory(
        twin="T",
        case_id=case,
        case_kind=kind,
        reward=reward,
        components={"x": reward or 0.0, "y": 1.0},
        **kw,
    )


def test_summarize_hand_computed():
    groups = [
        Group(
            case_id="c0",
            trajectories=[
                _traj("c0", 1.0, num_turns=2),
                _traj("c0", 0.0, num_turns=4, invalid_calls=2),
            ],
        ),
        Group(
            case_id="c1",
            trajectories=[
                _traj("c1", 1.0, "b", terminated=True),
                _traj("c1", 1.0, "b", terminated=True),
            ],
        ),
        Group(
            case_id="c2",
            trajectories=[
                _traj("c2", 0.5, "b", truncated=True),
                _traj("c2", None, "b", info={"error": "RuntimeError: x"}),
            ],
        ),
    ]
    s = summarize(groups)
    rewards = [1.0, 0.0, 1.0, 1.0, 0.5]
    assert s["episodes"] == 5 and s["errors"] == 1 and s["groups"] == 3
    assert s["group_size"] == 1  # the smallest group after dropping errors
    assert s["reward_mean"] == pytest.approx(sum(rewards) / 5)
    mean = sum(rewards) / 5
    assert s["reward_std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rewards) / 5))
    assert s["success_rate"] == pytest.approx(3 / 5)
    assert s["components"] == {"x": pytest.approx(0.7), "y": 1.0}
    # pass@1 averaged over groups: c0 1/2, c1 2/2, c2 0/1
    assert s["pass@k"] == {"1": pytest.approx((0.5 + 1.0 + 0.0) / 3)}
    assert s["mean_turns"] == pytest.approx(6 / 5)
    assert s["invalid_calls"] == pytest.approx(2 / 5) and s["invalid_calls_total"] == 2
    assert s["terminated_rate"] == pytest.approx(2 / 5) and s["truncated_rate"] == pytest.approx(
        1 / 5
    )
    assert s["by_kind"] == {
        "a": {"episodes": 2, "reward_mean": 0.5, "success_rate": 0.5},
        "b": {
            "episodes": 3,
            "reward_mean": pytest.approx(2.5 / 3),
            "success_rate": pytest.approx(2 / 3),
        },
    }
    json.dumps(s)  # JSON-able for the store


def test_summarize_pass_k_up_to_group_size_and_threshold():
    groups = [
        Group(case_id=f"c{i}", trajectories=[_traj(f"c{i}", r) for r in rs])
        for i, rs in enumerate([[1, 0, 0, 1], [0, 0, 0, 0], [0.6, 0.6, 0.6, 0.6]])
    ]
    s = summarize(groups)
    assert list(s["pass@k"]) == ["1", "2", "3", "4"]
    assert s["pass@k"]["2"] == pytest.approx((pass_at_k(4, 2, 2) + 0 + 0) / 3)
    assert s["pass^k"]["2"] == pytest.approx(pass_hat_k(4, 2, 2) / 3)
    lenient = summarize(groups, success_threshold=0.5)
    assert lenient["pass^k"]["4"] == pytest.approx(1 / 3)
    assert summarize([])["episodes"] == 0


def test_a_failing_reset_is_recorded_for_its_own_case(key_twin_cls):
    class BadPrompt(key_twin_cls):
        def prompt(self, case):
            if case.index == 1:
                raise KeyError("template field missing")
            return super().prompt(case)

    # concurrency=1: one env is reused, so a stale trajectory would show up here
    groups = run_episodes(
        BadPrompt(),
        SolverPolicy(),
        [("test", 0), ("test", 1), ("test", 2)],
        concurrency=1,
        progress=False,
    )
    bad = groups[1].trajectories[0]
    assert bad.case_id == "KeyTest/test/1" and bad.messages == [] and bad.reward is None
    assert bad.info["error"] == "KeyError: 'template field missing'"
    assert groups[0].trajectories[0].reward == 1.0 and groups[2].trajectories[0].reward == 1.0


# -- failures that must stay inside their own episode ---------------------------------------------
class SurrogateSometimes:
    """Solves every case, but on cases whose index is 0 mod 7 first writes a lone surrogate."""

    name = "surrogate"

    async def act(self, messages, tools):
        key = messages[1]["content"].split("key ")[1].split(" ")[0]
        if int(key[1:]) % 7 == 0 and len(messages) == 2:
            return {"role": "assistant", "content": "I think \ud800 is it"}
        return await SolverPolicy().act(messages, tools)


def test_an_unstorable_episode_is_an_error_and_the_others_are_stored(twin, tmp_path):
    """A lone surrogate in a policy's text made the store's JSON dump fail inside on_group;
    the error escaped gather and the other episodes were lost. Now that episode alone is an
    error (with the reason), stored with its text escaped, and the run finishes."""
    from twin.store import RunStore

    store = RunStore(tmp_path / "s.db")
    run = store.start_run("eval", twin.name, "surrogate")
    cases = [("test", i) for i in range(40)]
    groups = run_episodes(
        twin,
        SurrogateSometimes(),
        cases,
        concurrency=8,
        progress=False,
        on_group=lambda g: store.add_episodes(run, g.trajectories),
    )
    stored = store.episodes(run)
    assert len(stored) == 40
    bad = [t for t in stored if "error" in t.info]
    surrogate_cases = sorted(
        i
        for split, i in cases
        if int(twin.prompt(twin.case(split, i))[1]["content"].split("key k")[1].split(" ")[0]) % 7
        == 0
    )
    assert surrogate_cases and sorted(t.index for t in bad) == surrogate_cases
    for t in bad:
        assert t.info["error_type"] == "UnserializableTrajectory" and t.reward is None
        assert "surrogates not allowed" in t.info["error"]
        assert any("\\ud800" in str(m.get("content")) for m in t.messages)  # kept, escaped
    assert all(t.reward == 1.0 for t in stored if "error" not in t.info)
    summary = summarize(groups)
    assert summary["errors"] == len(bad) and summary["episodes"] == 40 - len(bad)
    (reason,) = summary["error_reasons"]
    assert reason["type"] == "UnserializableTrajectory" and reason["count"] == len(bad)
    store.close()


def test_error_reasons_group_by_class_and_message_with_turns_and_hints(twin):
    from twin.policies import PolicyError

    class Failing:
        name = "failing"

        async def act(self, messages, tools):
            key = int(messages[1]["content"].split("key ")[1].split(" ")[0][1:])
            turn = sum(m["role"] == "assistant" for m in messages) + 1
            if key % 3 == 0 and turn == 2:
                raise PolicyError(
                    "no reply within 1 s", hint="raise --timeout", cause="ReadTimeout"
                )
            if key % 3 == 1:
                raise ValueError("bad " + "x" * 400)
            return await SolverPolicy().act(messages, tools)

    cases = [("test", i) for i in range(12)]
    keys = {
        i: int(twin.prompt(twin.case(s, i))[1]["content"].split("key k")[1].split(" ")[0])
        for s, i in cases
    }
    slow = [i for i, k in keys.items() if k % 3 == 0]
    bad = [i for i, k in keys.items() if k % 3 == 1]
    assert slow and bad
    groups = run_episodes(twin, Failing(), cases, progress=False)
    by_index = {t.index: t for g in groups for t in g.trajectories}
    timed_out = by_index[slow[0]]
    assert timed_out.info["error"] == "PolicyError: no reply within 1 s"
    assert timed_out.info["error_turn"] == 2 and timed_out.info["error_hint"] == "raise --timeout"
    assert timed_out.num_turns == 1  # the partial trajectory: the turn before the failure
    reasons = summarize(groups)["error_reasons"]
    expected = [
        ("PolicyError (ReadTimeout)", len(slow), [2], "raise --timeout"),
        ("ValueError", len(bad), [1], None),
    ]
    assert [(r["type"], r["count"], r["turns"], r["hint"]) for r in reasons] == sorted(
        expected, key=lambda r: -r[1]
    )
    assert reasons[1]["message"].startswith("bad xxx") and len(reasons[1]["message"]) <= 160


def test_progress_bar_shows_turns_and_the_policys_figures(twin, capsys, monkeypatch):
    import twin.rollout as rollout

    monkeypatch.setattr(rollout, "_PROGRESS_TICK_S", 0.01)

    class Reporting(SolverPolicy):
        name = "reporting"

        def progress(self):
            return {"in_flight": 0, "tokens": 123}

    run_episodes(twin, Reporting(delay=0.05), [("test", i) for i in range(3)], progress=True)
    err = capsys.readouterr().err
    assert "turns=" in err and "tokens=123" in err and "in_flight=0" in err

"""Junk actions against every registered twin: ``env.step`` never raises, observations stay in
their space, and the stored trajectory stays within a size set by the twin's own limits.

The twins come from the registry, so a newly registered twin is fuzzed without touching this
file. Actions mix random text, tagged and bare calls with junk arguments, message dicts of every
shape, nesting thousands of levels deep, names and ids megabytes long, hundreds of calls in one
turn, and values that are no action at all.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twin
from twin.spaces import ChatMessages

#: Steps each twin must take; the examples below give about 1,100.
MIN_ACTIONS = 1_000
ACTIONS_PER_EXAMPLE = 4
EXAMPLES = 280


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Twins that cache their world on disk write it under a tmp dir, never ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TWINRL_CACHE", str(tmp_path_factory.mktemp("twinrl-cache")))
        yield


# -- building blocks ----------------------------------------------------------------------------
def _nested_dict(depth: int) -> dict[str, Any]:
    root: dict[str, Any] = {}
    node = root
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return root


def _nested_list(depth: int) -> list[Any]:
    root: list[Any] = []
    node = root
    for _ in range(depth):
        child: list[Any] = []
        node.append(child)
        node = child
    return root


def _deep_json_text(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        return "{"


huge = st.sampled_from([1_000, 17_000, 2_000_000]).map(lambda n: "x" * n)
depth = st.integers(1, 6_000)
deep = st.one_of(depth.map(_nested_dict), depth.map(_nested_list))
leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=30))
data = st.recursive(
    leaf,
    lambda s: st.lists(s, max_size=4) | st.dictionaries(st.text(max_size=8), s, max_size=4),
    max_leaves=12,
)
arguments = st.one_of(data, deep, huge, st.dictionaries(st.text(max_size=12), data, max_size=4))


def _strategies(tool_names: list[str]) -> st.SearchStrategy[Any]:
    names = st.one_of(
        st.sampled_from([*tool_names, "", "nope", " submit "]), st.text(max_size=20), huge, leaf
    )
    call_obj = st.builds(lambda n, a: {"name": n, "arguments": a}, names, arguments)
    tagged = call_obj.map(lambda c: f"<tool_call>{_dumps(c)}</tool_call>")
    small_call = st.builds(
        lambda n, a: f"<tool_call>{_dumps({'name': n, 'arguments': a})}</tool_call>",
        st.sampled_from([*tool_names, "nope"]),
        data,
    )
    texts = st.one_of(
        st.text(),
        huge,
        tagged,
        st.builds(lambda t, c: t + c, st.text(max_size=20), tagged),
        st.builds(lambda c, k: c * k, small_call, st.integers(1, 300)),  # many calls in a turn
        depth.map(_deep_json_text),
        depth.map(lambda d: f"<tool_call>{_deep_json_text(d)}</tool_call>"),
        call_obj.map(_dumps),  # a bare JSON call
        st.text(alphabet='<>{}[]":,tool_cal/ ', max_size=80),
    )
    message_call = st.builds(
        lambda i, n, a, raw: {
            "id": i,
            "type": "function",
            "function": {"name": n, "arguments": _dumps(a) if raw else a},
        },
        st.one_of(st.text(max_size=10), huge, leaf),
        names,
        arguments,
        st.booleans(),
    )
    messages = st.one_of(
        st.builds(
            lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls},
            st.one_of(st.none(), st.text(max_size=40), huge, deep),
            st.one_of(st.lists(message_call, max_size=4), deep, leaf),
        ),
        st.builds(
            lambda call, k: {"role": "assistant", "content": None, "tool_calls": [call] * k},
            message_call,
            st.integers(1, 300),
        ),
        st.dictionaries(
            st.sampled_from(["role", "content", "tool_calls", "name", "x"]),
            st.one_of(data, deep, huge),
            max_size=4,
        ),
        deep,
    )
    others = st.one_of(
        leaf,
        st.binary(max_size=20),
        st.lists(data, max_size=3),
        st.just(object()),
        st.just(math.nan),
    )
    return st.one_of(texts, texts, messages, messages, others)


def _turn_bound(cfg: Any) -> int:
    """Most characters one turn may add to the stored episode, from the twin's own limits: the
    turn (cut at ``max_action_chars``) with a short record and message for each call it can
    hold, and ``max_calls_per_turn`` results (cut at ``max_result_chars`` in the message, whole
    in the record, hence the factor)."""
    return 8 * cfg.max_action_chars + 3 * cfg.max_calls_per_turn * cfg.max_result_chars


# -- the suite ----------------------------------------------------------------------------------
@pytest.mark.parametrize("twin_id", [s.id for s in twin.list_twins()])
def test_junk_actions_never_break_a_twin(twin_id: str) -> None:
    env = twin.make(twin_id)
    cfg = env.twin.config
    per_turn = _turn_bound(cfg)
    space = ChatMessages()
    actions = _strategies([t.name for t in env.twin.tools])
    taken = [0]

    def check_episode_size() -> None:
        traj = env.trajectory
        assert len(traj.model_dump_json()) <= 10_000 + traj.num_turns * per_turn

    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(
        turns=st.lists(actions, min_size=ACTIONS_PER_EXAMPLE, max_size=ACTIONS_PER_EXAMPLE),
        index=st.integers(0, 99),
    )
    def run(turns: list[Any], index: int) -> None:
        obs, _ = env.reset(options={"split": "test", "index": index})
        assert space.contains(obs)
        for action in turns:
            obs, reward, terminated, truncated, info = env.step(action)
            taken[0] += 1
            assert obs and space.contains(obs)
            assert isinstance(reward, float) and math.isfinite(reward)
            assert isinstance(terminated, bool) and isinstance(truncated, bool)
            assert {"calls", "errors", "invalid_calls", "turn"} <= set(info)
            if terminated or truncated:
                check_episode_size()
                env.reset(options={"split": "test", "index": index})
        check_episode_size()

    run()
    assert taken[0] >= MIN_ACTIONS

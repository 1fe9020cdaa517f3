"""The env's trajectory filler: fields it is given, the model's defaults for the rest."""

from __future__ import annotations

import pytest

from twin.env import _fields_filler
from twin.trajectory import Trajectory


def test_the_filler_sets_the_given_fields_and_the_models_defaults_for_the_rest():
    fill = _fields_filler(
        Trajectory, ("twin", "case_id", "split", "index", "case_kind", "messages")
    )
    a = fill("T", "T/test/0", "test", 0, "k", [{"role": "user", "content": "hi"}])
    b = fill("T", "T/test/1", "test", 1, "k", [])
    assert (a.twin, a.case_id, a.index, a.messages[0]["content"]) == ("T", "T/test/0", 0, "hi")
    defaults = Trajectory.model_construct()
    for name in Trajectory.model_fields:
        if name not in ("twin", "case_id", "split", "index", "case_kind", "messages"):
            assert getattr(a, name) == getattr(defaults, name), name
    assert a.calls is not b.calls and a.components is not b.components  # one container each
    assert a.model_dump()["case_id"] == "T/test/0"


def test_the_filler_refuses_unknown_and_missing_required_fields():
    with pytest.raises(TypeError, match="unknown fields \\['nope'\\]"):
        _fields_filler(Trajectory, ("twin", "case_id", "split", "index", "nope"))
    with pytest.raises(TypeError, match="required fields \\['twin', 'case_id'\\]"):
        _fields_filler(Trajectory, ("split",))


def test_env_built_records_share_one_fields_set_that_assignment_and_copies_keep_whole():
    from twin.env import TwinEnv
    from twin.registry import make_twin

    env = TwinEnv(make_twin("Catalog-v1"))
    trajectories = []
    for index in (0, 1):
        env.reset(options={"split": "test", "index": index})
        env.step(
            '<tool_call>{"name": "search_taxonomy", "arguments": {"query": "shoes"}}</tool_call>'
        )
        env.step(
            '<tool_call>{"name": "search_taxonomy", "arguments": {"query": "bags"}}</tool_call>'
        )
        trajectories.append(env.trajectory)
    a, b = trajectories
    every = set(Trajectory.model_fields)
    assert a.model_fields_set == every and a.model_fields_set is b.model_fields_set
    first, second = a.calls
    assert first.model_fields_set == set(type(first).model_fields)
    assert first.model_fields_set is second.model_fields_set
    assert (a.num_turns, a.invalid_calls) == (2, 0)  # the per-turn writes reached the model
    a.reward = 0.5  # pydantic's setter adds to the shared set: a name it already holds
    assert a.model_fields_set == every and b.reward is None
    copy = a.model_copy(update={"reward": 1.0})
    assert copy.model_fields_set is not a.model_fields_set and copy.model_fields_set == every
    assert (copy.reward, a.reward) == (1.0, 0.5)
    assert a.model_dump(exclude_unset=True) == a.model_dump()  # every field counts as set


def test_a_dict_actions_loss_weight_of_0_or_1_is_kept_and_any_other_dropped():
    """A scripted teacher's ``weight`` reaches the stored chat (and so ``twin collect``'s rows);
    a value SFT would refuse is not stored."""
    from twin.env import TwinEnv
    from twin.registry import make_twin

    env = TwinEnv(make_twin("Catalog-v1"))
    call = {"name": "search_taxonomy", "arguments": '{"query": "shoes"}'}
    kept = []
    for weight in (0, 1, True, 0.5, "0", None):
        env.reset(options={"split": "test", "index": 0})
        action = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "a", "type": "function", "function": call}],
        }
        if weight is not None:
            action["weight"] = weight
        env.step(action)
        (turn,) = [m for m in env.trajectory.messages if m["role"] == "assistant"]
        assert turn["tool_calls"][0]["function"]["name"] == "search_taxonomy"
        kept.append(turn.get("weight"))
    assert kept == [0, 1, None, None, None, None]

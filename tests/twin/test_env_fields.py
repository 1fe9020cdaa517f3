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

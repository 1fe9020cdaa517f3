"""The registry: ids, names, suggestions, entry points, Gymnasium ids, check_twin on every twin."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from importlib.metadata import EntryPoint
from pathlib import Path

import gymnasium
import pytest

import twin
from twin import UnknownTwinError
from twin.doctor import TwinCheckError, check_twin
from twin.registry import TwinSpec, load_plugins, registry

ROOT = Path(__file__).resolve().parents[2]


def test_entry_point_twins_are_registered_lazily():
    assert "twin/Returns-v0" in registry
    spec = registry["twin/Returns-v0"]
    assert (spec.entry_point, spec.name, spec.version) == ("envs.returns:ReturnsTwin", "Returns", 0)
    assert "twin/Returns-v0" in gymnasium.registry


def test_import_twin_imports_no_twin():
    code = "import sys, twin; print(sorted(m for m in sys.modules if m.startswith('envs.')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "name", ["twin/Returns-v0", "Returns-v0", "Returns", "returns", "RETURNS", "twin/returns-v0"]
)
def test_names_are_case_insensitive(name):
    assert twin.spec(name).id == "twin/Returns-v0"
    assert type(twin.make_twin(name)).__name__ == "ReturnsTwin"


def test_make_passes_config_and_validates_it():
    env = twin.make("returns", max_turns=3, seed=1)
    assert env.twin.config.max_turns == 3 and env.twin.config.seed == 1
    with pytest.raises(twin.ConfigError, match="max_turn"):
        twin.make("returns", max_turn=3)


def test_unknown_id_suggests_the_closest():
    with pytest.raises(UnknownTwinError) as err:
        twin.make("Retruns")
    msg = str(err.value)
    assert msg.startswith("no twin 'Retruns'. Did you mean 'twin/Returns-v0'? Known twins: ")
    assert "twin/Returns-v0" in msg.split("Known twins: ")[1]
    assert "twin.register(MyTwin)" in msg
    with pytest.raises(UnknownTwinError, match="no twin 'Returns-v7'"):
        twin.spec("Returns-v7")
    with pytest.raises(KeyError):  # UnknownTwinError is a KeyError too, like a dict lookup
        twin.spec("zzz")


def test_register_a_class_and_a_string(tmp_path):
    from envs.returns import ReturnsTwin

    class MyReturns(ReturnsTwin):
        name = "MyReturns"
        version = 2

    spec = twin.register(MyReturns, max_turns=5)
    try:
        assert spec.id == "twin/MyReturns-v2" and spec.kwargs == {"max_turns": 5}
        assert twin.spec("myreturns").id == "twin/MyReturns-v2"
        assert twin.make_twin("MyReturns").config.max_turns == 5
        assert twin.make_twin("MyReturns", max_turns=2).config.max_turns == 2
        assert gymnasium.make("twin/MyReturns-v2").unwrapped.twin.config.max_turns == 5
        s2 = twin.register("envs.returns:ReturnsTwin", id="twin/Desk-v1")
        assert (s2.name, s2.version) == ("Desk", 1)
        s3 = twin.register("envs.returns:ReturnsTwin", id="twin/Desk2-v0")
        assert (s3.name, s3.version) == ("Desk2", 0)
        assert twin.make_twin("desk2").name == "Returns"
    finally:
        for key in ("twin/MyReturns-v2", "twin/Desk-v1", "twin/Desk2-v0"):
            registry.pop(key, None)
            gymnasium.registry.pop(key, None)


def test_broken_entry_point_fails_on_make_with_a_clear_message():
    spec = TwinSpec("twin/Broken-v0", "envs.does_not_exist:Nope", "Broken")
    with pytest.raises(
        UnknownTwinError, match="cannot load entry point 'envs.does_not_exist:Nope'"
    ):
        spec.load()
    spec = TwinSpec("twin/NotATwin-v0", "json:dumps", "NotATwin")
    with pytest.raises(UnknownTwinError, match="is not a Twin subclass"):
        spec.load()


def test_bad_plugin_only_warns(monkeypatch):
    # ``twin.registry`` is the dict (as in Gymnasium); the module is reached through importlib.
    reg = importlib.import_module("twin.registry")
    eps = [
        EntryPoint("Bad Name!", "x:Y", "twin.envs"),
        EntryPoint("Later", "x.y:Later", "twin.envs"),
    ]
    monkeypatch.setattr(reg, "entry_points", lambda group: eps)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = load_plugins()
        assert [s.id for s in found] == ["twin/Later-v0"]
        assert any("skipped twin plugin 'Bad Name!'" in str(w.message) for w in caught)
    finally:
        registry.pop("twin/Later-v0", None)
        gymnasium.registry.pop("twin/Later-v0", None)


def test_list_twins_is_sorted():
    ids = [s.id for s in twin.list_twins()]
    assert ids == sorted(ids) and "twin/Returns-v0" in ids


@pytest.mark.parametrize("twin_id", [spec.id for spec in twin.list_twins()])
def test_check_twin_on_every_registered_twin(twin_id):
    # every registered twin loads and keeps the contracts: a broken one fails here, never skips
    check_twin(twin_id)


def test_check_twin_catches_a_leak_and_a_missing_terminal_tool():
    from envs.returns import ReturnsTwin

    class Leaky(ReturnsTwin):
        name = "Leaky"

        def prompt(self, case):
            return super().prompt(case) + [{"role": "user", "content": f"psst: {case.truth}"}]

    with pytest.raises(
        TwinCheckError, match="prompt of \\('train', 0\\) contains the case's whole truth"
    ):
        check_twin(Leaky(), env_check=False)

    class LeakyInfo(ReturnsTwin):
        name = "LeakyInfo"

        def prompt(self, case):
            return [{"role": "user", "content": "hi", "truth": case.truth}]

    with pytest.raises(TwinCheckError, match="has a 'truth' key"):
        check_twin(LeakyInfo(), env_check=False)

    class NoEnd(twin.Twin):
        name = "NoEnd"

        @twin.tool
        def noop(self) -> str:
            """Do nothing."""
            return ""

    with pytest.raises(TwinCheckError, match="no terminal tool"):
        check_twin(NoEnd(), env_check=False)


def test_check_twin_catches_nondeterministic_cases():
    import itertools

    from envs.returns import ReturnsTwin

    counter = itertools.count()

    class Drifting(ReturnsTwin):
        name = "Drifting"

        def make_case(self, rng, split, index):
            kind, task, truth = super().make_case(rng, split, index)
            return kind, {**task, "n": next(counter)}, truth

    with pytest.raises(TwinCheckError, match="differs between two instances"):
        check_twin(Drifting(), env_check=False)

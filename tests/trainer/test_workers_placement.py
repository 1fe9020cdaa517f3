"""CPU placement of the async trainer (``devices.cpu_affinity``): the plan, the pinning, the
hand-over.

The plan and the parsing are pure functions (hypothesis); the pinning is checked in a child
process (pinning the test process itself would slow every later test), through the learner ->
environment -> rollout-process hand-over the trainer uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer.config import load_recipe
from trainer.placement import (
    ROLLOUT_CPUS_ENV,
    format_cpus,
    parse_cpus,
    plan_cpu_placement,
    thread_env,
)
from trainer.serving.process import ServerProcess
from twin.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _devices(affinity: str = "auto", rollout: str = "cpu", learner: str = "cpu") -> SimpleNamespace:
    return SimpleNamespace(
        cpu_affinity=affinity, rollout=rollout, learner=learner, cpu_threads=None
    )


@given(st.sets(st.integers(0, 255), min_size=1, max_size=40))
def test_cpu_lists_round_trip(cpus: set[int]) -> None:
    assert parse_cpus(format_cpus(cpus)) == tuple(sorted(cpus))


def test_cpu_list_ranges_and_errors() -> None:
    assert parse_cpus("0,2-4, 7") == (0, 2, 3, 4, 7)
    assert parse_cpus("3-3") == (3,)
    for bad in ("", "a", "1-b", ",", "-1"):
        with pytest.raises(ConfigError, match="taskset|core numbers"):
            parse_cpus(bad)


@given(st.sets(st.integers(0, 127), min_size=2, max_size=64))
def test_auto_splits_the_cores_into_two_disjoint_halves(cpus: set[int]) -> None:
    plan = plan_cpu_placement(_devices(), cpus=sorted(cpus))
    if not hasattr(os, "sched_setaffinity"):
        assert plan is None
        return
    assert plan is not None
    assert set(plan.rollout).isdisjoint(plan.learner)
    assert set(plan.rollout) | set(plan.learner) == cpus
    assert len(plan.rollout) == (len(cpus) + 1) // 2 and len(plan.learner) >= 1


def test_nothing_is_pinned_unless_auto_on_two_cpu_sides() -> None:
    two = [0, 1]
    assert plan_cpu_placement(_devices("off"), cpus=two) is None
    assert plan_cpu_placement(_devices(rollout="cuda:0"), cpus=two) is None
    assert plan_cpu_placement(_devices(learner="cuda:1"), cpus=two) is None
    assert plan_cpu_placement(_devices(), cpus=[3]) is None  # one core: nothing to split
    if hasattr(os, "sched_setaffinity"):
        plan = plan_cpu_placement(_devices(), cpus=two)
        assert plan is not None and (plan.rollout, plan.learner) == ((0,), (1,))


def test_recipe_field_is_validated() -> None:
    assert load_recipe("toy-cpu").devices.cpu_affinity == "off"
    assert load_recipe("toy-cpu", ["devices.cpu_affinity=auto"]).devices.cpu_affinity == "auto"
    assert (
        load_recipe("toy-cpu", ["devices.cpu_affinity=off"]).devices.cpu_affinity == "off"
    )  # YAML: False
    with pytest.raises(ConfigError, match="cpu_affinity"):
        load_recipe("toy-cpu", ["devices.cpu_affinity=sometimes"])


def test_thread_env_makes_idle_threads_sleep() -> None:
    assert thread_env(1) == {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    assert thread_env(0)["OMP_NUM_THREADS"] == "1"


def test_sampler_server_gets_threads_and_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROLLOUT_CPUS_ENV, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    server = ServerProcess("tiny", threads=1, cpus="0", port=1)
    argv = server.command()
    assert argv[argv.index("--threads") + 1] == "1" and argv[argv.index("--cpus") + 1] == "0"
    env = server.environment()
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["OMP_WAIT_POLICY"]) == (
        "1",
        "1",
        "PASSIVE",
    )
    plain = ServerProcess("tiny", port=1)
    assert "--threads" not in plain.command() and "--cpus" not in plain.command()
    assert "OMP_WAIT_POLICY" not in plain.environment()
    monkeypatch.setenv(ROLLOUT_CPUS_ENV, "0")  # exported by the learner: the child pins itself
    assert plain.environment()["OMP_WAIT_POLICY"] == "PASSIVE"


_CHILD = r"""
import json, os, subprocess, sys
from types import SimpleNamespace
from trainer.placement import ROLLOUT_CPUS_ENV, place_learner
import torch

cfg = SimpleNamespace(
    devices=SimpleNamespace(cpu_affinity="auto", rollout="cpu", learner="cpu", cpu_threads=None)
)
plan = place_learner(cfg)
grandchild = subprocess.run(
    [sys.executable, "-c",
     "import json, os; from trainer.placement import place_rollout_process; "
     "pinned = place_rollout_process(); "
     "print(json.dumps({'pinned': pinned, 'cpus': sorted(os.sched_getaffinity(0)), "
     "'threads': int(os.environ['OMP_NUM_THREADS']), 'wait': os.environ.get('OMP_WAIT_POLICY')}))"],
    capture_output=True, text=True, check=True,
)
print(json.dumps({
    "plan": [plan.rollout, plan.learner], "cpus": sorted(os.sched_getaffinity(0)),
    "threads": torch.get_num_threads(), "exported": os.environ.get(ROLLOUT_CPUS_ENV),
    "rollout": json.loads(grandchild.stdout.strip().splitlines()[-1]),
}))
"""


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and >= 2 cores",
)
def test_learner_pins_itself_and_hands_the_other_cores_to_rollout_processes() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(ROLLOUT_CPUS_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    rollout, learner = (list(p) for p in out["plan"])
    assert set(rollout).isdisjoint(learner) and sorted(rollout + learner) == sorted(
        os.sched_getaffinity(0)
    )
    assert out["cpus"] == learner and out["threads"] == len(learner)
    assert out["exported"] == ",".join(map(str, rollout))
    assert out["rollout"]["pinned"] == rollout and out["rollout"]["cpus"] == rollout
    assert out["rollout"]["threads"] == len(rollout) and out["rollout"]["wait"] == "PASSIVE"


def test_a_cpu_list_beyond_this_machine_is_refused_before_any_thread_starts(monkeypatch) -> None:
    """`--cpus 0-99999` once started 100,000 threads (one per named core) and crashed."""
    from trainer.placement import place_rollout_process

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with pytest.raises(ConfigError, match=r"core numbers must be in 0-8191"):
        parse_cpus("0-99999")
    with pytest.raises(ConfigError, match=r"core numbers must be in 0-8191"):
        parse_cpus("0-99999999999999")  # refused before a range of that size is built
    beyond = os.cpu_count()
    with pytest.raises(
        ConfigError, match=rf"cores {beyond}.* not on this machine; it has {beyond}"
    ):
        place_rollout_process(cpus=f"0-{beyond}")
    assert "OMP_NUM_THREADS" not in os.environ  # nothing was set up

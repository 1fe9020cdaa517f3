"""`turns:` rollouts are replayed through the real environment, on a twin registered through the
public registry API (twin.registry.register), not the catalog; the kit makes it through the
registry (make_shared_twin) and keeps no twin of its own."""

from __future__ import annotations

import json
import random
import textwrap

import pytest

from rewards import Reward, invalid_call_penalty, submitted_gate, term
from rewards.testing import clear_cache, rollout_twin, run_rollout_file
from twin import Twin, tool
from twin.registry import make_shared_twin, register, registry


@term
def right(trajectory, case):
    """1 when the submitted answer is the truth."""
    return float(trajectory.submission["answer"] == case.truth["answer"])


class KitToy(Twin):
    made = 0  # instances made: the kit must make one per process, through the registry
    name = "KitToy"
    version = 0
    description = "Guess a number."
    splits = {"train": 5, "test": 5}
    reward = Reward(
        {right: 1.0},
        penalties=[invalid_call_penalty(0.1, cap=0.3)],
        gates=[submitted_gate()],
        clip=(-0.3, 1.0),
    )

    def __init__(self, **config):
        super().__init__(**config)
        type(self).made += 1

    def make_case(self, rng: random.Random, split: str, index: int):
        return "toy", {"hint": index}, {"answer": index}

    def prompt(self, case):
        return [{"role": "user", "content": f"hint {case.task['hint']}"}]

    @tool
    def peek(self, n: int) -> dict:
        """Look at a number."""
        return {"n": n}

    @tool(terminal=True)
    def submit(self, answer: int) -> dict:
        """Submit the answer."""
        return {"submitted": answer}


def call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


@pytest.fixture
def toy():
    spec = register(KitToy)
    yield
    registry.pop(spec.id, None)
    clear_cache()


def test_turns_are_replayed_and_scored_with_the_file_truth(toy, tmp_path):
    p = tmp_path / "toy.rollouts.yaml"
    p.write_text(
        textwrap.dedent(f"""
        twin: KitToy
        cases:
          - name: peek then submit (the file's truth, not the case's)
            case: {{split: test, index: 2}}
            truth: {{answer: 42}}
            turns:
              - '{call("peek", n=1)}'
              - 'thinking out loud, no call'
              - role: assistant
                content: null
                tool_calls:
                  - id: c1
                    type: function
                    function: {{name: submit, arguments: '{{"answer": 42}}'}}
            expect: {{total: 0.9, components: {{right: 1, penalty: 0.1}}}}
          - name: bad arguments then no submit
            truth: {{answer: 3}}
            turns:
              - '{call("submit", answer="three")}'
              - '{call("nope")}'
            expect: {{total: -0.2, components: {{submitted: 0, penalty: 0.2}}}}
          - name: turns after the submit are not run
            truth: {{answer: 0}}
            turns:
              - '{call("submit", answer=0)}'
              - 'ignored'
            expect: {{total: 1.0}}
        """)
    )
    outcomes = run_rollout_file(p)
    assert [o.passed for o in outcomes] == [True, True, True], "\n".join(
        o.describe() for o in outcomes
    )


def test_shorthand_and_turns_can_use_the_twins_own_truth(toy, tmp_path):
    p = tmp_path / "own.rollouts.yaml"
    p.write_text(
        textwrap.dedent(f"""
        twin: KitToy
        description: the truth comes from the twin's case 4 (answer 4)
        cases:
          - name: shorthand on case 4
            case: {{split: test, index: 4}}
            submit: {{answer: 4}}
            expect: 1.0
          - name: replay on case 3
            case: {{split: test, index: 3}}
            turns: ['{call("submit", answer=3)}']
            expect: {{total: 1}}
          - name: wrong component name
            case: {{split: test, index: 3}}
            submit: {{answer: 3}}
            expect: {{components: {{correct: 1}}}}
        """)
    )
    good1, good2, bad = run_rollout_file(p)
    assert good1.passed and good2.passed, good1.describe() + good2.describe()
    assert (
        not bad.passed
        and "no such component (the reward reports: right, invalid_calls" in bad.describe()
    )


class KitToyDoubled(KitToy):
    """The same toy whose truth is twice the hint: registered under KitToy's id to replace it."""

    def make_case(self, rng: random.Random, split: str, index: int):
        return "toy", {"hint": index}, {"answer": 2 * index}


OWN_TRUTH = f"""
twin: KitToy
cases:
  - name: replay on case 3, answering 3
    case: {{split: test, index: 3}}
    turns: ['{call("submit", answer=3)}']
    expect: 1.0
"""


def test_the_kit_makes_the_twin_once_through_the_registry(toy, tmp_path):
    p = tmp_path / "own.rollouts.yaml"
    p.write_text(textwrap.dedent(OWN_TRUTH))
    before = KitToy.made
    assert run_rollout_file(p)[0].passed and run_rollout_file(p)[0].passed
    assert KitToy.made == before + 1  # two files' worth of cases, one twin
    shared = make_shared_twin("twin/KitToy-v0")
    assert rollout_twin("kittoy") is shared and type(shared) is KitToy
    clear_cache()  # forgets the registry's shared twins too: the next run makes a new one
    assert run_rollout_file(p)[0].passed and KitToy.made == before + 2
    assert rollout_twin("KitToy", {"max_turns": 3}) is not shared  # another config, another twin


def test_registering_the_id_again_replays_on_the_new_twin(toy, tmp_path):
    p = tmp_path / "own.rollouts.yaml"
    p.write_text(textwrap.dedent(OWN_TRUTH))
    assert run_rollout_file(p)[0].passed
    register(KitToyDoubled, id="twin/KitToy-v0")  # the same id, a new spec: no stale twin
    (outcome,) = run_rollout_file(p)
    assert not outcome.passed and "expected 1, got 0" in outcome.describe()
    assert type(rollout_twin("KitToy")) is KitToyDoubled


def test_an_unregistered_twin_is_an_error_outcome_naming_the_registry(tmp_path):
    p = tmp_path / "gone.rollouts.yaml"
    p.write_text(
        textwrap.dedent(OWN_TRUTH)
    )  # the toy fixture is not used: KitToy is not registered
    (outcome,) = run_rollout_file(p)
    assert not outcome.passed and "no reward for twin 'KitToy'" in outcome.error
    assert "twin.register" in outcome.error  # the registry's own hint on how to register one

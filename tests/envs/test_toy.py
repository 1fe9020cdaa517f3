"""The toy twin: registered, built on the public API, reward shaped from random text to 1.0."""

from __future__ import annotations

import statistics

import pytest

import twin
from envs.toy import ToyTwin
from envs.toy.twin import WORDS, ideal_call
from twin.registry import make, make_twin


def test_registered_by_name_and_id() -> None:
    assert isinstance(make_twin("Toy"), ToyTwin)
    assert isinstance(make("twin/Toy-v0").twin, ToyTwin)


def test_cases_are_deterministic_and_hide_the_truth() -> None:
    t = make_twin("Toy")
    assert t.case("train", 5).canonical_json() == make_twin("Toy").case("train", 5).canonical_json()
    words = {t.case("train", i).truth["answer"] for i in range(200)}
    assert words == set(WORDS[:4])
    assert {
        make_twin("Toy", num_words=2).case("train", i).truth["answer"] for i in range(50)
    } == set(WORDS[:2])


@pytest.mark.parametrize(
    "action, expected",
    [
        (None, 1.0),
        ('<tool_call>{"name": "submit", "arguments": {"answer": "red"}}</tool_call>', 1.0),
        ('<tool_call>\n{"name": "submit", "arguments": {"answer": "blue"}}\n</tool_call>', None),
        ("hello there", None),
    ],
)
def test_reward_levels(action, expected) -> None:
    env = make("Toy")
    obs, info = env.reset(options={"split": "train", "index": 0})
    answer = env.case.truth["answer"]
    if action is None:
        action = ideal_call(answer)
    elif "red" in action and answer != "red":
        action = action.replace("red", answer)
    _, reward, terminated, truncated, info = env.step(action)
    assert terminated or truncated
    if expected is not None:
        assert reward == pytest.approx(expected)
    elif "submit" in action:  # wrong word: a valid call, scored below random text
        assert reward < 0.1 and info["reward"]["components"]["correct"] == 0.0
        assert info["reward"]["components"]["wrong"] == 1.0
    else:
        assert reward <= 0.1 + 1e-9


def test_random_text_scores_low() -> None:
    import random

    rng = random.Random(0)
    env = make("Toy")
    rewards = []
    for i in range(50):
        env.reset(options={"split": "train", "index": i})
        text = "".join(rng.choice('<>{}":, abcdefghijklmnopqrstuvwxyz_') for _ in range(40))
        rewards.append(env.step(text)[1])
    assert 0.05 <= statistics.mean(rewards) <= 0.1 + 1e-9  # ~0.1: no repeated call pieces


def test_repeating_a_piece_costs() -> None:
    env = make("Toy")
    env.reset(options={"split": "train", "index": 0})
    once = env.step("<tool_call>hello")[1]
    env.reset(options={"split": "train", "index": 0})
    twice = env.step("<tool_call><tool_call>")[1]
    assert twice < once


def test_prefix_counts_whole_pieces_in_order() -> None:
    env = make("Toy")
    env.reset(options={"split": "train", "index": 0})
    word = env.case.truth["answer"]
    levels = []
    for text in [
        "</tool_call>",
        "<tool_call>",
        '<tool_call>\n{"name": "',
        '<tool_call>{"name": "submit"',
        f'<tool_call>{{"name": "submit", "arguments": {{"answer": "{word}',
    ]:
        env.reset(options={"split": "train", "index": 0})
        levels.append(env.step(text)[4]["reward"]["components"]["prefix"])
    assert levels == sorted(levels) and levels[0] == 0.0 and len(set(levels)) == 5


def test_each_step_towards_the_call_earns_more() -> None:
    env = make("Toy")
    env.reset(options={"split": "train", "index": 0})
    named = env.case.truth["answer"]
    other = next(w for w in WORDS if w != named)
    prefix = ideal_call(named).split(named)[0]
    texts = [
        "hello",  # random text: no_repeat only
        prefix,  # the call's fixed prefix
        prefix + "zebra",  # ... followed by a word that is not one of WORDS
        prefix + other,  # ... by another of the toy's words (below random text)
        prefix + named,  # ... by the named word, not closed
        ideal_call(named),  # the right call
    ]
    totals = []
    for text in texts:
        env.reset(options={"split": "train", "index": 0})
        totals.append(env.step(text)[1])
    assert totals[0] == pytest.approx(0.1) and totals[-1] == pytest.approx(1.0)
    assert (
        totals[1] == pytest.approx(totals[2]) and totals[0] < totals[1] < totals[4] < totals[5]
    ), totals
    # a wrong call earns less than random text: only reading the prompt's word pays
    assert totals[3] < totals[0], totals


def test_a_call_pays_only_when_it_names_the_prompts_word() -> None:
    # Averaged over prompts, always writing one call must score below random text plus the
    # prefix: otherwise RL learns the format first and collapses onto one call for every prompt.
    env = make("Toy", num_words=2)
    calls = {w: [] for w in WORDS[:2]}
    for i in range(40):
        for w in calls:
            env.reset(options={"split": "train", "index": i})
            calls[w].append(env.step(ideal_call(w))[1])
    for w, rewards in calls.items():
        assert statistics.fmean(rewards) < 0.6, (w, statistics.fmean(rewards))


def test_built_only_on_public_api() -> None:
    # The Toy twin is the template users copy: it may reach our code only through the two
    # packages' public namespaces (`from twin import ...`, `from rewards import ...`).
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the dev extra)")
    graph = grimp.build_graph("envs", "twin", "rewards", include_external_packages=True)
    packages = {"twin", "rewards", "envs", "trainer", "integrations"}
    imported = graph.find_modules_directly_imported_by("envs.toy.twin")
    ours = {m for m in imported if m.split(".")[0] in packages}
    assert ours == {"twin", "rewards"}, ours
    assert twin.Twin in ToyTwin.__mro__


def test_partial_reward_keeps_the_first_levels() -> None:
    env = make("Toy", wrong_call="partial")
    env.reset(options={"split": "train", "index": 0})
    other = next(w for w in WORDS if w != env.case.truth["answer"])
    assert env.step(ideal_call(other))[1] == pytest.approx(0.35)
    with pytest.raises(Exception, match="wrong_call"):
        make_twin("Toy", wrong_call="nope")


@pytest.mark.parametrize("arguments_as", ["json", "dict"])
def test_a_structured_call_is_shaped_like_the_same_call_written_as_text(arguments_as) -> None:
    # An OpenAI-style server or the `hf:` policy answers with tool_calls and empty content; the
    # shaping terms must read that turn as the call it is (a perfect answer scores 1.0 either way).
    import json

    env = make("Toy")
    env.reset(options={"split": "train", "index": 0})
    answer = env.case.truth["answer"]
    args = {"answer": answer}
    call = {
        "id": "c1",
        "type": "function",
        "function": {
            "name": "submit",
            "arguments": json.dumps(args) if arguments_as == "json" else args,
        },
    }
    _, reward, terminated, _, info = env.step(
        {"role": "assistant", "content": "", "tool_calls": [call]}
    )
    assert terminated and reward == pytest.approx(1.0), info["reward"]
    env.reset(options={"split": "train", "index": 0})
    wrong = next(w for w in WORDS if w != answer)
    call["function"]["arguments"] = json.dumps({"answer": wrong})
    _, reward, _, _, info = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    assert info["reward"]["components"]["wrong"] == 1.0 and reward < 0.1

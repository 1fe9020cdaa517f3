"""TwinEnv: the Gymnasium contract, every bad action, budgets, vector envs, determinism."""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twin
from twin import ToolError, Trajectory, Twin, TwinConfig, TwinEnv, tool
from twin.parsing import CALL_FORMAT

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    total: float
    components: dict = field(default_factory=dict)
    weighted: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def toy_reward(trajectory, case):
    ok = trajectory.submission == {"answer": case.truth["answer"]}
    return Result(float(ok), {"correct": float(ok)}, {"correct": float(ok)}, ["toy"])


class ToyTwin(Twin):
    """A tiny twin with one tool of each kind the env must handle."""

    name = "Toy"
    version = 0
    splits = {"train": 50, "dev": 5}
    reward = toy_reward

    def build_world(self):
        return {"words": {f"w{i}": i * i for i in range(10)}}

    def make_case(self, rng, split, index):
        word = f"w{rng.randrange(10)}"
        return "square", {"word": word}, {"answer": self.world["words"][word]}

    def prompt(self, case):
        return [
            {"role": "system", "content": "Find the number of the word, then submit it."},
            {"role": "user", "content": f"Word: {case.task['word']} — ünïcødé ok"},
        ]

    @tool
    def look(self, word: str, world: dict) -> dict:
        """Look a word up.

        Args:
            word: The word, e.g. "w3".
        """
        if word not in world["words"]:
            raise ToolError(f"no word {word!r}; words look like 'w3'")
        return {"word": word, "number": world["words"][word]}

    @tool
    def big(self, n: int = 10_000) -> str:
        """Return a long text."""
        return "x" * n

    @tool
    def boom(self) -> str:
        """A tool with a bug."""
        raise RuntimeError("bug in the tool")

    @tool(terminal=True)
    def submit(self, answer: int) -> dict:
        """Submit the answer; ends the episode.

        Args:
            answer: The number.
        """
        return {"submitted": answer}


def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


@pytest.fixture
def env():
    e = TwinEnv(ToyTwin())
    e.reset(options={"split": "train", "index": 0})
    return e


# -- the contract -------------------------------------------------------------------------------
def test_reset_returns_prompt_and_info_without_truth():
    e = TwinEnv(ToyTwin())
    obs, info = e.reset(options={"split": "dev", "index": 2})
    assert obs == ToyTwin().prompt(e.case)
    assert set(info) == {"tools", "case_id", "split", "index"}
    assert info["case_id"] == "Toy/dev/2" and info["split"] == "dev" and info["index"] == 2
    assert [t["function"]["name"] for t in info["tools"]] == ["look", "big", "boom", "submit"]
    assert "truth" not in json.dumps(info) and obs in e.observation_space
    assert e.messages == obs and e.messages is not obs


def test_a_full_episode(env):
    word = env.case.task["word"]
    obs, reward, terminated, truncated, info = env.step(call("look", word=word))
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert obs[0]["role"] == "tool" and obs[0]["tool_call_id"] == "call_0_0"
    number = json.loads(obs[0]["content"])["number"]
    assert info["calls"][0]["ok"] and info["errors"] == [] and info["invalid_calls"] == 0
    assert info["turn"] == 1
    obs, reward, terminated, truncated, info = env.step(call("submit", answer=number))
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["reward"] == {
        "total": 1.0,
        "components": {"correct": 1.0},
        "weighted": {"correct": 1.0},
        "notes": ["toy"],
    }
    assert info["outcome"] == {"truth": env.case.truth, "kind": "square"}
    traj = info["trajectory"]
    assert traj is env.trajectory and traj.submission == {"answer": number}
    assert traj.reward == 1.0 and traj.terminated and traj.num_turns == 2 and traj.calls[1].terminal
    assert [m["role"] for m in traj.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    assert Trajectory.model_validate_json(traj.model_dump_json()) == traj


def test_openai_dict_actions_are_stored_normalised(env):
    msg = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "x1",
                "type": "function",
                "function": {"name": "look", "arguments": '{"word": "w1"}'},
            }
        ],
    }
    obs, *_ = env.step(msg)
    assert obs[0]["tool_call_id"] == "x1"
    assert env.messages[-2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "x1",
                "type": "function",
                "function": {"name": "look", "arguments": '{"word": "w1"}'},
            }
        ],
    }


# -- every bad action ---------------------------------------------------------------------------
TOOLS = "look, big, boom, submit"


@pytest.mark.parametrize(
    ("action", "role", "message"),
    [
        (call("nope"), "tool", f"Error: unknown tool 'nope'. Available tools: {TOOLS}"),
        (
            call("lok", word="w1"),
            "tool",
            f"Error: unknown tool 'lok'. Did you mean 'look'? Available tools: {TOOLS}",
        ),
        (
            "<tool_call>{oops}</tool_call>",
            "tool",
            "Error: tool call #1 is not valid JSON: Expecting property name enclosed in double "
            "quotes at line 1 column 2 (char 1)",
        ),
        (
            call("look", word=3),
            "tool",
            "Error: look: argument 'word': Input should be a valid string (expected string, got "
            "3). Usage: look(word: string)",
        ),
        (
            call("look"),
            "tool",
            "Error: look: missing required argument 'word' (string). Usage: look(word: string)",
        ),
        (
            call("look", word="w1", extra=1),
            "tool",
            "Error: look: unknown argument 'extra'; allowed: word. Usage: look(word: string)",
        ),
        (call("look", word="zz"), "tool", "Error: no word 'zz'; words look like 'w3'"),
        (
            call("boom"),
            "tool",
            "Error: boom failed with an internal error (RuntimeError); this is not your fault. "
            "Try other arguments or another tool",
        ),
    ],
)
def test_bad_calls_become_tool_messages(env, action, role, message):
    obs, reward, terminated, truncated, info = env.step(action)
    assert [(m["role"], m["content"]) for m in obs] == [(role, message)]
    assert info["errors"] == [message.removeprefix("Error: ")]
    assert info["invalid_calls"] == 1 and env.trajectory.invalid_calls == 1
    assert not info["calls"][0]["ok"] and (terminated, truncated) == (False, False)


@pytest.mark.parametrize(
    ("action", "problem"),
    [
        (
            "I will think first.",
            f"no tool call found in your turn. Call one of: {TOOLS}, written as {CALL_FORMAT}",
        ),
        ("", f"the turn is empty; call a tool like {CALL_FORMAT}"),
        (
            '<tool_call>{"name": "look"',
            f"tool call #1: <tool_call> is not closed; end it with </tool_call>: {CALL_FORMAT}",
        ),
        (
            12,
            "the action must be the assistant's text (str) or an assistant message (dict), got int",
        ),
        (
            {"role": "assistant"},
            'the assistant message has neither "content" nor "tool_calls"; send one of them',
        ),
    ],
)
def test_turns_without_a_usable_call_get_a_user_message(env, action, problem):
    obs, _, _, _, info = env.step(action)
    assert len(obs) == 1 and obs[0]["role"] == "user"
    assert obs[0]["content"].startswith(
        f"Your last turn had a problem: {problem}. Tools: look(word: string)"
    )
    assert info["errors"] == [problem] and info["invalid_calls"] == 1


def test_oversized_turn_is_rejected_unparsed():
    e = TwinEnv(ToyTwin(max_action_chars=100))
    e.reset(options={"index": 1})
    action = call("submit", answer=1) + " " * 200
    obs, reward, terminated, _, info = e.step(action)
    assert not terminated and info["calls"] == []
    assert info["errors"][0].startswith(
        f"your turn has {len(action)} characters; the limit is 100."
    )
    assert len(e.messages[-2]["content"]) == 100  # the stored turn is cut too


def test_second_terminal_call_in_a_turn_is_rejected(env):
    obs, reward, terminated, _, info = env.step(call("submit", answer=1) + call("submit", answer=2))
    assert terminated and info["invalid_calls"] == 1
    assert obs[1]["content"] == (
        "Error: submit was not run: a terminal call already ended the episode in this turn; "
        "only one terminal call is allowed"
    )
    assert env.trajectory.submission == {"answer": 1}


def test_step_after_the_end_answers_and_changes_nothing(env):
    env.step(call("submit", answer=1))
    before = env.trajectory.model_dump_json()
    obs, reward, terminated, truncated, info = env.step(call("look", word="w1"))
    assert obs == [
        {
            "role": "user",
            "content": "the episode has ended (a terminal call succeeded); call reset() to start a "
            "new one",
        }
    ]
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert info["invalid_calls"] == 1 and env.trajectory.model_dump_json() == before


def test_step_before_reset_raises_reset_needed():
    with pytest.raises(gymnasium.error.ResetNeeded):
        TwinEnv(ToyTwin()).step("hi")


def test_turn_budget_truncates_and_scores():
    e = TwinEnv(ToyTwin(max_turns=2))
    e.reset(options={"index": 3})
    assert e.step("hmm")[3] is False
    obs, reward, terminated, truncated, info = e.step(call("look", word="w1"))
    assert (terminated, truncated, reward) == (False, True, 0.0)
    assert info["reward"]["total"] == 0.0 and info["trajectory"].truncated
    assert info["trajectory"].invalid_calls == 1


def test_long_results_are_cut_with_a_note(env):
    obs, *_ = env.step(call("big", n=20_000))
    content = obs[0]["content"]
    assert content.endswith("... [result cut at 8000 of 20002 characters; ask for less]")
    assert len(content) < 8100


def test_tool_bugs_are_logged(env, caplog):
    with caplog.at_level(logging.WARNING, logger="twin.env"):
        env.step(call("boom"))
    assert "tool boom raised RuntimeError" in caplog.text


def test_reset_accepts_numpy_indices():
    import numpy as np

    e = TwinEnv(ToyTwin())
    assert e.reset(options={"index": np.int64(3)})[1]["index"] == 3
    assert type(e.trajectory.index) is int
    assert e.reset(options={"index": np.array(3)})[1]["index"] == 3  # a 0-d integer array


@pytest.mark.parametrize("name", ["1-d array", "2-d array", "float array", "empty array"])
def test_reset_refuses_numpy_arrays_with_the_projects_error(name):
    import numpy as np

    from twin.errors import CaseError

    index = {"1-d array": np.array([3]), "2-d array": np.array([[3]]), "float array": np.array(3.0),
             "empty array": np.array([], dtype=np.int64)}[name]  # fmt: skip
    with pytest.raises(CaseError, match="index must be an integer"):
        TwinEnv(ToyTwin()).reset(options={"index": index})


def test_reset_draws_an_index_from_the_seed():
    e = TwinEnv(ToyTwin())
    a = e.reset(seed=5)[1]["index"]
    assert e.reset(seed=5)[1]["index"] == a
    with pytest.raises(twin.CaseError):
        e.reset(options={"split": "nope"})


def test_render_ansi():
    e = TwinEnv(ToyTwin(), render_mode="ansi")
    e.reset(options={"index": 0})
    e.step(call("look", word="w1"))
    text = e.render()
    assert text.startswith("[system] Find the number") and "[tool] " in text


# -- Gymnasium ----------------------------------------------------------------------------------
def test_check_env_on_toy_and_returns():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # check_env only warns: make every warning fail the test
        check_env(TwinEnv(ToyTwin()), skip_render_check=True)
        check_env(gymnasium.make("twin/Returns-v0").unwrapped)


def test_gymnasium_make_after_import_twin():
    env = gymnasium.make("twin/Returns-v0", max_turns=3)
    obs, info = env.reset(seed=0)
    assert info["case_id"].startswith("Returns/train/")
    assert env.unwrapped.twin.config.max_turns == 3
    assert env.spec.id == "twin/Returns-v0"


def _toy():
    return TwinEnv(ToyTwin(max_turns=3))


def test_sync_vector_env():
    envs = gymnasium.vector.SyncVectorEnv([_toy] * 3)
    obs, infos = envs.reset(seed=1)
    assert len(obs) == 3 and all(o in envs.single_observation_space for o in obs)
    for _ in range(5):
        obs, rewards, term, trunc, infos = envs.step(
            ["hi", call("look", word="w1"), call("submit", answer=1)]
        )
        assert len(obs) == 3
    envs.close()


def test_make_vec_by_id():
    envs = gymnasium.make_vec("twin/Returns-v0", num_envs=2, vectorization_mode="sync")
    obs, infos = envs.reset(seed=3)
    assert len(obs) == 2 and list(infos["split"]) == ["train", "train"]
    _, rewards, *_ = envs.step(["no call", "still none"])
    assert list(rewards) == [0.0, 0.0]
    envs.close()


def test_async_vector_env():
    envs = gymnasium.vector.AsyncVectorEnv([_toy] * 2, shared_memory=False)
    try:
        obs, _ = envs.reset(seed=1)
        assert len(obs) == 2
        for _ in range(4):
            obs, rewards, term, trunc, infos = envs.step([call("submit", answer=4), "no call"])
        assert len(rewards) == 2
    finally:
        envs.close()


# -- properties ---------------------------------------------------------------------------------
json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
json_data = st.recursive(
    json_leaf,
    lambda s: st.lists(s, max_size=3) | st.dictionaries(st.text(), s, max_size=3),
    max_leaves=10,
)
tool_names = st.sampled_from(["look", "big", "submit", "boom", "nope", ""])
calls = st.builds(lambda n, a: {"name": n, "arguments": a}, tool_names, json_data)
texts = st.one_of(
    st.text(),
    st.builds(lambda p, c: p + "<tool_call>" + json.dumps(c) + "</tool_call>", st.text(), calls),
    st.builds(lambda c: json.dumps(c), calls),
    st.text(alphabet='<>{}[]":,tool_cal/ ', max_size=60),
)
dicts = st.one_of(
    st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "x"]), json_data),
    st.builds(
        lambda c, cs: {
            "role": "assistant",
            "content": c,
            "tool_calls": [
                {
                    "id": "i",
                    "type": "function",
                    "function": {"name": x["name"], "arguments": json.dumps(x["arguments"])},
                }
                for x in cs
            ],
        },
        st.none() | st.text(),
        st.lists(calls, max_size=3),
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(st.one_of(texts, dicts, json_leaf), min_size=1, max_size=6))
def test_step_never_raises_and_observations_are_valid(actions):
    e = TwinEnv(ToyTwin(max_turns=4, max_action_chars=300))
    obs, _ = e.reset(options={"index": 0})
    assert obs in e.observation_space
    for action in actions:
        obs, reward, terminated, truncated, info = e.step(action)
        assert obs in e.observation_space and obs
        assert isinstance(reward, float) and {"calls", "errors", "invalid_calls", "turn"} <= set(
            info
        )
        if terminated or truncated:
            traj = info.get("trajectory") or e.trajectory
            assert (
                Trajectory.model_validate_json(traj.model_dump_json()).model_dump()
                == traj.model_dump()
            )
    assert e.messages in e.observation_space


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31))
def test_action_space_samples_are_actions(seed):
    e = TwinEnv(ToyTwin())
    e.action_space.seed(seed)
    e.observation_space.seed(seed)
    assert e.action_space.sample() in e.action_space
    assert e.observation_space.sample() in e.observation_space


def test_reset_is_byte_identical_across_processes():
    code = (
        "import json, twin; e = twin.make('Returns');"
        "print(json.dumps([e.reset(options={'split': s, 'index': i}) for s, i in "
        "[('train', 0), ('train', 4321), ('dev', 7), ('test', 99)]], sort_keys=True, "
        "ensure_ascii=False))"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        ).stdout
        for seed in ("1", "2")
    ]
    assert outs[0] == outs[1] and len(outs[0]) > 500


# -- hardening (issue #11) ----------------------------------------------------------------------
def _nested(depth: int) -> dict:
    """A dict nested ``depth`` levels deep, built without recursion."""
    root: dict = {}
    node = root
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return root


class _BrokenDict(dict):
    def get(self, *args, **kwargs):
        raise RuntimeError("a dict whose methods raise")


@pytest.mark.parametrize(
    "make_action",
    [
        lambda deep: deep,
        lambda deep: {"role": deep, "content": "x"},
        lambda deep: {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "look", "arguments": deep}}
            ],
        },
        lambda deep: {"role": "assistant", "content": None, "tool_calls": [deep]},
        lambda deep: [deep],
        lambda deep: _BrokenDict(role="assistant", content="hi"),
    ],
    ids=["action", "role", "arguments", "call", "list", "broken-dict"],
)
def test_any_action_of_any_depth_is_a_short_counted_invalid_call(env, make_action):
    obs, reward, terminated, truncated, info = env.step(make_action(_nested(5_000)))
    assert obs in env.observation_space and info["invalid_calls"] == 1
    assert all(len(m["content"]) < 600 for m in obs) and len(json.dumps(info["errors"])) < 600
    assert len(env.trajectory.model_dump_json()) < 10_000


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ("test", "got 'test' (str)"),
        (["dev", 1], "got ['dev', 1] (list)"),
        ({"split": ["x"]}, "split must be one of train, dev, got ['x'] (list)"),
        ({"split": "dev", "index": "3"}, "index must be an integer, got '3' (str)"),
        ({"index": 1.5}, "index must be an integer, got 1.5 (float)"),
        ({"index": True}, "index must be an integer, got True"),
        ({"splt": "dev"}, "unknown option(s) 'splt'"),
    ],
)
def test_reset_rejects_bad_options_with_a_case_error(options, problem):
    with pytest.raises(twin.CaseError) as err:
        TwinEnv(ToyTwin()).reset(options=options)
    text = str(err.value)
    assert text.startswith('reset options must be a dict {"split": <str>, "index": <int>}')
    assert problem in text


@pytest.mark.parametrize("field_name", ["name", "id"])
def test_turn_size_counts_call_names_and_ids(env, field_name):
    fn = {"name": "look", "arguments": '{"word": "w1"}'}
    item = {"id": "c1", "type": "function", "function": fn}
    (fn if field_name == "name" else item)[field_name] = "x" * 2_000_000
    obs, _, _, _, info = env.step({"role": "assistant", "content": None, "tool_calls": [item]})
    assert info["invalid_calls"] == 1 and info["calls"] == []
    assert info["errors"][0].startswith(
        "your turn has more than 16000 characters; the limit is 16000."
    )
    assert sum(len(m["content"]) for m in obs) < 2_000
    assert len(env.trajectory.model_dump_json()) < 20_000


def test_calls_past_the_per_turn_cap_are_refused_and_counted():
    e = TwinEnv(ToyTwin(max_calls_per_turn=3))
    e.reset(options={"index": 0})
    obs, _, _, _, info = e.step(call("look", word="w1") * 5)
    assert [c["ok"] for c in info["calls"]] == [True, True, True, False, False]
    assert obs[3]["content"] == (
        "Error: not run: at most 3 tool calls are run per turn; call it again in your next turn"
    )
    assert info["invalid_calls"] == 2 and len(obs) == 5
    assert TwinConfig().max_calls_per_turn == 8


class _SharingTwin(ToyTwin):
    """Hands out the world's own mutable dict, as a careless twin might."""

    name = "SharingToy"

    @tool
    def words(self, world: dict) -> dict:
        """All words and their numbers."""
        return world["words"]


def test_mutating_a_stored_result_changes_no_later_episode():
    e = TwinEnv(_SharingTwin())
    e.reset(options={"index": 0})
    e.step(call("words"))
    e.trajectory.calls[-1].result["w1"] = 999  # a caller edits the trajectory it was handed
    e.reset(options={"index": 0})
    obs, *_ = e.step(call("look", word="w1"))
    assert json.loads(obs[0]["content"])["number"] == 1


def test_infos_are_fresh_and_changing_them_changes_no_later_episode():
    e = TwinEnv(ToyTwin())
    _, info = e.reset(options={"index": 0})
    with contextlib.suppress(TypeError):  # read-only schemas refuse; copies may change freely
        info["tools"][0]["function"]["name"] = "changed"
    truth = dict(e.case.truth)
    *_, end = e.step(call("submit", answer=-1))
    end["outcome"]["truth"]["answer"] = "changed"
    _, info2 = e.reset(options={"index": 0})
    assert info2["tools"][0]["function"]["name"] == "look"
    assert e.case.truth == truth
    *_, end2 = e.step(call("submit", answer=truth["answer"]))
    assert end2["reward"]["total"] == 1.0 and end2["outcome"]["truth"] == truth
    assert end2["outcome"] is not end["outcome"]


def test_a_one_turn_twins_answer_terminates_the_episode():
    e = TwinEnv(ToyTwin(max_turns=1))
    e.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = e.step("no call at all")
    assert (terminated, truncated) == (True, False) and "reward" in info
    traj = info["trajectory"]
    assert not traj.terminated and not traj.truncated and traj.submission is None
    late = e.step("again")
    assert late[2:4] == (True, False)
    assert late[0][0]["content"].startswith("the episode has ended (this twin takes one answer")


def test_truncate_ends_and_scores_the_episode_as_a_cut_one():
    import gymnasium as gym

    from twin.registry import make

    env = make("Returns", max_turns=4)
    env.reset(options={"split": "test", "index": 0})
    order = env.case.task["order_id"]
    env.step(
        f'<tool_call>{{"name": "lookup_order", "arguments": {{"order_id": "{order}"}}}}</tool_call>'
    )
    reward, info = env.truncate("cut by the caller")
    traj = env.trajectory
    assert traj.truncated and not traj.terminated
    assert reward == traj.reward == info["reward"]["total"]
    assert reward == env.twin.score(traj, env.case).total  # the twin's own score of the cut episode
    assert info["reward"]["notes"][-1] == "cut by the caller" == traj.reward_notes[-1]
    assert info["outcome"] and info["trajectory"] is traj
    obs, late_reward, _, truncated, late = env.step("anything")  # a late step changes nothing
    assert late_reward == 0.0 and truncated and "episode has ended" in obs[0]["content"]
    with pytest.raises(gym.error.Error, match="already ended"):
        env.truncate()


def test_refuse_records_the_turn_runs_nothing_and_tells_the_agent_why():
    from twin.registry import make

    env = make("Returns", max_turns=4)
    env.reset(options={"split": "test", "index": 0})
    order = env.case.task["order_id"]
    text = (
        f'<tool_call>{{"name": "lookup_order", "arguments": {{"order_id": "{order}"}}}}</tool_call>'
    )
    obs, reward, terminated, truncated, info = env.refuse(
        text, "the template cannot hold this turn"
    )
    assert env.trajectory.calls == [] and info["calls"] == [] and info["invalid_calls"] == 1
    assert env.trajectory.messages[-2] == {"role": "assistant", "content": text}
    assert obs == [env.trajectory.messages[-1]] and obs[0]["role"] == "user"
    assert obs[0]["content"].startswith(
        "Your last turn had a problem: the template cannot hold this turn. Tools: "
    )
    assert (reward, terminated, truncated, info["turn"]) == (0.0, False, False, 1)


def test_a_new_trajectory_holds_every_declared_field_at_its_default():
    env = TwinEnv(ToyTwin())
    env.reset(options={"split": "dev", "index": 1})
    first = env.trajectory
    case = env.case
    expected = Trajectory(
        twin=first.twin,
        case_id=case.id,
        split="dev",
        index=1,
        case_kind=case.kind,
        messages=first.messages,
    )
    assert first.model_dump() == expected.model_dump()
    assert set(first.__dict__) == set(Trajectory.model_fields)
    env.step('<tool_call>{"name": "look", "arguments": {"word": "w1"}}</tool_call>')
    env.reset(options={"split": "dev", "index": 1})
    # each episode gets its own containers from the fields' default factories
    assert env.trajectory.calls == [] and len(first.calls) == 1
    assert env.trajectory.info is not first.info

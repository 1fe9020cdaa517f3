"""The toy twin: the user names a word; the agent must call ``submit(answer=<word>)``.

It exists to prove that the trainer learns: a randomly initialised tiny model
(:func:`trainer.tiny.build_tiny`) starts at a reward of 0.10 and GRPO lifts it to 0.94-1.00 in
200 steps, 1-2 minutes on two CPU cores (``data/recipes/toy-cpu.yaml``, seeds 0-3). It is built
only from the public twin API (``twin.Twin``, ``twin.tool``) and the reward library.

**Tools.** ``submit(answer)`` (terminal).

**Cases.** Case ``i`` of a split names one word from :data:`WORDS` (the first ``num_words`` of
them), drawn from the case's own seeded generator; ``truth = {"answer": word}``; the case's ``kind``
is the word (so ``twin.balance: kind`` in a recipe deals the words in turn).

**Reward** (a few clear terms; random text earns 0.1, the right call 1.0, a wrong call 0):

| term        | weight  | value                                                                  |
| ----------- | ------- | ---------------------------------------------------------------------- |
| no_repeat   | 0.1     | 1 when no piece of the call is written twice                           |
| call        | 0.05    | 1 when the first turn starts with the call's fixed prefix              |
| named       | 0.45    | 1 when the named word follows the prefix (closed or not)               |
| correct     | 0.4     | 1 when ``submit`` succeeded with the named word                        |
| wrong       | -0.5    | 1 when another of :data:`WORDS` follows the prefix                     |
| word        | 0 (log) | 1 when one of :data:`WORDS` follows the prefix (right or not)          |
| submitted   | 0 (log) | 1 when ``submit`` succeeded                                             |
| prefix      | 0 (log) | share of the ideal call's pieces the first turn starts with, in order  |
| closeness   | 0 (log) | character similarity of the first turn to the ideal call               |

Whitespace is ignored by the text terms; the total is clipped to [0, 1]. The call's fixed prefix
is :data:`CALL_PREFIX`, ``<tool_call>{"name":"submit","arguments":{"answer":"`` (one token of the
tiny tokenizer, see ``trainer.tiny.CALL_TOKENS``). Levels: a wrong word 0, random text 0.1, the
prefix 0.15, the named word 0.6, the right call 1.0.

Why a wrong call scores *below* random text: a randomly initialised model gives every prompt
nearly the same next-token distribution, so anything a call earns whatever the prompt names
(the format) is learned long before the model reads the word, and the policy collapses onto one
call for every prompt (measured: 0.675, half right). With the wrong call under random text the
only way up is to read the word, and a policy that collapsed onto one call is pushed off it.

**Episode end.** ``submit`` succeeds, or ``max_turns`` turns (default 1) pass. With one turn
the answer ends the episode whatever it holds (``terminated``; see :class:`twin.env.TwinEnv`).

**Version history.** v0: first version (reward reworked to the terms above, same cases).
v0, revision 2: a wrong word is penalised (``wrong``, -0.5; ``word`` logged only), the prefix
earns 0.05 (was 0.2): a call earns nothing unless it names the prompt's word.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Literal

from pydantic import Field
from rapidfuzz import fuzz

from rewards import Reward, term
from twin import Case, Trajectory, Twin, TwinConfig, tool

__all__ = [
    "CALL_PREFIX",
    "WORDS",
    "ToyConfig",
    "ToyOracle",
    "ToyTwin",
    "ideal_call",
    "toy_reward",
    "toy_reward_partial",
]

#: The words cases name (single tokens of the tiny tokenizer).
WORDS: tuple[str, ...] = ("red", "blue", "green", "yellow", "cat", "dog", "bird", "fish")


def ideal_call_for(name: str, arguments: Any) -> str:
    """The Hermes text of a call: ``<tool_call>`` + its JSON + ``</tool_call>``."""
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


def ideal_call(answer: str) -> str:
    """The text of a perfect first turn for ``answer``."""
    return ideal_call_for("submit", {"answer": answer})


#: The fixed start of every right call, whitespace dropped (everything before the word).
CALL_PREFIX = "".join(ideal_call("").split('"}}')[0].split())


def _call_text(call: Any) -> str:
    # A structured call ({"function": {"name", "arguments": <json string>}}) as the Hermes text a
    # model writes for it, so a policy that answers with tool_calls (an OpenAI server, `hf:`)
    # is shaped exactly like one that writes the call in its text.
    fn = call.get("function", call) if isinstance(call, dict) else {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return ""
    return ideal_call_for(str(fn.get("name", "")), args)


def _first_turn(trajectory: Trajectory) -> str:
    for msg in trajectory.messages:
        if msg.get("role") == "assistant":
            text = msg.get("content") or ""
            calls = msg.get("tool_calls") or []
            if not text.strip() and calls:
                return "\n".join(_call_text(c) for c in calls)
            return text
    return ""


def _squeeze(text: str) -> str:
    # Whitespace never matters to the parser, so the shaping terms ignore it: the call written
    # on one line or on three earns the same.
    return "".join(text.split())


# -- reward ------------------------------------------------------------------------------------
@term(low=0.0, high=1.0)
def closeness(trajectory: Trajectory, case: Case) -> float:
    """Character similarity (0..1) of the first assistant turn to the ideal call (whitespace ignored)."""  # noqa: E501 (a term's first docstring line is its description)
    return (
        fuzz.ratio(_squeeze(_first_turn(trajectory)), _squeeze(ideal_call(case.truth["answer"])))
        / 100.0
    )


def ideal_pieces(answer: str) -> list[str]:
    """The ideal call cut into the pieces a tokenizer writes as single tokens (whitespace
    dropped)."""
    return [
        "<tool_call>",
        '{"name":"',
        "submit",
        '","arguments":{"answer":"',
        answer,
        '"}}',
        "</tool_call>",
    ]


@term(low=0.0, high=1.0)
def prefix(trajectory: Trajectory, case: Case) -> float:
    """Fraction of the ideal call's pieces the first assistant turn starts with, in order."""
    text = _squeeze(_first_turn(trajectory))
    pieces = ideal_pieces(case.truth["answer"])
    done = 0
    for piece in pieces:
        if not text.startswith(piece):
            break
        text = text[len(piece) :]
        done += 1
    return done / len(pieces)


@term(low=0.0, high=1.0)
def call(trajectory: Trajectory, case: Case) -> float:
    """1 when the first assistant turn starts with the call's fixed prefix (whitespace ignored)."""
    return float(_squeeze(_first_turn(trajectory)).startswith(CALL_PREFIX))


@term(low=0.0, high=1.0)
def no_repeat(trajectory: Trajectory, case: Case) -> float:
    """1 when the first turn writes no piece of the call twice (a policy stuck repeating scores 0)."""  # noqa: E501 (a term's first docstring line is its description)
    text = _squeeze(_first_turn(trajectory))
    pieces = [p for p in ideal_pieces(case.truth["answer"]) if p != case.truth["answer"]]
    return float(all(text.count(p) <= 1 for p in pieces))


@term(low=0.0, high=1.0)
def submitted(trajectory: Trajectory, case: Case) -> float:
    """1 when ``submit`` succeeded."""
    return float(trajectory.submission is not None)


def _word_after_prefix(trajectory: Trajectory) -> str | None:
    # The word the first turn writes right after the call's fixed prefix (closed or not).
    text = _squeeze(_first_turn(trajectory))
    if not text.startswith(CALL_PREFIX):
        return None
    found = re.match(r"[A-Za-z]+", text[len(CALL_PREFIX) :])
    return found.group(0).lower() if found else None


@term(low=0.0, high=1.0)
def word(trajectory: Trajectory, case: Case) -> float:
    """1 when the call's fixed prefix is followed by one of :data:`WORDS` (right or not)."""
    return float(_word_after_prefix(trajectory) in WORDS)


@term(low=0.0, high=1.0)
def named(trajectory: Trajectory, case: Case) -> float:
    """1 when the call's fixed prefix is followed by the named word (closed or not)."""
    return float(_word_after_prefix(trajectory) == case.truth["answer"])


@term(low=0.0, high=1.0)
def wrong(trajectory: Trajectory, case: Case) -> float:
    """1 when the call's fixed prefix is followed by one of :data:`WORDS` other than the named one."""  # noqa: E501 (a term's first docstring line is its description)
    found = _word_after_prefix(trajectory)
    return float(found in WORDS and found != case.truth["answer"])


@term(low=0.0, high=1.0)
def correct(trajectory: Trajectory, case: Case) -> float:
    """1 when the submitted answer is the word the user named."""
    answer = (trajectory.submission or {}).get("answer")
    return float(isinstance(answer, str) and answer.strip().lower() == case.truth["answer"])


toy_reward = Reward(
    {
        no_repeat: 0.1,
        call: 0.05,
        named: 0.45,
        correct: 0.4,
        wrong: -0.5,
        word: 0.0,
        submitted: 0.0,
        prefix: 0.0,
        closeness: 0.0,
    },
    clip=(0.0, 1.0),
    name="toy",
)

#: The first Toy reward (``wrong_call: partial``): a wrong word still earns the prefix and the
#: word (0.35), so a policy that always writes one call scores 0.675 without reading the prompt.
toy_reward_partial = Reward(
    {
        no_repeat: 0.1,
        call: 0.2,
        word: 0.05,
        named: 0.35,
        correct: 0.3,
        wrong: 0.0,
        submitted: 0.0,
        prefix: 0.0,
        closeness: 0.0,
    },
    clip=(0.0, 1.0),
    name="toy_partial",
)


# -- the twin ----------------------------------------------------------------------------------
class ToyConfig(TwinConfig):
    """Toy options.

    Attributes:
        num_words: How many of :data:`WORDS` the cases draw from (fewer = easier).
        wrong_call: ``penalised`` (default): a call naming another word scores 0, below random
            text; ``partial``: the first reward, where it earns 0.35 (:data:`toy_reward_partial`).
        repeat: How many times the user message writes the word (a randomly initialised model's
            attention is spread over the whole ~210-token prompt: repeating the word makes it
            easier to read).
    """

    max_turns: int = Field(1, ge=1)
    num_words: int = Field(4, ge=1, le=len(WORDS))
    wrong_call: Literal["penalised", "partial"] = "penalised"
    repeat: int = Field(1, ge=1, le=64)


class ToyTwin(Twin):
    """Name a word, submit it."""

    name = "Toy"
    version = 0
    description = "Toy task: the user names a word; call submit(answer=<word>)."
    config_model = ToyConfig
    splits = {"train": 10_000, "dev": 100, "test": 100}
    reward = toy_reward

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        if self.config.wrong_call == "partial":
            self.reward = toy_reward_partial  # the instance's reward wins over the class default

    def make_case(self, rng: random.Random, split: str, index: int) -> tuple[str, dict, dict]:
        word = rng.choice(WORDS[: self.config.num_words])
        # The kind is the word: a recipe with ``twin.balance: kind`` then deals the words in turn.
        return word, {"word": word}, {"answer": word}

    def prompt(self, case: Case) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": "Call submit with the word the user names."},
            {
                "role": "user",
                "content": (
                    f"The word is {' '.join([case.task['word']] * self.config.repeat)}. Submit it."
                ),
            },
        ]

    # -- twin check hooks (twin/doctor/) --------------------------------------------------------
    # The prompt names the answer by design (the task is reading it), so a bag-of-words
    # classifier on prompts is expected to be perfect.
    check_thresholds = {"shortcut_margin": 1.0}

    def oracle_policy(self) -> ToyOracle:
        """Writes the ideal call for the word the prompt names."""
        return ToyOracle()

    def world_entities(self, split: str, limit: int | None = None) -> dict[str, set[str]]:
        """None: the toy has no world (its words are the answers, shared by every split)."""
        return {}

    @tool(terminal=True)
    def submit(self, answer: str) -> dict:
        """Submit the final answer.

        Args:
            answer: The word the user named.
        """
        return {"ok": True}


class ToyOracle:
    """Writes :func:`ideal_call` for the word the user message names: the maximum reward."""

    name = "oracle"

    async def act(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        """The ideal first turn."""
        user = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
        found = re.search(r"The word is (\w+)", user)
        return ideal_call(found.group(1) if found else "")

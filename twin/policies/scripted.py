"""Scripted policies, no model: :class:`ReplayPolicy` plays hand-written turns,
:class:`RandomPolicy` calls random tools with schema-shaped arguments (a baseline)."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twin.cases import stable_seed
from twin.errors import ConfigError
from twin.protocols import Message

__all__ = ["RandomPolicy", "ReplayPolicy", "tool_call"]


def tool_call(name: str, arguments: Any, call_id: str) -> dict[str, Any]:
    """An OpenAI tool-call dict; ``arguments`` is JSON-encoded unless it already is a string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _assistant_turns(messages: Sequence[Message]) -> int:
    return sum(1 for m in messages if m.get("role") == "assistant")


# -- replay ------------------------------------------------------------------------------------
class ReplayPolicy:
    """Plays hand-written assistant turns, one per call, in order.

    Each turn is either a string (raw model text, e.g. ``<tool_call>{...}</tool_call>``, parsed
    by the env) or a dict: a full assistant message (``{"role": "assistant", "content": ...,
    "tool_calls": [...]}``), a shorthand call ``{"name": "submit", "arguments": {...}}``, or
    ``{"calls": [{"name": ..., "arguments": ...}, ...], "content": "..."}`` for several calls.
    The position is the number of assistant messages already in the chat, so one policy serves
    any number of concurrent episodes. After the last turn it answers in text that the script
    has ended (the env counts that as a turn without a tool call).

    Args:
        turns: The turns.
        name: Name recorded in trajectories.

    Raises:
        ConfigError: a turn that is neither a string nor one of the dict forms.
    """

    def __init__(self, turns: Sequence[str | dict[str, Any]], name: str = "replay") -> None:
        self.name = name
        self.turns = [self._normalise(t, i) for i, t in enumerate(turns)]

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ReplayPolicy:
        """Load turns from a YAML or JSON file: a list of turns, or ``{"turns": [...]}``.

        Raises:
            ConfigError: the file is missing or does not hold a list of turns.
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"replay file {str(p)!r} not found; give a YAML or JSON list of turns"
            )
        from twin.yamlsafe import load_yaml_file

        data = load_yaml_file(p, what="replay file")  # YAML is a superset of JSON; bounded size
        if isinstance(data, dict) and "turns" in data:
            data = data["turns"]
        if not isinstance(data, list):
            raise ConfigError(
                f"replay file {str(p)!r} must hold a list of assistant turns "
                "(or {turns: [...]}), "
                f"got {type(data).__name__}"
            )
        return cls(data, name=f"replay:{p.name}")

    @staticmethod
    def _normalise(turn: Any, i: int) -> Message:
        if isinstance(turn, str):
            return {"role": "assistant", "content": turn}
        if not isinstance(turn, dict):
            raise ConfigError(
                f"replay turn {i}: expected a string or a dict, got {type(turn).__name__}: {turn!r}"
            )
        if "role" in turn or "tool_calls" in turn:
            msg = {"role": "assistant", "content": turn.get("content"), **turn}
            msg["role"] = "assistant"
            return msg
        if "name" in turn:
            calls = [turn]
        elif "calls" in turn:
            calls = list(turn["calls"])
        else:
            raise ConfigError(
                f"replay turn {i}: a dict turn needs 'role'/'tool_calls' (a message), 'name' and "
                f"'arguments' (one call) or 'calls' (several); got keys {sorted(turn)}"
            )
        tool_calls = []
        for j, call in enumerate(calls):
            if not isinstance(call, dict) or "name" not in call:
                raise ConfigError(
                    f"replay turn {i}, call {j}: expected {{name, arguments}}, got {call!r}"
                )
            tool_calls.append(tool_call(call["name"], call.get("arguments", {}), f"call_{i}_{j}"))
        return {"role": "assistant", "content": turn.get("content"), "tool_calls": tool_calls}

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """The next scripted turn (a copy), or a text turn saying the script has ended."""
        i = _assistant_turns(messages)
        if i < len(self.turns):
            return json.loads(json.dumps(self.turns[i]))  # a copy: envs may annotate messages
        return {
            "role": "assistant",
            "content": f"(replay finished: the script has {len(self.turns)} turns and no more)",
        }

    def __repr__(self) -> str:
        return f"ReplayPolicy({len(self.turns)} turns, name={self.name!r})"


# -- random ------------------------------------------------------------------------------------
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-./]{0,39}")


class RandomPolicy:
    """Random tool calls with arguments built from the tool schemas; sometimes junk.

    String arguments are drawn from the words and values already in the chat (ids in the
    prompt, names in tool results), so a random agent sometimes hits a real record; enums,
    numbers, booleans, arrays and objects follow the schema. With probability ``junk_rate`` a
    turn is junk instead: plain text, an unknown tool, malformed JSON or wrongly typed arguments.

    Deterministic: the turn depends only on ``seed``, the episode key (see ``for_episode``; by
    default the opening messages) and the turn number, never on scheduling.

    Args:
        seed: Seed.
        junk_rate: Probability of a junk turn.
        name: Name recorded in trajectories.
    """

    def __init__(
        self, seed: int = 0, junk_rate: float = 0.1, name: str = "random", _key: str | None = None
    ) -> None:
        if not 0.0 <= junk_rate <= 1.0:
            raise ConfigError(f"junk_rate must be in [0, 1], got {junk_rate}")
        self.seed = seed
        self.junk_rate = junk_rate
        self.name = name
        self._key = _key

    def for_episode(self, key: str) -> RandomPolicy:
        """A copy whose randomness is keyed by ``key`` (distinct episodes of one case differ)."""
        return RandomPolicy(self.seed, self.junk_rate, self.name, _key=key)

    def _rng(self, messages: Sequence[Message]) -> random.Random:
        key = self._key
        if key is None:
            key = json.dumps(
                [m.get("content") for m in messages[:2]],
                sort_keys=True,
                ensure_ascii=False,
                default=str,
            )
        return random.Random(
            stable_seed("RandomPolicy", self.seed, key, _assistant_turns(messages))
        )

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """A random tool call (or, rarely, junk)."""
        return self.turn(messages, tools)

    def turn(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> Message:
        """The synchronous body of :meth:`act`."""
        rng = self._rng(messages)
        turn = _assistant_turns(messages)
        call_id = f"call_{turn}_0"
        if not tools:
            return {"role": "assistant", "content": "I have no tools to call."}
        words = _candidate_words(messages)
        if rng.random() < self.junk_rate:
            return _junk(rng, tools, words, call_id)
        fn = rng.choice(list(tools))["function"]
        params = fn.get("parameters") or {}
        args = _sample_object(rng, params, params.get("$defs", {}), words, depth=0)
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call(fn["name"], args, call_id)],
        }

    def __repr__(self) -> str:
        return f"RandomPolicy(seed={self.seed}, junk_rate={self.junk_rate})"


class _Words:
    """Strings an argument may take: values from tool results (ids, names) and prompt words."""

    def __init__(self, values: list[str], words: _Words) -> None:
        self.values = values
        self.words = words or values or ["x"]

    def pick(self, rng: random.Random) -> str:
        # Half the time a value a tool returned: ids found by search are the plausible ones.
        if self.values and rng.random() < 0.5:
            return rng.choice(self.values)
        return rng.choice(self.words)


def _candidate_words(messages: Sequence[Message]) -> _Words:
    """Strings seen in the chat: tool-result values; prompt words and keys. In order, unique."""
    values: dict[str, None] = {}
    words: dict[str, None] = {}

    def add_json(value: Any) -> None:
        if isinstance(value, str):
            if 0 < len(value) <= 60:
                values.setdefault(value, None)
        elif isinstance(value, dict):
            for k, v in value.items():
                words.setdefault(str(k), None)
                add_json(v)
        elif isinstance(value, list):
            for v in value:
                add_json(v)

    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            continue
        if m.get("role") == "tool":
            try:
                add_json(json.loads(content))
                continue
            except (json.JSONDecodeError, ValueError):
                pass
        if m.get("role") in ("user", "tool"):
            for w in _WORD.findall(content):
                words.setdefault(w.rstrip(".,"), None)
        if len(values) + len(words) > 400:
            break
    return _Words(list(values), list(words))


def _sample_value(
    rng: random.Random, schema: dict[str, Any], defs: dict[str, Any], words: _Words, depth: int
) -> Any:
    if "$ref" in schema:
        target = defs.get(schema["$ref"].rsplit("/", 1)[-1], {})
        return _sample_value(rng, target, defs, words, depth + 1)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    for union in ("anyOf", "oneOf"):
        if union in schema:
            options = [s for s in schema[union] if s.get("type") != "null"] or schema[union]
            return _sample_value(rng, rng.choice(options), defs, words, depth + 1)
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = rng.choice([k for k in kind if k != "null"] or kind)
    if kind == "string":
        return words.pick(rng)
    if kind == "integer":
        low = int(schema.get("minimum", schema.get("exclusiveMinimum", -1) + 1))
        high = int(schema.get("maximum", schema.get("exclusiveMaximum", low + 11) - 1))
        return rng.randint(low, max(low, high))
    if kind == "number":
        low = float(schema.get("minimum", 0.0))
        high = float(schema.get("maximum", low + 100.0))
        return round(rng.uniform(low, high), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        if depth > 4:
            return []
        n = rng.randint(int(schema.get("minItems", 0)), int(schema.get("maxItems", 3)))
        return [
            _sample_value(rng, schema.get("items", {}), defs, words, depth + 1) for _ in range(n)
        ]
    if kind == "object":
        return _sample_object(rng, schema, defs, words, depth + 1)
    return words.pick(rng)


def _sample_object(
    rng: random.Random, schema: dict[str, Any], defs: dict[str, Any], words: _Words, depth: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if depth > 4:
        return out
    required = set(schema.get("required", []))
    for pname, prop in (schema.get("properties") or {}).items():
        if pname in required or rng.random() < 0.5:
            out[pname] = _sample_value(rng, prop, defs, words, depth)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict) and not schema.get("properties"):
        for _ in range(rng.randint(0, 3)):
            out[words.pick(rng)] = _sample_value(rng, extra, defs, words, depth)
    return out


def _junk(
    rng: random.Random, tools: Sequence[dict[str, Any]], words: _Words, call_id: str
) -> Message:
    name = rng.choice(list(tools))["function"]["name"]
    kind = rng.randrange(4)
    if kind == 0:
        return {"role": "assistant", "content": f"I think the answer is {words.pick(rng)}."}
    if kind == 1:
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call(name + "_x", {}, call_id)],
        }
    if kind == 2:
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call(name, '{"oops": ', call_id)],
        }
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [tool_call(name, {"_": [1, 2]}, call_id)],
    }

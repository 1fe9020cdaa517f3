"""Playing a twin for ``twin check`` (:mod:`twin.doctor`): episodes, probe policies, guarded checks.

Its own module because both the doctor (:mod:`twin.doctor`) and its playing checks
(:mod:`twin.doctor.checks`) use these, and the doctor runs those checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twin.core import Twin, as_policy
from twin.doctor.report import Report
from twin.protocols import Policy

if TYPE_CHECKING:
    from twin.env import TwinEnv

__all__ = [
    "ConstantAnswerPolicy",
    "NoToolsPolicy",
    "as_policy",
    "constant_answers",
    "first_output",
    "guard",
    "play",
]

_TURN_SLACK = 2  # turns past max_turns before an episode that never ends is given up


@dataclass
class _Episode:
    case: Any
    reward: float | None
    visible: str  # non-terminal tool outputs and infos, as the agent could have read them
    error: str | None = None


@dataclass
class _Run:
    episodes: list[_Episode] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return statistics.fmean(e.reward or 0.0 for e in self.episodes) if self.episodes else 0.0

    @property
    def errors(self) -> list[str]:
        return [e.error for e in self.episodes if e.error]


class NoToolsPolicy:
    """Answers every turn with plain text and never calls a tool."""

    name = "no_tools"

    async def act(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Plain text."""
        return {"role": "assistant", "content": "I have looked at this and have nothing to add."}


class ConstantAnswerPolicy:
    """``base``'s turns with argument ``arg`` of every ``tool`` call set to ``value``."""

    def __init__(self, base: Policy, tool: str, arg: str, value: Any) -> None:
        self.base, self.tool, self.arg, self.value = base, tool, arg, value
        self.name = f"constant {arg}={value}"

    def for_episode(self, key: str) -> ConstantAnswerPolicy:
        """The base's episode copy (random bases), wrapped."""
        from twin.protocols import policy_for_episode

        return ConstantAnswerPolicy(
            policy_for_episode(self.base, key), self.tool, self.arg, self.value
        )

    async def act(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Any:
        """The base's turn, its answer replaced by the constant."""
        turn = await self.base.act(messages, tools)
        if not isinstance(turn, dict) or not turn.get("tool_calls"):
            return turn
        calls = []
        for call in turn["tool_calls"]:
            fn = call.get("function", {})
            if fn.get("name") == self.tool:
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except json.JSONDecodeError:
                    args = {}
                args = {**(args if isinstance(args, dict) else {}), self.arg: self.value}
                call = {**call, "function": {**fn, "arguments": json.dumps(args)}}
            calls.append(call)
        return {**turn, "tool_calls": calls}


def constant_answers(twin: Twin) -> list[tuple[str, str, Any]]:
    """``(tool, argument, value)`` for every enum / Literal / boolean value of a terminal tool."""
    out = []
    for tool in twin.tools:
        if not tool.terminal:
            continue
        params = tool.schema["function"].get("parameters", {})
        defs = params.get("$defs", {})
        for arg, prop in params.get("properties", {}).items():
            if "$ref" in prop:
                prop = defs.get(prop["$ref"].rsplit("/", 1)[-1], prop)
            options = list(prop.get("enum") or [])
            for alt in prop.get("anyOf", []):
                options += [v for v in alt.get("enum", []) if v not in options]
            if not options and prop.get("type") == "boolean":
                options = [True, False]
            out += [(tool.name, arg, value) for value in options]
    return out


@contextlib.contextmanager
def guard(report: Report, check: str, name: str) -> Iterator[None]:
    """A check that raises becomes a failed row (the other checks still run)."""
    try:
        yield
    except Exception as exc:  # a broken hook or twin must not hide the other checks
        report.add(
            check, name, "fail", note=f"the check raised {type(exc).__name__}: {exc}", crashed=True
        )


def play(twin: Twin, policy: Policy, refs: list[tuple[str, int]]) -> _Run:
    """Play one episode of ``policy`` per case, keeping what the agent could read before the end."""
    from twin.env import TwinEnv
    from twin.protocols import policy_for_episode

    env = TwinEnv(twin)
    run = _Run()
    loop = asyncio.new_event_loop()
    try:
        for split, index in refs:
            run.episodes.append(_play_one(env, loop, policy, policy_for_episode, split, index))
    finally:
        loop.close()
    return run


def _play_one(
    env: TwinEnv,
    loop: asyncio.AbstractEventLoop,
    policy: Policy,
    for_episode: Callable[[Policy, str], Policy],
    split: str,
    index: int,
) -> _Episode:
    _, info = env.reset(options={"split": split, "index": index})
    case, tools = env.case, info["tools"]
    actor = for_episode(policy, f"{info['case_id']}#0")
    seen: list[str] = []
    try:
        for _ in range(env.twin.config.max_turns + _TURN_SLACK):
            message = loop.run_until_complete(actor.act(env.messages, tools))
            obs, _, terminated, truncated, info = env.step(message)
            if terminated or truncated:
                traj = info["trajectory"]
                return _Episode(case, traj.reward, "\n".join(seen))
            seen.append(json.dumps([obs, info], ensure_ascii=False, default=str))
        return _Episode(case, None, "\n".join(seen), error="the episode never ended")
    except Exception as exc:  # a failing policy costs its episode, not the check
        return _Episode(case, None, "\n".join(seen), error=f"{type(exc).__name__}: {exc}")


def first_output(twin: Twin, policy: Policy, refs: list[tuple[str, int]]) -> list[str | None]:
    """The text of ``policy``'s first turn's tool results per case (None: its first turn ended it
    or called no tool)."""
    from twin.env import TwinEnv
    from twin.protocols import policy_for_episode

    env = TwinEnv(twin)
    loop = asyncio.new_event_loop()
    out: list[str | None] = []
    try:
        for split, index in refs:
            _, info = env.reset(options={"split": split, "index": index})
            actor = policy_for_episode(policy, f"{info['case_id']}#0")
            try:
                message = loop.run_until_complete(actor.act(env.messages, info["tools"]))
                obs, _, terminated, truncated, info = env.step(message)
            except Exception:  # its absence is reported as a missing output
                out.append(None)
                continue
            results = [m.get("content") or "" for m in obs if m.get("role") == "tool"]
            out.append(None if terminated or truncated or not results else "\n".join(results))
    finally:
        loop.close()
    return out

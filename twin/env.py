"""``TwinEnv``: a twin behind the Gymnasium interface, one chat episode per case.

::

    env = TwinEnv(ReturnsTwin())
    messages, info = env.reset(options={"split": "dev", "index": 3})
    obs, reward, terminated, truncated, info = env.step(
        '<tool_call>{"name": "lookup_order", "arguments": {"order_id": "R-10007"}}</tool_call>'
    )

**Observation.** A list of OpenAI chat messages (:class:`twin.spaces.ChatMessages`): the opening
system + user messages on ``reset``, then on each ``step`` only the *new* messages: one ``tool``
message per call, and a ``user`` message when the turn had no usable call. The whole chat so far
is :attr:`TwinEnv.messages`.

**Action.** The assistant's raw text or an assistant message dict
(:class:`twin.spaces.AssistantTurn`). Tool calls are read by :func:`twin.parsing.parse_tool_calls`.

**Reward.** 0.0 until the episode ends; then the twin's reward of the whole trajectory, with
its components in ``info["reward"]``. A reward with terms scored against the episode's group
(RULER-style judge terms, ``Twin.needs_group``) is provisional at the end: each group term holds
its lowest value, and the trajectory's ``info["deferred"]`` names them until whoever holds the
group (the trainer's collection, ``twin eval``) calls :meth:`twin.core.Twin.score_groups`.

**Episode end.** ``terminated`` when a terminal tool (e.g. ``submit``) succeeds; ``truncated``
when ``config.max_turns`` assistant turns have been taken without one (the reward is still
computed: no submission usually scores low). A one-turn twin (``max_turns == 1``) has no budget
to run out: its single answer ends the episode, so that step is ``terminated`` whatever it held
(``Trajectory.terminated`` still says whether a terminal call succeeded).

**Bad actions never raise.** Unknown tools, malformed JSON, wrong argument types, missing
arguments, oversized turns (``config.max_action_chars``, counting everything the agent sends:
text, call names, ids and arguments), calls past ``config.max_calls_per_turn``, turns without a
call, calls after the terminal call, steps after the end and actions of any other type or depth
each become a short message that says what was wrong and what is allowed; each counts in
``info["invalid_calls"]`` and ``Trajectory.invalid_calls``.

**Episodes are isolated.** A tool result is stored and returned as the tool's own object only
when it is read-only (a :class:`twin.tools.FrozenDict` / :class:`twin.tools.FrozenList`, or a
scalar); anything else is copied (through its JSON) first, so no caller can change what a later
episode sees through a trajectory. Every ``info`` is fresh data.
"""

from __future__ import annotations

import difflib
import json
import logging
import operator
import time
from collections.abc import Iterator, Mapping
from typing import Any

import gymnasium as gym
from gymnasium.error import ResetNeeded
from pydantic_core import from_json, to_json

from twin.cases import Case
from twin.core import Twin
from twin.errors import CaseError, ToolError
from twin.parsing import (
    CALL_FORMAT,
    ParsedCall,
    ParsedTurn,
    parse_tool_calls,
    short_text,
)
from twin.spaces import AssistantTurn, ChatMessages
from twin.tools import FrozenDict, FrozenList, freeze, thaw, to_jsonable
from twin.trajectory import ToolCallRecord, Trajectory

__all__ = ["TwinEnv"]

logger = logging.getLogger("twin.env")


def _dumps(value: Any) -> str:
    """Compact JSON with non-ASCII kept (pydantic-core's encoder: 3x faster than ``json``)."""
    return to_json(value, fallback=str).decode()


# Results of these types are stored as returned: they cannot be changed, so sharing them (a
# look-up handing back the world's own frozen record) keeps steps fast and episodes small.
# Anything else is copied through its JSON text, which the agent sees anyway.
_SHAREABLE = frozenset({FrozenDict, FrozenList, str, int, float, bool, type(None)})
_OPTIONS = ("split", "index")


class TwinEnv(gym.Env[list, Any]):
    """A :class:`twin.core.Twin` as a Gymnasium environment over chat messages.

    Args:
        twin: The twin (its world is shared by every env of the same config in the process).
        render_mode: ``"ansi"`` makes :meth:`render` return the chat as text.

    ``reset(seed=None, options={"split": "train", "index": i})`` returns ``(messages, info)`` with
    ``info = {"tools": [schemas], "case_id", "split", "index"}``; without an index the case is drawn
    from the env's seeded generator. ``step(action)`` returns ``(new_messages, reward, terminated,
    truncated, info)`` with ``info = {"calls", "errors", "invalid_calls", "turn"}`` and, at the end,
    ``"reward"`` (total, components, weighted, notes), ``"outcome"`` and ``"trajectory"``.
    """

    # render_fps means nothing for chat, but Gymnasium's checker warns when it is missing.
    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, twin: Twin, render_mode: str | None = None) -> None:
        if not isinstance(twin, Twin):
            raise TypeError(f"TwinEnv needs a Twin instance, got {type(twin).__name__}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.render_mode = render_mode
        self._twin = twin
        cfg = twin.config
        self._max_turns = cfg.max_turns
        self._max_action = cfg.max_action_chars
        self._max_result = cfg.max_result_chars
        self._max_calls = cfg.max_calls_per_turn
        self._one_turn = cfg.max_turns == 1
        self._tools = {t.name: t for t in twin.tools}
        # read-only and shared: each reset hands out a new list of the same frozen schemas
        self._schemas = twin.frozen_tool_schemas
        names = list(self._tools)
        self._names_text = ", ".join(names) if names else "(none)"
        self._usage = "; ".join(t.signature_text() for t in twin.tools)
        self.observation_space = ChatMessages()
        self.action_space = AssistantTurn(tool_names=names)
        # Per-episode state: kept to a handful of references (the chat lives in the trajectory).
        self._world: Any = None  # the twin's shared world, fetched on the first tool call
        self._case: Case | None = None
        self._traj: Trajectory | None = None
        self._state: Any = None
        self._turn = 0
        self._done = False
        self._end: tuple[bool, bool] = (False, False)
        self._late_invalid = 0
        self._hidden = _Hidden(self)

    # -- public properties -----------------------------------------------------------------------
    @property
    def twin(self) -> Twin:
        """The twin this env runs."""
        return self._twin

    @property
    def case(self) -> Case | None:
        """The current case (None before the first reset)."""
        return self._case

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The whole chat so far, prompt included (the trajectory's own list)."""
        return self._traj.messages if self._traj is not None else []

    @property
    def trajectory(self) -> Trajectory | None:
        """The episode so far; trainers may append to ``trajectory.token_turns``."""
        return self._traj

    # -- gymnasium API -------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Start an episode on case ``(options["split"], options["index"])``.

        Args:
            seed: Seeds the env's generator (used to draw an index when none is given).
            options: ``{"split": "train", "index": int}``; both optional.

        Returns:
            The opening messages and ``{"tools", "case_id", "split", "index"}``.

        Raises:
            CaseError: options that are not such a dict (another type, another key, a split that
                is not a string or not the twin's, an index that is not an integer in range).
        """
        super().reset(seed=seed)
        twin = self._twin
        split, index = _read_options(options, twin)
        if index is None:
            index = int(self.np_random.integers(twin.num_cases(split)))
        case = twin.case(split, index)
        prompt = twin.prompt(case)
        self._case = case
        self._state = twin.new_state(case)
        self._turn = 0
        self._done = False
        self._end = (False, False)
        self._late_invalid = 0
        self._traj = _new_trajectory(twin.name, case.id, split, index, case.kind, list(prompt))
        return list(prompt), {
            "tools": list(self._schemas),
            "case_id": case.id,
            "split": split,
            "index": index,
        }

    def step(self, action: Any) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        """Run one assistant turn: parse its tool calls, run them, answer with messages.

        Args:
            action: The assistant's raw text, or an assistant message dict.

        Returns:
            observation: The new messages (one ``tool`` message per call; a ``user`` message when
                the turn had no usable call or a turn-level problem).
            reward: 0.0, or the episode's reward at its end.
            terminated: A terminal tool succeeded.
            truncated: The turn budget ran out first.
            info: ``calls`` (this turn's call records as dicts), ``errors`` (messages shown to the
                agent), ``invalid_calls`` (cumulative), ``turn`` (assistant turns taken); at the end
                also ``reward``, ``outcome`` and ``trajectory``.

        Raises:
            ResetNeeded: ``step`` before the first ``reset`` (a caller bug, not a bad action).
        """
        return self._step(action, None)

    def refuse(
        self, action: Any, reason: str
    ) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        """Take a turn the caller could not accept (e.g. the policy's chat template cannot
        represent it): record it, run nothing, count one invalid turn and tell the agent ``reason``.

        Returns and raises as :meth:`step`.
        """
        return self._step(action, reason)

    def _step(
        self, action: Any, refused: str | None
    ) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        traj = self._traj
        if traj is None:
            raise ResetNeeded("call env.reset() before env.step()")
        if self._done:
            return self._late_step()
        calls, turn_errors = self._parse_turn(action, refused, traj.messages)
        obs, calls_info, call_errors, terminated = self._run_calls(calls, traj)
        return self._close_turn(obs, calls_info, call_errors, turn_errors, terminated)

    def _parse_turn(
        self, action: Any, refused: str | None, messages: list[dict[str, Any]]
    ) -> tuple[list[ParsedCall], list[str]]:
        """Parse: record the assistant message; return its calls and the turn-level problems."""
        kind = type(action)
        if kind is not str and kind is not dict:  # the usual actions skip the call
            action = _plain_action(action)
        limit = self._max_action
        size = len(action) if type(action) is str else _action_size(action, limit)
        if size > limit:
            messages.append(_assistant_record(action, None, limit))
            # a message dict's walk stops at the limit: its exact size is not known
            has = f"{size}" if type(action) is str else f"more than {limit}"
            too_long = (
                f"your turn has {has} characters; the limit is {limit}. Nothing was run (the "
                f"count covers text, call names, ids and arguments). Send one short turn with "
                f"the tool calls only, e.g. {CALL_FORMAT}"
            )
            return [], [too_long]
        if refused is not None:
            messages.append(_assistant_record(action, None, limit))
            return [], [refused]
        try:
            parsed = parse_tool_calls(action, turn=self._turn, tools=self._schemas)
        except Exception as exc:  # noqa: BLE001 - e.g. an object inside the dict whose methods raise
            parsed = _unreadable(action, exc)
        messages.append(_assistant_record(action, parsed.calls, limit))
        errors = list(parsed.errors)
        if not parsed.calls and not errors:
            errors.append(
                f"no tool call found in your turn. Call one of: {self._names_text}, "
                f"written as {CALL_FORMAT}"
            )
        return parsed.calls, errors

    def _run_calls(
        self, calls: list[ParsedCall], traj: Trajectory
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str], bool]:
        """Run: each call in order (past ``max_calls_per_turn``, a refusal), its record kept.

        Returns the tool messages, the records as info dicts, the calls' errors and whether a
        terminal call succeeded.
        """
        turn = self._turn
        obs: list[dict[str, Any]] = []
        calls_info: list[dict[str, Any]] = []
        call_errors: list[str] = []
        terminated = False
        max_calls = self._max_calls
        for k, call in enumerate(calls):
            if k < max_calls:
                record, content = self._run(call, turn, terminated)
            else:
                record, content = _failed(
                    call.id,
                    short_text(call.name),
                    call.arguments,
                    f"not run: at most {max_calls} tool calls are run per turn; "
                    "call it again in your next turn",
                    turn,
                )
            traj.calls.append(record)
            rec_info = dict(record.__dict__)
            del rec_info["latency_s"]  # wall time differs run to run; info stays deterministic
            calls_info.append(rec_info)
            obs.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
            )
            if record.error is None:
                terminated = terminated or record.terminal
            else:
                call_errors.append(record.error)
        return obs, calls_info, call_errors, terminated

    def _close_turn(
        self,
        obs: list[dict[str, Any]],
        calls_info: list[dict[str, Any]],
        call_errors: list[str],
        turn_errors: list[str],
        terminated: bool,
    ) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        """Close: answer the turn, count it, and score the episode when it ended."""
        traj = self._traj
        assert traj is not None
        invalid = len(call_errors) + len(turn_errors)
        errors = call_errors + turn_errors if turn_errors else call_errors
        if turn_errors:
            # Turn-level problems reach the agent as a user message after any tool results.
            obs.append({"role": "user", "content": _user_note(turn_errors, self._usage)})
        traj.messages.extend(obs)

        self._turn = turn = self._turn + 1
        # Written into the model's __dict__ as pydantic's own field setter does (a trajectory
        # from _construct has every field in its fields-set already): BaseModel.__setattr__
        # costs two Python calls per write on the per-turn path.
        fields = traj.__dict__
        fields["num_turns"] = turn
        fields["invalid_calls"] += invalid
        truncated = not terminated and turn >= self._max_turns
        if truncated and self._one_turn:
            # a one-turn twin's answer is the whole episode: it ends it, nothing was cut short
            terminated, truncated, submitted = True, False, False
        else:
            submitted = terminated
        info: dict[str, Any] = {
            "calls": calls_info,
            "errors": errors,
            "invalid_calls": traj.invalid_calls,
            "turn": turn,
        }
        reward = 0.0
        if terminated or truncated:
            self._end = (terminated, truncated)
            reward = self._finish(submitted, truncated, info)
        return obs, reward, terminated, truncated, info

    def render(self) -> str | None:
        """With ``render_mode="ansi"``, the chat so far as text."""
        if self.render_mode != "ansi":
            return None
        lines = []
        for msg in self.messages:
            text = msg.get("content") or ""
            for call in msg.get("tool_calls") or []:
                fn = call.get("function", {})
                text += f"\n-> {fn.get('name')}({fn.get('arguments')})"
            lines.append(f"[{msg.get('role')}] {text}")
        return "\n".join(lines)

    # -- internals -----------------------------------------------------------------------------
    def _run(self, call: ParsedCall, turn: int, after_terminal: bool) -> tuple[ToolCallRecord, str]:
        """Run one parsed call; return its record and the text the agent sees."""
        name = call.name
        args = call.arguments
        if call.error is not None:
            return _failed(
                call.id, short_text(name), args if args is not None else call.raw, call.error, turn
            )
        if after_terminal:
            return _failed(
                call.id,
                name,
                args,
                f"{name} was not run: a terminal call already ended the episode in this turn; "
                "only one terminal call is allowed",
                turn,
            )
        tool = self._tools.get(name)
        if tool is None:
            shown = short_text(name)
            # names far longer than any tool's are no typo of one; difflib is quadratic in them
            close = difflib.get_close_matches(name, self._tools, n=1) if len(name) <= 100 else []
            hint = f" Did you mean {close[0]!r}?" if close else ""
            return _failed(
                call.id,
                shown,
                args,
                f"unknown tool {shown!r}.{hint} Available tools: {self._names_text}",
                turn,
            )
        started = time.perf_counter()
        try:
            kwargs = tool.validate(args)
            submission = to_jsonable(kwargs) if tool.terminal else None
            result = tool.run(kwargs, self._hidden)
        except ToolError as exc:
            return _failed(call.id, name, args, str(exc), turn, time.perf_counter() - started)
        except Exception as exc:  # a bug in the tool, not the agent's fault: log it, tell the agent
            logger.warning("tool %s raised %s on %r", name, type(exc).__name__, args, exc_info=True)
            return _failed(
                call.id,
                name,
                args,
                f"{name} failed with an internal error ({type(exc).__name__}); this is not your "
                "fault. Try other arguments or another tool",
                turn,
                time.perf_counter() - started,
            )
        latency = time.perf_counter() - started
        result, text = self._result_text(name, result)
        if tool.terminal:
            self._traj.submission = submission  # type: ignore[union-attr]
        record = _construct(
            ToolCallRecord,
            {
                "id": call.id,
                "name": name,
                "arguments": args,
                "ok": True,
                "error": None,
                "result": result,
                "terminal": tool.terminal,
                "turn": turn,
                "latency_s": latency,
            },
        )
        return record, text

    def _result_text(self, name: str, result: Any) -> tuple[Any, str]:
        """A tool's result as the trajectory keeps it, and the text the agent sees (cut at
        ``max_result_chars``)."""
        try:
            kind = type(result)
            text = (
                result.json_text() if kind is FrozenDict or kind is FrozenList else _dumps(result)
            )
            if kind not in _SHAREABLE:
                # the episode's own copy: the tool may have handed out shared, mutable data
                result = from_json(text)
        except Exception as exc:  # e.g. a lone surrogate or a cycle
            logger.warning("tool %s returned data that is not JSON: %s", name, exc)
            text = json.dumps(_describe(result), ensure_ascii=False)
            result = text
        if len(text) > self._max_result:
            text = (
                f"{text[: self._max_result]}... [result cut at {self._max_result} of {len(text)} "
                "characters; ask for less]"
            )
        return result, text

    def _fetch_world(self) -> Any:
        """The twin's shared world, fetched on the first tool call that needs it."""
        world = self._world
        if world is None:
            world = self._world = self._twin.world
        return world

    def truncate(self, note: str | None = None) -> tuple[float, dict[str, Any]]:
        """End the episode now, cut short, and score it as the twin scores a truncated episode.

        For a caller that runs out of something the env does not count (a trainer's token
        budget, a harness's time): the trajectory is marked ``truncated``, scored and given its
        outcome exactly as when the turn budget runs out, and later steps are late steps.

        Args:
            note: Added to the reward's notes (e.g. ``"episode cut at max_episode_tokens"``).

        Returns:
            ``(reward, info)`` with ``info`` as a last ``step`` gives it (``reward``,
            ``outcome``, ``trajectory``).

        Raises:
            ResetNeeded: no episode was started.
            gymnasium.error.Error: the episode has already ended.
        """
        if self._traj is None:
            raise ResetNeeded("call env.reset() before env.truncate()")
        if self._done:
            raise gym.error.Error("the episode has already ended; truncate() ends a running one")
        info: dict[str, Any] = {
            "calls": [],
            "errors": [],
            "invalid_calls": self._traj.invalid_calls,
            "turn": self._turn,
        }
        self._end = (False, True)
        reward = self._finish(False, True, info)
        if note:
            self._traj.reward_notes.append(note)
            info["reward"]["notes"].append(note)
        return reward, info

    def _finish(self, terminated: bool, truncated: bool, info: dict[str, Any]) -> float:
        traj = self._traj
        case = self._case
        assert traj is not None and case is not None
        self._done = True
        traj.terminated = terminated
        traj.truncated = truncated
        traj.timings["tools"] = sum(c.latency_s for c in traj.calls)
        twin = self._twin
        result = (
            twin.score(traj, case, defer_group=True) if twin.needs_group else twin.score(traj, case)
        )
        total = float(result.total)
        traj.reward = total
        traj.components = dict(result.components)
        traj.weighted = dict(result.weighted)
        traj.reward_notes = list(result.notes)
        deferred = list(getattr(result, "deferred", None) or ())
        if deferred:  # provisional until Twin.score_groups scores the episode with its group
            traj.info["deferred"] = {"terms": deferred, "reward_notes": len(traj.reward_notes)}
        # the trajectory keeps a read-only outcome (it may hold the case's own truth); the info
        # gets a fresh mutable copy, like every other info
        outcome = freeze(self._twin.outcome(traj, case))
        traj.info["outcome"] = outcome
        info["reward"] = {
            "total": total,
            "components": dict(traj.components),
            "weighted": dict(traj.weighted),
            "notes": list(traj.reward_notes),
        }
        info["outcome"] = thaw(outcome)
        info["trajectory"] = traj
        return total

    def _late_step(self) -> tuple[list[dict[str, Any]], float, bool, bool, dict[str, Any]]:
        # The trajectory is scored and handed out already: count the mistake, change nothing.
        traj = self._traj
        assert traj is not None
        self._late_invalid += 1
        if traj.terminated:
            how = "a terminal call succeeded"
        elif traj.truncated:
            how = "the turn budget ran out"
        else:
            how = "this twin takes one answer per episode"
        error = f"the episode has ended ({how}); call reset() to start a new one"
        terminated, truncated = self._end
        return (
            [{"role": "user", "content": error}],
            0.0,
            terminated,
            truncated,
            {
                "calls": [],
                "errors": [error],
                "invalid_calls": traj.invalid_calls + self._late_invalid,
                "turn": self._turn,
            },
        )


class _Hidden(Mapping[str, Any]):
    """An episode's hidden tool parameters (``world``, ``state``, ``task``) for
    :meth:`twin.tools.Tool.run`, read from the env when a tool asks: one small object per env
    (not a dict per episode), and ``world`` is fetched on first use, so a twin whose tools never
    read it never builds it."""

    __slots__ = ("_env",)

    def __init__(self, env: TwinEnv) -> None:
        self._env = env

    def __getitem__(self, name: str) -> Any:
        env = self._env
        if name == "state":
            return env._state
        if name == "task":
            return env._case.task if env._case is not None else None
        if name == "world":
            return env._fetch_world()
        return None

    def __iter__(self) -> Iterator[str]:
        return iter(("world", "state", "task"))

    def __len__(self) -> int:
        return 3


_setattr = object.__setattr__

#: Per model class, the one ``__pydantic_fields_set__`` its env-built instances share. It holds
#: every field, so pydantic's ``add`` on an assignment never changes it; a set per instance was
#: 1.2 KB per trajectory and 0.7 KB per call record.
_ALL_FIELDS: dict[type[Any], set[str]] = {}


def _all_fields(cls: type[Any]) -> set[str]:
    fields = _ALL_FIELDS.get(cls)
    if fields is None:
        fields = _ALL_FIELDS[cls] = set(cls.model_fields)
    return fields


def _construct(cls: type[Any], values: dict[str, Any]) -> Any:
    """``cls.model_construct(**values)`` without its per-field alias checks.

    ``values`` must hold every field; the env builds them itself, so nothing needs validating.
    This keeps a tool step a few microseconds cheaper than ``model_construct``.
    """
    obj = object.__new__(cls)
    _setattr(obj, "__dict__", values)
    _setattr(obj, "__pydantic_fields_set__", _ALL_FIELDS.get(cls) or _all_fields(cls))
    _setattr(obj, "__pydantic_extra__", None)
    _setattr(obj, "__pydantic_private__", None)
    return obj


def _fields_filler(cls: type[Any], given: tuple[str, ...]) -> Any:
    """A function ``(*values) -> cls`` taking the fields ``given`` in that order and setting every
    other field to the model's declared default (a default factory gives each instance its own
    container), read from the model itself, so the env never lists the fields by hand.

    Written once per call site as one dict display, as :mod:`dataclasses` writes ``__init__``: a
    loop over the fields on every reset costs about 1 us, as much as the rest of the reset.
    """
    names = list(cls.model_fields)
    unknown = [g for g in given if g not in cls.model_fields]
    missing = [n for n, f in cls.model_fields.items() if f.is_required() and n not in given]
    if unknown or missing:
        raise TypeError(f"{cls.__name__}: unknown fields {unknown}, required fields {missing}")
    scope: dict[str, Any] = {
        "_new": object.__new__,
        "_setattr": _setattr,
        "_cls": cls,
        "_fields": _all_fields(cls),
    }
    items = []
    for i, name in enumerate(names):
        field = cls.model_fields[name]
        if name in given:
            value = f"v{given.index(name)}"
        elif field.default_factory in (list, dict):
            value = "[]" if field.default_factory is list else "{}"
        elif field.default_factory is not None:
            scope[f"_f{i}"] = field.default_factory
            value = f"_f{i}()"
        else:
            scope[f"_d{i}"] = field.default
            value = f"_d{i}"
        items.append(f"{name!r}: {value}")
    params = ", ".join(f"v{j}" for j in range(len(given)))
    # _construct's body written out: one Python call fewer on every reset
    source = (
        f"def fill({params}):\n"
        f"    values = {{{', '.join(items)}}}\n"
        "    obj = _new(_cls)\n"
        "    _setattr(obj, '__dict__', values)\n"
        "    _setattr(obj, '__pydantic_fields_set__', _fields)\n"
        "    _setattr(obj, '__pydantic_extra__', None)\n"
        "    _setattr(obj, '__pydantic_private__', None)\n"
        "    return obj\n"
    )
    exec(compile(source, f"<{cls.__name__} filler>", "exec"), scope)
    return scope["fill"]


#: A new episode's trajectory from the fields :meth:`TwinEnv.reset` knows, the rest at defaults.
_new_trajectory = _fields_filler(
    Trajectory, ("twin", "case_id", "split", "index", "case_kind", "messages")
)


def _failed(
    call_id: str, name: str, arguments: Any, error: str, turn: int, latency: float = 0.0
) -> tuple[ToolCallRecord, str]:
    record = _construct(
        ToolCallRecord,
        {
            "id": call_id,
            "name": name,
            "arguments": arguments,
            "ok": False,
            "error": error,
            "result": None,
            "terminal": False,
            "turn": turn,
            "latency_s": latency,
        },
    )
    return record, f"Error: {error}"


def _read_options(options: Any, twin: Twin) -> tuple[str, int | None]:
    """``(split, index)`` out of ``reset``'s options, or a CaseError saying what is allowed."""
    allowed = 'reset options must be a dict {"split": <str>, "index": <int>} (both optional)'
    if options is None:
        return "train", None
    if not isinstance(options, Mapping):
        raise CaseError(
            f"{allowed}, got {short_text(_describe(options))} ({type(options).__name__})"
        )
    unknown = [k for k in options if k not in _OPTIONS]
    if unknown:
        raise CaseError(
            f"{allowed}; unknown option(s) {short_text(', '.join(map(_describe, unknown)))}"
        )
    split = options.get("split", "train")
    if split is None:
        split = "train"
    if not isinstance(split, str):
        raise CaseError(
            f"{allowed}; split must be one of {', '.join(twin.splits)}, got "
            f"{short_text(_describe(split))} ({type(split).__name__})"
        )
    index = options.get("index")
    if index is not None and not isinstance(index, int):
        # numpy integers from vector envs and samplers are integers too; a numpy array has
        # __index__ as well, but it raises TypeError for anything but a 0-d integer array
        wrong = CaseError(
            f"{allowed}; index must be an integer, got {short_text(_describe(index))} "
            f"({type(index).__name__})"
        )
        if isinstance(index, bool) or not hasattr(type(index), "__index__"):
            raise wrong
        try:
            index = operator.index(index)
        except (TypeError, ValueError):
            raise wrong from None
    if isinstance(index, bool):
        raise CaseError(f"{allowed}; index must be an integer, got {index!r}")
    if index is not None and type(index) is not int:
        index = int(index)  # an int subclass (e.g. IntEnum) must not reach the case memo
    return split, index


def _describe(value: Any) -> str:
    """``repr(value)`` that never raises (deep nesting, huge ints, broken ``__repr__``)."""
    try:
        return repr(value)
    except BaseException:  # noqa: BLE001 - RecursionError, ValueError, a user __repr__ ...
        return f"<{type(value).__name__} that cannot be shown>"


def _plain_action(action: Any) -> Any:
    """The action with a str or dict subclass turned into the plain type (their overridden
    methods must not run inside the env); anything else as it came. The env calls it only for
    an action that is not a plain str or dict."""
    if isinstance(action, str):
        return str.__str__(action)
    if isinstance(action, dict):
        return dict(dict.items(action))
    return action


def _unreadable(action: Any, exc: Exception) -> ParsedTurn:
    """The turn error for an action :func:`parse_tool_calls` raised on (it could not foresee
    ``action``, e.g. an object inside the dict whose methods raise)."""
    logger.warning("unreadable action of type %s: %s", type(action).__name__, type(exc).__name__)
    return ParsedTurn(
        "",
        errors=[
            "the action could not be read; send the assistant's text (str) or an assistant "
            f"message dict with JSON data only, e.g. {CALL_FORMAT}"
        ],
    )


# What one scalar of a dict action counts, at least: a number, true, null, ...
_SCALAR_SIZE = 4


def _action_size(action: Any, limit: int) -> int:
    """Characters the agent sent: the text, or every key and value of a message dict (names, ids,
    arguments, unknown fields alike). Walks the dict without recursion and stops once past
    ``limit``, so depth, size and cycles cost at most ``limit`` steps."""
    if type(action) is str:
        return len(action)
    if type(action) is not dict:
        return 0
    size = _message_size(action, limit)
    if size is not None:
        return size
    size = 0
    stack: list[Any] = [action]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        item = pop()
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, dict):
            size += 2
            for key, value in dict.items(item):
                push(key)
                push(value)
        elif isinstance(item, (list, tuple)):
            size += 2
            extend(item)
        else:
            size += _SCALAR_SIZE
        if size > limit:
            break
    return size


def _message_size(msg: dict[str, Any], limit: int) -> int | None:
    """:func:`_action_size` of the usual message (string fields, ``tool_calls`` of
    ``{"id", "type", "function": {"name", "arguments"}}``) in one flat pass, counted the same
    way; None for any other shape."""
    size = 2
    for key, value in msg.items():
        if type(key) is not str:
            return None
        size += len(key)
        if type(value) is str:
            size += len(value)
        elif value is None:
            size += _SCALAR_SIZE
        elif type(value) is list:
            size += 2
            for call in value:
                if type(call) is not dict:
                    return None
                size += 2
                for ckey, cval in call.items():
                    if type(ckey) is not str:
                        return None
                    size += len(ckey)
                    if type(cval) is str:
                        size += len(cval)
                    elif type(cval) is dict:
                        size += 2
                        for fkey, fval in cval.items():
                            if type(fkey) is not str or type(fval) is not str:
                                return None
                            size += len(fkey) + len(fval)
                    else:
                        return None
                if size > limit:
                    return size
        else:
            return None
    return size


def _assistant_record(action: Any, calls: list[ParsedCall] | None, limit: int) -> dict[str, Any]:
    """The assistant message as stored in the chat: raw text kept exactly, dicts normalised.

    A dict's ``weight`` (0 or 1, as in OpenAI's fine-tuning format) is kept: a scripted teacher
    marks a turn 0 when it is there to be answered, not imitated (``trainer.rows.render_row``
    gives it no loss)."""
    if isinstance(action, str):
        return {"role": "assistant", "content": action if len(action) <= limit else action[:limit]}
    if not isinstance(action, dict):
        return {"role": "assistant", "content": f"<invalid action of type {type(action).__name__}>"}
    content = action.get("content")
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": str.__str__(content[:limit]) if isinstance(content, str) else None,
    }
    if calls and isinstance(action.get("tool_calls"), list) and action["tool_calls"]:
        msg["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name[:limit], "arguments": c.raw[:limit]},
            }
            for c in calls
        ]
    if action.get("weight") in (0, 1) and not isinstance(action.get("weight"), bool):
        msg["weight"] = int(action["weight"])
    return msg


def _user_note(errors: list[str], usage: str) -> str:
    return "Your last turn had a problem: " + " | ".join(errors) + f". Tools: {usage}"

"""Adapters: a reward as TRL ``reward_funcs``, and per-component values flattened for logging.

TRL's ``GRPOTrainer`` calls each reward function as ``f(prompts, completions, **columns)``
where ``columns`` are the dataset's other columns; it logs each function under its
``__name__``. :func:`as_trl_reward` parses the tool calls in each completion (with the same
parser the environment uses), builds a :class:`twin.Trajectory` ending in the terminal call,
and scores it against the row's ``truth`` column::

    from trl import GRPOTrainer
    reward_fn = as_trl_reward(make_catalog_reward(world.exists))
    funcs, weights = as_trl_reward_funcs(make_catalog_reward(world.exists))  # + components
    GRPOTrainer(model, reward_funcs=funcs, args=GRPOConfig(reward_weights=weights), ...)

For logging elsewhere, :func:`component_metrics` turns results into ``rewards/<term>`` means.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from rewards._reward import Reward, RewardResult
from twin.cases import Case
from twin.trajectory import ToolCallRecord, Trajectory

__all__ = [
    "TRLRewardFunc",
    "as_trl_reward",
    "as_trl_reward_funcs",
    "completion_trajectory",
    "component_metrics",
    "flatten_result",
    "terminal_tool_names",
]

#: TRL's reward function signature.
TRLRewardFunc = Callable[..., list[float]]


def flatten_result(result: RewardResult, prefix: str = "rewards/") -> dict[str, float]:
    """``{"rewards/total": .., "rewards/<component>": ..}`` for one result."""
    return result.metrics(prefix)


def component_metrics(
    results: Iterable[RewardResult], prefix: str = "rewards/"
) -> dict[str, float]:
    """Mean total and mean of every component over ``results`` (a component missing from a
    result is left out of that mean, not counted as 0)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for r in results:
        for k, v in flatten_result(r, prefix).items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
    return {k: sums[k] / counts[k] for k in sums}


def _assistant_turns(completion: Any) -> list[Any]:
    if isinstance(completion, str):
        return [completion]
    if isinstance(completion, dict):
        return [completion]
    if isinstance(completion, Sequence):
        return [
            m
            for m in completion
            if isinstance(m, dict) and m.get("role", "assistant") == "assistant"
        ]
    return [completion]


def completion_trajectory(
    completion: Any,
    case: Case,
    *,
    terminal_tools: Iterable[str] = ("submit",),
    tool_names: Iterable[str] | None = None,
    validate: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None,
    completion_tokens: int = 0,
) -> Trajectory:
    """The episode a single completion amounts to (tool calls parsed, none executed).

    A call is invalid when it cannot be parsed, names an unknown tool (when ``tool_names`` is
    given), fails ``validate(name, arguments)`` (which returns the cleaned arguments or raises),
    or is a terminal call after the first successful one; a turn with no call also counts.

    Args:
        completion: Text, an assistant message dict, or a list of messages (conversational).
        case: The case the completion answers.
        terminal_tools: Names of terminal tools (the first valid one is the submission).
        tool_names: Every known tool name, or None to accept any name.
        validate: Optional argument validator, e.g. ``lambda n, a: twin.tool(n).validate(a)``.
        completion_tokens: Length of the completion in tokens, when known.
    """
    from twin.parsing import parse_tool_calls  # the environment's own parser

    terminal = set(terminal_tools)
    known = set(tool_names) if tool_names is not None else None
    calls: list[ToolCallRecord] = []
    submission: dict[str, Any] | None = None
    invalid = 0
    turns = _assistant_turns(completion)
    for i, turn in enumerate(turns):
        parsed = parse_tool_calls(turn, turn=i)
        if not parsed.calls:
            invalid += 1
            continue
        for c in parsed.calls:
            error = c.error
            args = c.arguments
            if error is None and known is not None and c.name not in known:
                error = f"unknown tool {c.name!r}"
            if error is None and validate is not None and args is not None:
                try:
                    args = validate(c.name, args)
                except Exception as exc:  # a validation failure is the agent's mistake, counted
                    error = str(exc)
            if error is None and c.name in terminal and submission is not None:
                error = "a second terminal call"
            ok = error is None and args is not None
            is_terminal = ok and c.name in terminal
            if is_terminal:
                submission = dict(args)  # type: ignore[arg-type]
            invalid += 0 if ok else 1
            calls.append(
                ToolCallRecord(
                    id=c.id,
                    name=c.name,
                    arguments=args if args is not None else c.raw,
                    ok=ok,
                    error=error,
                    terminal=is_terminal,
                    turn=i,
                )
            )
    return Trajectory(
        twin=case.twin,
        case_id=case.id,
        split=case.split,
        index=case.index,
        case_kind=case.kind,
        policy="trl",
        calls=calls,
        submission=submission,
        invalid_calls=invalid,
        num_turns=len(turns),
        terminated=submission is not None,
        completion_tokens=completion_tokens,
    )


def _truth(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise TypeError(
            f"the truth column must hold a dict or its JSON text, got {type(value).__name__}"
        )
    return value


def _row(kwargs: dict[str, Any], key: str, i: int, default: Any = None) -> Any:
    col = kwargs.get(key)
    return (
        col[i]
        if isinstance(col, Sequence) and not isinstance(col, str) and len(col) > i
        else default
    )


def _score_all(
    reward: Callable[[Trajectory, Case], Any],
    completions: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    twin: Any,
    twin_name: str,
    truth_column: str,
    terminal_tools: Iterable[str],
) -> list[RewardResult]:
    results = []
    names = [t.name for t in twin.tools] if twin is not None and hasattr(twin, "tools") else None
    validate = (
        (lambda n, a: twin.tool(n).validate(a))
        if twin is not None and hasattr(twin, "tool")
        else None
    )
    for i, completion in enumerate(completions):
        split = _row(kwargs, "split", i, "train")
        index = int(_row(kwargs, "index", i, 0))
        if _row(kwargs, truth_column, i) is not None:
            case = Case(
                twin=twin_name,
                split=split,
                index=index,
                kind=_row(kwargs, "kind", i, "default") or "default",
                task={},
                truth=_truth(_row(kwargs, truth_column, i)),
            )
        elif twin is not None:
            case = twin.case(split, index)
        else:
            raise KeyError(
                f"row {i}: no {truth_column!r} column; add the case truth to the dataset or pass "
                "twin= with 'split' and 'index' columns"
            )
        ids = _row(kwargs, "completion_ids", i)
        traj = completion_trajectory(
            completion,
            case,
            terminal_tools=terminal_tools,
            tool_names=names,
            validate=validate,
            completion_tokens=len(ids) if ids is not None else 0,
        )
        raw = reward(traj, case)
        results.append(
            raw
            if isinstance(raw, RewardResult)
            else RewardResult.model_validate(raw, from_attributes=True)
        )
    return results


def terminal_tool_names(
    twin: Any = None, terminal_tools: Iterable[str] | None = None
) -> tuple[str, ...]:
    """The terminal tools a completion is scored by: ``terminal_tools`` when given, else the
    twin's ``@tool(terminal=True)`` tools, else ``("submit",)`` (no twin to ask).

    Raises:
        ValueError: the twin declares no terminal tool (nothing could ever be submitted).
    """
    if terminal_tools is not None:
        return tuple(terminal_tools)
    tools = getattr(twin, "tools", None) if twin is not None else None
    if tools is None:
        return ("submit",)
    names = tuple(t.name for t in tools if getattr(t, "terminal", False))
    if not names:
        raise ValueError(
            f"twin {getattr(twin, 'name', twin)!r} has no terminal tool (@tool(terminal=True)); "
            "pass terminal_tools= with the tool whose call ends an episode"
        )
    return names


def as_trl_reward(
    reward: Callable[[Trajectory, Case], Any],
    *,
    twin: Any = None,
    name: str | None = None,
    truth_column: str = "truth",
    terminal_tools: Iterable[str] | None = None,
    component: str | None = None,
) -> TRLRewardFunc:
    """``reward`` as a TRL reward function ``f(prompts, completions, **kwargs) -> list[float]``.

    Args:
        reward: A :class:`Reward` or any ``(trajectory, case) -> RewardResult``.
        twin: Optional twin: its tool names, terminal tools and argument validation are used,
            and rows without a truth column are looked up with ``twin.case(split, index)``.
        name: ``__name__`` of the function (TRL logs under it); default the reward's name.
        truth_column: Dataset column holding the case truth (dict or JSON text).
        terminal_tools: Names of terminal tools (default: :func:`terminal_tool_names`, the
            twin's ``@tool(terminal=True)`` tools, or ``("submit",)`` without a twin).
        component: Return this component instead of the total (for logging with weight 0).
    """
    twin_name = getattr(twin, "name", None) or "twin"
    terminal = terminal_tool_names(twin, terminal_tools)

    def reward_func(
        prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
    ) -> list[float]:
        results = _score_all(
            reward,
            completions,
            kwargs,
            twin=twin,
            twin_name=twin_name,
            truth_column=truth_column,
            terminal_tools=terminal,
        )
        if component is None:
            return [r.total for r in results]
        return [r.components.get(component, math.nan) for r in results]

    base = name or getattr(reward, "name", None) or getattr(reward, "__name__", "reward")
    reward_func.__name__ = base if component is None else f"{base}/{component}"
    reward_func.__qualname__ = reward_func.__name__
    return reward_func


def as_trl_reward_funcs(
    reward: Reward,
    *,
    twin: Any = None,
    truth_column: str = "truth",
    terminal_tools: Iterable[str] | None = None,
) -> tuple[list[TRLRewardFunc], list[float]]:
    """The total (weight 1) plus one function per term and penalty (weight 0: logged only).

    Pass the lists as ``reward_funcs`` and ``GRPOConfig(reward_weights=...)``; TRL then trains on
    the total and logs ``rewards/<reward>/<term>`` for every component. ``terminal_tools`` as in
    :func:`as_trl_reward` (default: the twin's terminal tools).
    """
    terminal_tools = terminal_tool_names(twin, terminal_tools)
    funcs = [
        as_trl_reward(reward, twin=twin, truth_column=truth_column, terminal_tools=terminal_tools)
    ]
    names = [t.name for t in reward.terms] + [p.name for p in reward.penalties]
    for n in names:
        funcs.append(
            as_trl_reward(
                reward,
                twin=twin,
                truth_column=truth_column,
                terminal_tools=terminal_tools,
                component=n,
            )
        )
    return funcs, [1.0] + [0.0] * len(names)

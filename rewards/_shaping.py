"""Ready-made penalties, bonuses and gates: invalid calls, turn cost, soft overlong, useful
tools."""

from __future__ import annotations

import json
from typing import Any

from rewards._reward import Gate, Penalty
from twin.errors import ConfigError

__all__ = [
    "completion_tokens",
    "invalid_call_penalty",
    "overlong_fraction",
    "overlong_penalty",
    "submitted_gate",
    "turn_cost",
    "useful_tool_bonus",
]


def invalid_call_penalty(
    per_call: float = 0.01, cap: float | None = 0.05, *, name: str = "invalid_calls"
) -> Penalty:
    """``per_call`` for each invalid call (``trajectory.invalid_calls``), at most ``cap`` in all."""
    return Penalty(
        name=name,
        fn=lambda trajectory, case: float(trajectory.invalid_calls),
        per_unit=per_call,
        cap=cap,
        description=f"{per_call:g} per invalid tool call or turn without a call"
        + (f", at most {cap:g}" if cap is not None else ""),
    )


def turn_cost(
    per_turn: float, *, free_turns: int = 0, cap: float | None = None, name: str = "turn_cost"
) -> Penalty:
    """``per_turn`` for each assistant turn after the first ``free_turns``, at most ``cap``."""
    if free_turns < 0:
        raise ConfigError(f"turn_cost free_turns must be >= 0, got {free_turns}")
    return Penalty(
        name=name,
        fn=lambda trajectory, case: float(max(0, trajectory.num_turns - free_turns)),
        per_unit=per_turn,
        cap=cap,
        description=f"{per_turn:g} per turn after {free_turns}",
    )


def completion_tokens(trajectory: Any) -> int:
    """Tokens the agent generated: ``completion_tokens``, or the sum over ``token_turns``."""
    if trajectory.completion_tokens:
        return int(trajectory.completion_tokens)
    return sum(len(t.completion_ids) for t in trajectory.token_turns)


def overlong_fraction(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment as a fraction in ``[0, 1]``.

    0 up to ``max_tokens - buffer``; rises linearly to 1 at ``max_tokens``; 1 beyond.
    """
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length >= max_tokens:
        return 1.0
    return (length - start) / buffer


def overlong_penalty(
    max_tokens: int, buffer: int, penalty: float = 1.0, *, name: str = "overlong"
) -> Penalty:
    """DAPO-style soft overlong penalty over the last ``buffer`` tokens before ``max_tokens``.

    Args:
        max_tokens: The generation budget (``L_max``).
        buffer: Length of the linear ramp (``L_cache``); 0 gives a hard cut at ``max_tokens``.
        penalty: The penalty at and beyond ``max_tokens``.
        name: Component name.

    A recipe with ``algorithm.overlong_buffer > 0`` charges length itself and refuses a twin
    whose reward holds this penalty (:attr:`Penalty.overlong`).
    """
    if max_tokens <= 0 or buffer < 0 or buffer > max_tokens:
        raise ConfigError(
            "overlong_penalty needs 0 <= buffer <= max_tokens and max_tokens > 0, got "
            f"max_tokens={max_tokens}, buffer={buffer}"
        )

    def units(trajectory: Any, case: Any) -> float:
        n = completion_tokens(trajectory)
        if buffer == 0:
            return 1.0 if n > max_tokens else 0.0
        return overlong_fraction(n, max_tokens, buffer)

    return Penalty(
        name=name,
        fn=units,
        per_unit=penalty,
        cap=None,
        description=f"linear over the last {buffer} tokens before {max_tokens}, up to {penalty:g}",
        overlong=True,
    )


def _useful(result: Any) -> bool:
    return result not in (None, "", [], {}) and not (
        isinstance(result, dict) and result.get("error")
    )


def useful_tool_bonus(
    per_call: float = 0.02, cap: float = 0.1, *, name: str = "useful_tools"
) -> Penalty:
    """A small capped bonus for distinct non-terminal tool calls that returned data.

    Repeating the same call with the same arguments counts once, so the bonus cannot be farmed.
    """

    def units(trajectory: Any, case: Any) -> float:
        seen: set[tuple[str, str]] = set()
        for c in trajectory.calls:
            if c.ok and not c.terminal and _useful(c.result):
                seen.add((c.name, json.dumps(c.arguments, sort_keys=True, default=str)))
        return float(len(seen))

    return Penalty(
        name=name,
        fn=units,
        per_unit=per_call,
        cap=cap,
        bonus=True,
        description=f"{per_call:g} per distinct useful tool call, at most {cap:g}",
    )


def submitted_gate(
    *,
    name: str = "submitted",
    fail_values: dict[str, float] | None = None,
    total: float | None = None,
) -> Gate:
    """A gate that fails when the episode has no valid terminal call (``submission is None``)."""
    return Gate(
        name=name,
        check=lambda trajectory, case: trajectory.submission is not None,
        fail_values=fail_values or {},
        total=total,
        description="no valid submission before the episode ended",
    )

"""``submission_trajectory``: an episode that ends in a given submission, built without a twin.

Its own module because the property checks (``rewards.properties``), the hypothesis strategies
(``rewards.strategies``) and the rollout-testing kit (``rewards/testing/``) all build episodes this
way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twin.cases import Case
from twin.trajectory import ToolCallRecord, Trajectory

__all__ = ["submission_trajectory"]


def submission_trajectory(
    case: Case,
    submission: Mapping[str, Any] | None,
    *,
    invalid_calls: int = 0,
    num_turns: int | None = None,
    policy: str = "synthetic",
    twin: str | None = None,
    case_kind: str | None = None,
    completion_tokens: int = 0,
) -> Trajectory:
    """An episode of ``case`` that ends in ``submission`` (None: no valid submit), built directly.

    Shared by the property checks and the rollout files' shorthand cases.

    Args:
        case: The case the episode ran on.
        submission: The terminal call's arguments, or None for an episode with no valid submit.
        invalid_calls: Failed calls before the end.
        num_turns: Assistant turns; default ``invalid_calls`` plus one for the submit.
        policy: The policy name recorded.
        twin: The twin name recorded (default ``case.twin``).
        case_kind: The case kind recorded (default ``case.kind``).
        completion_tokens: Generated tokens (for overlong penalties).
    """
    sub = dict(submission) if submission is not None else None
    calls = []
    if sub is not None:
        calls.append(
            ToolCallRecord(id="call_submit", name="submit", arguments=sub, ok=True, terminal=True)
        )
    return Trajectory(
        twin=case.twin if twin is None else twin,
        case_id=case.id,
        split=case.split,
        index=case.index,
        case_kind=case.kind if case_kind is None else case_kind,
        policy=policy,
        calls=calls,
        submission=sub,
        invalid_calls=invalid_calls,
        num_turns=num_turns
        if num_turns is not None
        else invalid_calls + (1 if sub is not None else 0),
        terminated=sub is not None,
        completion_tokens=completion_tokens,
    )

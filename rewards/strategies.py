"""Hypothesis strategies for reward property tests that hold for any twin.

:func:`twin_cases` draws the cases a twin makes; :func:`trajectories` draws episodes of a case
that end in a submission drawn from a strategy the caller gives (None: no valid submit). A
twin's own answer format (its truths and submissions) belongs with the twin: the catalog's are in
``envs/catalog/strategies.py``.

Needs ``hypothesis`` (the ``dev`` extra).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from rewards._submission import submission_trajectory
from twin.cases import Case
from twin.trajectory import Trajectory

__all__ = ["trajectories", "twin_cases"]


def trajectories(
    case: Case,
    submissions: st.SearchStrategy[dict[str, Any] | None],
    *,
    max_invalid_calls: int = 10,
) -> st.SearchStrategy[Trajectory]:
    """Episodes of ``case`` ending in a drawn submission (None: no valid submit) with 0..N invalid
    calls."""
    return st.builds(
        lambda sub, n: submission_trajectory(case, sub, invalid_calls=n),
        submissions,
        st.integers(0, max_invalid_calls),
    )


def twin_cases(
    twin: Any, splits: tuple[str, ...] | None = None, max_index: int = 1_000
) -> st.SearchStrategy[Case]:
    """Cases the twin makes: ``twin.case(split, index)`` over its splits (first ``max_index`` of
    each)."""
    names = tuple(splits or twin.splits)
    return st.sampled_from(names).flatmap(
        lambda s: st.integers(0, min(twin.num_cases(s), max_index) - 1).map(
            lambda i: twin.case(s, i)
        )
    )

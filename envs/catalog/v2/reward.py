"""Catalog v2's reward: category, attributes and a decision scored by a cost matrix.

::

    R = clip(0.3*C + 0.3*A + 0.4*P - penalties, -1.0, 1.0),   P = 1 - regret(truth, decision)

C and A are v0's (hierarchical category credit, attribute F1). The decision's cost, in units of
one lost sale (:data:`OPERATING_COSTS`, rows: the truth the written rules give, columns: the
decision)::

    truth \\ decision | ok  | counterfeit | prohibited | escalate
    -----------------+-----+-------------+------------+---------
    ok               | 0   | 2           | 2          | 1.5       a false alarm costs the sale (2);
    counterfeit      | 6   | 0           | 0.5        | 1.5       a review costs its fee (1.5)
    prohibited       | 6   | 0.5         | 0          | 1.5       whatever the truth; a miss 6
    escalate         | 4.5 | 3           | 3          | 1.5       (+1 for a wrong document)

``escalate`` truth is a listing the rules call unproven: passing it unreviewed risks a miss
(4.5), removing it without proof is a false alarm plus an appeal (3), a review costs its fee.
``regret`` is the cost minus the cheapest decision's cost for that truth (so every case's best
decision scores P = 1 and the reward's maximum is 1.0): :data:`REGRET`. Cost per 1,000 listings
(:func:`operating_cost`) uses the operating costs themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rewards import (
    CostMatrix,
    Reward,
    Scored,
    attribute_f1,
    category_credit,
    invalid_call_penalty,
    submitted_gate,
    term,
)

__all__ = [
    "CLIP",
    "OPERATING_COSTS",
    "REGRET",
    "WRONG_REQUEST",
    "make_reward_v2",
    "operating_cost",
    "regret",
]

OPERATING_COSTS: dict[str, dict[str, float]] = {
    "ok": {"ok": 0.0, "counterfeit": 2.0, "prohibited": 2.0, "escalate": 1.5},
    "counterfeit": {"ok": 6.0, "counterfeit": 0.0, "prohibited": 0.5, "escalate": 1.5},
    "prohibited": {"ok": 6.0, "counterfeit": 0.5, "prohibited": 0.0, "escalate": 1.5},
    "escalate": {"ok": 4.5, "counterfeit": 3.0, "prohibited": 3.0, "escalate": 1.5},
}
#: Extra cost of an escalation that asks for the wrong document (the reviewer must ask again).
WRONG_REQUEST = 1.0
#: Regret matrix: operating cost minus the row's minimum (zero diagonal).
REGRET = CostMatrix(
    {t: {d: c - min(row.values()) for d, c in row.items()} for t, row in OPERATING_COSTS.items()}
)
CLIP: tuple[float, float] = (-1.0, 1.0)
WEIGHTS = {"category": 0.3, "attributes": 0.3, "policy": 0.4}


def _norm(value: Any) -> str | None:
    return value.strip().lower() if isinstance(value, str) else None


def operating_cost(
    truth: str, request: str | None, decision: str | None, asked: str | None
) -> float:
    """The cost of ``decision`` (asking for ``asked``) on a listing whose truth is ``truth``."""
    if decision not in OPERATING_COSTS:
        return max(OPERATING_COSTS[truth].values()) + WRONG_REQUEST
    cost = OPERATING_COSTS[truth][decision]
    if decision == "escalate" and truth == "escalate" and asked != request:
        cost += WRONG_REQUEST
    return cost


def regret(truth: str, request: str | None, decision: str | None, asked: str | None) -> float:
    """``operating_cost`` minus the cheapest decision's cost for ``truth``."""
    return operating_cost(truth, request, decision, asked) - min(OPERATING_COSTS[truth].values())


def make_reward_v2(category_exists: Callable[[str], bool]) -> Reward:
    """The v2 reward over a taxonomy (see the module docstring)."""

    @term(low=0.0, high=1.0)
    def category(trajectory: Any, case: Any) -> Scored:
        """Hierarchical credit for the submitted category id (1 = exact)."""
        true_id = case.truth["category_id"]
        sub = trajectory.submission.get("category_id")
        value = category_credit(true_id, sub, category_exists)
        return Scored(value, f"category: submitted {sub!r}, true {true_id!r} -> {value:.4g}")

    @term(low=0.0, high=1.0)
    def attributes(trajectory: Any, case: Any) -> float:
        """F1 over (attribute, value) pairs vs the true required attributes."""
        return attribute_f1(
            case.truth.get("attributes") or {}, trajectory.submission.get("attributes") or {}
        )

    worst = max(max(r.values()) for r in OPERATING_COSTS.values()) + WRONG_REQUEST

    @term(low=1.0 - worst, high=1.0)
    def policy(trajectory: Any, case: Any) -> Scored:
        """1 - regret of the decision (and, for escalate, of the document requested)."""
        sub = trajectory.submission
        truth, req = case.truth["decision"], case.truth.get("request")
        dec, asked = _norm(sub.get("decision")), _norm(sub.get("request"))
        lost = regret(truth, req, dec, asked)
        return Scored(
            1.0 - lost,
            f"policy: true {truth!r} ({req}), submitted {dec!r} ({asked}) -> regret {lost:g}",
        )

    return Reward(
        {
            category: WEIGHTS["category"],
            attributes: WEIGHTS["attributes"],
            policy: WEIGHTS["policy"],
        },
        penalties=[invalid_call_penalty(0.01, cap=0.05)],
        gates=[
            submitted_gate(
                fail_values={"category": 0.0, "attributes": 0.0, "policy": 1.0 - worst},
                total=CLIP[0],
            )
        ],
        clip=CLIP,
        name="catalog_v2_reward",
    )

"""The catalog twin's default reward.

::

    R = clip(0.3*C + 0.3*A + 0.4*P - penalties, -0.4, 1.0)

Components (range in brackets):

- `category` [0, 1]: C: 1 if the id is the true one, else depth(deepest common ancestor) / max
  depth; 0 for an id that does not exist.
- `attributes` [0, 1]: A: F1 over (handle, value) pairs vs the true required attributes; values
  case-insensitive, trimmed; empty vs empty = 1.
- `policy` [-1, 1]: P: 1 - cost(true verdict, submitted verdict), costs in
  :data:`VERDICT_COSTS`.
- `invalid_calls` [0, 0.05]: 0.01 per invalid tool call (or turn without a call), at most 0.05.
- `penalty` [0, 0.05]: sum of the penalties (= `invalid_calls`).
- `submitted` {0, 1}: 1 when a valid `submit` ended the episode; else R = -0.4, P = -1,
  C = A = 0.

A missed counterfeit or prohibited item (P = -1) costs exactly 7x a false alarm (P = 5/7):
``VERDICT_COSTS.ratio(("counterfeit", "ok"), ("ok", "counterfeit")) == 7``.
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
    "CLIP_V1",
    "VERDICTS",
    "VERDICT_COSTS",
    "VERDICT_COSTS_V1",
    "WEIGHTS",
    "make_catalog_reward",
]

#: The decisions an analyst can take.
VERDICTS: tuple[str, ...] = ("ok", "counterfeit", "prohibited")

#: Cost of a decision (rows: truth, columns: submitted)::
#:
#:     true \ submitted | ok  | counterfeit | prohibited
#:     -----------------+-----+-------------+-----------
#:     ok               | 0   | 2/7         | 2/7          false alarm
#:     counterfeit      | 2   | 0           | 2/7          miss = 2 (7x)
#:     prohibited       | 2   | 2/7         | 0
VERDICT_COSTS = CostMatrix(
    {
        "ok": {"ok": 0.0, "counterfeit": 2 / 7, "prohibited": 2 / 7},
        "counterfeit": {"ok": 2.0, "counterfeit": 0.0, "prohibited": 2 / 7},
        "prohibited": {"ok": 2.0, "counterfeit": 2 / 7, "prohibited": 0.0},
    }
)

#: Catalog v1's costs: the same 7:1 ratio at 2.5x the scale (a false alarm costs 5/7, a miss 5),
#: so that flagging everything loses clearly to careful work (envs/catalog/README.md)::
#:
#:     true \ submitted | ok  | counterfeit | prohibited
#:     -----------------+-----+-------------+-----------
#:     ok               | 0   | 5/7         | 5/7          false alarm
#:     counterfeit      | 5   | 0           | 5/7          miss = 5 (7x)
#:     prohibited       | 5   | 5/7         | 0
VERDICT_COSTS_V1 = CostMatrix(
    {
        "ok": {"ok": 0.0, "counterfeit": 5 / 7, "prohibited": 5 / 7},
        "counterfeit": {"ok": 5.0, "counterfeit": 0.0, "prohibited": 5 / 7},
        "prohibited": {"ok": 5.0, "counterfeit": 5 / 7, "prohibited": 0.0},
    }
)

#: Default weights of C, A and P.
WEIGHTS: dict[str, float] = {"category": 0.3, "attributes": 0.3, "policy": 0.4}

#: Clip of the total; also the total of an episode without a valid submission.
CLIP: tuple[float, float] = (-0.4, 1.0)

#: Catalog v1's clip: low enough that a miss with the category and attributes right
#: (0.6 + 0.4*(1 - 5) = -1.0) is not clipped, so a miss loses exactly 7x a false alarm in the
#: total too (2.0 vs 2/7), and an episode without a submission scores no better than a miss.
CLIP_V1: tuple[float, float] = (-1.0, 1.0)


def _submitted_verdict(submission: dict[str, Any]) -> str | None:
    verdict = submission.get("verdict")
    return verdict.strip().lower() if isinstance(verdict, str) else None


def make_catalog_reward(
    category_exists: Callable[[str], bool],
    costs: CostMatrix = VERDICT_COSTS,
    clip: tuple[float, float] = CLIP,
) -> Reward:
    """Build the catalog reward for a taxonomy.

    Args:
        category_exists: Whether a category id exists in the twin's taxonomy (the world's
            look-up). Submitted ids that do not exist get no category credit.
        costs: The verdict cost matrix: :data:`VERDICT_COSTS` (v0) or :data:`VERDICT_COSTS_V1`.
        clip: Bounds of the total, the low one also the total without a submission:
            :data:`CLIP` (v0) or :data:`CLIP_V1`.

    Returns:
        The :class:`rewards.Reward` described in this module's docstring.
    """

    @term(low=0.0, high=1.0)
    def category(trajectory: Any, case: Any) -> Scored:
        """Hierarchical credit for the submitted category id (1 = exact)."""
        true_id = case.truth["category_id"]
        sub = trajectory.submission.get("category_id")
        value = category_credit(true_id, sub, category_exists)
        return Scored(value, f"category: submitted {sub!r}, true {true_id!r} -> {value:.4g}")

    @term(low=0.0, high=1.0)
    def attributes(trajectory: Any, case: Any) -> float:
        """F1 over (attribute, value) pairs vs the values the true category requires."""
        return attribute_f1(
            case.truth.get("attributes") or {}, trajectory.submission.get("attributes") or {}
        )

    worst = max(costs.costs.values())

    @term(low=1.0 - worst, high=1.0)
    def policy(trajectory: Any, case: Any) -> Scored:
        """1 - cost of the submitted verdict (a miss costs 7x a false alarm)."""
        true = case.truth["verdict"]
        sub = _submitted_verdict(trajectory.submission)
        if sub not in costs.labels:
            # The submit tool rejects unknown verdicts; a hand-built trajectory may not. Score the
            # worst decision for this truth rather than guessing what was meant.
            cost = costs.max_cost(true)
            return Scored(
                1.0 - cost, f"policy: unknown verdict {sub!r} scored as the worst decision"
            )
        return Scored(1.0 - costs.cost(true, sub), f"policy: true {true!r}, submitted {sub!r}")

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
                total=clip[0],
            )
        ],
        clip=clip,
        name="catalog_reward",
    )

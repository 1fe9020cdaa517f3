"""What the catalog's reward must satisfy, in the catalog's answer format, for the generic
property checks of ``rewards/properties.py``.

- :func:`catalog_oracle`: the ``submit`` arguments that read a case's truth (must score the
  maximum);
- :func:`catalog_mistakes`: episodes one mistake away from the oracle's (each must score less);
- :data:`CATALOG_COST_RATIOS`: how much more one verdict mistake loses than another (a missed
  counterfeit or prohibited item loses 7x a false alarm), read off the verdict cost matrix;
- :func:`check_catalog_reward`: :func:`rewards.properties.check_reward_properties` with all of
  the above and random submissions near the truth (``envs/catalog/strategies.py``).

Needs ``hypothesis`` (the ``dev`` extra) for :func:`check_catalog_reward` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from envs.catalog.reward import VERDICT_COSTS, VERDICTS
from rewards import CostMatrix
from rewards.properties import PropertyReport, check_reward_properties, submission_trajectory
from twin.cases import Case
from twin.trajectory import Trajectory

__all__ = [
    "CATALOG_COST_RATIOS",
    "catalog_cost_ratios",
    "catalog_mistakes",
    "catalog_oracle",
    "check_catalog_reward",
]


def catalog_oracle(case: Case) -> dict[str, Any]:
    """The ``submit`` arguments that read the truth: the true category, attributes and verdict."""
    t = case.truth
    return {
        "category_id": t["category_id"],
        "attributes": {str(k): str(v) for k, v in (t.get("attributes") or {}).items()},
        "verdict": t["verdict"],
        "reason": "oracle",
    }


def catalog_mistakes(case: Case) -> dict[str, Trajectory]:
    """Episodes that differ from the oracle's by exactly one mistake, by label.

    Category: another vertical, the parent, a child that does not exist. Attributes: one missing,
    one wrong value, one extra. Verdict: ``verdict_<true>_as_<submitted>`` for each other verdict.
    Then one invalid call before the oracle's submit, and no submit at all.
    """
    oracle = catalog_oracle(case)
    true_id: str = oracle["category_id"]
    out: dict[str, Trajectory] = {}

    def with_(label: str, **changes: Any) -> None:
        out[label] = submission_trajectory(case, {**oracle, **changes})

    other_vertical = "zz" if not true_id.startswith("zz") else "yy"
    with_("category_other_vertical", category_id=f"{other_vertical}-1")
    if "-" in true_id:
        with_("category_parent", category_id=true_id.rsplit("-", 1)[0])
    with_("category_child", category_id=f"{true_id}-99")
    attrs = dict(oracle["attributes"])
    if attrs:
        first = sorted(attrs)[0]
        with_("attribute_missing", attributes={k: v for k, v in attrs.items() if k != first})
        with_("attribute_wrong_value", attributes={**attrs, first: attrs[first] + " (wrong)"})
    with_("attribute_extra", attributes={**attrs, "zz_extra_attribute": "x"})
    for v in VERDICTS:
        if v != oracle["verdict"]:
            with_(f"verdict_{oracle['verdict']}_as_{v}", verdict=v)
    out["invalid_call"] = submission_trajectory(case, oracle, invalid_calls=1)
    out["no_submit"] = submission_trajectory(case, None)
    return out


def catalog_cost_ratios(costs: CostMatrix = VERDICT_COSTS) -> tuple[tuple[str, str, float], ...]:
    """``(mistake a, mistake b, loss(a) / loss(b))`` for the verdict mistakes of
    :func:`catalog_mistakes`, read off ``costs``.

    The total's losses keep the matrix's ratios because only the ``policy`` term changes between
    the oracle and a verdict mistake, and neither is clipped: for each flagged verdict ``t``, a
    miss (``t`` as ok) against a false alarm (ok as ``t``), and against the other flag.
    """
    ratios = []
    for t in VERDICTS:
        if t == "ok":
            continue
        ratios.append(
            (f"verdict_{t}_as_ok", f"verdict_ok_as_{t}", costs.ratio((t, "ok"), ("ok", t)))
        )
        for other in VERDICTS:
            if other not in ("ok", t):
                ratios.append(
                    (
                        f"verdict_{t}_as_ok",
                        f"verdict_{t}_as_{other}",
                        costs.ratio((t, "ok"), (t, other)),
                    )
                )
    return tuple(ratios)


#: The cost ratios of the catalog's verdicts (v0 and v1 alike: every one is 7).
CATALOG_COST_RATIOS: tuple[tuple[str, str, float], ...] = catalog_cost_ratios()


def check_catalog_reward(
    reward: Callable[[Trajectory, Case], Any],
    source: Any,
    *,
    cost_ratios: tuple[tuple[str, str, float], ...] = CATALOG_COST_RATIOS,
    max_examples: int = 100,
    **kwargs: Any,
) -> PropertyReport:
    """:func:`rewards.properties.check_reward_properties` for a catalog reward.

    Args:
        reward: A catalog reward, or a catalog twin's ``score``.
        source: A catalog twin (its cases are drawn), or a hypothesis strategy of cases in the
            catalog's truth format (``envs.catalog.strategies.catalog_cases()``).
        cost_ratios: The verdict cost ratios that must hold (default :data:`CATALOG_COST_RATIOS`).
        max_examples: Cases hypothesis draws.
        **kwargs: Passed on (``bounds``, ``tolerance``, ``random_trajectories``).

    Returns:
        The :class:`rewards.properties.PropertyReport`.

    Raises:
        AssertionError: a property does not hold.
    """
    from hypothesis import strategies as st

    from envs.catalog.strategies import catalog_submissions
    from rewards.strategies import trajectories

    def near_the_truth(case: Case) -> Any:
        return trajectories(case, st.one_of(st.none(), catalog_submissions(case.truth)))

    kwargs.setdefault("random_trajectories", near_the_truth)
    return check_reward_properties(
        reward,
        source,
        oracle=catalog_oracle,
        mistakes=catalog_mistakes,
        cost_ratios=cost_ratios,
        max_examples=max_examples,
        **kwargs,
    )

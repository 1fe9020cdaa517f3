"""``check_reward_properties``: what every reward must satisfy, checked with hypothesis.

- **bounded**: every total lies within the reward's bounds;
- **deterministic**: the same episode (also after a JSON round trip) gives the same result;
- **oracle is maximal**: the oracle's submission scores the upper bound;
- **single mistakes cost**: any one mistake scores strictly less than the oracle;
- **cost ratios**: the loss of one mistake is the stated multiple of another's
  (the catalog: a missed counterfeit loses 7x what a false alarm loses).

Oracles and single mistakes for the catalog truth format are built in
(:func:`catalog_oracle`, :func:`catalog_mistakes`); other twins pass their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rewards._submission import submission_trajectory
from twin.cases import Case
from twin.trajectory import Trajectory

__all__ = [
    "CATALOG_COST_RATIOS",
    "PropertyReport",
    "catalog_mistakes",
    "catalog_oracle",
    "check_reward_properties",
    "submission_trajectory",
]

#: ``(mistake a, mistake b, loss(a) / loss(b))`` for the catalog reward.
CATALOG_COST_RATIOS: tuple[tuple[str, str, float], ...] = (
    ("verdict_counterfeit_as_ok", "verdict_ok_as_counterfeit", 7.0),
    ("verdict_prohibited_as_ok", "verdict_ok_as_prohibited", 7.0),
    ("verdict_counterfeit_as_ok", "verdict_counterfeit_as_prohibited", 7.0),
    ("verdict_prohibited_as_ok", "verdict_prohibited_as_counterfeit", 7.0),
)

_VERDICTS = ("ok", "counterfeit", "prohibited")


def catalog_oracle(case: Case) -> dict[str, Any]:
    """The submission that reads the truth (catalog format)."""
    t = case.truth
    return {
        "category_id": t["category_id"],
        "attributes": {str(k): str(v) for k, v in (t.get("attributes") or {}).items()},
        "verdict": t["verdict"],
        "reason": "oracle",
    }


def catalog_mistakes(case: Case) -> dict[str, Trajectory]:
    """Episodes that differ from the oracle's by exactly one mistake (catalog format)."""
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
    for v in _VERDICTS:
        if v != oracle["verdict"]:
            with_(f"verdict_{oracle['verdict']}_as_{v}", verdict=v)
    out["invalid_call"] = submission_trajectory(case, oracle, invalid_calls=1)
    out["no_submit"] = submission_trajectory(case, None)
    return out


@dataclass
class PropertyReport:
    """What :func:`check_reward_properties` checked.

    Attributes:
        examples: Cases checked.
        bounds: The bounds the totals were checked against.
        losses: ``{mistake: sorted distinct losses (oracle total - mistake total)}``.
        ratios: ``{(a, b): observed loss(a) / loss(b)}``.
    """

    examples: int = 0
    bounds: tuple[float, float] = (-math.inf, math.inf)
    losses: dict[str, list[float]] = field(default_factory=dict)
    ratios: dict[tuple[str, str], float] = field(default_factory=dict)


def _bounds_of(reward: Any) -> tuple[float, float] | None:
    b = getattr(reward, "bounds", None)
    if b is None:  # a twin's bound `score`: use the bounds of the twin's Reward
        inner = getattr(getattr(reward, "__self__", None), "reward", None)
        b = getattr(inner, "bounds", None)
    return tuple(b) if b is not None else None  # type: ignore[return-value]


def _cases_strategy(source: Any) -> Any:
    from hypothesis import strategies as st

    if isinstance(source, st.SearchStrategy):
        return source
    if hasattr(source, "case") and hasattr(source, "splits"):
        from rewards.strategies import twin_cases

        return twin_cases(source)
    if callable(source):
        return st.integers(0, 10**6).map(source)
    raise TypeError(f"source must be a Twin, a hypothesis strategy of Case, or a callable(int) -> Case; got {source!r}")


def check_reward_properties(
    reward: Callable[[Trajectory, Case], Any],
    source: Any,
    *,
    oracle: Callable[[Case], Mapping[str, Any]] | None = None,
    mistakes: Callable[[Case], Mapping[str, Trajectory]] | None = None,
    cost_ratios: tuple[tuple[str, str, float], ...] | None = None,
    random_trajectories: Callable[[Case], Any] | None = None,
    bounds: tuple[float, float] | None = None,
    max_examples: int = 100,
    tolerance: float = 1e-9,
) -> PropertyReport:
    """Check that ``reward`` is bounded, deterministic, maximal for the oracle, strictly lower for
    any single mistake, and keeps the stated cost ratios.

    Args:
        reward: A :class:`rewards.Reward` or any ``(trajectory, case) -> RewardResult``.
        source: A twin (its cases are drawn), a hypothesis strategy of cases, or ``f(int) -> Case``.
        oracle: ``oracle(case) -> submission``; default :func:`catalog_oracle`.
        mistakes: ``mistakes(case) -> {label: trajectory}``; default :func:`catalog_mistakes`.
        cost_ratios: ``(a, b, r)``: loss(a) / loss(b) must equal ``r`` whenever both occur;
            default :data:`CATALOG_COST_RATIOS` when the catalog defaults are used, else none.
        random_trajectories: ``f(case) -> strategy of Trajectory`` for the boundedness check
            (default: catalog submissions near the truth, or none).
        bounds: ``(low, high)``; default ``reward.bounds``.
        max_examples: Cases hypothesis draws.
        tolerance: Absolute tolerance of equalities.

    Returns:
        A :class:`PropertyReport`.

    Raises:
        AssertionError: a property does not hold; the message names the case and the mistake.
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    catalog_defaults = oracle is None and mistakes is None
    oracle = oracle or catalog_oracle
    mistakes = mistakes or catalog_mistakes
    if cost_ratios is None:
        cost_ratios = CATALOG_COST_RATIOS if catalog_defaults else ()
    if random_trajectories is None and catalog_defaults:
        from rewards.strategies import catalog_submissions, trajectories

        def random_trajectories(case: Case) -> Any:
            return trajectories(case, st.one_of(st.none(), catalog_submissions(case.truth)))

    b = bounds or _bounds_of(reward)
    if b is None:
        raise AssertionError("the reward has no `bounds`; pass bounds=(low, high)")
    lo, hi = b
    report = PropertyReport(bounds=(lo, hi))
    losses: dict[str, dict[float, float]] = {}  # rounded key -> first exact loss

    def score(t: Trajectory, c: Case) -> Any:
        r = reward(t, c)
        assert isinstance(r.total, float) and math.isfinite(r.total), f"{c.id}: total {r.total!r} is not a finite float"
        assert lo - tolerance <= r.total <= hi + tolerance, f"{c.id}: total {r.total} outside bounds [{lo}, {hi}]"
        for k, v in r.components.items():
            assert math.isfinite(v), f"{c.id}: component {k!r} = {v!r} is not finite"
        return r

    cases = _cases_strategy(source)
    extra = random_trajectories or (lambda c: st.none())

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data: Any) -> None:
        case = data.draw(cases, label="case")
        best = submission_trajectory(case, oracle(case))
        r1 = score(best, case)
        r2 = score(best, case)
        again = Trajectory.model_validate_json(best.model_dump_json())
        case2 = Case.model_validate_json(case.model_dump_json())
        r3 = score(again, case2)
        assert r1 == r2 == r3, f"{case.id}: the same episode scored differently: {r1} / {r2} / {r3}"
        assert math.isclose(r1.total, hi, abs_tol=tolerance), (
            f"{case.id}: the oracle scored {r1.total}, not the maximum {hi}\n{r1.explain()}"
        )
        for label, traj in mistakes(case).items():
            r = score(traj, case)
            assert r.total < r1.total - tolerance, (
                f"{case.id}: single mistake {label!r} scored {r.total}, not less than the oracle's {r1.total}\n"
                f"{r.explain()}"
            )
            loss = r1.total - r.total
            losses.setdefault(label, {}).setdefault(round(loss, 12), loss)
        t = data.draw(extra(case), label="random trajectory")
        if t is not None:
            score(t, case)
            assert score(t, case) == score(t, case), f"{case.id}: a random episode scored differently twice"
        report.examples += 1

    run()
    report.losses = {k: sorted(v.values()) for k, v in losses.items()}
    for a, bb, ratio in cost_ratios:
        if a not in losses or bb not in losses:
            raise AssertionError(
                f"cost ratio {a!r}/{bb!r}: {'neither' if a not in losses and bb not in losses else 'one'} "
                f"of the mistakes occurred in {report.examples} cases; raise max_examples"
            )
        for la in losses[a].values():
            for lb in losses[bb].values():
                assert lb > 0 and math.isclose(la / lb, ratio, rel_tol=1e-9), (
                    f"cost ratio {a!r}/{bb!r}: losses {la} / {lb} = {la / lb if lb else math.inf}, expected {ratio}"
                )
                report.ratios[(a, bb)] = la / lb
    return report

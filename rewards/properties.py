"""``check_reward_properties``: what every reward must satisfy, checked with hypothesis.

- **bounded**: every total lies within the reward's bounds;
- **deterministic**: the same episode (also after a JSON round trip) gives the same result;
- **oracle is maximal**: the oracle's submission scores the upper bound;
- **single mistakes cost**: any one mistake scores strictly less than the oracle;
- **cost ratios**: the loss of one mistake is the stated multiple of another's
  (e.g. a missed counterfeit loses 7x what a false alarm loses).

The checks know no twin's answer format: the caller passes the oracle (the submission that reads
the truth), the single mistakes and the cost ratios of its own twin. The catalog's are in
``envs/catalog/reward_checks.py``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rewards._reward import Reward
from rewards._submission import submission_trajectory
from twin.cases import Case
from twin.trajectory import Trajectory

__all__ = [
    "PropertyReport",
    "check_reward_properties",
    "reward_bounds",
    "submission_trajectory",
]

#: ``oracle(case) -> submission``: the terminal call's arguments that read the case's truth.
Oracle = Callable[[Case], Mapping[str, Any]]
#: ``mistakes(case) -> {label: trajectory}``: episodes one mistake away from the oracle's.
Mistakes = Callable[[Case], Mapping[str, Trajectory]]


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


def reward_bounds(scorer: Any) -> tuple[float, float] | None:
    """``(low, high)`` of a scorer: a :class:`rewards.Reward`, anything with ``bounds``, or a
    twin's bound ``score`` (its ``reward``'s bounds); None when they cannot be known.

    The twin's ``reward`` is read without running descriptors, so a property is never called.
    """
    if isinstance(scorer, Reward):
        return scorer.bounds
    b = getattr(scorer, "bounds", None)
    if b is not None:
        low, high = b
        return float(low), float(high)
    owner = getattr(scorer, "__self__", None)  # a twin's bound `score`
    if owner is not None:
        r = inspect.getattr_static(owner, "reward", None)
        if isinstance(r, staticmethod):
            r = r.__func__
        if isinstance(r, Reward):
            return r.bounds
    return None


def _cases_strategy(source: Any) -> Any:
    from hypothesis import strategies as st

    if isinstance(source, st.SearchStrategy):
        return source
    if hasattr(source, "case") and hasattr(source, "splits"):
        from rewards.strategies import twin_cases

        return twin_cases(source)
    if callable(source):
        return st.integers(0, 10**6).map(source)
    raise TypeError(
        "source must be a Twin, a hypothesis strategy of Case, or a callable(int) -> Case; "
        f"got {source!r}"
    )


def check_reward_properties(
    reward: Callable[[Trajectory, Case], Any],
    source: Any,
    *,
    oracle: Oracle,
    mistakes: Mistakes,
    cost_ratios: Sequence[tuple[str, str, float]] = (),
    random_trajectories: Callable[[Case], Any] | None = None,
    bounds: tuple[float, float] | None = None,
    max_examples: int = 100,
    tolerance: float = 1e-9,
    seed: int = 0,
) -> PropertyReport:
    """Check that ``reward`` is bounded, deterministic, maximal for the oracle, strictly lower for
    any single mistake, and keeps the stated cost ratios.

    Args:
        reward: A :class:`rewards.Reward` or any ``(trajectory, case) -> RewardResult``.
        source: A twin (its cases are drawn), a hypothesis strategy of cases, or ``f(int) -> Case``.
        oracle: ``oracle(case) -> submission`` in the twin's answer format; it must score the
            reward's upper bound.
        mistakes: ``mistakes(case) -> {label: trajectory}``: each must score strictly less than
            the oracle (labels name them in failures and in :attr:`PropertyReport.losses`).
        cost_ratios: ``(a, b, r)``: loss(a) / loss(b) must equal ``r`` whenever both occur.
        random_trajectories: ``f(case) -> strategy of Trajectory`` (or of None) for the
            boundedness check on episodes other than the oracle's and the mistakes'; default none.
        bounds: ``(low, high)``; default ``reward.bounds``.
        max_examples: Cases hypothesis draws.
        tolerance: Absolute tolerance of equalities.
        seed: Hypothesis' seed: the same seed draws the same cases, whatever the source code's
            layout (``derandomize`` would hash the checking function's source).

    Returns:
        A :class:`PropertyReport`.

    Raises:
        AssertionError: a property does not hold; the message names the case and the mistake.
        TypeError: ``oracle`` or ``mistakes`` is not callable, or ``source`` is none of the above.
    """
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    for name, fn in (("oracle", oracle), ("mistakes", mistakes)):
        if not callable(fn):
            raise TypeError(f"{name} must be a callable taking a Case, got {fn!r}")
    b = bounds or reward_bounds(reward)
    if b is None:
        raise AssertionError("the reward has no `bounds`; pass bounds=(low, high)")
    check = _Checker(reward, lo=b[0], hi=b[1], tolerance=tolerance)
    cases = _cases_strategy(source)
    extra = random_trajectories or (lambda c: st.none())

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis_seed(seed)
    @given(data=st.data())
    def run(data: Any) -> None:
        case = data.draw(cases, label="case")
        check.oracle_and_mistakes(case, oracle, mistakes)
        t = data.draw(extra(case), label="random trajectory")
        if t is not None:
            check.random_episode(t, case)
        check.report.examples += 1

    run()
    report = check.report
    report.losses = {k: sorted(v.values()) for k, v in check.losses.items()}
    for a, bb, ratio in cost_ratios:
        report.ratios[(a, bb)] = _cost_ratio(check.losses, a, bb, ratio, report.examples)
    return report


class _Checker:
    """The per-case checks of :func:`check_reward_properties`, and the losses they saw."""

    def __init__(self, reward: Callable[..., Any], *, lo: float, hi: float, tolerance: float):
        self.reward = reward
        self.lo, self.hi, self.tolerance = lo, hi, tolerance
        self.report = PropertyReport(bounds=(lo, hi))
        self.losses: dict[str, dict[float, float]] = {}  # label -> rounded loss -> first exact

    def score(self, t: Trajectory, c: Case) -> Any:
        """``reward(t, c)``, checked finite and within the bounds."""
        lo, hi, tolerance = self.lo, self.hi, self.tolerance
        r = self.reward(t, c)
        assert isinstance(r.total, float) and math.isfinite(r.total), (
            f"{c.id}: total {r.total!r} is not a finite float"
        )
        assert lo - tolerance <= r.total <= hi + tolerance, (
            f"{c.id}: total {r.total} outside bounds [{lo}, {hi}]"
        )
        for k, v in r.components.items():
            assert math.isfinite(v), f"{c.id}: component {k!r} = {v!r} is not finite"
        return r

    def oracle_and_mistakes(self, case: Case, oracle: Oracle, mistakes: Mistakes) -> None:
        """The oracle scores the maximum, the same each time (also after a JSON round trip);
        each single mistake scores strictly less (its loss is recorded)."""
        best = submission_trajectory(case, oracle(case))
        r1 = self.score(best, case)
        r2 = self.score(best, case)
        again = Trajectory.model_validate_json(best.model_dump_json())
        case2 = Case.model_validate_json(case.model_dump_json())
        r3 = self.score(again, case2)
        assert r1 == r2 == r3, f"{case.id}: the same episode scored differently: {r1} / {r2} / {r3}"
        assert math.isclose(r1.total, self.hi, abs_tol=self.tolerance), (
            f"{case.id}: the oracle scored {r1.total}, not the maximum {self.hi}\n{r1.explain()}"
        )
        for label, traj in mistakes(case).items():
            r = self.score(traj, case)
            assert r.total < r1.total - self.tolerance, (
                f"{case.id}: single mistake {label!r} scored {r.total}, not less than the "
                f"oracle's {r1.total}\n{r.explain()}"
            )
            loss = r1.total - r.total
            self.losses.setdefault(label, {}).setdefault(round(loss, 12), loss)

    def random_episode(self, t: Trajectory, case: Case) -> None:
        """Any other episode scores within the bounds, the same twice."""
        self.score(t, case)
        assert self.score(t, case) == self.score(t, case), (
            f"{case.id}: a random episode scored differently twice"
        )


def _cost_ratio(
    losses: dict[str, dict[float, float]], a: str, b: str, ratio: float, examples: int
) -> float:
    """loss(a) / loss(b), checked equal to ``ratio`` for every pair of losses seen."""
    if a not in losses or b not in losses:
        which = "neither" if a not in losses and b not in losses else "one"
        raise AssertionError(
            f"cost ratio {a!r}/{b!r}: {which} of the mistakes occurred in {examples} cases; "
            "raise max_examples"
        )
    last = math.nan
    for la in losses[a].values():
        for lb in losses[b].values():
            assert lb > 0 and math.isclose(la / lb, ratio, rel_tol=1e-9), (
                f"cost ratio {a!r}/{b!r}: losses {la} / {lb} = "
                f"{la / lb if lb else math.inf}, expected {ratio}"
            )
            last = la / lb
    return last

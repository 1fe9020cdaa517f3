"""Score a rollout file's cases: build or replay each episode, score it, compare with ``expect``.

A ``submit:`` case is built directly (:func:`rewards._submission.submission_trajectory`); a
``turns:`` case is replayed through the real environment (:class:`twin.env.TwinEnv`) on the twin
the registry makes (:func:`rewards.testing.resolve.rollout_twin`).
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, Field

from rewards._reward import RewardResult
from rewards._submission import submission_trajectory
from rewards.properties import reward_bounds
from rewards.testing.judge_replay import replaying
from rewards.testing.resolve import resolve_scorer, rollout_twin
from rewards.testing.schema import (
    DEFAULT_TOLERANCE,
    CaseRef,
    RolloutCase,
    RolloutFile,
    load_rollout_file,
)
from twin.cases import Case
from twin.env import TwinEnv
from twin.errors import ConfigError, TwinError
from twin.trajectory import Trajectory

__all__ = ["CaseOutcome", "check_rollout_file", "replay_turns", "run_rollout_file", "score_case"]


class CaseOutcome(BaseModel):
    """The result of checking one rollout case.

    Attributes:
        file: The rollout file.
        name: The case's name.
        result: The reward result (None when scoring failed).
        expected: The expected total and components, resolved to numbers.
        mismatches: ``(what, expected, got)`` for every value outside the tolerance.
        error: The error, when scoring failed.
        tolerance: The tolerance used.
    """

    file: str
    name: str
    result: RewardResult | None = None
    expected: dict[str, float] = Field(default_factory=dict)
    mismatches: list[tuple[str, float, float | None]] = Field(default_factory=list)
    error: str | None = None
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def passed(self) -> bool:
        """No error and no mismatch."""
        return self.error is None and not self.mismatches

    def describe(self) -> str:
        """Expected vs got, one line per mismatch, then the breakdown."""
        if self.error:
            return f"{self.file} :: {self.name}: ERROR {self.error}"
        lines = [f"{self.file} :: {self.name}:"]
        for what, exp, got in self.mismatches:
            if got is None:
                have = ", ".join(self.result.components) if self.result else ""
                got_txt = f"no such component (the reward reports: {have})"
            else:
                got_txt = f"{got:.6g} (diff {got - exp:+.6g})"
            lines.append(
                f"  {what}: expected {exp:.6g}, got {got_txt} (tolerance {self.tolerance:g})"
            )
        if self.result is not None:
            lines.append("  " + self.result.explain().replace("\n", "\n  "))
        return "\n".join(lines)


def replay_turns(f: RolloutFile, c: RolloutCase) -> tuple[Trajectory, Case]:
    """Replay a ``turns:`` case through the environment; return its episode and the case to score.

    The episode runs on the twin's case ``c.case`` (default ``test`` 0) until a terminal tool
    succeeds or the twin's turn budget ends; turns after that are not run. The case returned
    carries the file's ``truth`` (and ``kind``) when it gives one, else the twin's own.
    """
    ref = c.case or CaseRef()
    env = TwinEnv(rollout_twin(f.twin, f.config))
    env.reset(options={"split": ref.split, "index": ref.index})
    for turn in c.turns or []:
        _, _, terminated, truncated, _ = env.step(turn)
        if terminated or truncated:
            break
    trajectory = env.trajectory
    if trajectory is None:  # pragma: no cover - the env always has one after reset
        raise TwinError("the environment returned no trajectory")
    base = env.case
    truth = c.truth if c.truth is not None else base.truth
    kind = c.kind if c.truth is not None or c.kind != "default" else base.kind
    case = Case(
        twin=base.twin, split=base.split, index=base.index, kind=kind, task=base.task, truth=truth
    )
    return trajectory, case


def score_case(
    f: RolloutFile, c: RolloutCase, *, file: str = "<memory>", allow_import: bool = False
) -> CaseOutcome:
    """Score one case of a rollout file and compare it with its expectations.

    Never raises for a broken reward: the error is recorded in the outcome (and fails it).

    Args:
        f: The rollout file.
        c: One of its cases.
        file: The file's name in the outcome.
        allow_import: Let the file's ``reward:`` import any module (see :func:`resolve_scorer`).
    """
    tol = c.tolerance if c.tolerance is not None else f.tolerance
    out = CaseOutcome(file=file, name=c.name, tolerance=tol)
    try:
        scorer = resolve_scorer(f.twin, f.config, f.reward, allow_import=allow_import)
        if c.turns is not None:
            trajectory, case = replay_turns(f, c)
        else:
            ref = c.case or CaseRef()
            if c.truth is None:  # the twin's own case
                case = rollout_twin(f.twin, f.config).case(ref.split, ref.index)
            else:
                case = Case(
                    twin=f.twin,
                    split=ref.split,
                    index=ref.index,
                    kind=c.kind,
                    task=c.task,
                    truth=c.truth,
                )
            trajectory = submission_trajectory(
                case,
                c.submit,
                invalid_calls=c.invalid_calls,
                num_turns=c.num_turns,
                policy="rollout-file",
                twin=f.twin,
                case_kind=c.kind,
                completion_tokens=c.completion_tokens,
            )
        with replaying(f.judge, c.judge_answers, file):  # recorded judge answers, when given
            raw = scorer(trajectory, case)
        result = (
            raw
            if isinstance(raw, RewardResult)
            else RewardResult.model_validate(raw, from_attributes=True)
        )
    except Exception as exc:  # report, do not crash the whole run
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.result = result
    expected_total = c.expect.total
    if expected_total == "max":
        bounds = reward_bounds(scorer)
        if bounds is None:
            out.error = "expect total: max needs a Reward whose bounds are known"
            return out
        expected_total = bounds[1]
    if expected_total is not None:
        out.expected["total"] = float(expected_total)
        if not math.isclose(result.total, float(expected_total), rel_tol=0.0, abs_tol=tol):
            out.mismatches.append(("total", float(expected_total), result.total))
    for name, exp in c.expect.components.items():
        out.expected[name] = float(exp)
        got = result.components.get(name)
        if got is None or not math.isclose(got, float(exp), rel_tol=0.0, abs_tol=tol):
            out.mismatches.append((name, float(exp), got))
    return out


def run_rollout_file(path: str | Path, *, allow_import: bool = False) -> list[CaseOutcome]:
    """Check every case of a rollout file (a file that cannot be loaded gives one failed outcome).

    Args:
        path: The rollout file.
        allow_import: Let the file's ``reward:`` import any module (see :func:`resolve_scorer`).
    """
    try:
        f = load_rollout_file(path)
    except ConfigError as exc:
        return [CaseOutcome(file=str(path), name="<file>", error=str(exc))]
    except Exception as exc:  # noqa: BLE001 - one unreadable file must not stop the others
        return [CaseOutcome(file=str(path), name="<file>", error=f"{type(exc).__name__}: {exc}")]
    return [score_case(f, c, file=str(path), allow_import=allow_import) for c in f.cases]


def check_rollout_file(path: str | Path, *, allow_import: bool = False) -> list[CaseOutcome]:
    """Like :func:`run_rollout_file` but raise ``AssertionError`` listing every failed case."""
    outcomes = run_rollout_file(path, allow_import=allow_import)
    failed = [o for o in outcomes if not o.passed]
    if failed:
        raise AssertionError("\n\n".join(o.describe() for o in failed))
    return outcomes

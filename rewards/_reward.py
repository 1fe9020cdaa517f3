"""``Reward``: a weighted sum of named terms, gates, penalties after the sum, and a clip.

::

    total = clip( sum_i w_i * term_i(trajectory, case)  -  sum_j penalty_j  +  sum_k bonus_k )

When a gate fails (say "no valid submit"), the terms are not run: each reports the gate's
fail value (0 unless the gate says otherwise) and, when the gate sets ``total``, that is the
total. Every term, penalty and gate is reported in ``RewardResult.components`` by name, and the
reward keeps no state between calls, so one ``Reward`` may score episodes from many threads.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, Field

from rewards._terms import RewardError, Scored, Term, TermError, check_name
from twin.errors import ConfigError

__all__ = ["Gate", "Penalty", "Reward", "RewardResult"]


class RewardResult(BaseModel):
    """What a reward returns for one episode.

    Attributes:
        total: The reward, after penalties, bonuses and the clip.
        components: Every term's value (unweighted), every penalty's amount (positive, as
            subtracted), ``penalty`` (their sum) when there are penalties, ``bonus`` when there
            are bonuses, and each gate as 1.0 (passed) or 0.0 (failed).
        weighted: Each term's weighted contribution and each penalty as a negative contribution
            (bonuses positive); they add up to ``unclipped`` unless a gate set the total.
        notes: Human-readable lines: term notes, failed gates, clipping.
        unclipped: The total before the clip.
        deferred: The group terms left for the episode's group to score (scored with
            ``defer_group=True``; each holds its lowest value until then).
    """

    total: float
    components: dict[str, float] = Field(default_factory=dict)
    weighted: dict[str, float] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    unclipped: float = 0.0
    deferred: list[str] = Field(default_factory=list)

    def explain(self) -> str:
        """A readable table: each component, its weighted contribution, then the total and notes."""
        names = list(self.components) + [n for n in self.weighted if n not in self.components]
        width = max([len(n) for n in names] + [9])
        lines = [f"{'component':<{width}}  {'value':>9}  {'weighted':>9}"]
        lines.append("-" * len(lines[0]))
        for n in names:
            value = self.components.get(n)
            w = self.weighted.get(n)
            v_txt = f"{value:9.4f}" if value is not None else " " * 9
            w_txt = f"{w:+9.4f}" if w is not None else " " * 9
            lines.append(f"{n:<{width}}  {v_txt}  {w_txt}")
        lines.append("-" * len(lines[0]))
        if not math.isclose(self.unclipped, self.total, abs_tol=1e-12):
            lines.append(f"{'unclipped':<{width}}  {self.unclipped:9.4f}")
        lines.append(f"{'total':<{width}}  {self.total:9.4f}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def metrics(self, prefix: str = "rewards/") -> dict[str, float]:
        """Flat ``{prefix + name: value}`` for logging: the total and every component."""
        out = {f"{prefix}total": self.total}
        out.update({f"{prefix}{k}": v for k, v in self.components.items()})
        return out


def _finite(value: Any, what: str, *, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{what} must be >= {minimum}, got {value!r}")
    return float(value)


@dataclass(frozen=True, eq=False)
class Penalty:
    """An amount subtracted after the weighted sum (or added, for a bonus), with an optional cap.

    ``amount = min(per_unit * fn(trajectory, case), cap)``; ``fn`` counts units (invalid calls,
    turns, overlong fraction) and must return a finite number >= 0.

    Attributes:
        name: Component name, e.g. ``invalid_calls``.
        fn: ``fn(trajectory, case) -> float`` (units, >= 0).
        per_unit: Amount per unit (overridable from YAML).
        cap: Largest amount in all, or None for no cap (overridable from YAML).
        bonus: True to add the amount instead of subtracting it.
        description: One line for docs and ``explain``.
        overlong: True for a penalty on the episode's length (:func:`overlong_penalty`): a
            recipe whose own overlong shaping is on refuses a twin whose reward holds one, so
            one episode is never charged for its length twice.
    """

    name: str
    fn: Callable[[Any, Any], float]
    per_unit: float = 1.0
    cap: float | None = None
    bonus: bool = False
    description: str = ""
    overlong: bool = False

    def __post_init__(self) -> None:
        check_name(self.name, "penalty")
        if not callable(self.fn):
            raise ConfigError(f"penalty {self.name!r}: fn must be callable, got {self.fn!r}")
        object.__setattr__(
            self, "per_unit", _finite(self.per_unit, f"penalty {self.name!r} per_unit", minimum=0.0)
        )
        if self.cap is not None:
            object.__setattr__(
                self, "cap", _finite(self.cap, f"penalty {self.name!r} cap", minimum=0.0)
            )

    def amount(self, trajectory: Any, case: Any) -> float:
        """The (positive) amount for this episode.

        Raises:
            TermError: ``fn`` raised or returned a negative or non-finite number.
        """
        try:
            units = self.fn(trajectory, case)
        except Exception as exc:
            raise TermError(f"penalty {self.name!r} raised {type(exc).__name__}: {exc}") from exc
        if (
            isinstance(units, bool)
            or not isinstance(units, numbers.Real)
            or not math.isfinite(units)
            or units < 0
        ):
            raise TermError(
                f"penalty {self.name!r} returned {units!r}; expected a finite number >= 0"
            )
        value = float(units) * self.per_unit
        return min(value, self.cap) if self.cap is not None else value

    @property
    def max_amount(self) -> float:
        """The cap, or ``inf`` when uncapped (and ``per_unit`` > 0)."""
        if self.cap is not None:
            return self.cap
        return 0.0 if self.per_unit == 0 else math.inf


@dataclass(frozen=True, eq=False)
class Gate:
    """A prerequisite: when ``check`` is False the terms are not run and score their fail values.

    Attributes:
        name: Component name (reported as 1.0 when passed, 0.0 when failed).
        check: ``check(trajectory, case) -> bool``.
        fail_values: Values the terms report when the gate fails (default 0.0 each).
        total: When set, the total of a failed episode (penalties are still reported).
        description: One line, shown in the notes when the gate fails.
    """

    name: str
    check: Callable[[Any, Any], bool]
    fail_values: Mapping[str, float] = field(default_factory=dict)
    total: float | None = None
    description: str = ""

    def __post_init__(self) -> None:
        check_name(self.name, "gate")
        if not callable(self.check):
            raise ConfigError(f"gate {self.name!r}: check must be callable, got {self.check!r}")
        vals = {
            k: _finite(v, f"gate {self.name!r} fail value of {k!r}")
            for k, v in dict(self.fail_values).items()
        }
        object.__setattr__(self, "fail_values", MappingProxyType(vals))
        if self.total is not None:
            object.__setattr__(self, "total", _finite(self.total, f"gate {self.name!r} total"))

    def passed(self, trajectory: Any, case: Any) -> bool:
        """Run the check.

        Raises:
            TermError: the check raised or did not return a bool.
        """
        try:
            ok = self.check(trajectory, case)
        except Exception as exc:
            raise TermError(f"gate {self.name!r} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(ok, bool):
            raise TermError(f"gate {self.name!r} returned {ok!r}; expected True or False")
        return ok


class Reward:
    """A weighted sum of named terms, with gates, penalties after the sum, and a clip.

    Example::

        reward = Reward({correct: 1.0, format_ok: 0.0},          # weight 0: logged only
                        penalties=[invalid_call_penalty(0.01, cap=0.05)],
                        gates=[submitted_gate()], clip=(-1.0, 1.0))
        result = reward(trajectory, case)
        print(result.explain())

    Args:
        terms: ``{Term: weight}``; weights are finite numbers, 0 means logged only.
        penalties: :class:`Penalty` objects (bonuses too), applied after the weighted sum.
        clip: ``(low, high)`` bounds of the total, or None.
        gates: :class:`Gate` objects, checked in order before the terms.
        name: Name of the reward (TRL adapters use it as ``__name__``).

    Raises:
        ConfigError: a key that is not a Term, a bad weight, duplicate names, a bad clip, or a
            gate fail value for an unknown term or outside its range.
    """

    def __init__(
        self,
        terms: Mapping[Term, float],
        *,
        penalties: Iterable[Penalty] = (),
        clip: tuple[float, float] | None = None,
        gates: Iterable[Gate] = (),
        name: str = "reward",
    ) -> None:
        if not isinstance(terms, Mapping) or not terms:
            raise ConfigError(f"Reward needs a non-empty {{Term: weight}} dict, got {terms!r}")
        items: list[tuple[Term, float]] = []
        for t, w in terms.items():
            if not isinstance(t, Term):
                raise ConfigError(
                    f"Reward keys must be Term objects, got {t!r}; decorate the function with "
                    "@term(low=.., high=..)"
                )
            items.append((t, _finite(w, f"weight of term {t.name!r}")))
        self._terms: tuple[tuple[Term, float], ...] = tuple(items)
        self._penalties: tuple[Penalty, ...] = tuple(penalties)
        self._gates: tuple[Gate, ...] = tuple(gates)
        for p in self._penalties:
            if not isinstance(p, Penalty):
                raise ConfigError(f"penalties must be Penalty objects, got {p!r}")
        for g in self._gates:
            if not isinstance(g, Gate):
                raise ConfigError(f"gates must be Gate objects, got {g!r}")
        names = (
            [t.name for t, _ in self._terms]
            + [p.name for p in self._penalties]
            + [g.name for g in self._gates]
        )
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(
                f"Reward: duplicate names {dupes}; every term, penalty and gate needs its own name"
            )
        term_by_name = {t.name: t for t, _ in self._terms}
        for g in self._gates:
            for k, v in g.fail_values.items():
                if k not in term_by_name:
                    raise ConfigError(
                        f"gate {g.name!r}: fail value for unknown term {k!r}; terms: "
                        f"{list(term_by_name)}"
                    )
                t = term_by_name[k]
                if not t.low <= v <= t.high:
                    raise ConfigError(
                        f"gate {g.name!r}: fail value {v} of {k!r} is outside [{t.low}, {t.high}]"
                    )
        if clip is not None:
            if not isinstance(clip, (tuple, list)) or len(clip) != 2:
                raise ConfigError(f"clip must be (low, high) or None, got {clip!r}")
            lo, hi = _finite(clip[0], "clip low"), _finite(clip[1], "clip high")
            if not lo < hi:
                raise ConfigError(f"clip low must be < high, got ({lo}, {hi})")
            clip = (lo, hi)
        self._clip: tuple[float, float] | None = clip
        self.name = check_name(name, "reward")

    # -- read-only views --------------------------------------------------------------------
    @property
    def terms(self) -> tuple[Term, ...]:
        """The terms, in order."""
        return tuple(t for t, _ in self._terms)

    @property
    def weights(self) -> dict[str, float]:
        """``{term name: weight}`` (a copy)."""
        return {t.name: w for t, w in self._terms}

    @property
    def penalties(self) -> tuple[Penalty, ...]:
        """The penalties and bonuses, in order."""
        return self._penalties

    @property
    def gates(self) -> tuple[Gate, ...]:
        """The gates, in order."""
        return self._gates

    @property
    def clip(self) -> tuple[float, float] | None:
        """The clip bounds, or None."""
        return self._clip

    @property
    def bounds(self) -> tuple[float, float]:
        """The smallest and largest total this reward can return (may be infinite)."""
        lo = math.fsum(min(w * t.low, w * t.high) for t, w in self._terms)
        hi = math.fsum(max(w * t.low, w * t.high) for t, w in self._terms)
        for g in self._gates:
            if g.total is not None:
                lo, hi = min(lo, g.total), max(hi, g.total)
        for p in self._penalties:
            if p.bonus:
                hi += p.max_amount
            else:
                lo -= p.max_amount
        if self._clip is not None:
            lo, hi = max(lo, self._clip[0]), min(hi, self._clip[1])
        return lo, hi

    @property
    def needs_group(self) -> bool:
        """True when a term is scored against the episode's group (a RULER-style judge term,
        :func:`rewards.judge_terms.group_term`): such a reward scores whole groups with
        :meth:`score_groups`."""
        return any(getattr(t, "needs_group", False) for t in self.terms)

    # -- scoring ----------------------------------------------------------------------------
    def __call__(self, trajectory: Any, case: Any, *, defer_group: bool = False) -> RewardResult:
        """Score one episode.

        Args:
            trajectory: The episode.
            case: Its case.
            defer_group: Leave the group terms for :meth:`score_groups` (an episode's end,
                before its group is complete): each holds its lowest value, is named in
                ``RewardResult.deferred`` and in a note. Without it a group term scored alone
                is an error.

        Raises:
            TermError: a term, penalty or gate raised or returned a value it may not.
        """
        components: dict[str, float] = {}
        weighted: dict[str, float] = {}
        notes: list[str] = []
        deferred: list[str] = []

        failed: Gate | None = None
        gate_values: dict[str, float] = {}
        for g in self._gates:
            ok = g.passed(trajectory, case)
            gate_values[g.name] = 1.0 if ok else 0.0
            if not ok and failed is None:
                failed = g
                notes.append(
                    f"gate {g.name!r} failed" + (f": {g.description}" if g.description else "")
                )
            if not ok:
                break  # the first failure decides; later gates are not run

        for t, w in self._terms:
            if failed is not None:
                value = failed.fail_values.get(t.name, 0.0)
            elif defer_group and getattr(t, "needs_group", False):
                value = t.low
                deferred.append(t.name)
                notes.append(
                    f"{t.name}: deferred until the episode's group is scored ({value:g} until then)"
                )
            else:
                value, note = t.evaluate(trajectory, case)
                if note:
                    notes.append(note)
            components[t.name] = value
            weighted[t.name] = w * value

        penalty_sum: list[float] = []
        bonus_sum: list[float] = []
        for p in self._penalties:
            amount = p.amount(trajectory, case)
            components[p.name] = amount
            weighted[p.name] = amount if p.bonus or amount == 0 else -amount
            (bonus_sum if p.bonus else penalty_sum).append(amount)
        if any(not p.bonus for p in self._penalties):
            components["penalty"] = math.fsum(penalty_sum)
        if any(p.bonus for p in self._penalties):
            components["bonus"] = math.fsum(bonus_sum)
        components.update(gate_values)

        if failed is not None and failed.total is not None:
            unclipped = failed.total
        else:
            unclipped = math.fsum(weighted.values())
        total = unclipped
        if self._clip is not None:
            total = min(max(unclipped, self._clip[0]), self._clip[1])
            if total != unclipped:
                notes.append(f"clipped from {unclipped:.6g} to {total:.6g}")
        return RewardResult(
            total=total,
            components=components,
            weighted=weighted,
            notes=notes,
            unclipped=unclipped,
            deferred=deferred,
        )

    def score_groups(
        self, groups: Sequence[Sequence[tuple[Any, Any]]], *, new_step: bool = False
    ) -> list[list[RewardResult]]:
        """Score groups of ``(trajectory, case)`` episodes, each group's episodes together.

        A reward with group terms asks its judges for every group at once
        (:func:`rewards.judge_terms.score_groups`; ``new_step`` starts each judge's next budget
        step first); any other reward scores each episode alone.

        Raises:
            TermError: a term, penalty or gate failed; JudgeError / JudgeBudgetError from a judge.
        """
        scorer = next((t for t in self.terms if getattr(t, "needs_group", False)), None)
        if scorer is None:
            return [[self(t, c) for t, c in g] for g in groups]
        return scorer.score_reward_groups(self, groups, new_step=new_step)

    # -- overrides --------------------------------------------------------------------------
    def with_overrides(self, overrides: Mapping[str, Any]) -> Reward:
        """A copy with weights, penalty amounts or the clip changed, e.g. from a YAML file::

            weights: {category: 0.5, attributes: 0.1}
            penalties: {invalid_calls: {per_unit: 0.02, cap: 0.1}}   # or a number = per_unit
            clip: [-1.0, 1.0]                                        # or null

        Raises:
            ConfigError: an unknown section, term or penalty (with suggestions), or a bad value.
        """
        if overrides is None:
            return self
        if not isinstance(overrides, Mapping):
            raise ConfigError(f"reward overrides must be a mapping, got {type(overrides).__name__}")
        allowed = ("weights", "penalties", "clip")
        unknown = [k for k in overrides if k not in allowed]
        if unknown:
            raise ConfigError(
                f"reward overrides: unknown section(s) {unknown}; allowed: {list(allowed)}"
            )
        terms = dict(self._terms)
        by_name = {t.name: t for t in terms}
        for key, w in dict(overrides.get("weights") or {}).items():
            if key not in by_name:
                raise ConfigError(_unknown("term", key, list(by_name)))
            terms[by_name[key]] = _finite(w, f"weight of term {key!r}")
        pens = list(self._penalties)
        pen_index = {p.name: i for i, p in enumerate(pens)}
        for key, spec in dict(overrides.get("penalties") or {}).items():
            if key not in pen_index:
                raise ConfigError(_unknown("penalty", key, list(pen_index)))
            i = pen_index[key]
            if isinstance(spec, Mapping):
                bad = [k for k in spec if k not in ("per_unit", "cap")]
                if bad:
                    raise ConfigError(
                        f"penalty {key!r} override: unknown field(s) {bad}; allowed: per_unit, cap"
                    )
                pens[i] = replace(pens[i], **dict(spec))
            else:
                pens[i] = replace(pens[i], per_unit=spec)
        clip = overrides["clip"] if "clip" in overrides else self._clip
        if isinstance(clip, list):
            clip = tuple(clip)
        return Reward(terms, penalties=pens, clip=clip, gates=self._gates, name=self.name)

    @classmethod
    def from_yaml(cls, path: str | Path, base: Reward) -> Reward:
        """``base`` with the overrides in a YAML file (the sections of :meth:`with_overrides`,
        optionally nested under a top-level ``reward:`` key).

        Raises:
            ConfigError: the file is missing, not YAML, too large once its aliases are expanded, or
                names unknown terms.
        """
        from twin.yamlsafe import load_yaml_file  # lazy: keep `import rewards` light

        p = Path(path)
        data = load_yaml_file(p, what="reward overrides file")
        if isinstance(data, Mapping) and set(data) == {"reward"}:
            data = data["reward"]
        try:
            return base.with_overrides(data or {})
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None

    def describe(self) -> str:
        """A Markdown table of the terms, weights, ranges and descriptions, then penalties and
        gates."""
        rows = ["| term | weight | range | description |", "| --- | --- | --- | --- |"]
        rows += [
            f"| {t.name} | {w:g} | [{t.low:g}, {t.high:g}] | {t.description} |"
            for t, w in self._terms
        ]
        for p in self._penalties:
            cap = "none" if p.cap is None else f"{p.cap:g}"
            kind = "bonus" if p.bonus else "penalty"
            rows.append(
                f"| {p.name} ({kind}) | {p.per_unit:g}/unit, cap {cap} | | {p.description} |"
            )
        for g in self._gates:
            rows.append(f"| {g.name} (gate) | | | {g.description} |")
        if self._clip is not None:
            rows.append(f"\nclip: [{self._clip[0]:g}, {self._clip[1]:g}]")
        return "\n".join(rows)

    def __repr__(self) -> str:
        inner = ", ".join(f"{t.name}={w:g}" for t, w in self._terms)
        return (
            f"Reward({self.name!r}: {inner}; penalties={[p.name for p in self._penalties]}, "
            f"clip={self._clip})"
        )


def _unknown(what: str, key: Any, known: list[str]) -> str:
    hint = difflib.get_close_matches(str(key), known, n=1)
    extra = f" Did you mean {hint[0]!r}?" if hint else ""
    return f"reward overrides: unknown {what} {key!r}; known {what}s: {known}.{extra}"


# Re-exported for convenience: errors and the Scored helper live beside Term.
_ = (RewardError, Scored)

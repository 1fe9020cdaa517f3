"""Reward terms: named, pure functions of ``(trajectory, case)`` with a declared range.

A term is the unit a reward is composed of and the unit that gets logged. Its value must lie
in its declared range ``[low, high]``; a term that returns anything else, or raises, is an
error (:class:`TermError`), never silently scored as 0 (a rubric that swallows a failing
function as 0 hides reward bugs as low scores).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, overload

from twin.errors import ConfigError, TwinError

__all__ = ["RewardError", "Scored", "Term", "TermError", "TermFn", "check_name", "term"]

#: What a term function looks like: ``fn(trajectory, case) -> float`` (or :class:`Scored`).
TermFn = Callable[[Any, Any], "float | Scored"]

# Names the reward itself uses in ``components``; terms, penalties and gates may not take them.
RESERVED_NAMES = frozenset({"total", "penalty", "bonus"})


class RewardError(TwinError):
    """A reward could not be computed (a term raised, or returned a value it does not allow)."""


class TermError(RewardError):
    """A term raised, or returned a value outside its declared range."""


class Scored(NamedTuple):
    """A term value with a human-readable note that ends up in ``RewardResult.notes``.

    Attributes:
        value: The term's value.
        note: Why it has that value, e.g. ``"category: 'aa-1-2' vs 'aa-1-3' share 'aa-1'"``.
    """

    value: float
    note: str


def check_name(name: Any, what: str) -> str:
    """Validate a term, penalty or gate name (a non-empty identifier-like string, not reserved).

    Raises:
        ConfigError: the name is empty, not a string, has spaces or slashes, or is reserved.
    """
    if not isinstance(name, str) or not name or any(c.isspace() or c == "/" for c in name):
        raise ConfigError(
            f"{what} name must be a non-empty string without spaces or '/', got {name!r}"
        )
    if name in RESERVED_NAMES:
        raise ConfigError(
            f"{what} name {name!r} is reserved (the reward reports {sorted(RESERVED_NAMES)} "
            "itself); pick another name"
        )
    return name


def _check_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True, eq=False)
class Term:
    """A named reward term with a declared range.

    Build one with :func:`term`; call it as ``term(trajectory, case)`` to get a checked value.
    Terms hash by identity so they can key a ``Reward``'s weight dict; they hold no mutable
    state, so one term may score many episodes concurrently.

    Attributes:
        name: The metric name (``rewards/<name>`` in logs).
        fn: ``fn(trajectory, case) -> float`` or :class:`Scored`; must be pure.
        low: Smallest value the term may return.
        high: Largest value the term may return.
        description: One line saying what it measures (the function's docstring by default).
    """

    name: str
    fn: TermFn
    low: float = 0.0
    high: float = 1.0
    description: str = ""

    def __post_init__(self) -> None:
        check_name(self.name, "term")
        if not callable(self.fn):
            raise ConfigError(f"term {self.name!r}: fn must be callable, got {self.fn!r}")
        low = _check_number(self.low, f"term {self.name!r} low")
        high = _check_number(self.high, f"term {self.name!r} high")
        if not low <= high:
            raise ConfigError(f"term {self.name!r}: low must be <= high, got [{low}, {high}]")
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)

    def evaluate(self, trajectory: Any, case: Any) -> Scored:
        """Run the term and check its value.

        Returns:
            The value and its note (an empty note when the function returned a plain float).

        Raises:
            TermError: the function raised, returned a non-number, NaN, or a value outside
                ``[low, high]``; the message names the term, the value and the case.
        """
        where = _where(case)
        try:
            out = self.fn(trajectory, case)
        except Exception as exc:  # a term that raises is a broken reward: say so, loudly
            raise TermError(
                f"term {self.name!r} raised {type(exc).__name__}: {exc} (case {where}); "
                "a term must return a number for every trajectory, including ones with no "
                "submission"
            ) from exc
        note = ""
        if isinstance(out, Scored):
            out, note = out.value, out.note
        if isinstance(out, bool) or not isinstance(out, numbers.Real):
            raise TermError(
                f"term {self.name!r} returned {out!r} ({type(out).__name__}); expected a number "
                f"in [{self.low}, {self.high}] (case {where})"
            )
        value = float(out)
        if math.isnan(value) or not self.low <= value <= self.high:
            raise TermError(
                f"term {self.name!r} returned {value!r}, outside its declared range "
                f"[{self.low}, {self.high}] (case {where}); fix the term or widen its range"
            )
        return Scored(value, note)

    def __call__(self, trajectory: Any, case: Any) -> float:
        """The checked value of the term (see :meth:`evaluate`)."""
        return self.evaluate(trajectory, case).value

    def __repr__(self) -> str:
        return f"Term({self.name!r}, [{self.low:g}, {self.high:g}])"


def _where(case: Any) -> str:
    ident = getattr(case, "id", None)
    return str(ident) if ident is not None else type(case).__name__


def _first_line(doc: str | None) -> str:
    doc = inspect.cleandoc(doc or "")
    return doc.splitlines()[0] if doc else ""


@overload
def term(fn: TermFn, /) -> Term: ...


@overload
def term(
    *, low: float = 0.0, high: float = 1.0, name: str | None = None
) -> Callable[[TermFn], Term]: ...


def term(
    fn: TermFn | None = None,
    /,
    *,
    low: float = 0.0,
    high: float = 1.0,
    name: str | None = None,
) -> Term | Callable[[TermFn], Term]:
    """Turn ``fn(trajectory, case) -> float`` into a :class:`Term`.

    Use bare (range ``[0, 1]``) or with arguments::

        @term(low=-1.0, high=1.0)
        def policy(trajectory, case):
            \"\"\"1 - cost of the submitted verdict.\"\"\"
            ...

    Args:
        fn: The function (when used bare).
        low: Smallest value the term may return.
        high: Largest value the term may return.
        name: Metric name; defaults to the function's ``__name__``.

    Returns:
        A :class:`Term` (or a decorator making one) named after the function, described by
        the first line of its docstring.
    """

    def wrap(f: TermFn) -> Term:
        return Term(
            name=name or getattr(f, "__name__", ""),
            fn=f,
            low=low,
            high=high,
            description=_first_line(getattr(f, "__doc__", None)),
        )

    return wrap(fn) if fn is not None else wrap

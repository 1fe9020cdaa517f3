"""Cost matrices for asymmetric decisions (a missed counterfeit costs more than a false alarm)."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from twin.errors import ConfigError

__all__ = ["CostMatrix"]


@dataclass(frozen=True, eq=False)
class CostMatrix:
    """The cost of deciding ``predicted`` when the truth is ``true``.

    Rows are the true label, columns the decision. The catalog twin's matrix, for example
    (a miss costs 7x a false alarm)::

        true \\ submitted | ok  | counterfeit | prohibited
        ------------------+-----+-------------+-----------
        ok                | 0   | 2/7         | 2/7
        counterfeit       | 2   | 0           | 2/7
        prohibited        | 2   | 2/7         | 0

    Build it from a nested dict ``{true: {predicted: cost}}``; every off-diagonal pair must be
    given (no silent default), the diagonal may be omitted and is then 0.

    Attributes:
        labels: The labels, in order.
        costs: ``{(true, predicted): cost}`` for every pair (read-only).
    """

    labels: tuple[str, ...]
    costs: Mapping[tuple[str, str], float] = field(repr=False)

    def __init__(
        self, costs: Mapping[str, Mapping[str, float]], labels: Iterable[str] | None = None
    ):
        """Validate and store the matrix.

        Args:
            costs: ``{true_label: {predicted_label: cost}}``.
            labels: The label order; defaults to the order of ``costs``' keys.

        Raises:
            ConfigError: an unknown label, a missing off-diagonal pair, a negative or
                non-finite cost, or a non-zero diagonal.
        """
        if not isinstance(costs, Mapping) or not costs:
            raise ConfigError(
                f"CostMatrix needs a non-empty {{true: {{predicted: cost}}}} dict, got {costs!r}"
            )
        labs = tuple(labels) if labels is not None else tuple(costs)
        if len(set(labs)) != len(labs) or not all(isinstance(x, str) and x for x in labs):
            raise ConfigError(f"CostMatrix labels must be distinct non-empty strings, got {labs!r}")
        table: dict[tuple[str, str], float] = {}
        for true, row in costs.items():
            self._known(true, labs, "true label")
            if not isinstance(row, Mapping):
                raise ConfigError(
                    f"CostMatrix row {true!r} must be a {{predicted: cost}} dict, got {row!r}"
                )
            for pred, cost in row.items():
                self._known(pred, labs, "predicted label", f" in row {true!r}")
                if (
                    isinstance(cost, bool)
                    or not isinstance(cost, numbers.Real)
                    or not math.isfinite(cost)
                ):
                    raise ConfigError(
                        f"CostMatrix cost({true!r}, {pred!r}) must be a finite number, got {cost!r}"
                    )
                if cost < 0:
                    raise ConfigError(
                        f"CostMatrix cost({true!r}, {pred!r}) must be >= 0, got {cost!r}"
                    )
                if true == pred and cost != 0:
                    raise ConfigError(
                        f"CostMatrix diagonal cost({true!r}, {pred!r}) must be 0 (a right decision "
                        f"costs nothing), got {cost!r}"
                    )
                table[(true, pred)] = float(cost)
        missing = [(t, p) for t in labs for p in labs if t != p and (t, p) not in table]
        if missing:
            raise ConfigError(
                "CostMatrix is missing the cost of "
                + ", ".join(f"(true={t!r}, predicted={p!r})" for t, p in missing)
                + "; give every off-diagonal pair explicitly"
            )
        for lab in labs:
            table.setdefault((lab, lab), 0.0)
        object.__setattr__(self, "labels", labs)
        object.__setattr__(self, "costs", MappingProxyType(table))

    @staticmethod
    def _known(label: object, labels: tuple[str, ...], what: str, where: str = "") -> None:
        if label not in labels:
            folded = {x.casefold(): x for x in labels}
            hint = difflib.get_close_matches(str(label).casefold(), list(folded), n=1)
            extra = f" Did you mean {folded[hint[0]]!r}?" if hint else ""
            raise ConfigError(
                f"CostMatrix: unknown {what} {label!r}{where}; labels are {list(labels)}.{extra}"
            )

    def cost(self, true: str, predicted: str) -> float:
        """The cost of deciding ``predicted`` when the truth is ``true``.

        Raises:
            ConfigError: either label is unknown (the message lists the labels).
        """
        self._known(true, self.labels, "true label")
        self._known(predicted, self.labels, "predicted label")
        return self.costs[(true, predicted)]

    def ratio(self, a: tuple[str, str], b: tuple[str, str]) -> float:
        """``cost(*a) / cost(*b)``, e.g.
        ``ratio(("counterfeit", "ok"), ("ok", "counterfeit")) == 7``.

        Raises:
            ConfigError: an unknown label, or ``b`` costs 0.
        """
        den = self.cost(*b)
        if den == 0:
            raise ConfigError(f"CostMatrix.ratio: cost{b} is 0; the ratio is undefined")
        return self.cost(*a) / den

    def max_cost(self, true: str | None = None) -> float:
        """The largest cost overall, or in the row of ``true``."""
        if true is not None:
            self._known(true, self.labels, "true label")
            return max(self.costs[(true, p)] for p in self.labels)
        return max(self.costs.values())

    def table(self) -> str:
        """The matrix as a Markdown table (rows: truth, columns: decision)."""
        head = "| true \\ predicted | " + " | ".join(self.labels) + " |"
        sep = "| --- |" + " --- |" * len(self.labels)
        rows = [
            f"| {t} | " + " | ".join(f"{self.costs[(t, p)]:.4g}" for p in self.labels) + " |"
            for t in self.labels
        ]
        return "\n".join([head, sep, *rows])

"""The report of ``twin check`` (:func:`twin.doctor.doctor`): one row per check, and its thresholds.

A :class:`Report` renders as rich tables in the terminal, as Markdown and as JSON; a test asserts
on it with :meth:`Report.assert_ok`. Statuses: ``pass``; ``warn`` (worth a look, never fails the
command: a hook the twin does not implement, or a figure close to its threshold); ``fail``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from twin.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from twin.core import Twin

__all__ = [
    "DEFAULT_THRESHOLDS",
    "WARN_SHARE",
    "CheckRow",
    "Report",
    "Status",
    "parse_threshold",
    "thresholds_for",
]

Status = Literal["pass", "warn", "fail"]

#: Thresholds of every check; a twin overrides them with a ``check_thresholds`` class attribute,
#: the command line with ``--threshold NAME=VALUE``.
DEFAULT_THRESHOLDS: dict[str, float] = {
    # solvable: the oracle must score at least max_reward - oracle_tolerance on every case
    "oracle_tolerance": 1e-3,
    # degenerate: fail when (best reference mean reward - a degenerate policy's) < degenerate_gap
    "degenerate_gap": 0.1,
    # shortcut: fail when bag-of-words accuracy - majority rate > shortcut_margin
    "shortcut_margin": 0.25,
    # the same on the best reference policy's first tool output
    "first_output_margin": 0.25,
    # truth: fail when a truth value is in the visible text of its own cases this much more
    # often (share of episodes) than in the text of cases without it
    "leak_margin": 0.5,
    # truth: shortest truth string scanned for (shorter ones, "ok", match too much by chance)
    "truth_min_chars": 4.0,
    # overlap: fail when more than this share of a kind of test-split entities appears in train
    "split_overlap": 0.5,
}


#: A shortcut or overlap figure above this share of its threshold (but not above it) warns.
WARN_SHARE = 0.8


def parse_threshold(item: str) -> tuple[str, float]:
    """``"degenerate_gap=0.2"`` -> ``("degenerate_gap", 0.2)``.

    Raises:
        ConfigError: no ``=``, an unknown name or a value that is not a number.
    """
    name, sep, raw = item.partition("=")
    name = name.strip()
    if not sep or name not in DEFAULT_THRESHOLDS:
        raise ConfigError(
            f"--threshold expects NAME=VALUE with NAME one of {', '.join(DEFAULT_THRESHOLDS)}; "
            f"got {item!r}"
        )
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"--threshold {name}: {raw!r} is not a number") from None
    if math.isnan(value):
        raise ConfigError(f"--threshold {name}: a number is required, got nan")
    return name, value


def thresholds_for(twin: Twin, overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    """Defaults, then the twin's ``check_thresholds``, then ``overrides``.

    Raises:
        ConfigError: a name that is not a threshold (the message lists them).
    """
    out = dict(DEFAULT_THRESHOLDS)
    for source, values in (
        ("check_thresholds", twin.check_thresholds),
        ("threshold overrides", overrides or {}),
    ):
        unknown = set(values) - set(DEFAULT_THRESHOLDS)
        if unknown:
            raise ConfigError(
                f"{source}: unknown threshold(s) {', '.join(sorted(unknown))}; known: "
                f"{', '.join(DEFAULT_THRESHOLDS)}"
            )
        out.update({k: float(v) for k, v in values.items()})
    return out


@dataclass
class CheckRow:
    """One line of the report.

    Attributes:
        check: Check family: contract, determinism, truth, solvable, reference, degenerate,
            shortcut, overlap.
        name: What exactly was checked, e.g. ``"constant verdict=ok"``.
        status: ``pass``, ``warn`` or ``fail``.
        figure: The measured figure, as text (e.g. ``"0.41 (gap 0.52)"``).
        threshold: The rule the figure was held to, as text (e.g. ``"gap >= 0.1"``).
        note: Why, or what to fix.
        value: The figure as a number when there is one (for JSON consumers).
        crashed: The check itself raised (a bug in the twin or in the check); the row fails.
    """

    check: str
    name: str
    status: Status
    figure: str = ""
    threshold: str = ""
    note: str = ""
    value: float | None = None
    crashed: bool = False


@dataclass
class Report:
    """Everything ``twin check`` found about one twin.

    Attributes:
        twin: The twin's id, ``twin/<Name>-v<N>``.
        rows: One row per check, in the order they ran.
        thresholds: The thresholds used (defaults, the twin's, the overrides).
        settings: How the checks ran (cases per kind, splits, sample sizes).
        details: Per-check tables (per-kind oracle rewards, policy means, overlap counts).
    """

    twin: str
    rows: list[CheckRow] = field(default_factory=list)
    thresholds: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def add(
        self,
        check: str,
        name: str,
        status: Status,
        figure: str = "",
        threshold: str = "",
        note: str = "",
        value: float | None = None,
        crashed: bool = False,
    ) -> CheckRow:
        """Append a row and return it."""
        row = CheckRow(check, name, status, figure, threshold, note, value, crashed)
        self.rows.append(row)
        return row

    @property
    def ok(self) -> bool:
        """True when no row failed (warnings allowed)."""
        return all(r.status != "fail" for r in self.rows)

    def failures(self) -> list[CheckRow]:
        """The rows that failed."""
        return [r for r in self.rows if r.status == "fail"]

    def row(self, check: str, name: str | None = None) -> CheckRow:
        """The first row of ``check`` (and ``name`` when given).

        Raises:
            KeyError: no such row.
        """
        for r in self.rows:
            if r.check == check and (name is None or r.name == name):
                return r
        raise KeyError(f"no row {check!r}{'/' + name if name else ''} in the report of {self.twin}")

    def assert_ok(self) -> None:
        """Raise ``AssertionError`` listing every failed row (for pytest)."""
        bad = self.failures()
        if bad:
            lines = [f"twin check {self.twin}: {len(bad)} check(s) failed"]
            lines += [
                f"- {r.check} / {r.name}: {r.figure} (needs {r.threshold}) {r.note}".rstrip()
                for r in bad
            ]
            raise AssertionError("\n".join(lines))

    # -- rendering -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return {
            "twin": self.twin,
            "ok": self.ok,
            "rows": [asdict(r) for r in self.rows],
            "thresholds": self.thresholds,
            "settings": self.settings,
            "details": self.details,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False, default=str)

    def summary_line(self) -> str:
        """``"twin/X-v0: 9 pass, 2 warn, 1 fail"``."""
        counts = {s: sum(r.status == s for r in self.rows) for s in ("pass", "warn", "fail")}
        return f"{self.twin}: " + ", ".join(f"{n} {s}" for s, n in counts.items())

    def to_markdown(self) -> str:
        """The report as Markdown: the check table, the thresholds and the details."""
        out = [
            f"# twin check {self.twin}",
            "",
            f"**{self.summary_line()}**",
            "",
            "| check | name | status | figure | threshold | note |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        out += [
            f"| {r.check} | {_md(r.name)} | {r.status.upper()} | {_md(r.figure)} | "
            f"{_md(r.threshold)} | {_md(r.note)} |"
            for r in self.rows
        ]
        out += ["", "## Thresholds", "", "| name | value |", "| --- | --- |"]
        out += [f"| {k} | {v:g} |" for k, v in self.thresholds.items()]
        out += ["", "## Settings", "", "| name | value |", "| --- | --- |"]
        out += [f"| {k} | {_md(str(v))} |" for k, v in self.settings.items()]
        for name, table in self.details.items():
            if isinstance(table, dict) and table:
                out += ["", f"## {name}", "", "| key | value |", "| --- | --- |"]
                out += [f"| {_md(str(k))} | {_md(_fmt(v))} |" for k, v in table.items()]
        return "\n".join(out) + "\n"

    def print(self, console: Console | None = None) -> None:
        """Print the report as rich tables (to ``console``, default stdout)."""
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        console = console or Console()
        style = {"pass": "green", "warn": "yellow", "fail": "bold red"}
        table = Table(title=f"twin check {self.twin}", show_lines=False)
        for col in ("check", "status", "figure", "threshold", "note"):
            table.add_column(
                col, overflow="fold", no_wrap=col == "status", ratio=2 if col == "note" else 1
            )
        for r in self.rows:
            table.add_row(
                f"{r.check}: {escape(r.name)}",
                f"[{style[r.status]}]{r.status.upper()}[/]",
                escape(r.figure),
                escape(r.threshold),
                escape(r.note),
            )
        console.print(table)
        knobs = ", ".join(f"{k}={v:g}" for k, v in self.thresholds.items())
        console.print(f"thresholds: {escape(knobs)}")
        line = self.summary_line()
        console.print(f"[{'green' if self.ok else 'bold red'}]{escape(line)}[/]")


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items())
    return str(value)

"""``twin reward test FILE...``: check rollout files and print one table per file."""

from __future__ import annotations

import glob
import re
import sys
from collections.abc import Sequence
from typing import Any

from rewards.testing.replay import CaseOutcome, run_rollout_file

__all__ = ["cli_main", "render_outcomes"]


#: Most characters of one name in the table (case, component, file) and of one failure's report.
NAME_LIMIT = 200
REPORT_LIMIT = 4000

# C0 and C1 control characters (ESC starts a terminal escape sequence) but newline and tab
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean_text(text: Any, limit: int = NAME_LIMIT) -> str:
    """``text`` safe to print on any terminal: lone surrogates replaced, control characters
    shown escaped (an ANSI sequence in a case name prints as ``\\x1b[31m``, not as colour), at
    most ``limit`` characters (the cut is said)."""
    text = str(text).encode("utf-8", "replace").decode("utf-8")  # a lone surrogate becomes "?"
    text = _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.4g}"


def render_outcomes(outcomes: Sequence[CaseOutcome], console: Any = None) -> None:
    """Print one rich table per file: each case's components, total, expected total, verdict."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    by_file: dict[str, list[CaseOutcome]] = {}
    for o in outcomes:
        by_file.setdefault(o.file, []).append(o)
    for file, outs in by_file.items():
        names: list[str] = []
        for o in outs:
            for n in o.result.components if o.result else {}:
                if n not in names:
                    names.append(n)
        table = Table(title=escape(clean_text(file)), show_lines=False)
        table.add_column("case", overflow="fold")
        for n in names:
            table.add_column(escape(clean_text(n, 60)), justify="right")
        table.add_column("total", justify="right")
        table.add_column("expected", justify="right")
        table.add_column("", justify="center")
        for o in outs:
            comps = o.result.components if o.result else {}
            cells = []
            bad = {m[0] for m in o.mismatches}
            for n in names:
                txt = _fmt(comps.get(n))
                if n in bad:
                    txt = f"[red]{txt} (want {_fmt(o.expected.get(n))})[/red]"
                cells.append(txt)
            total = _fmt(o.result.total) if o.result else ""
            if "total" in bad:
                total = f"[red]{total}[/red]"
            status = (
                "[green]pass[/green]"
                if o.passed
                else ("[red]ERROR[/red]" if o.error else "[red]FAIL[/red]")
            )
            table.add_row(
                escape(clean_text(o.name)), *cells, total, _fmt(o.expected.get("total")), status
            )
        console.print(table)
    failed = [o for o in outcomes if not o.passed]
    for o in failed:
        console.print(clean_text(o.describe(), REPORT_LIMIT), markup=False, highlight=False)
    n = len(outcomes)
    msg = f"{n - len(failed)}/{n} rollouts pass"
    console.print(f"[red]{msg}[/red]" if failed else f"[green]{msg}[/green]")


def cli_main(files: list[str], allow_import: bool = False) -> int:
    """``twin reward test FILE...``: check rollout files, print the tables.

    Args:
        files: Rollout files (glob patterns are expanded when the shell did not).
        allow_import: Let the files' ``reward: module:attr`` import any module (``--allow-import``).

    Returns:
        0 when every case passes, 1 when any case fails or errors, 2 when no file was given
        or found.
    """
    from rich.console import Console

    # Off a terminal rich assumes 80 columns, which truncates the component headers.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    paths: list[str] = []
    for f in files:
        matches = sorted(glob.glob(f)) if any(ch in f for ch in "*?[") else [f]
        if not matches:
            console.print(f"[red]no file matches {f!r}[/red]")
            return 2
        paths.extend(matches)
    if not paths:
        console.print("[red]give one or more *.rollouts.yaml files[/red]")
        return 2
    outcomes: list[CaseOutcome] = []
    for p in paths:
        outcomes.extend(run_rollout_file(p, allow_import=allow_import))
    render_outcomes(outcomes, console)
    return 0 if all(o.passed for o in outcomes) else 1

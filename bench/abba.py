"""Compare one ``twin bench`` between two trees in ABBA order.

``python -m bench.abba --before WORKTREE -- catalog --n 500`` runs ``twin bench catalog --n 500``
in the tree given by ``--before`` and in ``--after`` (default: this checkout), in the order
before, after, after, before (``--rounds`` repeats the pattern), so that a drift in the machine's
load hits both sides alike. Each run writes its figures as JSON (``--out`` for ``catalog``,
``--json`` for the others); this script reads every numeric leaf of them and prints, per figure,
the mean of each side and the ratio after / before.

Both trees run with the same interpreter (this one), each from its own folder with ``PYTHONPATH``
set to it, so an old commit checked out with ``git worktree add`` is measured with the same
packages. A figure only one side reports is listed without a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["abba_order", "compare", "leaves", "main"]

#: The option each bench writes its JSON figures to.
JSON_OPTION = {"catalog": "--out"}


def abba_order(rounds: int) -> list[str]:
    """``before, after, after, before`` repeated ``rounds`` times."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    return ["before", "after", "after", "before"] * rounds


def leaves(doc: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every numeric leaf of a JSON document as ``(dotted.path, value)`` (booleans left out)."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from leaves(value, f"{prefix}[{i}]")
    elif isinstance(doc, int | float) and not isinstance(doc, bool):
        yield prefix, float(doc)


def compare(runs: Sequence[tuple[str, dict[str, float]]]) -> list[tuple[str, float, float, float]]:
    """``(figure, before mean, after mean, after / before)`` for figures both sides report."""
    sides: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for side, figures in runs:
        for name, value in figures.items():
            sides[side].setdefault(name, []).append(value)
    rows = []
    for name in sorted(set(sides["before"]) & set(sides["after"])):
        before = statistics.fmean(sides["before"][name])
        after = statistics.fmean(sides["after"][name])
        rows.append((name, before, after, after / before if before else float("nan")))
    return rows


def _run_once(tree: Path, bench: list[str], out: Path) -> dict[str, float]:
    option = JSON_OPTION.get(bench[0], "--json")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "twinrl_cli", "bench", *bench, option, str(out)]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.exists():
        tail = (done.stdout + done.stderr)[-2000:]
        raise SystemExit(f"{' '.join(cmd)} in {tree} failed (exit {done.returncode}):\n{tail}")
    return dict(leaves(json.loads(out.read_text())))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="The earlier tree.")
    parser.add_argument("--after", default=Path.cwd(), type=Path, help="The later tree.")
    parser.add_argument("--rounds", type=int, default=1, help="ABBA patterns to run.")
    parser.add_argument("--json", type=Path, help="Also write the comparison here.")
    parser.add_argument("--match", default="", help="Print only figures containing this.")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- BENCH [options]")
    args = parser.parse_args(argv)
    bench = [a for a in args.bench if a != "--"]
    if not bench:
        parser.error("name the bench after --, e.g. -- catalog --n 500")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, side in enumerate(abba_order(args.rounds)):
            print(f"run {i + 1}: {side} ({trees[side]})", flush=True)
            runs.append((side, _run_once(trees[side], bench, Path(tmp) / f"{i}.json")))
    rows = [r for r in compare(runs) if args.match in r[0]]
    print(f"{'figure':60} {'before':>12} {'after':>12} {'after/before':>12}")
    for name, before, after, ratio in rows:
        print(f"{name[:60]:60} {before:12.4g} {after:12.4g} {ratio:12.3f}")
    if args.json:
        trees_out = {k: str(v) for k, v in trees.items()}
        doc = {"bench": bench, "trees": trees_out, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

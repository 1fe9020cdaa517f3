"""Count the CPU instructions of ``env.reset`` and ``env.step`` under callgrind, in one tree or
two.

Wall-clock figures of a few microseconds swing by tens of percent between runs on a shared
machine; instruction counts repeat to within 0.1%. This runs a catalog episode loop (a reset,
then one step per look-up tool: ``get_attribute_schema``, ``search_taxonomy``, ``lookup_brand``,
``get_seller``) under
``valgrind --tool=callgrind`` and counts only inside the loop: it runs as the reducing function of
``functools.reduce`` and callgrind collects while ``functools_reduce`` is on the stack
(``--toggle-collect``), so imports, the world build and tantivy's threads stay out of the count.

``python -m bench.instructions --before ../before`` prints, per operation, the instructions of
each tree and the ratio after / before (``git worktree add ../before <commit>`` for an earlier
commit). Both trees run with this interpreter, each with ``PYTHONPATH`` set to it. Needs
``valgrind`` (Debian's ``valgrind`` package); a loop of 200 episodes takes about a minute per
figure.

Figures, each per operation:

- ``env.reset``: a reset of a memoised case;
- ``env.step (text)``: a step whose action is the assistant's text with one ``<tool_call>``;
- ``env.step (message)``: a step whose action is an assistant message dict with ``tool_calls``
  (as ``twin bench catalog`` sends).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LOOP", "MODES", "count", "main", "per_operation"]

#: The loop run under callgrind: ``MODE N`` as arguments. Written against the registry and
#: ``TwinEnv`` only, so an earlier tree runs it unchanged.
LOOP = r"""
import functools, json, sys
from twin.env import TwinEnv
from twin.registry import make_twin

mode, n = sys.argv[1], int(sys.argv[2])
twin = make_twin("Catalog-v1")
env = TwinEnv(twin)
opts = {"split": "test", "index": 0}
env.reset(options=opts)
task = twin.case("test", 0).task
calls = {
    "get_attribute_schema": {"category_id": twin.case("test", 0).truth["category_id"]},
    "search_taxonomy": {"query": "running shoes"},
    "lookup_brand": {"name": task.get("brand") or "Acme"},
    "get_seller": {"name": task["seller"]},
}
text = [
    "<tool_call>\n" + json.dumps({"name": k, "arguments": v}) + "\n</tool_call>"
    for k, v in calls.items()
]
message = [
    {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function",
     "function": {"name": k, "arguments": json.dumps(v)}}]}
    for i, (k, v) in enumerate(calls.items())
]
actions = {"reset": [], "text": text, "message": message}[mode]

def episode(_acc, _i):
    env.reset(options=opts)
    for action in actions:
        env.step(action)

for _ in range(3):  # warm the caches (search results, the case memo) before counting
    episode(None, 0)
functools.reduce(episode, range(n), None)
"""

#: Figure name -> loop mode.
MODES = {"env.reset": "reset", "env.step (text)": "text", "env.step (message)": "message"}

_STEPS = 4  # look-up steps per episode in the text and message modes

_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def count(tree: Path, mode: str, n: int, python: str = sys.executable) -> int:
    """Instructions callgrind counts in ``n`` episodes of ``mode`` run from ``tree``.

    Raises:
        RuntimeError: valgrind is missing, or the run printed no count (its output is quoted).
    """
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("valgrind is not installed (Debian: apt-get install valgrind)")
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    cmd = [
        valgrind,
        "--tool=callgrind",
        "--collect-atstart=no",
        "--toggle-collect=functools_reduce",
        "--callgrind-out-file=/dev/null",
        python,
        "-c",
        LOOP,
        mode,
        str(n),
    ]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    found = _COLLECTED.findall(proc.stderr)
    if proc.returncode != 0 or not found:
        raise RuntimeError(
            f"callgrind run in {tree} ({mode}, n={n}) failed with exit code {proc.returncode}:\n"
            f"{proc.stderr[-2000:]}"
        )
    return int(found[-1])


def per_operation(counts: dict[str, int], n: int) -> dict[str, float]:
    """Instructions per operation from the totals of ``n`` episodes per mode: a reset is its
    episode; a step is its episode less one reset, divided by the steps in it."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    reset = counts["env.reset"] / n
    figures = {"env.reset": reset}
    for name in ("env.step (text)", "env.step (message)"):
        if name in counts:
            figures[name] = (counts[name] / n - reset) / _STEPS
    return figures


def _figures(tree: Path, n: int) -> dict[str, float]:
    return per_operation({name: count(tree, mode, n) for name, mode in MODES.items()}, n)


def main(argv: Sequence[str] | None = None) -> int:
    """Print instructions per ``env.reset`` and ``env.step`` for this tree (and ``--before``)."""
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    parser.add_argument("--before", type=Path, help="An earlier tree to compare against.")
    parser.add_argument(
        "--after", type=Path, default=Path(__file__).resolve().parents[1], help="This checkout."
    )
    parser.add_argument("--n", type=int, default=200, help="Episodes counted per figure.")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"--n must be at least 1, got {args.n}")
    after = _figures(args.after, args.n)
    before = _figures(args.before, args.n) if args.before else None
    print(f"instructions per operation ({args.n} episodes each; callgrind)")
    for name, value in after.items():
        line = f"{name:20} {value:>10,.0f}"
        if before is not None:
            was = before[name]
            line = f"{name:20} {was:>10,.0f} -> {value:>10,.0f}  {value / was:.3f}x"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

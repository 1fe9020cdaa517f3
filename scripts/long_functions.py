"""List functions longer than a limit (80 lines) that carry no reason for their length.

A function's length runs from its ``def`` line to its last line; decorators are not counted. A
long function is accepted when the line directly above it (above its decorators) is a comment
that starts with ``# long:`` and says why, e.g. ``# long: the Typer options are the signature``.

``python scripts/long_functions.py [PATH ...]`` prints ``length path:line name`` for each
offender and exits 1 when there is one; ``make lint`` runs it over the project's packages.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

__all__ = ["LIMIT", "LongFunction", "long_functions", "main"]

#: The most lines a function may take without a stated reason.
LIMIT = 80
#: Folders never scanned: environments, build output, caches.
SKIP = {".git", ".venv", ".venv-vllm", "build", "runs", "__pycache__", "node_modules"}


class LongFunction(NamedTuple):
    """One function over the limit without a ``# long:`` reason."""

    path: str
    line: int
    name: str
    length: int


def _python_files(paths: Iterable[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_file():
            yield path
        elif path.is_dir():
            for file in sorted(path.rglob("*.py")):
                if not SKIP.intersection(file.relative_to(path).parts):
                    yield file
        else:
            raise FileNotFoundError(f"{path}: no such file or folder")


def long_functions(source: str, path: str = "<source>", limit: int = LIMIT) -> list[LongFunction]:
    """The functions of ``source`` longer than ``limit`` lines with no ``# long:`` line above."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length <= limit:
            continue
        top = min([d.lineno for d in node.decorator_list] + [node.lineno])
        above = lines[top - 2].strip() if top >= 2 else ""
        if not above.startswith("# long:") or not above[len("# long:") :].strip():
            found.append(LongFunction(path, node.lineno, node.name, length))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[Path(".")])
    parser.add_argument("--limit", type=int, default=LIMIT, help="Most lines without a reason.")
    args = parser.parse_args(argv)
    found = []
    for file in _python_files(args.paths):
        found += long_functions(file.read_text(encoding="utf-8"), str(file), args.limit)
    for f in sorted(found, key=lambda f: -f.length):
        print(f"{f.length:4d} {f.path}:{f.line} {f.name}")
    if found:
        print(f"{len(found)} function(s) over {args.limit} lines without a '# long: <reason>' line")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

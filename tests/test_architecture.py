"""The packages' import directions (docs/architecture.md), checked on the import graph.

The contracts themselves live in pyproject.toml (`[tool.importlinter]`), so `lint-imports` on the
command line and this test check the same thing.
"""

from __future__ import annotations

from pathlib import Path

from importlinter.application.output import console
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_directions_follow_the_contracts() -> None:
    # import-linter prints its report through its own rich console; capture it so a broken
    # contract fails with import-linter's own explanation (which import, along which chain).
    with console.capture() as captured:
        exit_code = lint_imports(
            config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True
        )
    report = captured.get()
    assert exit_code == 0, report

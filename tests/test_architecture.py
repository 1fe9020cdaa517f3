"""The packages' import directions (docs/architecture.md), checked on the import graph.

The contracts themselves live in pyproject.toml (`[tool.importlinter]`), so `lint-imports` on the
command line and this test check the same thing.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import grimp
from importlinter.application.output import console
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
ROOT_PACKAGES = ("twin", "rewards", "envs", "trainer", "integrations", "twinrl_cli", "bench")


@functools.cache
def _lint() -> tuple[int, str]:
    """``lint-imports`` on pyproject.toml's contracts: the exit code and the report."""
    # import-linter prints its report through its own rich console; capture it so a broken
    # contract fails with import-linter's own explanation (which import, along which chain).
    # lint_imports configures logging with disable_existing_loggers: put every logger back as it
    # was, or later tests that read our loggers (caplog) would see nothing
    loggers = [logging.getLogger(name) for name in logging.root.manager.loggerDict]
    disabled = [logger.disabled for logger in loggers]
    try:
        with console.capture() as captured:
            exit_code = lint_imports(
                config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True
            )
    finally:
        for logger, was in zip(loggers, disabled):
            logger.disabled = was
    return exit_code, captured.get()


def test_import_directions_follow_the_contracts() -> None:
    exit_code, report = _lint()
    assert exit_code == 0, report


def test_the_libraries_are_checked_to_import_no_benchmark() -> None:
    # the contract that keeps bench/ out of the libraries is one of those checked, and holds
    _, report = _lint()
    line = " ".join(report.split())
    assert "(bench) sit above the libraries: none imports them KEPT" in line, report


def test_the_core_of_twin_is_checked_to_import_none_of_its_sub_packages() -> None:
    # twin/*.py (tools, cases, Twin, TwinEnv, parsing, registry, rollout, ...) never import the
    # run store, evaluation, policies, doctor or web viewer; that contract is checked, and holds
    _, report = _lint()
    line = " ".join(report.split())
    assert (
        "the core of twin imports none of its sub-packages (store, evaluation, policies, doctor, "
        "ui) KEPT" in line
    ), report


# Import cycles between our modules not yet broken, as (importer, imported) of the import that
# closes the cycle. Lazy imports inside functions count: they still tie the two modules together.
KNOWN_CYCLES: frozenset[tuple[str, str]] = frozenset()


def _import_cycles() -> set[tuple[str, str]]:
    """Every direct import ``a -> b`` (a before b) for which a chain of imports leads back."""
    graph = grimp.build_graph(*ROOT_PACKAGES, cache_dir=None)
    cycles = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            if graph.find_shortest_chain(importer=imported, imported=importer):
                cycles.add(tuple(sorted((importer, imported))))
    return cycles


def test_no_new_import_cycles_between_our_modules() -> None:
    cycles = _import_cycles()
    new = sorted(cycles - KNOWN_CYCLES)
    assert not new, f"import cycles between our modules (a <-> b): {new}; break them"
    gone = sorted(KNOWN_CYCLES - cycles)
    assert not gone, f"these known cycles are gone: {gone}; remove them from KNOWN_CYCLES"

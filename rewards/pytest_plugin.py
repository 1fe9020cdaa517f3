"""pytest plugin (entry point ``pytest11: twin_rewards``): every case of a ``*.rollouts.yaml``
file becomes a test item, as ``check_env`` does for environments.

``pytest data/rollouts/`` (or a path to one file) checks each hand-written rollout against
its twin's reward; a failure shows expected vs got and the full breakdown. Heavy imports
(the twin, its world) happen only when such a file is collected. A file's ``reward:
module:attr`` outside the reward library and the registered twins' packages needs
``pytest --rollouts-allow-import`` (see :mod:`rewards.testing`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

__all__ = ["RolloutItem", "RolloutYamlFile", "pytest_addoption", "pytest_collect_file"]

SUFFIX = ".rollouts.yaml"


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--rollouts-allow-import``: let rollout files import their ``reward:`` from any module."""
    parser.getgroup("twin_rewards").addoption(
        "--rollouts-allow-import",
        action="store_true",
        default=False,
        help="let *.rollouts.yaml files import `reward: module:attr` from any module (runs its "
        "code)",
    )


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """Collect ``*.rollouts.yaml`` files."""
    if file_path.name.endswith(SUFFIX):
        return RolloutYamlFile.from_parent(parent, path=file_path)
    return None


class RolloutFileError(Exception):
    """A rollout file that does not load."""


class RolloutYamlFile(pytest.File):
    """A rollout file: one item per case."""

    def collect(self) -> Any:
        """Yield one :class:`RolloutItem` per case (or one failing item if the file is invalid)."""
        from rewards.testing import load_rollout_file
        from twin.errors import ConfigError

        try:
            spec = load_rollout_file(self.path)
        except ConfigError as exc:
            raise RolloutFileError(str(exc)) from None
        seen: dict[str, int] = {}
        for case in spec.cases:
            n = seen.get(case.name, 0)
            seen[case.name] = n + 1
            name = case.name if n == 0 else f"{case.name}#{n + 1}"
            yield RolloutItem.from_parent(self, name=name, spec=spec, case=case)


class RolloutMismatch(Exception):
    """A case scored differently from its expectation."""


class RolloutItem(pytest.Item):
    """One rollout case: score it and compare with ``expect``."""

    def __init__(self, *, spec: Any, case: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.case = case

    def runtest(self) -> None:
        """Score the case; raise :class:`RolloutMismatch` when it does not meet ``expect``."""
        from rewards.testing import score_case

        allow = bool(self.config.getoption("rollouts_allow_import", default=False))
        outcome = score_case(self.spec, self.case, file=str(self.path), allow_import=allow)
        if not outcome.passed:
            raise RolloutMismatch(outcome.describe())

    def repr_failure(self, excinfo: Any, style: Any = None) -> Any:
        """Show expected vs got and the breakdown instead of a traceback."""
        if isinstance(excinfo.value, RolloutMismatch):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int, str]:
        """Location shown by pytest."""
        return self.path, 0, f"rollout: {self.name}"

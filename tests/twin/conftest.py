"""Shared doubles of the twin-core tests: a tiny key/value twin and its reward.

``test_cli``, ``test_rollout`` and ``test_policies`` each need a twin that is quick to build and
trivially solvable (look a key up, submit its value). They share :class:`KeyTwin` through the
``key_twin_cls`` fixture (tests run with ``--import-mode=importlib``, so test files cannot import
each other) and subclass it for what they test: the name, the splits, the size of the world and
how a case picks its key are class attributes and small hooks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from twin.core import Twin
from twin.errors import ToolError
from twin.tools import tool


@dataclass
class Result:
    """What a reward returns, without importing ``rewards``."""

    total: float
    components: dict[str, float] = field(default_factory=dict)
    weighted: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def keyed_reward(trajectory: Any, case: Any) -> Result:
    """1.0 when the submitted value is the case's, else 0.0."""
    correct = float((trajectory.submission or {}).get("value") == case.truth["value"])
    return Result(
        total=correct,
        components={"correct": correct},
        weighted={"correct": correct},
        notes=["checked"],
    )


class KeyTwin(Twin):
    """Find the value stored under a key and submit it; keys ``k0 .. k<world_size - 1>``."""

    name = "KeyTest"
    description = "Find the value stored under a key and submit it."
    splits = {"train": 50, "test": 500}
    reward = keyed_reward
    world_size: ClassVar[int] = 600

    def value_of(self, i: int) -> str:
        """The value stored under ``k<i>``."""
        return f"v{i * 7 % 101}"

    def key_for(self, rng: random.Random, index: int) -> str:
        """The key case ``index`` asks for (drawn from the case's rng)."""
        return f"k{rng.randrange(self.world_size)}"

    def kind_for(self, index: int) -> str:
        """The case kind (two kinds, so per-kind metrics have something to split)."""
        return "even" if index % 2 == 0 else "odd"

    def build_world(self) -> dict[str, str]:
        return {f"k{i}": self.value_of(i) for i in range(self.world_size)}

    def make_case(self, rng: random.Random, split: str, index: int) -> tuple[str, dict, dict]:
        key = self.key_for(rng, index)
        return self.kind_for(index), {"key": key}, {"value": self.world[key]}

    def prompt(self, case: Any) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": "Use the tools."},
            {"role": "user", "content": f"Find the value of key {case.task['key']} and submit it."},
        ]

    @tool
    def lookup(self, key: str, world: Any) -> dict[str, str]:
        """Look up the value stored under a key.

        Args:
            key: The key, e.g. "k12".
        """
        if key not in world:
            raise ToolError(f"no key {key!r}")
        return {"key": key, "value": world[key]}

    @tool(terminal=True)
    def submit(self, value: str) -> str:
        """Submit the value.

        Args:
            value: The value found.
        """
        return "submitted"


@pytest.fixture(scope="session")
def key_twin_cls() -> type[KeyTwin]:
    """The :class:`KeyTwin` class, to instantiate or subclass."""
    return KeyTwin

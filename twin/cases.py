"""Controlled cases: the task an episode starts from, and its hidden truth.

A case is addressed by ``(split, index)`` and must be the same bytes on every machine: twins
draw everything from :func:`case_rng`, which derives a seed from a SHA-256 of the twin name,
the world seed, the split and the index (never from ``hash()``, which Python salts per process).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Case", "DEFAULT_SPLITS", "case_rng", "stable_seed"]

#: Default split sizes; twins override ``Twin.splits``.
DEFAULT_SPLITS: dict[str, int] = {"train": 10_000, "dev": 200, "test": 200}


class Case(BaseModel):
    """One controlled case.

    Attributes:
        twin: Name of the twin that made it.
        split: ``train``, ``dev`` or ``test`` (or a twin's own split names).
        index: Position within the split.
        kind: The planted case type, e.g. ``"counterfeit_typosquat"``; used for per-type metrics.
        task: What the agent may see (the prompt is rendered from it; tools get it as ``task``).
        truth: The hidden right answer; only the reward and the terminal ``info`` see it.
    """

    model_config = ConfigDict(frozen=True)

    twin: str
    split: str
    index: int = Field(ge=0)
    kind: str = "default"
    task: dict[str, Any]
    truth: dict[str, Any]

    @property
    def id(self) -> str:
        """A stable id, ``<twin>/<split>/<index>``."""
        return f"{self.twin}/{self.split}/{self.index}"

    def canonical_json(self) -> str:
        """Sorted-key JSON of the whole case, for byte-identity checks."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, ensure_ascii=False)


def stable_seed(*parts: Any) -> int:
    """A 64-bit seed from the parts' text, identical on every machine and Python version."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def case_rng(twin: str, seed: int, split: str, index: int) -> random.Random:
    """The random generator a twin uses to build case ``(split, index)``.

    ``random.Random`` seeded with an int gives the same stream on every platform.
    """
    return random.Random(stable_seed(twin, seed, split, index))

"""twinrl's trainer: GRPO-family losses, token-exact renderer, samplers, learner, async loop.

Importing ``trainer`` is cheap: torch and transformers load only when a name that needs them is
first used (``trainer.Renderer``, ``trainer.build_tiny``, ...). The algorithms are in
:mod:`trainer.algorithms`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["EpisodeTokens", "Renderer", "build_tiny"]

# name -> module that defines it (loaded on first access, PEP 562)
_LAZY = {
    "EpisodeTokens": "trainer.renderer",
    "Renderer": "trainer.renderer",
    "build_tiny": "trainer.tiny",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

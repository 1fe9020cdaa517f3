"""Locate the data files twinrl ships (vocabularies, recipes, example rollouts).

In a checkout (or an editable install) they live in ``data/`` at the repository root. In a
wheel they are installed as the package ``twinrl_data``; :func:`data_path` finds either.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["data_path"]

_REPO_DATA = Path(__file__).resolve().parent.parent / "data"


def data_path(*parts: str) -> Path:
    """Return the path of a shipped data file or folder, e.g.
    ``data_path("recipes", "toy-cpu.yaml")``.

    Raises:
        FileNotFoundError: the file is not shipped; the message names where it was looked for.
    """
    roots = [_REPO_DATA]
    spec = importlib.util.find_spec("twinrl_data")
    if spec is not None and spec.submodule_search_locations:
        roots.extend(Path(p) for p in spec.submodule_search_locations)
    for root in roots:
        candidate = root.joinpath(*parts)
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"twinrl data file {'/'.join(parts)!r} not found; looked in: {', '.join(map(str, roots))}"
    )

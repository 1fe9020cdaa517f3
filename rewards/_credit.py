"""Partial credit: hierarchical category credit from path ids, and set / attribute F1."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

__all__ = [
    "attribute_f1",
    "attribute_pairs",
    "category_credit",
    "common_ancestor_depth",
    "id_depth",
    "normalize_value",
    "set_f1",
]


def _parts(category_id: str) -> list[str]:
    return category_id.strip().split("-")


def id_depth(category_id: str) -> int:
    """Depth of a path id: ``aa`` is 1, ``aa-1-13-8`` is 4."""
    return len(_parts(category_id))


def common_ancestor_depth(a: str, b: str) -> int:
    """Depth of the deepest common ancestor of two path ids (0 when none).

    Segments are compared whole: ``aa-1-13`` and ``aa-1-1`` share ``aa-1`` (depth 2).
    """
    depth = 0
    for x, y in zip(_parts(a), _parts(b)):
        if x != y:
            break
        depth += 1
    return depth


def category_credit(
    true_id: str, submitted_id: Any, exists: Callable[[str], bool] | None = None
) -> float:
    """Credit for a submitted category id against the true one, from the ids alone.

    1 when the ids are equal (after trimming); 0 when ``submitted_id`` is not a non-empty
    string or ``exists`` says it does not exist; otherwise
    ``depth(deepest common ancestor) / max(depth(true), depth(submitted))``.

    Args:
        true_id: The right id, e.g. ``aa-1-13-8``.
        submitted_id: The agent's id.
        exists: Whether an id exists in the taxonomy; None accepts every id.

    Returns:
        A value in ``[0, 1]``.
    """
    if not isinstance(submitted_id, str) or not submitted_id.strip():
        return 0.0
    t, s = true_id.strip(), submitted_id.strip()
    if t == s:
        return 1.0
    if exists is not None and not exists(s):
        return 0.0
    return common_ancestor_depth(t, s) / max(id_depth(t), id_depth(s))


def normalize_value(value: Any) -> str:
    """Attribute values compare case-insensitively after trimming: ``" Red "`` -> ``"red"``."""
    return str(value).strip().casefold()


def set_f1(truth: Iterable[Hashable], predicted: Iterable[Hashable]) -> float:
    """F1 of two sets: ``2|T & P| / (|T| + |P|)``; 1 when both are empty, 0 when only one is."""
    t, p = set(truth), set(predicted)
    if not t and not p:
        return 1.0
    return 2 * len(t & p) / (len(t) + len(p))


def attribute_pairs(attributes: Mapping[str, Any] | None) -> set[tuple[str, str]]:
    """``{(handle, normalised value)}``; a list value gives one pair per element.

    Handles are trimmed (not case-folded: they are slugs such as ``color``); a missing or
    non-mapping ``attributes`` gives the empty set.
    """
    if not isinstance(attributes, Mapping):
        return set()
    pairs: set[tuple[str, str]] = set()
    for handle, value in attributes.items():
        values = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
        for v in values:
            if v is None:
                continue
            pairs.add((str(handle).strip(), normalize_value(v)))
    return pairs


def attribute_f1(truth: Mapping[str, Any] | None, submitted: Mapping[str, Any] | None) -> float:
    """F1 over ``(attribute handle, value)`` pairs, values compared case-insensitively after
    trimming.

    An empty truth and an empty submission give 1.
    """
    return set_f1(attribute_pairs(truth), attribute_pairs(submitted))

"""Hypothesis strategies in the catalog's answer format, without building the catalog's world.

:func:`category_ids` (Shopify-style path ids), :func:`attribute_dicts`, :func:`catalog_truths`,
:func:`catalog_cases`, :func:`catalog_submissions` (``submit`` arguments, random or mixed with
the truth) and :func:`catalog_episodes` (a case and an episode on it). The generic ones (cases a
twin makes, episodes ending in a drawn submission) are in ``rewards/strategies.py``.

Needs ``hypothesis`` (the ``dev`` extra).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from envs.catalog.reward import VERDICTS
from rewards.strategies import trajectories
from twin.cases import Case
from twin.trajectory import Trajectory

__all__ = [
    "attribute_dicts",
    "catalog_cases",
    "catalog_episodes",
    "catalog_submissions",
    "catalog_truths",
    "category_ids",
]

_VERTICALS = ("aa", "ae", "el", "hg", "sg", "tg")
_HANDLES = ("color", "size", "material", "pattern", "age_group", "target_gender", "capacity")
_VALUES = ("red", "Red", " blue ", "cotton", "XL", "adult", "unisex", "500 ml", "striped", "steel")


def category_ids(
    verticals: tuple[str, ...] = _VERTICALS, max_depth: int = 7
) -> st.SearchStrategy[str]:
    """Shopify-style path ids such as ``aa-1-13-8`` (depth 1 to ``max_depth``)."""
    return st.builds(
        lambda v, rest: "-".join([v, *map(str, rest)]),
        st.sampled_from(verticals),
        st.lists(st.integers(1, 4), max_size=max_depth - 1),
    )


def attribute_dicts(max_size: int = 4) -> st.SearchStrategy[dict[str, str]]:
    """Attribute dicts ``{handle: value}`` with realistic handles and case/space variants."""
    return st.dictionaries(st.sampled_from(_HANDLES), st.sampled_from(_VALUES), max_size=max_size)


def catalog_truths() -> st.SearchStrategy[dict[str, Any]]:
    """Truths in the catalog format: ``category_id``, ``attributes``, ``verdict``, ``signals``."""
    return st.fixed_dictionaries(
        {
            "category_id": category_ids(),
            "attributes": attribute_dicts(),
            "verdict": st.sampled_from(VERDICTS),
            "signals": st.lists(
                st.sampled_from(["price_anomaly", "typosquat", "replica_wording"]), max_size=2
            ),
        }
    )


def catalog_cases(
    truths: st.SearchStrategy[dict[str, Any]] | None = None,
) -> st.SearchStrategy[Case]:
    """Catalog cases (``twin="Catalog"``) with the given truths (default :func:`catalog_truths`)."""
    return st.builds(
        lambda truth, index: Case(
            twin="Catalog", split="test", index=index, kind="generated", task={}, truth=truth
        ),
        truths if truths is not None else catalog_truths(),
        st.integers(0, 10_000),
    )


def catalog_submissions(truth: dict[str, Any] | None = None) -> st.SearchStrategy[dict[str, Any]]:
    """Arguments of ``submit``: random, or (given ``truth``) random mixes of right and wrong
    parts."""
    ids = category_ids()
    attrs = attribute_dicts()
    if truth is not None:
        ids = st.one_of(st.just(truth["category_id"]), ids)
        attrs = st.one_of(st.just(dict(truth.get("attributes") or {})), attrs)
    return st.fixed_dictionaries(
        {
            "category_id": ids,
            "attributes": attrs,
            "verdict": st.sampled_from(VERDICTS),
            "reason": st.text(max_size=20),
        }
    )


@st.composite
def catalog_episodes(draw: st.DrawFn) -> tuple[Case, Trajectory]:
    """A catalog case and an episode on it (submission near or far from the truth, or none)."""
    case = draw(catalog_cases())
    subs = st.one_of(st.none(), catalog_submissions(case.truth))
    return case, draw(trajectories(case, subs))

"""Catalog v2 (issue #23): four decisions, borderline evidence, held-out tactics, a ceiling policy
that plays the written policy from tool outputs only, and the constant and cheap policies far
below it."""

from __future__ import annotations

import ast
import statistics
from pathlib import Path

import pytest

from twin.doctor_play import play
from twin.errors import ConfigError

from envs.catalog.v2.listings import HELD_OUT, KIND_DECISION

N = 150  # test cases played per policy in the fast suite (the 1,000-case figures: docs/catalog-v2.md)


@pytest.fixture(scope="module")
def v2(twin_v1):
    """Catalog v2 on the generated world (the offline default), seed 0."""
    from envs.catalog import CatalogTwinV2

    t = CatalogTwinV2(seed=0, taxonomy_path=None, train_size=2000, dev_size=200, test_size=400)
    t.world
    return t


def _mean(t, name, n=N):
    policy = t.baselines()[name](t)
    run = play(t, policy, [("test", i) for i in range(n)])
    assert not run.errors, run.errors[:3]
    return statistics.fmean(e.reward or 0.0 for e in run.episodes)


def test_v2_is_a_preview_beside_v1(v2):
    import twin as twinlib

    assert twinlib.spec("catalog").id == "twin/Catalog-v1"
    assert twinlib.spec("Catalog-v2").load() is type(v2)


def test_cases_are_deterministic_and_labelled_by_kind(v2):
    from envs.catalog import CatalogTwinV2

    fresh = CatalogTwinV2(seed=0, taxonomy_path=None, train_size=2000, dev_size=200, test_size=400)
    for i in range(0, 400, 23):
        a, b = v2.case("test", i), fresh.case("test", i)
        assert (a.kind, a.task, a.truth) == (b.kind, b.task, b.truth)
        assert a.truth["decision"] == KIND_DECISION[a.kind]
        assert (a.truth["request"] is None) == (a.truth["decision"] != "escalate")
    with pytest.raises(ConfigError):
        CatalogTwinV2(case_mix={"cleen": 1.0}, taxonomy_path=None)


def test_held_out_kinds_and_leaves(v2):
    train = [v2.case("train", i) for i in range(600)]
    test = [v2.case("test", i) for i in range(400)]
    assert not {c.kind for c in train} & set(HELD_OUT)
    assert set(HELD_OUT) <= {c.kind for c in test}
    assert not {c.truth["category_id"] for c in train} & {c.truth["category_id"] for c in test}
    # every decision and every request appears in the test split
    assert {c.truth["decision"] for c in test} == {"ok", "counterfeit", "prohibited", "escalate"}
    assert {c.truth["request"] for c in test} - {None} == {"invoice", "authorisation_letter",
                                                          "safety_certificate", "recall_remedy_notice"}


def test_ceiling_reaches_the_maximum_and_cheap_policies_lose(v2):
    ceiling = _mean(v2, "ceiling")
    assert ceiling >= 0.95
    for name in ("always_ok", "always_counterfeit", "always_prohibited", "always_escalate", "two_call_flagger"):
        assert _mean(v2, name) <= ceiling - 0.40, name
    assert _mean(v2, "heuristic") <= ceiling - 0.25


def test_ceiling_imports_no_labelling_code():
    src = Path(__file__).resolve().parents[3] / "envs" / "catalog" / "v2" / "ceiling.py"
    tree = ast.parse(src.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert modules <= {"__future__", "json", "re", "collections.abc", "typing"}, modules


def test_submit_needs_a_request_to_escalate(v2):
    from twin.errors import ToolError

    case = v2.case("test", 0)
    with pytest.raises(ToolError, match="request"):
        v2.submit(case.truth["category_id"], dict(case.truth["attributes"]), "escalate")

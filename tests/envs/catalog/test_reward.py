"""The catalog twin's default reward: exact values from issue 4, and hypothesis properties
(the generic checks of rewards/properties.py with the catalog's oracle, mistakes and ratios)."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings

from envs.catalog.reward import (
    CLIP_V1,
    VERDICT_COSTS,
    VERDICT_COSTS_V1,
    VERDICTS,
    make_catalog_reward,
)
from envs.catalog.reward_checks import (
    CATALOG_COST_RATIOS,
    catalog_cost_ratios,
    catalog_mistakes,
    catalog_oracle,
    check_catalog_reward,
)
from envs.catalog.strategies import catalog_cases, catalog_episodes
from rewards import CostMatrix, Reward, TermError
from rewards.properties import check_reward_properties, submission_trajectory
from twin import Case

IDS = {"aa", "aa-1", "aa-1-13", "aa-1-13-8", "aa-1-13-9", "aa-2", "el", "el-4"}
REWARD = make_catalog_reward(IDS.__contains__)
ANY_ID = make_catalog_reward(lambda i: re.fullmatch(r"[a-z]{2}(-\d+)*", i) is not None)


def case(verdict="ok", category_id="aa-1-13-8", attributes=None) -> Case:
    truth = {
        "category_id": category_id,
        "attributes": attributes if attributes is not None else {"color": "Red", "size": "M"},
        "verdict": verdict,
        "signals": [],
    }
    return Case(twin="Catalog", split="test", index=1, kind="clean", task={}, truth=truth)


def score(c: Case, reward: Reward = REWARD, invalid_calls: int = 0, **changes):
    sub = {**catalog_oracle(c), **changes}
    return reward(submission_trajectory(c, sub, invalid_calls=invalid_calls), c)


def test_oracle_scores_one_and_reports_every_component():
    r = score(case())
    assert r.total == 1.0
    assert r.components == {
        "category": 1.0,
        "attributes": 1.0,
        "policy": 1.0,
        "invalid_calls": 0.0,
        "penalty": 0.0,
        "submitted": 1.0,
    }


@pytest.mark.parametrize(("true", "sub"), list(itertools.product(VERDICTS, VERDICTS)))
def test_every_verdict_pair(true, sub):
    cost = {
        ("ok", "ok"): 0,
        ("ok", "counterfeit"): 2 / 7,
        ("ok", "prohibited"): 2 / 7,
        ("counterfeit", "ok"): 2,
        ("counterfeit", "counterfeit"): 0,
        ("counterfeit", "prohibited"): 2 / 7,
        ("prohibited", "ok"): 2,
        ("prohibited", "counterfeit"): 2 / 7,
        ("prohibited", "prohibited"): 0,
    }[(true, sub)]
    r = score(case(true), verdict=sub)
    assert r.components["policy"] == pytest.approx(1 - cost)
    assert r.total == pytest.approx(0.6 + 0.4 * (1 - cost))


def test_miss_costs_seven_false_alarms():
    miss = score(case("counterfeit"), verdict="ok")
    alarm = score(case("ok"), verdict="counterfeit")
    assert miss.components["policy"] == -1.0
    assert alarm.components["policy"] == pytest.approx(5 / 7)
    assert (1 - miss.total) / (1 - alarm.total) == pytest.approx(7.0)
    assert VERDICT_COSTS.ratio(("counterfeit", "ok"), ("ok", "counterfeit")) == pytest.approx(7.0)
    assert VERDICT_COSTS.cost("prohibited", "ok") == 2.0 and VERDICT_COSTS.cost(
        "ok", "prohibited"
    ) == pytest.approx(2 / 7)


@pytest.mark.parametrize(
    ("sub_id", "credit"),
    [
        ("aa-1-13-8", 1.0),
        ("aa-1-13-9", 0.75),
        ("aa-1-13", 0.75),
        ("aa-1", 0.5),
        ("aa-2", 0.25),
        ("aa", 0.25),
        ("el-4", 0.0),
        ("aa-1-13-7", 0.0),
        ("nonsense", 0.0),
    ],
)
def test_category_credit_in_the_reward(sub_id, credit):
    r = score(case(), category_id=sub_id)
    assert r.components["category"] == pytest.approx(credit)
    assert r.total == pytest.approx(0.3 * credit + 0.7)


def test_attributes_component():
    assert score(case(), attributes={"color": " red", "size": "m "}).components["attributes"] == 1.0
    assert score(case(), attributes={"color": "red"}).components["attributes"] == pytest.approx(
        2 / 3
    )
    assert score(case(), attributes={"color": "red", "size": "M", "x": "1"}).components[
        "attributes"
    ] == pytest.approx(0.8)
    assert score(case(), attributes={}).components["attributes"] == 0.0
    empty = case(attributes={})
    assert score(empty, attributes={}).components["attributes"] == 1.0
    assert score(empty, attributes={"color": "red"}).components["attributes"] == 0.0
    # a submission that leaves attributes out is an empty submission
    c = case(attributes={})
    sub = {k: v for k, v in catalog_oracle(c).items() if k != "attributes"}
    assert REWARD(submission_trajectory(c, sub), c).components["attributes"] == 1.0


@pytest.mark.parametrize(
    ("n", "pen"), [(0, 0.0), (1, 0.01), (4, 0.04), (5, 0.05), (6, 0.05), (50, 0.05)]
)
def test_invalid_call_penalty_and_cap(n, pen):
    r = score(case(), invalid_calls=n)
    assert r.components["penalty"] == pytest.approx(pen) and r.components[
        "invalid_calls"
    ] == pytest.approx(pen)
    assert r.total == pytest.approx(1.0 - pen)


def test_no_submit():
    c = case("counterfeit")
    for n in (0, 3, 20):
        r = REWARD(submission_trajectory(c, None, invalid_calls=n), c)
        assert (
            r.total == -0.4 and r.components["policy"] == -1.0 and r.components["submitted"] == 0.0
        )
        assert r.components["category"] == 0.0 and r.components["attributes"] == 0.0
        assert "penalty" in r.components


def test_clip_at_minus_point_four():
    c = case("counterfeit")
    r = score(c, invalid_calls=9, category_id="el-4", attributes={}, verdict="ok")
    assert r.unclipped == pytest.approx(-0.45) and r.total == -0.4


def test_unknown_verdict_is_the_worst_decision_and_bad_truth_raises():
    assert score(case("counterfeit"), verdict="approve").components["policy"] == -1.0
    assert score(case("ok"), verdict=" OK ").components["policy"] == 1.0
    bad = Case(
        twin="Catalog",
        split="test",
        index=0,
        task={},
        truth={"category_id": "aa", "attributes": {}, "verdict": "maybe", "signals": []},
    )
    with pytest.raises(TermError, match="policy"):
        REWARD(
            submission_trajectory(bad, {"category_id": "aa", "attributes": {}, "verdict": "ok"}),
            bad,
        )


# -- properties ---------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(catalog_episodes())
def test_bounded_and_deterministic(episode):
    c, t = episode
    r1, r2 = ANY_ID(t, c), ANY_ID(t, c)
    assert r1 == r2
    assert -0.4 <= r1.total <= 1.0
    assert set(r1.components) >= {"category", "attributes", "policy", "penalty"}


@settings(max_examples=100, deadline=None)
@given(catalog_cases())
def test_oracle_is_max_and_single_mistakes_cost(c):
    best = ANY_ID(submission_trajectory(c, catalog_oracle(c)), c).total
    assert best == 1.0
    for label, t in catalog_mistakes(c).items():
        assert ANY_ID(t, c).total < best, label


def test_check_reward_properties_on_the_catalog_reward():
    report = check_catalog_reward(ANY_ID, catalog_cases(), max_examples=120)
    assert report.examples == 120 and report.bounds == (-0.4, 1.0)
    for pair, ratio in report.ratios.items():
        assert ratio == pytest.approx(7.0), pair
    assert report.losses["verdict_counterfeit_as_ok"] == [pytest.approx(0.8)]
    assert report.losses["verdict_ok_as_counterfeit"] == [pytest.approx(0.8 / 7)]


def test_check_reward_properties_catches_a_broken_reward():
    # a reward that gives the same to a miss and a false alarm breaks the stated 7x ratio
    flat = make_catalog_reward(lambda i: True).with_overrides(
        {"weights": {"policy": 0.0}, "clip": [-0.4, 0.6]}
    )
    with pytest.raises(AssertionError, match="single mistake 'verdict_"):
        check_catalog_reward(flat, catalog_cases(), max_examples=20)


def test_the_generic_check_holds_a_reward_to_the_ratios_it_is_given():
    # symmetric verdict costs: every single mistake still costs, but a miss is no worse than a
    # false alarm; the generic check knows no catalog, so only the ratios it is given can catch it
    even = make_catalog_reward(
        lambda i: True,
        costs=CostMatrix({v: {w: 1.0 for w in VERDICTS if w != v} for v in VERDICTS}),
    )
    report = check_reward_properties(
        even, catalog_cases(), oracle=catalog_oracle, mistakes=catalog_mistakes, max_examples=30
    )
    assert report.examples == 30 and report.ratios == {}
    assert report.losses["verdict_counterfeit_as_ok"] == [pytest.approx(0.4)]
    assert report.losses["verdict_ok_as_counterfeit"] == [pytest.approx(0.4)]
    with pytest.raises(AssertionError, match="cost ratio 'verdict_.*expected 7"):
        check_reward_properties(
            even,
            catalog_cases(),
            oracle=catalog_oracle,
            mistakes=catalog_mistakes,
            cost_ratios=CATALOG_COST_RATIOS,
            max_examples=30,
        )
    with pytest.raises(TypeError, match="oracle must be a callable"):
        check_reward_properties(even, catalog_cases(), oracle=None, mistakes=catalog_mistakes)


def test_the_cost_ratios_are_read_off_the_cost_matrix():
    assert {(a, b) for a, b, _ in CATALOG_COST_RATIOS} == {
        ("verdict_counterfeit_as_ok", "verdict_ok_as_counterfeit"),
        ("verdict_counterfeit_as_ok", "verdict_counterfeit_as_prohibited"),
        ("verdict_prohibited_as_ok", "verdict_ok_as_prohibited"),
        ("verdict_prohibited_as_ok", "verdict_prohibited_as_counterfeit"),
    }
    assert all(r == pytest.approx(7.0) for _, _, r in CATALOG_COST_RATIOS)
    v1 = catalog_cost_ratios(VERDICT_COSTS_V1)
    assert [(a, b) for a, b, _ in v1] == [(a, b) for a, b, _ in CATALOG_COST_RATIOS]
    assert [r for *_, r in v1] == pytest.approx([r for *_, r in CATALOG_COST_RATIOS])
    skewed = CostMatrix(
        {
            "ok": {"counterfeit": 1.0, "prohibited": 1.0},
            "counterfeit": {"ok": 3.0, "prohibited": 1.5},
            "prohibited": {"ok": 2.0, "counterfeit": 1.0},
        }
    )
    ratios = {(a, b): r for a, b, r in catalog_cost_ratios(skewed)}
    assert ratios[("verdict_counterfeit_as_ok", "verdict_ok_as_counterfeit")] == pytest.approx(3.0)
    assert ratios[
        ("verdict_counterfeit_as_ok", "verdict_counterfeit_as_prohibited")
    ] == pytest.approx(2.0)


# -- catalog v1: same weights and 7:1 ratio, 2.5x the cost scale, total clipped to [-1, 1] -------
REWARD_V1 = make_catalog_reward(IDS.__contains__, costs=VERDICT_COSTS_V1, clip=CLIP_V1)
ANY_ID_V1 = make_catalog_reward(
    lambda i: re.fullmatch(r"[a-z]{2}(-\d+)*", i) is not None, costs=VERDICT_COSTS_V1, clip=CLIP_V1
)


@pytest.mark.parametrize(("true", "sub"), list(itertools.product(VERDICTS, VERDICTS)))
def test_v1_every_verdict_pair(true, sub):
    cost = 0.0 if true == sub else (5.0 if sub == "ok" else 5 / 7)
    r = score(case(true), REWARD_V1, verdict=sub)
    assert r.components["policy"] == pytest.approx(1 - cost)
    assert r.total == pytest.approx(0.6 + 0.4 * (1 - cost))


def test_v1_miss_costs_seven_false_alarms_in_the_total_and_no_submit_is_worst():
    miss = score(case("counterfeit"), REWARD_V1, verdict="ok")
    alarm = score(case("ok"), REWARD_V1, verdict="counterfeit")
    assert miss.total == pytest.approx(-1.0) and miss.unclipped == pytest.approx(-1.0)
    assert (1 - miss.total) / (1 - alarm.total) == pytest.approx(7.0)
    assert VERDICT_COSTS_V1.ratio(("counterfeit", "ok"), ("ok", "counterfeit")) == pytest.approx(
        7.0
    )
    none = REWARD_V1(submission_trajectory(case("ok"), None), case("ok"))
    assert none.total == -1.0 and none.total <= miss.total


def test_v1_constant_verdicts_lose_clearly_on_the_default_mix():
    """The reward arithmetic behind the mix: with the category and attributes right, each
    constant verdict loses at least 0.15 of mean reward to always answering right."""
    from envs.catalog.v1.listings import DEFAULT_MIX, KIND_VERDICT

    share = {v: sum(w for k, w in DEFAULT_MIX.items() if KIND_VERDICT[k] == v) for v in VERDICTS}
    assert share["ok"] == pytest.approx(0.6)
    for constant in VERDICTS:
        loss = sum(
            share[t] * (1.0 - score(case(t), REWARD_V1, verdict=constant).total) for t in VERDICTS
        )
        assert loss >= 0.15, (constant, loss)
    # in v0's reward and mix a constant counterfeit verdict lost only 0.114 per false alarm
    alarm_v0 = 1.0 - score(case("ok"), verdict="counterfeit").total
    assert alarm_v0 == pytest.approx(0.8 / 7)


def test_check_reward_properties_on_the_v1_reward():
    report = check_catalog_reward(ANY_ID_V1, catalog_cases(), max_examples=80)
    assert report.bounds == (-1.0, 1.0)
    for pair, ratio in report.ratios.items():
        assert ratio == pytest.approx(7.0), pair
    assert report.losses["verdict_counterfeit_as_ok"] == [pytest.approx(2.0)]

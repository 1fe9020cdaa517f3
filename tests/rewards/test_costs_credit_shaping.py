"""Unit tests of CostMatrix, category credit, set/attribute F1 and the shaping helpers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewards import (
    CostMatrix,
    Reward,
    attribute_f1,
    category_credit,
    common_ancestor_depth,
    id_depth,
    invalid_call_penalty,
    normalize_value,
    overlong_fraction,
    overlong_penalty,
    set_f1,
    submitted_gate,
    term,
    turn_cost,
    useful_tool_bonus,
)
from twin import Case, TokenTurn, ToolCallRecord, Trajectory
from twin.errors import ConfigError

CASE = Case(twin="Toy", split="test", index=0, task={}, truth={})

# Path ids as category_credit reads them (a root, then dash-separated children), e.g. "aa-1-3".
PATH_IDS = st.builds(
    lambda root, rest: "-".join([root, *map(str, rest)]),
    st.sampled_from(["aa", "el", "zz"]),
    st.lists(st.integers(1, 4), max_size=6),
)
M = {"ok": {"ok": 0, "bad": 1.0}, "bad": {"ok": 7.0}}


def T(**kw) -> Trajectory:
    return Trajectory(twin="Toy", case_id=CASE.id, **kw)


# -- CostMatrix ---------------------------------------------------------------------------------
def test_cost_matrix_lookups_and_ratio():
    m = CostMatrix(M)
    assert m.labels == ("ok", "bad")
    assert m.cost("bad", "ok") == 7.0 and m.cost("bad", "bad") == 0.0 and m.cost("ok", "bad") == 1.0
    assert m.ratio(("bad", "ok"), ("ok", "bad")) == 7.0
    assert m.max_cost() == 7.0 and m.max_cost("ok") == 1.0
    assert "| bad | 7 | 0 |" in m.table()
    with pytest.raises(ConfigError, match="ratio is undefined"):
        m.ratio(("bad", "ok"), ("ok", "ok"))
    with pytest.raises(ConfigError, match="unknown predicted label 'Ok'.*Did you mean 'ok'"):
        m.cost("bad", "Ok")


@pytest.mark.parametrize(
    ("costs", "match"),
    [
        ({"ok": {"ok": 0, "bad": 1}}, "unknown predicted label 'bad'"),
        ({"ok": {"bad": 1}, "bad": {}}, r"missing the cost of \(true='bad', predicted='ok'\)"),
        ({"ok": {"bad": -1}, "bad": {"ok": 1}}, ">= 0"),
        ({"ok": {"bad": float("inf")}, "bad": {"ok": 1}}, "finite"),
        ({"ok": {"ok": 0.5, "bad": 1}, "bad": {"ok": 1}}, "diagonal"),
        ({}, "non-empty"),
    ],
)
def test_cost_matrix_validation(costs, match):
    with pytest.raises(ConfigError, match=match):
        CostMatrix(costs)


# -- category credit ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("true", "sub", "expected"),
    [
        ("aa-1-13-8", "aa-1-13-8", 1.0),
        ("aa-1-13-8", "aa-1-13", 3 / 4),
        ("aa-1-13-8", "aa-1-13-9", 3 / 4),
        ("aa-1-13", "aa-1-1", 2 / 3),  # segments compare whole: '1' is not a prefix of '13'
        ("aa-1", "aa-1-2-3", 2 / 4),
        ("aa-1", "el-1", 0.0),
        ("aa", "aa-1", 1 / 2),
        ("aa-1", " aa-1 ", 1.0),
        ("aa-1", "", 0.0),
        ("aa-1", None, 0.0),
        ("aa-1", 7, 0.0),
    ],
)
def test_category_credit(true, sub, expected):
    assert category_credit(true, sub) == pytest.approx(expected)


def test_category_credit_unknown_ids_get_nothing():
    exists = {"aa", "aa-1", "aa-1-1"}.__contains__
    assert category_credit("aa-1-1", "aa-1", exists) == pytest.approx(2 / 3)
    assert category_credit("aa-1-1", "aa-1-7", exists) == 0.0
    # equality wins even when the look-up does not know the (true) id
    assert category_credit("zz-9", "zz-9", exists) == 1.0
    assert id_depth("aa-1-13-8") == 4 and common_ancestor_depth("aa-1-13-8", "aa-1-2") == 2


@given(PATH_IDS, PATH_IDS)
def test_category_credit_is_bounded_and_symmetric(a, b):
    c = category_credit(a, b)
    assert 0.0 <= c <= 1.0 and c == category_credit(b, a)
    assert (c == 1.0) == (a == b)


# -- F1
# -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("truth", "sub", "expected"),
    [
        ({}, {}, 1.0),
        ({}, {"color": "red"}, 0.0),
        ({"color": "red"}, {}, 0.0),
        ({"color": "Red "}, {"color": " rED"}, 1.0),
        ({"color": "red", "size": "XL"}, {"color": "red"}, 2 / 3),
        ({"color": "red"}, {"color": "red", "size": "XL"}, 2 / 3),
        ({"color": "red", "size": "XL"}, {"color": "blue", "size": "xl"}, 1 / 2),
        ({"color": "red"}, {"Color": "red"}, 0.0),  # handles are slugs, not case-folded
        ({"color": ["red", "blue"]}, {"color": ["Blue", "red"]}, 1.0),
        (None, None, 1.0),
        ({"size": 42}, {"size": "42"}, 1.0),
    ],
)
def test_attribute_f1(truth, sub, expected):
    assert attribute_f1(truth, sub) == pytest.approx(expected)


def test_set_f1_and_normalize():
    assert set_f1([], []) == 1.0 and set_f1([1], []) == 0.0 and set_f1([1, 2], [2, 3]) == 0.5
    assert normalize_value("  Mixed Case ") == "mixed case"


# -- shaping
# -------------------------------------------------------------------------------------------
def test_invalid_call_penalty_and_cap():
    p = invalid_call_penalty(0.01, cap=0.05)
    assert [p.amount(T(invalid_calls=n), CASE) for n in (0, 1, 3, 5, 9)] == pytest.approx(
        [0, 0.01, 0.03, 0.05, 0.05]
    )
    assert invalid_call_penalty(0.5, cap=None).amount(T(invalid_calls=9), CASE) == 4.5


def test_turn_cost():
    p = turn_cost(0.02, free_turns=2, cap=0.1)
    assert [p.amount(T(num_turns=n), CASE) for n in (1, 2, 4, 20)] == pytest.approx(
        [0, 0, 0.04, 0.1]
    )
    with pytest.raises(ConfigError):
        turn_cost(0.1, free_turns=-1)


def test_overlong_is_linear_over_the_buffer():
    # DAPO: 0 up to L_max - L_cache, then (L - (L_max - L_cache)) / L_cache, then 1
    assert [overlong_fraction(n, 100, 20) for n in (0, 80, 85, 90, 100, 150)] == [
        0,
        0,
        0.25,
        0.5,
        1,
        1,
    ]
    p = overlong_penalty(100, 20, penalty=0.5)
    assert p.amount(T(completion_tokens=90), CASE) == 0.25
    tt = [TokenTurn(completion_ids=list(range(45))), TokenTurn(completion_ids=list(range(50)))]
    assert p.amount(T(token_turns=tt), CASE) == pytest.approx(0.5 * 15 / 20)
    hard = overlong_penalty(100, 0)
    assert (
        hard.amount(T(completion_tokens=100), CASE) == 0
        and hard.amount(T(completion_tokens=101), CASE) == 1
    )
    with pytest.raises(ConfigError):
        overlong_penalty(10, 20)


def test_useful_tool_bonus_counts_distinct_useful_calls_with_a_cap():
    calls = [
        ToolCallRecord(
            id="1", name="search", arguments={"q": "shoe"}, ok=True, result=[{"id": "aa-1"}]
        ),
        ToolCallRecord(
            id="2", name="search", arguments={"q": "shoe"}, ok=True, result=[{"id": "aa-1"}]
        ),  # repeat
        ToolCallRecord(
            id="3", name="search", arguments={"q": "zzz"}, ok=True, result=[]
        ),  # nothing found
        ToolCallRecord(id="4", name="brand", arguments={"n": "x"}, ok=False, error="unknown"),
        ToolCallRecord(id="5", name="brand", arguments={"n": "y"}, ok=True, result={"name": "y"}),
        ToolCallRecord(
            id="6", name="submit", arguments={}, ok=True, result={"ok": 1}, terminal=True
        ),
    ]
    b = useful_tool_bonus(0.02, cap=0.1)
    assert b.bonus and b.amount(T(calls=calls), CASE) == pytest.approx(0.04)
    assert useful_tool_bonus(0.03, cap=0.05).amount(T(calls=calls), CASE) == pytest.approx(0.05)


def test_bonus_is_added_and_reported():
    @term
    def half(trajectory, case):
        """Always 0.5."""
        return 0.5

    calls = [ToolCallRecord(id="1", name="s", arguments={}, ok=True, result={"a": 1})]
    r = Reward(
        {half: 1.0},
        penalties=[useful_tool_bonus(0.1, cap=0.2), invalid_call_penalty(0.1, cap=1)],
        gates=[submitted_gate()],
    )
    res = r(T(calls=calls, submission={}, invalid_calls=2), CASE)
    assert res.components["bonus"] == pytest.approx(0.1) and res.components[
        "penalty"
    ] == pytest.approx(0.2)
    assert res.total == pytest.approx(0.4) and res.components["submitted"] == 1.0
    assert r.bounds == pytest.approx((-1.0, 1.2))  # term range [0, 1] + bonus cap 0.2; -penalty cap

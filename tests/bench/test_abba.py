"""bench/abba.py: the run order and the comparison of two trees' figures."""

from __future__ import annotations

import math

import pytest

from bench.abba import abba_order, compare, leaves


def test_abba_order_puts_each_side_first_and_last_alike():
    assert abba_order(1) == ["before", "after", "after", "before"]
    order = abba_order(2)
    assert order.count("before") == order.count("after") == 4
    with pytest.raises(ValueError, match="at least 1"):
        abba_order(0)


def test_leaves_flattens_numbers_and_leaves_out_text_and_booleans():
    doc = {"env.step": {"value": 12.5, "unit": "us", "ok": True}, "runs": [1, {"x": 2}]}
    assert dict(leaves(doc)) == {"env.step.value": 12.5, "runs[0]": 1.0, "runs[1].x": 2.0}


def test_compare_means_each_side_and_divides_after_by_before():
    runs = [
        ("before", {"a": 10.0, "only_before": 1.0}),
        ("after", {"a": 12.0}),
        ("after", {"a": 14.0, "zero": 1.0}),
        ("before", {"a": 14.0, "zero": 0.0}),
    ]
    rows = {name: rest for name, *rest in compare(runs)}
    assert rows["a"] == [12.0, 13.0, pytest.approx(13 / 12)]
    assert "only_before" not in rows
    assert math.isnan(rows["zero"][2])

"""The training case stream (trainer.cases): seeded, resumable, and balanced by kind on request."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.cases import draw_cases
from twin.registry import make_twin

TOY = make_twin("Toy", num_words=4)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    start=st.integers(0, 500),
    n=st.integers(0, 40),
    cut=st.integers(0, 40),
    balance=st.sampled_from(["none", "kind"]),
)
def test_a_stream_read_in_two_pieces_equals_one_read(seed, start, n, cut, balance):
    # What makes --resume exact: the cases depend only on (seed, position), never on the reads.
    cut = min(cut, n)
    whole = draw_cases(TOY, "train", seed, start, n, balance=balance)
    parts = draw_cases(TOY, "train", seed, start, cut, balance=balance) + draw_cases(
        TOY, "train", seed, start + cut, n - cut, balance=balance
    )
    assert whole == parts and len(whole) == n
    assert all(split == "train" and 0 <= i < TOY.num_cases("train") for split, i in whole)


def test_kind_balance_deals_every_kind_in_turn():
    cases = draw_cases(TOY, "train", 3, 0, 64, balance="kind")
    kinds = [TOY.case(*c).kind for c in cases]
    assert Counter(kinds) == {w: 16 for w in ("red", "blue", "green", "yellow")}
    assert all(len(set(kinds[i : i + 4])) == 4 for i in range(0, 64, 4))  # each run of 4: all kinds
    plain = [TOY.case(*c).kind for c in draw_cases(TOY, "train", 3, 0, 64)]
    assert plain != kinds  # the plain draw is not dealt in turn


def test_balanced_cases_are_the_plain_draw_split_by_kind():
    plain = draw_cases(TOY, "train", 5, 0, 200)
    balanced = draw_cases(TOY, "train", 5, 0, 40, balance="kind")
    red_plain = [c for c in plain if TOY.case(*c).kind == "red"]
    red_balanced = [c for c in balanced if TOY.case(*c).kind == "red"]
    assert red_balanced == red_plain[: len(red_balanced)]


def test_unknown_balance_is_refused():
    with pytest.raises(ValueError, match="'none' or 'kind'"):
        draw_cases(TOY, "train", 0, 0, 4, balance="words")  # type: ignore[arg-type]

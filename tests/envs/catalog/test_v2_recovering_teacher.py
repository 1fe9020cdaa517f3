"""``ceiling_recovering``: Catalog-v2's ceiling that, on a fixed share of listings, first submits
the slip small models make (item specifics copied as attributes), marked weight 0, then answers the
tool's error with the ceiling's own submission."""

from __future__ import annotations

import json

import pytest


def _submits(trajectory) -> list[tuple[dict, dict, str]]:
    """Each submit turn, its parsed arguments and the tool's answer."""
    answers = {
        m.get("tool_call_id"): m["content"] for m in trajectory.messages if m["role"] == "tool"
    }
    return [
        (m, json.loads(c["function"]["arguments"]), answers[c["id"]])
        for m in trajectory.messages
        for c in m.get("tool_calls") or []
        if c["function"]["name"] == "submit"
    ]


@pytest.fixture(scope="module")
def four_turns(v2_twin, play):
    twin, n = v2_twin(4), 160
    return list(
        zip(play(twin, "ceiling", n, "train"), play(twin, "ceiling_recovering", n, "train"))
    )


def test_a_slipped_submission_is_rejected_and_the_next_is_the_ceilings(four_turns) -> None:
    slipped = 0
    for plain, recovering in four_turns:
        submits = _submits(recovering)
        ((_, right, _),) = _submits(plain)
        assert submits[-1][1] == right and "submitted" in submits[-1][2]
        assert "weight" not in submits[-1][0]
        if len(submits) == 1:
            assert recovering.reward == pytest.approx(plain.reward) == pytest.approx(1.0)
            assert recovering.messages == plain.messages
            continue
        slipped += 1
        ((turn, slip, answer),) = submits[:-1]
        assert turn["weight"] == 0  # kept by the env, so SFT gives it no loss
        assert answer.startswith("Error: submit: '") and "is not an attribute of" in answer
        # the slip is the ceiling's submission plus the listing's other item specifics
        assert set(right["attributes"].items()) < set(slip["attributes"].items())
        assert {k: v for k, v in slip.items() if k != "attributes"} == {
            k: v for k, v in right.items() if k != "attributes"
        }
        assert recovering.reward == pytest.approx(0.99)  # the invalid call's 0.01
    # the share: half the listings whose specifics the schema lacks
    assert 0.05 * len(four_turns) < slipped < 0.35 * len(four_turns)


def test_the_same_listings_slip_on_every_run(v2_twin, play) -> None:
    twin = v2_twin(4)
    runs = [[len(_submits(t)) for t in play(twin, "ceiling_recovering", 40, "train")] for _ in "ab"]
    assert runs[0] == runs[1] and 2 in runs[0]


def test_without_a_fourth_turn_it_is_the_ceiling(v2_twin, play) -> None:
    twin = v2_twin(3)
    for plain, recovering in zip(
        play(twin, "ceiling", 40, "train"),
        play(twin, "ceiling_recovering", 40, "train"),
        strict=True,
    ):
        assert recovering.messages == plain.messages and recovering.reward == plain.reward

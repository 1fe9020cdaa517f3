"""``ceiling_recovering``: Catalog-v2's ceiling that, on a fixed share of listings, first submits
the slip small models make (item specifics copied as attributes), marked weight 0, then answers the
tool's error with the ceiling's own submission."""

from __future__ import annotations

import json

import pytest

from twin.rollout import run_episodes


def _twin(max_turns: int):
    from envs.catalog import CatalogTwinV2

    t = CatalogTwinV2(seed=0, taxonomy_path=None, max_turns=max_turns, test_size=400)
    _ = t.world
    return t


def _episodes(twin, name: str, n: int):
    policy = twin.baselines()[name](twin)
    groups = run_episodes(
        twin, policy, [("train", i) for i in range(n)], group_size=1, progress=False
    )
    return [t for g in groups for t in g.trajectories]


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
def four_turns():
    twin = _twin(4)
    n = 160
    return list(zip(_episodes(twin, "ceiling", n), _episodes(twin, "ceiling_recovering", n)))


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


def test_the_same_listings_slip_on_every_run() -> None:
    twin = _twin(4)
    runs = [[len(_submits(t)) for t in _episodes(twin, "ceiling_recovering", 40)] for _ in range(2)]
    assert runs[0] == runs[1] and 2 in runs[0]


def test_without_a_fourth_turn_it_is_the_ceiling() -> None:
    twin = _twin(3)
    for plain, recovering in zip(
        _episodes(twin, "ceiling", 40), _episodes(twin, "ceiling_recovering", 40), strict=True
    ):
        assert recovering.messages == plain.messages and recovering.reward == plain.reward

"""Unit tests of Term, Reward, Penalty, Gate, overrides and RewardResult.explain."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

import rewards
from rewards import Gate, Penalty, Reward, RewardResult, Scored, Term, TermError, term
from twin import Case, Trajectory
from twin.errors import ConfigError

CASE = Case(twin="Toy", split="test", index=3, task={}, truth={"answer": 7})


def traj(answer=None, invalid=0, turns=1) -> Trajectory:
    sub = {"answer": answer} if answer is not None else None
    return Trajectory(
        twin="Toy", case_id=CASE.id, submission=sub, invalid_calls=invalid, num_turns=turns
    )


@term
def correct(trajectory, case):
    """1 when the answer is right."""
    return float(trajectory.submission["answer"] == case.truth["answer"])


@term(low=-1.0, high=1.0, name="closeness")
def close(trajectory, case):
    """Signed closeness."""
    d = trajectory.submission["answer"] - case.truth["answer"]
    return Scored(max(-1.0, 1.0 - abs(d) / 5), f"off by {d}")


def test_exports_are_sorted_by_group_and_exist():
    for name in rewards.__all__:
        assert hasattr(rewards, name), name


def test_term_decorator_names_and_describes():
    assert isinstance(correct, Term)
    assert correct.name == "correct" and correct.description == "1 when the answer is right."
    assert (correct.low, correct.high) == (0.0, 1.0)
    assert close.name == "closeness" and (close.low, close.high) == (-1.0, 1.0)
    assert correct(traj(7), CASE) == 1.0
    assert close.evaluate(traj(9), CASE) == Scored(0.6, "off by 2")


def test_term_out_of_range_is_an_error_not_zero():
    bad = Term("bad", lambda t, c: 1.5)
    with pytest.raises(
        TermError, match=r"'bad' returned 1.5, outside its declared range \[0.0, 1.0\].*Toy/test/3"
    ):
        bad(traj(1), CASE)


@pytest.mark.parametrize("value", [float("nan"), "1", None, True])
def test_term_non_numbers_are_errors(value):
    with pytest.raises(TermError, match="bad"):
        Term("bad", lambda t, c: value)(traj(1), CASE)


def test_term_that_raises_is_an_error():
    with pytest.raises(TermError, match="raised TypeError"):
        correct(traj(None), CASE)  # submission is None -> subscript fails


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": ""},
        {"name": "a b"},
        {"name": "total"},
        {"name": "x", "low": 2.0, "high": 1.0},
        {"name": "x", "low": math.inf},
        {"name": "x", "fn": 3},
    ],
)
def test_term_construction_is_validated(kwargs):
    args = {"name": "x", "fn": lambda t, c: 0.0, **kwargs}
    with pytest.raises(ConfigError):
        Term(**args)


def test_weighted_sum_penalties_after_sum_and_clip():
    pen = Penalty("invalid", lambda t, c: float(t.invalid_calls), per_unit=0.1, cap=0.25)
    r = Reward({correct: 0.5, close: 0.5}, penalties=[pen], clip=(-0.2, 1.0))
    res = r(traj(9, invalid=1), CASE)
    assert res.components == {
        "correct": 0.0,
        "closeness": pytest.approx(0.6),
        "invalid": pytest.approx(0.1),
        "penalty": pytest.approx(0.1),
    }
    assert res.weighted["closeness"] == pytest.approx(0.3) and res.weighted[
        "invalid"
    ] == pytest.approx(-0.1)
    assert res.total == pytest.approx(0.2)
    assert "off by 2" in res.notes
    # the cap holds and the clip applies after the penalties
    res = r(traj(100, invalid=9), CASE)
    assert res.components["invalid"] == 0.25
    assert res.unclipped == pytest.approx(-0.5 - 0.25) and res.total == -0.2
    assert any("clipped" in n for n in res.notes)


def test_weight_zero_is_logged_only():
    r = Reward({correct: 1.0, close: 0.0})
    res = r(traj(9), CASE)
    assert res.components["closeness"] == pytest.approx(0.6) and res.weighted["closeness"] == 0.0
    assert res.total == 0.0


@pytest.mark.parametrize("w", [math.nan, math.inf, "1", True, None])
def test_bad_weights_are_rejected(w):
    with pytest.raises(ConfigError, match="weight of term 'correct'"):
        Reward({correct: w})


def test_reward_rejects_plain_functions_duplicates_and_bad_clip():
    with pytest.raises(ConfigError, match="@term"):
        Reward({(lambda t, c: 1.0): 1.0})
    twin_term = Term("correct", lambda t, c: 1.0)
    with pytest.raises(ConfigError, match="duplicate names"):
        Reward({correct: 1.0, twin_term: 1.0})
    for clip in [(1.0, 0.0), (0.0,), (0.0, math.nan)]:
        with pytest.raises(ConfigError, match="clip"):
            Reward({correct: 1.0}, clip=clip)
    with pytest.raises(ConfigError, match="non-empty"):
        Reward({})


def test_gate_zeroes_the_rest_and_sets_the_total():
    gate = Gate(
        "submitted",
        lambda t, c: t.submission is not None,
        fail_values={"closeness": -1.0},
        total=-0.5,
    )
    pen = Penalty("invalid", lambda t, c: float(t.invalid_calls), per_unit=0.1)
    r = Reward({correct: 1.0, close: 1.0}, gates=[gate], penalties=[pen], clip=(-1.0, 2.0))
    res = r(traj(None, invalid=2), CASE)  # terms would raise without a submission: not run
    assert res.components["correct"] == 0.0 and res.components["closeness"] == -1.0
    assert res.components["submitted"] == 0.0 and res.components["invalid"] == pytest.approx(0.2)
    assert res.total == -0.5
    assert any("gate 'submitted' failed" in n for n in res.notes)
    assert r(traj(7), CASE).components["submitted"] == 1.0
    # without a total the gated sum is used
    r2 = Reward({correct: 1.0}, gates=[Gate("submitted", lambda t, c: t.submission is not None)])
    assert r2(traj(None), CASE).total == 0.0


def test_gate_validation():
    with pytest.raises(ConfigError, match="unknown term 'nope'"):
        Reward({correct: 1.0}, gates=[Gate("g", lambda t, c: True, fail_values={"nope": 0.0})])
    with pytest.raises(ConfigError, match="outside"):
        Reward({correct: 1.0}, gates=[Gate("g", lambda t, c: True, fail_values={"correct": -1.0})])
    with pytest.raises(TermError, match="expected True or False"):
        Reward({correct: 1.0}, gates=[Gate("g", lambda t, c: 1)])(traj(7), CASE)


def test_penalty_validation():
    with pytest.raises(ConfigError, match="per_unit"):
        Penalty("p", lambda t, c: 1.0, per_unit=-1.0)
    with pytest.raises(TermError, match="expected a finite number >= 0"):
        Reward({correct: 1.0}, penalties=[Penalty("p", lambda t, c: -1.0)])(traj(7), CASE)


def test_bounds():
    pen = Penalty("p", lambda t, c: 1.0, per_unit=0.1, cap=0.3)
    assert Reward({correct: 0.5, close: 2.0}, penalties=[pen]).bounds == pytest.approx((-2.3, 2.5))
    assert Reward({correct: 1.0}, penalties=[pen], clip=(-0.1, 0.5)).bounds == (-0.1, 0.5)
    assert Reward({correct: 1.0}, penalties=[Penalty("q", lambda t, c: 1.0)]).bounds[0] == -math.inf


def test_with_overrides_and_from_yaml(tmp_path):
    pen = Penalty("invalid", lambda t, c: float(t.invalid_calls), per_unit=0.1, cap=0.25)
    r = Reward({correct: 0.5, close: 0.5}, penalties=[pen], clip=(-1.0, 1.0))
    r2 = r.with_overrides(
        {"weights": {"correct": 1.0}, "penalties": {"invalid": {"cap": 0.5}}, "clip": None}
    )
    assert r2.weights == {"correct": 1.0, "closeness": 0.5} and r2.clip is None
    assert r2.penalties[0].cap == 0.5 and r2.penalties[0].per_unit == 0.1
    assert r.weights == {"correct": 0.5, "closeness": 0.5}  # the original is untouched
    assert r.with_overrides({"penalties": {"invalid": 0.2}}).penalties[0].per_unit == 0.2
    with pytest.raises(ConfigError, match="unknown term 'corect'.*Did you mean 'correct'"):
        r.with_overrides({"weights": {"corect": 1.0}})
    with pytest.raises(ConfigError, match="unknown penalty 'x'"):
        r.with_overrides({"penalties": {"x": 1.0}})
    with pytest.raises(ConfigError, match="unknown section"):
        r.with_overrides({"weight": {}})
    with pytest.raises(ConfigError, match="finite number"):
        r.with_overrides({"weights": {"correct": "heavy"}})
    f = tmp_path / "w.yaml"
    f.write_text("reward:\n  weights: {closeness: 0.0}\n  clip: [-0.5, 0.5]\n")
    r3 = Reward.from_yaml(f, r)
    assert r3.weights["closeness"] == 0.0 and r3.clip == (-0.5, 0.5)
    f.write_text("weights: {nope: 1}\n")
    with pytest.raises(ConfigError, match=r"w.yaml: reward overrides: unknown term 'nope'"):
        Reward.from_yaml(f, r)
    with pytest.raises(ConfigError, match="could not be read"):
        Reward.from_yaml(tmp_path / "missing.yaml", r)


def test_from_yaml_refuses_alias_bombs_and_binary_files(tmp_path):
    r = Reward({correct: 0.5, close: 0.5})
    bomb = tmp_path / "bomb.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    lines.append("weights: {correct: *a8}")  # an error message that quoted it would never end
    bomb.write_text("\n".join(lines) + "\n")  # 10**9 nodes once expanded, ~700 bytes on disk
    with pytest.raises(ConfigError, match="bomb.yaml") as info:
        Reward.from_yaml(bomb, r)
    assert len(str(info.value)) < 400
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00\x01\x02weights")
    with pytest.raises(ConfigError, match="binary file"):
        Reward.from_yaml(binary, r)


def test_explain_and_metrics():
    r = Reward(
        {correct: 0.5, close: 0.5}, penalties=[Penalty("invalid", lambda t, c: 1.0, per_unit=0.1)]
    )
    res = r(traj(9, invalid=1), CASE)
    text = res.explain()
    for needle in (
        "correct",
        "closeness",
        "invalid",
        "penalty",
        "total",
        "note: off by 2",
        "+0.3000",
        "-0.1000",
    ):
        assert needle in text
    assert res.metrics() == {
        "rewards/total": res.total,
        **{f"rewards/{k}": v for k, v in res.components.items()},
    }
    assert RewardResult.model_validate_json(res.model_dump_json()) == res


def test_reward_is_deterministic_and_thread_safe():
    r = Reward(
        {correct: 0.5, close: 0.5},
        penalties=[Penalty("invalid", lambda t, c: float(t.invalid_calls), 0.1, 0.3)],
    )
    episodes = [traj(a, invalid=a % 4) for a in range(3, 12)] * 50
    expected = [r(t, CASE) for t in episodes]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: r(t, CASE), episodes))
    assert got == expected
    assert "Reward('reward'" in repr(r) and "| correct | 0.5 |" in r.describe()

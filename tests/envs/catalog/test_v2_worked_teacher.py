"""``ceiling_worked``: Catalog-v2's ceiling writing its working (a line per rule it checked, with
the figures it read and the points they gave) before the same ``submit`` call."""

from __future__ import annotations

import json
import re

import pytest


@pytest.fixture(scope="module")
def v2(v2_twin):
    """Catalog v2, four turns (the v2 learning chain's twin)."""
    return v2_twin(4)


def _submit_turn(trajectory) -> tuple[str, dict]:
    for m in reversed(trajectory.messages):
        for c in m.get("tool_calls") or []:
            if c["function"]["name"] == "submit":
                return m.get("content") or "", json.loads(c["function"]["arguments"])
    raise AssertionError("no submit")


def _tool_answer(trajectory, name: str) -> dict:
    ids = {
        c["id"]
        for m in trajectory.messages
        for c in m.get("tool_calls") or []
        if c["function"]["name"] == name
    }
    return next(
        json.loads(m["content"])
        for m in trajectory.messages
        if m["role"] == "tool" and m.get("tool_call_id") in ids
    )


@pytest.fixture(scope="module")
def pairs(v2, play):
    n = 400
    return list(zip(play(v2, "ceiling", n), play(v2, "ceiling_worked", n)))


def test_the_worked_ceiling_submits_what_the_ceiling_submits(pairs):
    """Same calls, same submission, same reward (1.0 on every test case): the working only adds
    text, and the plain ceiling writes none."""
    for plain, worked in pairs:
        text, args = _submit_turn(worked)
        plain_text, plain_args = _submit_turn(plain)
        assert args == plain_args and plain_text == ""
        assert text
        assert worked.reward == pytest.approx(1.0) == plain.reward
        assert [c["function"] for m in plain.messages for c in m.get("tool_calls") or []] == [
            c["function"] for m in worked.messages for c in m.get("tool_calls") or []
        ]


def test_the_working_adds_up_to_the_decision_it_submits(pairs):
    """Each point line's points sum to the ``points`` line, the last line names the submitted
    decision and request, and a decision reached on points is the one the thresholds give."""
    decisions = set()
    for _, worked in pairs:
        text, args = _submit_turn(worked)
        lines = text.splitlines()
        want = f"-> {args['decision']}" + (f" ({args['request']})" if args.get("request") else "")
        assert lines[-1] == want, text
        decisions.add(args["decision"])
        total = [ln for ln in lines if ln.startswith("points ")]
        if not total:
            continue  # decided by rules 1-3 before any points
        items = [
            int(m.group(1))
            for ln in lines
            if not ln.startswith("points ") and (m := re.search(r" ([+-]\d+)$", ln))
        ]
        assert sum(items) == int(total[0].split()[1]), text
        if int(total[0].split()[1]) >= 5:
            assert args["decision"] == "counterfeit", text
    assert decisions == {"ok", "counterfeit", "prohibited", "escalate"}


def test_the_working_copies_the_sellers_figures_and_the_schemas_policy(pairs):
    """What the working states is what the tools answered, not the case's truth."""
    for _, worked in pairs:
        text, _ = _submit_turn(worked)
        schema = _tool_answer(worked, "get_attribute_schema")
        assert text.splitlines()[0] == f"policy {schema['policy']}"
        if schema["policy"] == "prohibited":
            continue
        seller = _tool_answer(worked, "get_seller")
        fakes = [t for t in seller["takedowns"] if t["reason"] == "counterfeit"]
        line = next((ln for ln in text.splitlines() if ln.startswith("seller ")), None)
        if line is None:  # decided by a look-alike brand, a copy or a recall before rule 4
            assert text.splitlines()[-1] in ("-> counterfeit", "-> prohibited"), text
            continue
        assert line == (
            f"seller {seller['account_age_days']} days, {seller['sales']} sales, "
            f"rating {seller['rating']}, {len(fakes)} counterfeit takedowns"
        )

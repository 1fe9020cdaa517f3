"""Catalog v2's own rows of ``twin check`` (the doctor calls :meth:`CatalogTwinV2.extra_checks`).

Each row has its figure and its threshold:

* **base rates**: the decision shares of the evaluation (test), training (train) and natural mixes;
* **cheap policies**: the best constant decision and the two-call flagger at least 0.40 under the
  ceiling, the heuristic 0.25 under it; decision trees of depth 3 and 6 trained on train-split
  tool-output features, scored on the test split, at least 0.15 and 0.05 under it;
* **held-out tactics**: one row per held-out kind (the ceiling's and the heuristic's reward);
* **text**: masked description-sentence templates (the largest share <= 2%, the top 50 <= 25%)
  and the share of item types that are the leaf's exact name (<= 30%);
* **realism**: every generated case's attribute values in its category's lists, conditions only
  where they apply, prices inside the category's written range;
* **natural mix**: cost per 1,000 listings, precision and recall; every constant decision costs
  more than the heuristic, and the ceiling least.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

import numpy as np

from envs.catalog.common.text import listing_text
from envs.catalog.v2 import content
from envs.catalog.v2.listings import HELD_OUT, KIND_DECISION, MIXES
from envs.catalog.v2.reward import WEIGHTS, operating_cost, regret
from envs.catalog.v2.rules import stated_condition
from envs.catalog.v2.tree import DecisionTree
from envs.catalog.v2.voices import sentences

__all__ = ["features", "natural_costs", "template_figures", "v2_checks"]

Row = dict[str, Any]


def _row(
    check: str,
    name: str,
    ok: bool,
    figure: str,
    threshold: str,
    note: str = "",
    value: float | None = None,
) -> Row:
    return {
        "check": check,
        "name": name,
        "status": "pass" if ok else "fail",
        "figure": figure,
        "threshold": threshold,
        "note": note,
        "value": value,
    }


def features(twin: Any, case: Any) -> list[float]:
    """Tool-output features of a case: what the schema, the brand look-up (with the category) and
    the seller record return, as numbers (the price ratio from the listing's price)."""
    v = twin.views
    t = case.task
    schema = v.schema(case.truth["category_id"])
    look = (
        v.lookup(t["brand"], case.truth["category_id"])
        if t["brand"]
        else {"exact": None, "similar": []}
    )
    seller = v.seller(t["seller"]) or {}
    ex = look["exact"] or {}
    msrp = ex.get("msrp") or {}
    sims = [s["similarity"] for s in look["similar"] if s["registered"]]
    fakes = [d for d in seller.get("takedowns", []) if d["reason"] == "counterfeit"]
    own = [d["year"] for d in fakes if d["brand"] == ex.get("name")]
    return [
        float(schema["policy"] == "prohibited"),
        float(schema["policy"] == "certificate_required"),
        float(schema["conditions"]),
        float(bool(ex)),
        float(bool(ex.get("registered"))),
        float(bool(ex.get("protected"))),
        float(t["seller"] in (ex.get("authorized_sellers") or ())),
        t["price"] / msrp["low"] if msrp.get("low") else -1.0,
        max(sims, default=0.0),
        float(seller.get("account_age_days", 0)),
        float(seller.get("rating", 0)),
        float(seller.get("sales", 0)),
        float(max(own, default=0)),
        float(len(fakes) - len(own)),
        float(len(ex.get("recalls") or ())),
        t["price"],
    ]


def _score(truth: Any, decision: str, request: str | None) -> float:
    """Reward with the category and attributes right and this decision."""
    lost = regret(truth["decision"], truth.get("request"), decision, request)
    return max(-1.0, WEIGHTS["category"] + WEIGHTS["attributes"] + WEIGHTS["policy"] * (1 - lost))


def template_figures(twin: Any, split: str, n: int) -> dict[str, float]:
    """Masked description-sentence templates and exact-leaf-name item types over ``n`` cases."""
    counts: Counter[str] = Counter()
    exact = 0
    for i in range(n):
        case = twin.case(split, i)
        t = case.task
        slots = [
            t["brand"],
            t["seller"],
            *t["attributes"].values(),
            twin.world.categories[case.truth["category_id"]].name,
        ]
        text = t["description"]
        for s in sorted((x for x in slots if x), key=len, reverse=True):
            text = re.sub(re.escape(s), " X ", text, flags=re.IGNORECASE)
        for sent in sentences(text):
            masked = re.sub(r"\s+", " ", re.sub(r"\d+(?:\.\d+)?", "#", sent.lower())).strip()
            counts[masked] += 1
        name = twin.world.categories[case.truth["category_id"]].name
        exact += t["attributes"].get("Item type", "").lower() == name.lower()
    total = sum(counts.values()) or 1
    top = counts.most_common(50)
    return {
        "sentences": total,
        "templates": len(counts),
        "top1": top[0][1] / total if top else 0.0,
        "top50": sum(c for _, c in top) / total,
        "exact_item_type": exact / max(n, 1),
        "top1_text": top[0][0] if top else "",
    }


def realism_problems(twin: Any, case: Any) -> list[str]:
    """What a domain expert would object to in one case (empty: nothing)."""
    w, v = twin.world, twin.views
    t, leaf = case.task, case.truth["category_id"]
    cat = w.categories[leaf]
    out = []
    allowed = {a.name: set(a.values) for a, _ in w.schema(leaf)}
    for k, val in t["attributes"].items():
        if k in allowed and val not in allowed[k]:
            out.append(f"{k}={val!r} not in the category's list")
    text = listing_text({**t, "specifics": t["attributes"]})
    if stated_condition(text) and not content.conditions_apply(cat.vertical, cat.full_name):
        out.append("a condition on an item that cannot have one")
    lo, hi = content.price_bounds(cat.vertical, cat.full_name)
    if not lo <= t["price"] <= hi:
        out.append(f"price {t['price']} outside {lo}-{hi}")
    exact = (v.lookup(t["brand"], leaf) if t["brand"] else {}).get("exact") or {}
    msrp = exact.get("msrp")
    wlo, whi = content.written_range(cat.vertical, cat.full_name)
    if msrp and not (wlo <= msrp["low"] <= msrp["high"] <= whi):
        out.append(f"MSRP {msrp} outside {wlo}-{whi}")
    return out


def natural_costs(twin: Any, n: int, names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Cost per 1,000 listings, precision and recall of flagging (any decision but ok) on the
    natural mix's first ``n`` test cases, per policy."""
    nat = type(twin)(**{**twin.config.model_dump(), "mix": "natural", "case_mix": None})
    out = {}
    for name in names:
        subs = _submissions(nat, nat.baselines()[name](nat), n)
        cost, tp, fp, fn = 0.0, 0, 0, 0
        for truth, sub in subs:
            cost += operating_cost(
                truth["decision"], truth.get("request"), sub.get("decision"), sub.get("request")
            )
            flagged, bad = sub.get("decision", "ok") != "ok", truth["decision"] != "ok"
            tp, fp, fn = (
                tp + (flagged and bad),
                fp + (flagged and not bad),
                fn + (bad and not flagged),
            )
        out[name] = {
            "cost_per_1000": 1000 * cost / max(len(subs), 1),
            "precision": tp / (tp + fp) if tp + fp else 0.0,
            "recall": tp / (tp + fn) if tp + fn else 0.0,
        }
    return out


def _submissions(twin: Any, policy: Any, n: int) -> list[tuple[Any, dict[str, Any]]]:
    """``(truth, submitted arguments)`` of one episode per test case (``{}`` when none)."""
    import asyncio

    from twin.env import TwinEnv

    env = TwinEnv(twin)
    loop = asyncio.new_event_loop()
    out = []
    try:
        for i in range(n):
            _, info = env.reset(options={"split": "test", "index": i})
            tools = info["tools"]
            sub: dict[str, Any] = {}
            for _ in range(twin.config.max_turns + 2):
                msg = loop.run_until_complete(policy.act(env.messages, tools))
                _, _, term, trunc, info = env.step(msg)
                if term or trunc:
                    sub = dict(info["trajectory"].submission or {})
                    break
            out.append((env.case.truth, sub))
    finally:
        loop.close()
    return out


def v2_checks(
    twin: Any,
    cases: int,
    n_test: int | None = None,
    n_train: int | None = None,
    n_text: int | None = None,
) -> list[Row]:
    """Every v2 row, sized by ``cases`` (the doctor's cases per kind; 2 in the fast suite): ``100 *
    cases`` test and ``300 * cases`` train cases unless ``n_test`` / ``n_train`` say otherwise (the
    text figures read ``n_text`` train listings, default the train cases)
    (``python -m envs.catalog.v2.measure`` measures 1,000 test and 5,000 train cases)."""
    n_test = min(twin.num_cases("test"), n_test or 100 * cases)
    n_train = min(twin.num_cases("train"), n_train or 300 * cases)
    rows = _base_rate_rows()
    policy_rows, ceil, by_kind, h_kind = _policy_rows(twin, n_test)
    rows += policy_rows
    train = [twin.case("train", i) for i in range(n_train)]
    test = [twin.case("test", i) for i in range(n_test)]
    rows += _tree_rows(twin, train, test, ceil)
    rows.append(_shortcut_row(twin, train, test))
    rows += _held_out_rows(by_kind, h_kind, train, test)
    rows += _text_rows(twin, min(n_text or n_train, twin.num_cases("train")))
    rows.append(_realism_row(twin, train + test))
    rows.append(_natural_row(twin, n_test))
    return rows


def _base_rate_rows() -> list[Row]:
    """Base rates of each mix (from the kind schedule: no case is built)."""
    rows: list[Row] = []
    for mix in ("evaluation", "training", "natural"):
        shares = MIXES[mix]
        rates = Counter()
        for k, s in shares.items():
            rates[KIND_DECISION[k]] += s
        total = sum(rates.values())
        fig = ", ".join(
            f"{d} {rates[d] / total:.1%}" for d in ("ok", "counterfeit", "prohibited", "escalate")
        )
        rows.append(
            _row("base rates", f"{mix} mix", True, fig, "shown", note=f"{len(shares)} kinds")
        )
    return rows


def _policy_rows(
    twin: Any, n_test: int
) -> tuple[list[Row], float, dict[str, list[float]], dict[str, list[float]]]:
    """The ceiling and the cheap policies on the first ``n_test`` test cases: the rows, the
    ceiling's mean, and the ceiling's and the heuristic's rewards by kind."""
    from twin.doctor.play import play

    rows: list[Row] = []
    refs = [("test", i) for i in range(n_test)]
    means = {}
    for name in (
        "ceiling",
        "heuristic",
        "always_ok",
        "always_counterfeit",
        "always_prohibited",
        "always_escalate",
        "two_call_flagger",
    ):
        run = play(twin, twin.baselines()[name](twin), refs)
        means[name] = statistics.fmean(e.reward or 0.0 for e in run.episodes)
        if name == "ceiling":
            by_kind: dict[str, list[float]] = {}
            for e in run.episodes:
                by_kind.setdefault(e.case.kind, []).append(e.reward or 0.0)
        if name == "heuristic":
            h_kind: dict[str, list[float]] = {}
            for e in run.episodes:
                h_kind.setdefault(e.case.kind, []).append(e.reward or 0.0)
    ceil = means["ceiling"]
    rows.append(
        _row(
            "ceiling",
            "ceiling policy",
            ceil >= 0.95,
            f"{ceil:.3f}",
            ">= 0.95 of the maximum 1.0",
            note=f"{n_test} test cases",
            value=ceil,
        )
    )
    best_const = max(
        ("always_ok", "always_counterfeit", "always_prohibited", "always_escalate"), key=means.get
    )
    for name, gap in ((best_const, 0.40), ("two_call_flagger", 0.40), ("heuristic", 0.25)):
        rows.append(
            _row(
                "cheap policies",
                name if name != best_const else f"best constant ({name})",
                means[name] <= ceil - gap,
                f"{means[name]:.3f}",
                f"<= ceiling - {gap:g} ({ceil - gap:.3f})",
                value=means[name],
            )
        )
    return rows, ceil, by_kind, h_kind


def _tree_rows(twin: Any, train: list[Any], test: list[Any], ceil: float) -> list[Row]:
    """Decision trees on tool-output features, against the ceiling."""
    n_train, n_test = len(train), len(test)
    rows: list[Row] = []
    xtr = np.array([features(twin, c) for c in train])
    ytr = [f"{c.truth['decision']}:{c.truth['request']}" for c in train]
    xte = np.array([features(twin, c) for c in test])
    for depth, gap in ((3, 0.15), (6, 0.05)):
        pred = DecisionTree(depth).fit(xtr, ytr).predict(xte)
        score = statistics.fmean(
            _score(c.truth, *(p.split(":")[0], None if p.endswith("None") else p.split(":")[1]))
            for c, p in zip(test, pred)
        )
        rows.append(
            _row(
                "cheap policies",
                f"decision tree depth {depth}",
                score <= ceil - gap,
                f"{score:.3f}",
                f"<= ceiling - {gap:g} ({ceil - gap:.3f})",
                note=f"{len(xtr[0])} tool-output features, {n_train} train / {n_test} test cases",
                value=score,
            )
        )
    return rows


def _shortcut_row(twin: Any, train: list[Any], test: list[Any]) -> Row:
    """The prompt alone: bag-of-words decision accuracy vs the majority rate."""
    from twin.doctor.audit import bag_of_words_audit

    n_train, n_test = len(train), len(test)

    def body(c: Any) -> str:
        return "\n".join(
            str(m.get("content") or "") for m in twin.prompt(c) if m.get("role") != "system"
        )

    bow = bag_of_words_audit(
        [body(c) for c in train],
        [c.truth["decision"] for c in train],
        [body(c) for c in test],
        [c.truth["decision"] for c in test],
    )
    return _row(
        "shortcut",
        "prompt bag-of-words (decision)",
        bow.margin <= 0.05,
        f"{bow.accuracy:.3f} vs majority {bow.majority:.3f}",
        "accuracy - majority <= 0.05",
        note=f"naive Bayes, {n_train} train / {n_test} test prompts",
        value=bow.margin,
    )


def _held_out_rows(
    by_kind: dict[str, list[float]],
    h_kind: dict[str, list[float]],
    train: list[Any],
    test: list[Any],
) -> list[Row]:
    """Held-out tactics: present in test, absent from train."""
    n_test = len(test)
    rows: list[Row] = []
    for kind, what in HELD_OUT.items():
        got = by_kind.get(kind, [])
        ok = bool(got)
        fig = (
            (
                f"ceiling {statistics.fmean(got):.3f}, heuristic "
                f"{statistics.fmean(h_kind.get(kind, [0.0])):.3f}, "
                f"{len(got)} cases"
            )
            if got
            else "absent"
        )
        rows.append(
            _row("held-out tactics", kind, ok, fig, "present in test, absent from train", note=what)
        )
    seen = {k for c in train for k in [c.kind]} & set(HELD_OUT)
    leaves_tr = {c.truth["category_id"] for c in train}
    shared = sum(c.truth["category_id"] in leaves_tr for c in test)
    rows.append(
        _row(
            "held-out tactics",
            "train split",
            not seen and shared == 0,
            f"{len(seen)} held-out kinds in train; {shared} of {n_test} test leaves in train",
            "0 and 0",
        )
    )
    return rows


def _text_rows(twin: Any, n_text: int) -> list[Row]:
    """Text figures of the first ``n_text`` train listings."""
    rows: list[Row] = []
    tf = template_figures(twin, "train", n_text)
    rows.append(
        _row(
            "text",
            "largest masked sentence template",
            tf["top1"] <= 0.02,
            f"{tf['top1']:.2%}",
            "<= 2%",
            note=f"{tf['sentences']} sentences, {tf['templates']} templates; e.g. "
            f"{tf['top1_text'][:60]!r}",
            value=tf["top1"],
        )
    )
    rows.append(
        _row(
            "text",
            "top 50 templates",
            tf["top50"] <= 0.25,
            f"{tf['top50']:.2%}",
            "<= 25%",
            value=tf["top50"],
        )
    )
    rows.append(
        _row(
            "text",
            "item type = leaf name",
            tf["exact_item_type"] <= 0.30,
            f"{tf['exact_item_type']:.1%}",
            "<= 30%",
            value=tf["exact_item_type"],
        )
    )
    return rows


def _realism_row(twin: Any, built: list[Any]) -> Row:
    """Realism of every case built for the other rows."""
    problems = [(c.id, p) for c in built for p in realism_problems(twin, c)]
    return _row(
        "realism",
        "attribute values, conditions, prices",
        not problems,
        f"{len(problems)} problems in {len(built)} cases",
        "0",
        note=f"e.g. {problems[0]}" if problems else "",
    )


def _natural_row(twin: Any, n_test: int) -> Row:
    """Costs per 1,000 listings on the natural mix."""
    nat = natural_costs(
        twin,
        n_test,
        (
            "ceiling",
            "heuristic",
            "always_ok",
            "always_counterfeit",
            "always_prohibited",
            "always_escalate",
        ),
    )
    consts = [nat[k]["cost_per_1000"] for k in nat if k.startswith("always_")]
    ok = min(consts) > nat["heuristic"]["cost_per_1000"] and nat["ceiling"]["cost_per_1000"] == min(
        v["cost_per_1000"] for v in nat.values()
    )
    fig = "; ".join(
        f"{k} {v['cost_per_1000']:.0f} (P {v['precision']:.2f}, R {v['recall']:.2f})"
        for k, v in nat.items()
    )
    return _row(
        "natural mix",
        "cost per 1,000 listings",
        ok,
        fig,
        "every constant > heuristic; ceiling lowest",
        note=f"{n_test} natural-mix test cases",
    )

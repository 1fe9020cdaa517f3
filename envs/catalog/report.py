"""Catalog metrics, terminal tables and the Markdown + PNG report of ``twin demo``.

:func:`catalog_metrics` adds what a trust-and-safety team reads to the generic
:func:`twin.rollout.summarize`: verdict accuracy and a confusion matrix (true vs submitted
verdict) per case kind, missed counterfeits / prohibited items versus false alarms, and exact
category and attribute rates.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from envs.catalog.v0.listings import KINDS as KINDS_V0
from envs.catalog.v0.listings import VERDICTS
from envs.catalog.v1.listings import KINDS as KINDS_V1
from twin.trajectory import Group, Trajectory

#: Every case kind of every version, in table order.
KINDS: tuple[str, ...] = KINDS_V0 + tuple(k for k in KINDS_V1 if k not in KINDS_V0)

__all__ = ["catalog_metrics", "print_tables", "write_report"]

#: Column of the confusion matrix for an episode without a valid submission.
NO_SUBMIT = "none"
_SUBMITTED = (*VERDICTS, NO_SUBMIT)


def _truth(t: Trajectory, twin: Any) -> dict[str, Any]:
    outcome = t.info.get("outcome") or {}
    truth = outcome.get("truth")
    if truth is None:  # an episode that raised has no outcome: ask the twin
        truth = twin.case(t.split, t.index).truth
    return truth


def _submitted(t: Trajectory) -> str:
    verdict = (t.submission or {}).get("verdict")
    return verdict if verdict in VERDICTS else NO_SUBMIT


def catalog_metrics(groups: Iterable[Group], twin: Any) -> dict[str, Any]:
    """Per-kind accuracy and confusion matrices, misses vs false alarms, category/attribute rates.

    Args:
        groups: Groups from :func:`twin.rollout.run_episodes`.
        twin: The catalog twin (reads a case's truth when a trajectory lacks its outcome).

    Returns:
        ``verdict_accuracy``, ``category_exact``, ``attributes_exact``, ``missed`` (truth
        counterfeit or prohibited, submitted ok), ``false_alarms`` (truth ok, submitted anything
        else), ``bad_verdict_type`` (counterfeit <-> prohibited), ``no_submit``, ``confusion``
        (``{true: {submitted: n}}``) and ``by_kind`` (``{kind: {episodes, accuracy, reward_mean,
        category_exact, confusion}}``), all over the episodes that did not raise.
    """
    trajs = [t for g in groups for t in g.trajectories if "error" not in t.info]
    confusion: dict[str, Counter[str]] = {v: Counter() for v in VERDICTS}
    per_kind: dict[str, list[tuple[Trajectory, dict[str, Any]]]] = defaultdict(list)
    correct = cat_exact = attr_exact = missed = alarms = swapped = none = 0
    for t in trajs:
        truth = _truth(t, twin)
        sub = _submitted(t)
        confusion[truth["verdict"]][sub] += 1
        per_kind[t.case_kind].append((t, truth))
        correct += sub == truth["verdict"]
        none += sub == NO_SUBMIT
        if truth["verdict"] != "ok" and sub == "ok":
            missed += 1
        elif truth["verdict"] == "ok" and sub in ("counterfeit", "prohibited"):
            alarms += 1
        elif (
            truth["verdict"] != "ok"
            and sub in ("counterfeit", "prohibited")
            and sub != truth["verdict"]
        ):
            swapped += 1
        if t.submission:
            cat_exact += t.submission.get("category_id") == truth["category_id"]
            attr_exact += _norm(t.submission.get("attributes")) == _norm(truth["attributes"])
    n = len(trajs)
    by_kind: dict[str, Any] = {}
    for kind in sorted(per_kind, key=lambda k: KINDS.index(k) if k in KINDS else len(KINDS)):
        rows = per_kind[kind]
        kc: dict[str, Counter[str]] = {}
        for t, truth in rows:
            kc.setdefault(truth["verdict"], Counter())[_submitted(t)] += 1
        by_kind[kind] = {
            "episodes": len(rows),
            "accuracy": _rate(sum(_submitted(t) == tr["verdict"] for t, tr in rows), len(rows)),
            "reward_mean": _rate(math.fsum(t.reward or 0.0 for t, _ in rows), len(rows)),
            "category_exact": _rate(
                sum((t.submission or {}).get("category_id") == tr["category_id"] for t, tr in rows),
                len(rows),
            ),
            "true_verdicts": sorted(kc),
            "confusion": {v: dict(c) for v, c in kc.items()},
        }
    return {
        "episodes": n,
        "verdict_accuracy": _rate(correct, n),
        "category_exact": _rate(cat_exact, n),
        "attributes_exact": _rate(attr_exact, n),
        "missed": missed,
        "false_alarms": alarms,
        "bad_verdict_type": swapped,
        "no_submit": none,
        "confusion": {v: dict(c) for v, c in confusion.items()},
        "by_kind": by_kind,
    }


def _norm(attrs: Any) -> dict[str, str]:
    if not isinstance(attrs, dict):
        return {}
    return {str(k): str(v).strip().lower() for k, v in attrs.items()}


def _rate(num: float, den: int) -> float:
    return num / den if den else 0.0


# -- terminal ----------------------------------------------------------------------------------
def print_tables(
    console: Console, policy: str, summary: dict[str, Any], metrics: dict[str, Any]
) -> None:
    """Print the figures of one policy: overall, per-kind, and the verdict confusion matrix."""
    top = Table(
        title=f"[bold]{policy}[/]: {summary['episodes']} episodes, "
        f"{summary['groups']} groups of {summary['group_size']}",
        show_header=True,
    )
    top.add_column("metric")
    top.add_column("value", justify="right")
    top.add_row(
        "reward (mean +- std)", f"{summary['reward_mean']:.3f} +- {summary['reward_std']:.3f}"
    )
    for name, value in summary["components"].items():
        top.add_row(f"  {name}", f"{value:.3f}")
    for k, v in summary["pass@k"].items():
        top.add_row(f"pass@{k} / pass^{k}", f"{v:.3f} / {summary['pass^k'][k]:.3f}")
    top.add_row("verdict accuracy", f"{metrics['verdict_accuracy']:.3f}")
    top.add_row(
        "category exact / attributes exact",
        f"{metrics['category_exact']:.3f} / {metrics['attributes_exact']:.3f}",
    )
    top.add_row("missed counterfeit+prohibited (-> ok)", str(metrics["missed"]))
    top.add_row("false alarms (ok -> flagged)", str(metrics["false_alarms"]))
    top.add_row("counterfeit <-> prohibited", str(metrics["bad_verdict_type"]))
    top.add_row("no submit", str(metrics["no_submit"]))
    top.add_row(
        "mean turns / invalid calls",
        f"{summary['mean_turns']:.2f} / {summary['invalid_calls']:.2f}",
    )
    console.print(top)

    kinds = Table(title=f"{policy}: per case type (verdict: true -> submitted counts)")
    kinds.add_column("case type", no_wrap=True, min_width=max(map(len, KINDS)))
    for col, just in (
        ("n", "right"),
        ("reward", "right"),
        ("acc", "right"),
        ("cat=", "right"),
        ("true", "left"),
        ("ok", "right"),
        ("counterfeit", "right"),
        ("prohibited", "right"),
        ("none", "right"),
    ):
        kinds.add_column(col, justify=just)  # type: ignore[arg-type]
    for kind, row in metrics["by_kind"].items():
        for i, true in enumerate(row["true_verdicts"]):
            counts = row["confusion"][true]
            head = (
                (
                    kind,
                    str(row["episodes"]),
                    f"{row['reward_mean']:.3f}",
                    f"{row['accuracy']:.2f}",
                    f"{row['category_exact']:.2f}",
                )
                if i == 0
                else ("", "", "", "", "")
            )
            kinds.add_row(*head, true, *(str(counts.get(s, 0)) for s in _SUBMITTED))
    console.print(kinds)

    conf = Table(title=f"{policy}: verdict confusion (rows true, columns submitted)")
    conf.add_column("true \\ submitted")
    for s in _SUBMITTED:
        conf.add_column(s, justify="right")
    for v in VERDICTS:
        conf.add_row(v, *(str(metrics["confusion"].get(v, {}).get(s, 0)) for s in _SUBMITTED))
    console.print(conf)


# -- report ------------------------------------------------------------------------------------
def write_report(out: str | Path, results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> Path:
    """Write ``report.md`` and PNG plots under ``out``; return the Markdown file's path.

    Args:
        out: Output folder (created).
        results: ``{policy: {"summary": summarize(...), "metrics": catalog_metrics(...)}}``.
        meta: Run facts shown at the top (world, split, episodes, timings, run ids).
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    plots = _plots(folder, results)
    lines = ["# Catalog twin demo", ""]
    lines += [f"- **{k}**: {v}" for k, v in meta.items()]
    lines += [
        "",
        "## Policies",
        "",
        "| policy | reward | category | attributes | policy term | pass@1 | pass@k | pass^k | "
        "verdict acc | missed | false alarms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, res in results.items():
        s, m = res["summary"], res["metrics"]
        k = str(s["group_size"])
        c = s["components"]
        lines.append(
            f"| {name} | {s['reward_mean']:.3f} | {c.get('category', 0):.3f} | "
            f"{c.get('attributes', 0):.3f} | {c.get('policy', 0):.3f} | "
            f"{s['pass@k'].get('1', 0):.3f} | "
            f"{s['pass@k'].get(k, 0):.3f} | {s['pass^k'].get(k, 0):.3f} | "
            f"{m['verdict_accuracy']:.3f} | "
            f"{m['missed']} | {m['false_alarms']} |"
        )
    lines += ["", f"k = group size. ![mean reward]({plots['reward']})", ""]
    for name, res in results.items():
        m = res["metrics"]
        lines += [
            f"## {name}: per case type",
            "",
            "| case type | n | reward | verdict acc | category "
            "exact | true | ok | counterfeit | prohibited | none |",
            "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
        ]
        for kind, row in m["by_kind"].items():
            for i, true in enumerate(row["true_verdicts"]):
                counts = row["confusion"][true]
                head = (
                    (
                        f"{kind} | {row['episodes']} | {row['reward_mean']:.3f} | "
                        f"{row['accuracy']:.2f} | "
                        f"{row['category_exact']:.2f}"
                    )
                    if i == 0
                    else " |  |  |  | "
                )
                lines.append(
                    f"| {head} | {true} | "
                    + " | ".join(str(counts.get(s, 0)) for s in _SUBMITTED)
                    + " |"
                )
        lines += ["", f"![confusion]({plots['confusion_' + name]})", ""]
    lines += [f"![reward by case type]({plots['by_kind']})", ""]
    path = folder / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _plots(folder: Path, results: dict[str, dict[str, Any]]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")  # no display on CI or servers
    import matplotlib.pyplot as plt

    names = list(results)
    files: dict[str, str] = {}

    fig, ax = plt.subplots(figsize=(6, 3.5))
    comps = ("category", "attributes", "policy")
    width = 0.8 / (len(comps) + 1)
    for j, comp in enumerate(("reward", *comps)):
        vals = [
            results[n]["summary"]["reward_mean"]
            if comp == "reward"
            else results[n]["summary"]["components"].get(comp, 0.0)
            for n in names
        ]
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=comp)
    ax.set_xticks([i + 1.5 * width for i in range(len(names))], names)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_ylabel("mean")
    ax.set_title("Reward and components by policy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "reward.png", dpi=110)
    plt.close(fig)
    files["reward"] = "reward.png"

    kinds = [k for k in KINDS if any(k in results[n]["metrics"]["by_kind"] for n in names)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(names), 1)
    for j, n in enumerate(names):
        bk = results[n]["metrics"]["by_kind"]
        ax.bar(
            [i + j * width for i in range(len(kinds))],
            [bk.get(k, {}).get("reward_mean", 0.0) for k in kinds],
            width,
            label=n,
        )
    ax.set_xticks(
        [i + width * (len(names) - 1) / 2 for i in range(len(kinds))],
        kinds,
        rotation=60,
        ha="right",
        fontsize=7,
    )
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_ylabel("mean reward")
    ax.set_title("Reward by case type")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(folder / "by_kind.png", dpi=110)
    plt.close(fig)
    files["by_kind"] = "by_kind.png"

    for n in names:
        conf = results[n]["metrics"]["confusion"]
        grid = [[conf.get(v, {}).get(s, 0) for s in _SUBMITTED] for v in VERDICTS]
        fig, ax = plt.subplots(figsize=(4.2, 3.2))
        ax.imshow(grid, cmap="Blues")
        for r, row in enumerate(grid):
            for c, val in enumerate(row):
                ax.text(c, r, str(val), ha="center", va="center", fontsize=9)
        ax.set_xticks(range(len(_SUBMITTED)), _SUBMITTED, fontsize=8)
        ax.set_yticks(range(len(VERDICTS)), VERDICTS, fontsize=8)
        ax.set_xlabel("submitted")
        ax.set_ylabel("true")
        ax.set_title(f"{n}: verdicts")
        fig.tight_layout()
        fname = f"confusion_{_slug(n)}.png"
        fig.savefig(folder / fname, dpi=110)
        plt.close(fig)
        files["confusion_" + n] = fname
    return files


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text)

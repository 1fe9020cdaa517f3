"""What the pages of ``twin ui`` read from the run store, as bounded queries.

Every query asks the database for what one page shows: a page of runs or episodes, aggregates
computed by the database (counts, means, per-kind and per-case figures), one trajectory for an
episode page. No query loads a whole run's trajectories into Python; the one that reads
trajectory documents in bulk (the decision confusion) is capped at :data:`CONFUSION_CAP`.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import JSON, Text, case, cast, func, or_, select, type_coerce
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from twin.store import STALE_AFTER_S, EpisodeTable, MetricTable, RunTable, writer_gone
from twin.trajectory import Trajectory

__all__ = [
    "CONFUSION_CAP",
    "PAGE_SIZE",
    "RUN_SORTS",
    "TERMS_CAP",
    "Compare",
    "EpisodeRow",
    "Page",
    "RunRow",
    "Terms",
    "case_episodes",
    "compare_runs",
    "confusion",
    "curves",
    "episode",
    "episodes_page",
    "kind_table",
    "run_figures",
    "run_row",
    "runs_page",
    "term_means",
]

#: Rows per page of the runs and episodes tables.
PAGE_SIZE = 50
#: Most episodes whose trajectory documents the decision confusion reads (the first ones stored).
CONFUSION_CAP = 5_000
#: Most episodes (the latest) whose reward terms a run without a summary averages.
TERMS_CAP = 20_000
#: Keys of a case's truth tried, in order, as the decision of the confusion table.
DECISION_KEYS = ("verdict", "decision", "label", "answer", "action", "category")
#: Sort keys of the runs table -> the column they order by.
RUN_SORTS = ("id", "started", "twin", "policy", "kind", "status", "episodes", "reward")
_Z95 = 1.959963984540054


@dataclass
class RunRow:
    """One run as the runs table and the run page show it."""

    id: int
    kind: str
    twin: str
    policy: str
    status: str
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    config: dict[str, Any]
    metrics: dict[str, Any]
    episodes: int
    scored: int
    reward_mean: float | None
    reward_lo: float | None
    reward_hi: float | None

    @property
    def split(self) -> str:
        """The split the run played (its summary's or config's ``split``)."""
        twin_cfg = self.config.get("twin")
        nested = twin_cfg.get("split") if isinstance(twin_cfg, dict) else None
        return str(self.metrics.get("split") or self.config.get("split") or nested or "")

    @property
    def version(self) -> str:
        """The twin's version where the config records one."""
        for holder in (self.config, self.config.get("twin_config") or {}):
            if isinstance(holder, dict) and holder.get("version") is not None:
                return str(holder["version"])
        return ""

    @property
    def pass_at(self) -> tuple[str, float] | None:
        """``(k, pass@k)`` for the largest k of the run's summary, if it has one."""
        table = self.metrics.get("pass@k")
        if not isinstance(table, dict) or not table:
            return None
        k = max(table, key=lambda key: int(key) if str(key).isdigit() else 0)
        value = table[k]
        return (str(k), float(value)) if isinstance(value, (int, float)) else None


@dataclass
class Page:
    """A page of rows and where it sits among all of them."""

    rows: list[Any]
    page: int
    total: int
    size: int = PAGE_SIZE

    @property
    def pages(self) -> int:
        """Number of pages (at least 1)."""
        return max(1, math.ceil(self.total / self.size))


def _status(status: str, pid: int | None, host: str | None, beat: Any, started: Any) -> str:
    """The status a run reads back with (see :class:`twin.store.RunStore`): ``running`` whose
    writer is gone reads ``interrupted``."""
    if status != "running":
        return status
    if writer_gone(pid, host):
        return "interrupted"
    last = beat or started
    if last is None:
        return status
    if last.tzinfo is None:
        last = last.replace(tzinfo=dt.timezone.utc)
    age = (dt.datetime.now(dt.timezone.utc) - last).total_seconds()
    return "interrupted" if age > STALE_AFTER_S else status


def _stats(run_ids: Any = None) -> Any:
    """Per run: episodes, scored episodes, mean reward and mean squared reward (reads every
    episode row of the runs: for sorting by reward and for runs without a summary)."""
    query = select(
        EpisodeTable.run_id.label("run_id"),
        func.count(EpisodeTable.id).label("n"),
        func.count(EpisodeTable.reward).label("scored"),
        func.avg(EpisodeTable.reward).label("mean"),
        func.avg(EpisodeTable.reward * EpisodeTable.reward).label("mean_sq"),
    ).group_by(EpisodeTable.run_id)
    if run_ids is not None:
        query = query.where(EpisodeTable.run_id.in_(run_ids))
    return query.subquery()


def _summary_stats(status: str, metrics: Any) -> tuple[int, float, float] | None:
    """``(scored, mean, mean of squares)`` from a finished run's summary
    (:func:`twin.rollout.summarize`: ``episodes``, ``reward_mean``, ``reward_std``), else None."""
    if status != "finished" or not isinstance(metrics, dict):
        return None
    n, mean, std = metrics.get("episodes"), metrics.get("reward_mean"), metrics.get("reward_std")
    if not isinstance(n, int) or n <= 0 or not _finite(mean) or not _finite(std):
        return None
    return n, float(mean), float(std) ** 2 + float(mean) ** 2


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rows(
    session: Session, runs: list[Any], stats: dict[int, tuple[Any, ...]] | None
) -> list[RunRow]:
    """RunRows for ``runs``: episode counts from the run_id index alone; reward figures from the
    run's summary when finished, else from the episodes (``stats`` when the caller has them)."""
    ids = [r.id for r in runs]
    counts = (
        dict(
            session.execute(
                select(EpisodeTable.run_id, func.count(EpisodeTable.id))
                .where(EpisodeTable.run_id.in_(ids))
                .group_by(EpisodeTable.run_id)
            ).all()
        )
        if ids
        else {}
    )
    summaries = {r.id: _summary_stats(r.status, r.metrics) for r in runs}
    if stats is None:
        missing = [i for i in ids if summaries[i] is None and counts.get(i)]
        stats = {}
        if missing:
            sub = _stats(missing)
            for run_id, _n, scored, mean, mean_sq in session.execute(select(sub)).all():
                stats[run_id] = (scored, mean, mean_sq)
    out = []
    for run in runs:
        figures = summaries[run.id] or stats.get(run.id) or (0, None, None)
        out.append(_row(run, counts.get(run.id, 0), *figures))
    return out


def _row(run: RunTable, n: Any, scored: Any, mean: Any, mean_sq: Any) -> RunRow:
    scored = int(scored or 0)
    lo = hi = None
    if mean is not None and scored > 1:
        var = max(0.0, float(mean_sq) - float(mean) ** 2) * scored / (scored - 1)
        half = _Z95 * math.sqrt(var / scored)
        lo, hi = float(mean) - half, float(mean) + half
    return RunRow(
        id=run.id,
        kind=run.kind,
        twin=run.twin,
        policy=run.policy,
        status=_status(run.status, run.pid, run.host, run.heartbeat_at, run.started_at),
        started_at=run.started_at,
        finished_at=run.finished_at,
        config=dict(run.config or {}),
        metrics=dict(run.metrics or {}),
        episodes=int(n or 0),
        scored=scored,
        reward_mean=None if mean is None else float(mean),
        reward_lo=lo,
        reward_hi=hi,
    )


def runs_page(
    engine: Engine,
    *,
    page: int = 1,
    sort: str = "id",
    desc: bool = True,
    kind: str | None = None,
    status: str | None = None,
    text: str | None = None,
    size: int = PAGE_SIZE,
) -> Page:
    """A page of the runs table, filtered and sorted by the database.

    Only the listed runs' figures are computed, from the run_id index and the runs' summaries;
    sorting by reward reads every episode's reward.

    Args:
        engine: The read-only engine.
        page: 1-based page number.
        sort: One of :data:`RUN_SORTS`.
        desc: Descending order.
        kind: Only runs of this kind.
        status: Only runs with this status (``interrupted`` and ``running`` are told apart from
            the writer's liveness, like ``twin runs``).
        text: Only runs whose twin or policy contains it (case-insensitive).
        size: Rows per page.
    """
    by_stats = sort in ("episodes", "reward")
    stats = _stats() if by_stats else None
    order_of = {
        "id": RunTable.id,
        "started": RunTable.started_at,
        "twin": RunTable.twin,
        "policy": RunTable.policy,
        "kind": RunTable.kind,
        "status": RunTable.status,
    }
    if stats is not None:
        order_of.update(episodes=func.coalesce(stats.c.n, 0), reward=stats.c.mean)
    column = order_of.get(sort, RunTable.id)
    ordered = column.desc() if desc else column.asc()
    query = select(RunTable)
    if stats is not None:
        query = select(
            RunTable, stats.c.n, stats.c.scored, stats.c.mean, stats.c.mean_sq
        ).outerjoin(stats, stats.c.run_id == RunTable.id)
    if kind:
        query = query.where(RunTable.kind == kind)
    if text:
        pattern = f"%{text.lower()}%"
        query = query.where(
            or_(func.lower(RunTable.twin).like(pattern), func.lower(RunTable.policy).like(pattern))
        )
    live = status in ("running", "interrupted")
    if status and not live:
        query = query.where(RunTable.status == status)
    elif live:
        query = query.where(RunTable.status == "running")
    query = query.order_by(ordered.nulls_last(), RunTable.id.desc())
    page = max(1, page)
    with Session(engine) as session:
        if not live:
            total = session.scalar(select(func.count()).select_from(query.subquery())) or 0
            query = query.limit(size).offset((page - 1) * size)
        result = session.execute(query).all()
        runs = [r[0] for r in result]
        known = {r[0].id: (r[2], r[3], r[4]) for r in result} if stats is not None else None
        rows = _rows(session, runs, known)
    if live:  # liveness is judged here, not in SQL: few runs are ever `running`
        rows = [r for r in rows if r.status == status]
        return Page(rows[(page - 1) * size : page * size], page, len(rows), size)
    return Page(rows, page, int(total), size)


def run_row(engine: Engine, run_id: int) -> RunRow | None:
    """One run with its episode count, mean reward and its 95% interval (None: no such run)."""
    with Session(engine) as session:
        run = session.get(RunTable, run_id)
        return None if run is None else _rows(session, [run], None)[0]


def _doc(engine: Engine, column: Any) -> Any:
    """A JSON-text column as a JSON expression the database can index into."""
    if engine.dialect.name == "sqlite":
        return type_coerce(column, JSON)
    return cast(column, JSON)


def _strict_json(column: Any) -> Any:
    """A JSON text column with the non-standard numbers the store keeps (``NaN``, ``Infinity``:
    a diverged reward term) read as null, which the databases' JSON parsers refuse otherwise."""
    text_ = type_coerce(column, Text)
    for token in ("-Infinity", "Infinity", "NaN"):
        text_ = func.replace(text_, token, "null")
    return text_


def _summary_of(row: RunRow) -> dict[str, Any] | None:
    """The run's own summary (:func:`twin.rollout.summarize`) when it finished with one."""
    return row.metrics if _summary_stats(row.status, row.metrics) is not None else None


def kind_table(engine: Engine, row: RunRow) -> list[dict[str, Any]]:
    """Per case kind: episodes, mean reward and success rate; from a finished run's summary,
    else counted by the database (no success rate then: that is the twin's to judge)."""
    summary = _summary_of(row)
    by_kind = summary.get("by_kind") if summary else None
    if isinstance(by_kind, dict) and by_kind:
        return [
            {
                "kind": kind,
                "episodes": int(v.get("episodes", 0)),
                "reward_mean": v.get("reward_mean"),
                "success_rate": v.get("success_rate"),
            }
            for kind, v in sorted(by_kind.items())
            if isinstance(v, dict)
        ]
    query = (
        select(EpisodeTable.case_kind, func.count(EpisodeTable.id), func.avg(EpisodeTable.reward))
        .where(EpisodeTable.run_id == row.id)
        .group_by(EpisodeTable.case_kind)
        .order_by(EpisodeTable.case_kind)
    )
    with engine.connect() as conn:
        return [
            {"kind": kind, "episodes": int(n), "reward_mean": mean, "success_rate": None}
            for kind, n, mean in conn.execute(query).all()
        ]


def _term_names(engine: Engine, row: RunRow) -> list[str]:
    query = (
        select(EpisodeTable.components)
        .where(EpisodeTable.run_id == row.id)
        .order_by(EpisodeTable.id.desc())
        .limit(1)
    )
    with engine.connect() as conn:
        found = conn.scalar(query)
    if isinstance(found, str):  # PostgreSQL keeps the document as text
        found = json.loads(found)
    return list(found) if isinstance(found, dict) else []


def term_means(engine: Engine, row: RunRow) -> list[tuple[str, float | None]]:
    """The mean of each reward term over the run's episodes: a finished run's summary, else
    computed by the database."""
    summary = _summary_of(row)
    comps = summary.get("components") if summary else None
    if isinstance(comps, dict) and comps:
        return [(name, float(v) if _finite(v) else None) for name, v in comps.items()]
    names = _term_names(engine, row)
    if not names:
        return []
    doc = _doc(engine, EpisodeTable.components)
    columns = [func.avg(doc[name].as_float()) for name in names]
    with engine.connect() as conn:
        values = conn.execute(select(*columns).where(EpisodeTable.run_id == row.id)).one()
    return [(n, None if v is None else float(v)) for n, v in zip(names, values, strict=True)]


@dataclass
class Terms:
    """Reward-term means and the episodes they are over (the last ``episodes`` of the run when
    ``capped``)."""

    means: list[tuple[str, float | None]]
    episodes: int
    capped: bool = False


def run_figures(
    engine: Engine, run_id: int, terms_cap: int | None = TERMS_CAP
) -> tuple[RunRow, list[dict[str, Any]], Terms] | None:
    """A run with its per-kind table and reward-term means, for the run page (None: no such run).

    A finished run with a summary reads them from it. Any other run is counted by the database:
    per kind, its episodes, rewards and squared rewards in one pass (the run's own figures are
    their sums), and the term means over its last ``terms_cap`` episodes (None: all), which
    reads each one's components document.
    """
    with Session(engine) as session:
        run = session.get(RunTable, run_id)
        if run is None:
            return None
        if _summary_stats(run.status, run.metrics) is not None:
            row = _rows(session, [run], None)[0]
            return row, kind_table(engine, row), Terms(term_means(engine, row), row.episodes)
        query = (
            select(
                EpisodeTable.case_kind,
                func.count(EpisodeTable.id),
                func.count(EpisodeTable.reward),
                func.sum(EpisodeTable.reward),
                func.sum(EpisodeTable.reward * EpisodeTable.reward),
            )
            .where(EpisodeTable.run_id == run_id)
            .group_by(EpisodeTable.case_kind)
            .order_by(EpisodeTable.case_kind)
        )
        per_kind = session.execute(query).all()
    n = scored = 0
    total = squares = 0.0
    kinds = []
    for kind, kn, ks, ksum, ksq in per_kind:
        n, scored = n + int(kn), scored + int(ks)
        total, squares = total + float(ksum or 0.0), squares + float(ksq or 0.0)
        mean = float(ksum) / int(ks) if ks else None
        kinds.append({"kind": kind, "episodes": int(kn), "reward_mean": mean, "success_rate": None})
    row = _row(
        run, n, scored, total / scored if scored else None, squares / scored if scored else None
    )
    capped = terms_cap is not None and n > terms_cap
    means = _counted_term_means(engine, row, terms_cap)
    return row, kinds, Terms(means, min(n, terms_cap) if capped else n, capped)


def _counted_term_means(
    engine: Engine, row: RunRow, cap: int | None
) -> list[tuple[str, float | None]]:
    names = _term_names(engine, row)
    if not names:
        return []
    latest = (
        select(EpisodeTable.components.label("components"))
        .where(EpisodeTable.run_id == row.id)
        .order_by(EpisodeTable.id.desc())
        .limit(cap)  # None: no limit
        .subquery()
    )
    doc = _doc(engine, _strict_json(latest.c.components))
    with engine.connect() as conn:
        values = conn.execute(select(*[func.avg(doc[n].as_float()) for n in names])).one()
    return [(n, None if v is None else float(v)) for n, v in zip(names, values, strict=True)]


def _decision_key(truth: Any) -> str | None:
    if not isinstance(truth, dict):
        return None
    for key in DECISION_KEYS:
        if isinstance(truth.get(key), str):
            return key
    return next((k for k, v in truth.items() if isinstance(v, str)), None)


@dataclass
class Confusion:
    """Decision confusion: rows the truth's decision, columns the submitted one."""

    key: str
    labels_true: list[str]
    labels_submitted: list[str]
    counts: dict[tuple[str, str], int]
    episodes: int
    capped: bool


def confusion(engine: Engine, row: RunRow, cap: int | None = CONFUSION_CAP) -> Confusion | None:
    """The decision confusion of a run (truth key from :data:`DECISION_KEYS`), over its first
    ``cap`` episodes (None: all); None when its episodes carry no truth with a text decision."""
    doc = _doc(engine, EpisodeTable.trajectory)
    truth_at = ("info", "outcome", "truth")
    with engine.connect() as conn:
        first = conn.scalar(
            select(EpisodeTable.trajectory)
            .where(EpisodeTable.run_id == row.id, doc[truth_at].isnot(None))
            .order_by(EpisodeTable.id)
            .limit(1)
        )
        if first is None:
            return None
        truth = ((json.loads(first).get("info") or {}).get("outcome") or {}).get("truth")
        key = _decision_key(truth)
        if key is None:
            return None
        sub = (
            select(
                doc[(*truth_at, key)].as_string().label("truth"),
                doc[("submission", key)].as_string().label("submitted"),
            )
            .where(EpisodeTable.run_id == row.id)
            .order_by(EpisodeTable.id)
            .limit(cap)  # None: no limit
            .subquery()
        )
        grouped = select(sub.c.truth, sub.c.submitted, func.count()).group_by(
            sub.c.truth, sub.c.submitted
        )
        counts: dict[tuple[str, str], int] = {}
        for t, s, n in conn.execute(grouped).all():
            cell = (t if t is not None else "?", s if s is not None else "none")
            counts[cell] = counts.get(cell, 0) + int(n)
    total = sum(counts.values())
    return Confusion(
        key=key,
        labels_true=sorted({t for t, _ in counts}),
        labels_submitted=sorted({s for _, s in counts}, key=lambda s: (s == "none", s)),
        counts=counts,
        episodes=total,
        capped=cap is not None and row.episodes > cap,
    )


#: Order of the metric groups on a training run's page (by the part of the name before "/").
_GROUP_ORDER = ("rewards", "losses", "policy", "perf", "episodes", "batch", "optim")


def curves(
    engine: Engine, run_id: int
) -> list[tuple[str, list[tuple[str, list[tuple[float, float]]]]]]:
    """A training run's logged metrics as ``[(group, [(name, [(step, value)])])]``, the groups in
    the order rewards, losses, policy, perf, then the rest; non-numeric values skipped."""
    query = (
        select(MetricTable.step, MetricTable.values)
        .where(MetricTable.run_id == run_id)
        .order_by(MetricTable.id)
    )
    series: dict[str, list[tuple[float, float]]] = {}
    with engine.connect() as conn:
        for step, values in conn.execute(query):
            if isinstance(values, str):
                values = json.loads(values)
            for name, value in (values or {}).items():
                if _finite(value):
                    series.setdefault(name, []).append((float(step), float(value)))
    groups: dict[str, list[tuple[str, list[tuple[float, float]]]]] = {}
    for name, points in series.items():
        groups.setdefault(name.partition("/")[0] if "/" in name else "other", []).append(
            (name, points)
        )

    def rank(group: str) -> tuple[int, str]:
        return (_GROUP_ORDER.index(group) if group in _GROUP_ORDER else len(_GROUP_ORDER), group)

    out = []
    for group in sorted(groups, key=rank):
        items = groups[group]
        items.sort(key=lambda item: (item[0] != "rewards/total", item[0]))
        out.append((group, items))
    return out


@dataclass
class EpisodeRow:
    """One line of a run's episodes table."""

    id: int
    case_id: str
    case_kind: str
    step: int | None
    reward: float | None
    turns: int | None
    invalid: int | None
    terminated: bool | None


def episodes_page(
    engine: Engine,
    run_id: int,
    *,
    page: int = 1,
    kind: str | None = None,
    step: int | None = None,
    order: str = "id",
    size: int = PAGE_SIZE,
) -> Page:
    """A page of a run's episodes (``order``: ``id``, ``reward`` or ``-reward``)."""
    doc = _doc(engine, EpisodeTable.trajectory)
    where: list[ColumnElement[bool]] = [EpisodeTable.run_id == run_id]
    if kind:
        where.append(EpisodeTable.case_kind == kind)
    if step is not None:
        where.append(EpisodeTable.step == step)
    ordering = {
        "reward": (EpisodeTable.reward.asc().nulls_first(), EpisodeTable.id),
        "-reward": (EpisodeTable.reward.desc().nulls_last(), EpisodeTable.id),
    }.get(order, (EpisodeTable.id.asc(),))
    page = max(1, page)
    query = (
        select(
            EpisodeTable.id,
            EpisodeTable.case_id,
            EpisodeTable.case_kind,
            EpisodeTable.step,
            EpisodeTable.reward,
            doc["num_turns"].as_integer(),
            doc["invalid_calls"].as_integer(),
            doc["terminated"].as_boolean(),
        )
        .where(*where)
        .order_by(*ordering)
        .limit(size)
        .offset((page - 1) * size)
    )
    with engine.connect() as conn:
        total = conn.scalar(select(func.count(EpisodeTable.id)).where(*where)) or 0
        rows = [EpisodeRow(*r) for r in conn.execute(query).all()]
    return Page(rows, page, int(total), size)


def episode(engine: Engine, episode_id: int) -> tuple[int, int | None, Trajectory] | None:
    """``(run_id, step, trajectory)`` of one episode, or None."""
    query = select(EpisodeTable.run_id, EpisodeTable.step, EpisodeTable.trajectory).where(
        EpisodeTable.id == episode_id
    )
    with engine.connect() as conn:
        found = conn.execute(query).first()
    if found is None:
        return None
    return found[0], found[1], Trajectory.model_validate_json(found[2])


def neighbours(engine: Engine, run_id: int, episode_id: int) -> tuple[int | None, int | None]:
    """The ids of the episodes stored just before and just after ``episode_id`` in its run."""
    with engine.connect() as conn:
        before = conn.scalar(
            select(func.max(EpisodeTable.id)).where(
                EpisodeTable.run_id == run_id, EpisodeTable.id < episode_id
            )
        )
        after = conn.scalar(
            select(func.min(EpisodeTable.id)).where(
                EpisodeTable.run_id == run_id, EpisodeTable.id > episode_id
            )
        )
    return before, after


def case_episodes(engine: Engine, run_id: int, case_id: str, limit: int = 64) -> list[int]:
    """Ids of a run's episodes of one case, in storing order."""
    query = (
        select(EpisodeTable.id)
        .where(EpisodeTable.run_id == run_id, EpisodeTable.case_id == case_id)
        .order_by(EpisodeTable.id)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [int(i) for i in conn.scalars(query)]


@dataclass
class Compare:
    """Two runs on the cases they share.

    Attributes:
        threshold: An episode succeeds when its reward is at least this.
        common: Cases both runs played.
        only_a: Cases only run A played.
        only_b: Cases only run B played.
        fixed: Cases solved by B and not by A, as per-case rows.
        broken: Cases solved by A and not by B.
        kinds: Per-kind rows over the common cases: episodes and mean reward and success in
            each run, and the deltas (B - A).
        moved: Common cases by how far their mean reward moved, largest first (a page).
    """

    threshold: float
    common: int
    only_a: int
    only_b: int
    fixed: list[dict[str, Any]] = field(default_factory=list)
    broken: list[dict[str, Any]] = field(default_factory=list)
    kinds: list[dict[str, Any]] = field(default_factory=list)
    moved: list[dict[str, Any]] = field(default_factory=list)
    fixed_total: int = 0
    broken_total: int = 0


def _per_case(
    engine: Engine, run_id: int, threshold: float
) -> dict[str, tuple[str, int, float, int]]:
    # within float noise of the threshold counts (a reward of 0.1 + 0.2 reaches 0.3)
    ok = func.sum(case((EpisodeTable.reward >= threshold - 1e-9, 1), else_=0))
    query = (
        select(
            EpisodeTable.case_id,
            func.min(EpisodeTable.case_kind),
            func.count(EpisodeTable.id),
            func.avg(func.coalesce(EpisodeTable.reward, 0.0)),
            ok,
        )
        .where(EpisodeTable.run_id == run_id)
        .group_by(EpisodeTable.case_id)
    )
    with engine.connect() as conn:
        return {
            c: (k, int(n), float(m), int(s or 0)) for c, k, n, m, s in conn.execute(query).all()
        }


def compare_runs(
    engine: Engine, a: int, b: int, threshold: float, moved: int = 50, listed: int = 200
) -> Compare:
    """Flipped cases, per-kind deltas and the most moved cases of run ``b`` against run ``a``
    (the first ``listed`` flipped cases each way, in case order, with their totals).

    A case is solved in a run when at least half of its episodes there succeed (reward at least
    ``threshold``); it flips when one run solves it and the other does not.
    """
    per_a, per_b = _per_case(engine, a, threshold), _per_case(engine, b, threshold)
    common = sorted(set(per_a) & set(per_b), key=_case_order)
    out = Compare(
        threshold, len(common), len(set(per_a) - set(per_b)), len(set(per_b) - set(per_a))
    )
    kinds: dict[str, list[float]] = {}
    rows = []
    for case_id in common:
        ka, na, ma, sa = per_a[case_id]
        _, nb, mb, sb = per_b[case_id]
        row = {
            "case": case_id,
            "kind": ka,
            "a_mean": ma,
            "b_mean": mb,
            "a_ok": sa,
            "a_n": na,
            "b_ok": sb,
            "b_n": nb,
            "delta": mb - ma,
        }
        solved_a, solved_b = 2 * sa >= na, 2 * sb >= nb
        if solved_b and not solved_a:
            out.fixed.append(row)
        elif solved_a and not solved_b:
            out.broken.append(row)
        rows.append(row)
        acc = kinds.setdefault(ka, [0, 0.0, 0.0, 0, 0, 0, 0])
        acc[0] += 1
        acc[1] += ma * na
        acc[2] += mb * nb
        acc[3] += na
        acc[4] += nb
        acc[5] += sa
        acc[6] += sb
    for kind in sorted(kinds):
        cases, sum_a, sum_b, na, nb, sa, sb = kinds[kind]
        ma, mb = sum_a / na, sum_b / nb
        ra, rb = sa / na, sb / nb
        out.kinds.append(
            {
                "kind": kind,
                "cases": int(cases),
                "a_mean": ma,
                "b_mean": mb,
                "delta": mb - ma,
                "a_success": ra,
                "b_success": rb,
                "success_delta": rb - ra,
            }
        )
    rows.sort(key=lambda r: -abs(r["delta"]))
    out.moved = [r for r in rows[:moved] if r["delta"] != 0.0]
    out.fixed_total, out.broken_total = len(out.fixed), len(out.broken)
    out.fixed, out.broken = out.fixed[:listed], out.broken[:listed]
    return out


def _case_order(case_id: str) -> tuple[str, int, str]:
    head, _, last = case_id.rpartition("/")
    return (head, int(last), "") if last.isdigit() else (case_id, 0, case_id)


def decision_of(trajectory: Trajectory) -> str | None:
    """The decision key an episode's truth is read by (see :data:`DECISION_KEYS`)."""
    outcome = trajectory.info.get("outcome") if isinstance(trajectory.info, dict) else None
    truth = outcome.get("truth") if isinstance(outcome, dict) else None
    return _decision_key(truth)

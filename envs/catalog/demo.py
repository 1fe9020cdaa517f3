"""``twin demo`` (what ``make demo`` runs): the catalog twin's baselines, side by side.

Builds the world (progress bar), runs each baseline policy on the test split in groups, prints a
table per policy (reward and components, pass@k and pass^k, verdict accuracy and a confusion
matrix per case type, missed counterfeits vs false alarms), writes ``reports/demo/report.md`` with
PNG plots, and records every episode in the run store (``twin runs`` lists them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from envs.catalog.v0.listings import KINDS
from envs.catalog.v1.listings import KINDS as KINDS_V1

__all__ = ["DEFAULT_EPISODES", "V1_POLICIES", "main", "select_cases", "twin_class"]

#: The policies the v1 demo runs: baselines, the careful reference and the degenerate ones.
V1_POLICIES = (
    "random",
    "heuristic",
    "careful",
    "oracle",
    "always_ok",
    "always_counterfeit",
    "always_prohibited",
    "no_tools",
    "first_hit",
)


def twin_class(version: int) -> Any:
    """The catalog twin class of ``version`` (0 or 1).

    Raises:
        ValueError: another version.
    """
    from envs.catalog.v0.twin import CatalogTwin
    from envs.catalog.v1.twin import CatalogTwinV1

    classes = {0: CatalogTwin, 1: CatalogTwinV1}
    if version not in classes:
        raise ValueError(f"catalog version must be 0 or 1, got {version!r}")
    return classes[version]


#: Cases in the default demo: None runs the whole split (200 test cases x group size).
DEFAULT_EPISODES: int | None = None


def select_cases(twin: Any, split: str, episodes: int | None) -> list[tuple[str, int]]:
    """Cases of ``split`` for the demo, stratified so that every planted kind appears.

    Args:
        twin: The catalog twin.
        split: Split to draw from.
        episodes: Number of cases; None for the whole split. Cases are taken round-robin over
            the kinds, in index order within each kind.
    """
    total = twin.num_cases(split)
    by_kind: dict[str, list[int]] = {}
    for i in range(total):
        by_kind.setdefault(twin.kind_of(split, i), []).append(i)
    order = KINDS_V1 if twin.version >= 1 else KINDS
    kinds = [k for k in order if k in by_kind]
    want = total if episodes is None else max(1, int(episodes))
    want = min(want, total)
    picked: list[int] = []
    depth = 0
    while len(picked) < want:
        for k in kinds:
            if depth < len(by_kind[k]) and len(picked) < want:
                picked.append(by_kind[k][depth])
        depth += 1
    return [(split, i) for i in sorted(picked)]


def main(
    episodes: int | None = DEFAULT_EPISODES,
    group_size: int = 4,
    split: str = "test",
    taxonomy: str | None = None,
    out: str = "reports/demo",
    store: str | bool | None = None,
    policies: Sequence[str] | str | None = None,
    seed: int = 0,
    progress: bool = True,
    version: int = 1,
    **_: Any,
) -> int:
    """Run the demo; return 0 (the CLI's exit status).

    Args:
        episodes: Test cases to run (each ``group_size`` times); None: the whole split.
        group_size: Episodes per case (k of pass@k and pass^k).
        split: Split to run on.
        taxonomy: A Shopify taxonomy checkout to use instead of the generated world.
        out: Folder for ``report.md`` and the plots.
        store: Run store URL or file (default ``$TWINRL_STORE`` or ``runs/twinrl.db``);
            ``"none"`` or False (``--no-store``) to skip.
        policies: Baselines to run (names or one comma-separated string); default for v1
            :data:`V1_POLICIES`, for v0 random, heuristic and oracle.
        seed: World and case seed.
        progress: Show progress bars.
        version: Catalog version (1, the latest, or 0).
    """
    from envs.catalog.report import write_report

    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the tables into 80 columns
        console = Console(width=160)
    if policies is None:
        policies = V1_POLICIES if int(version) >= 1 else ("random", "heuristic", "oracle")
    names = (
        [p.strip() for p in policies.split(",")] if isinstance(policies, str) else list(policies)
    )
    started = time.perf_counter()
    twin = twin_class(int(version))(seed=seed, taxonomy_path=taxonomy, progress=progress)
    console.print(f"[bold]twinrl demo[/]: {twin!r} on the {split} split")
    t0 = time.perf_counter()
    world = twin.world
    build_s = time.perf_counter() - t0
    console.print(f"world: {world!r} ready in {build_s:.1f} s")
    baselines = twin.baselines()
    unknown = [n for n in names if n not in baselines]
    if unknown:
        console.print(f"[red]unknown policies {unknown}; baselines: {', '.join(baselines)}[/]")
        return 2
    cases = select_cases(twin, split, episodes)
    run_store = _open_store(store)
    config = {"split": split, "cases": len(cases), "group_size": group_size, "seed": seed,
              "taxonomy": taxonomy, "world": world.digest()}  # fmt: skip
    results, run_ids = _run_baselines(
        console,
        twin,
        [(n, baselines[n]) for n in names],
        cases,
        group_size,
        progress,
        run_store,
        config,
    )
    total_s = time.perf_counter() - started
    kinds = len({twin.kind_of(s, i) for s, i in cases})
    meta = _meta(world, split, f"{len(cases)} ({kinds} case types), group size {group_size}")
    meta["world build (s)"] = f"{build_s:.2f}"
    meta["total wall time (s)"] = f"{total_s:.1f}"
    meta["run store"] = (
        f"{run_store.url} runs {run_ids}" if run_store is not None else "not written"
    )
    path = write_report(out, results, meta)
    console.print(f"report: {path} | run store: {meta['run store']} | total {total_s:.1f} s")
    if run_store is not None:
        run_store.close()
    return 0


def _run_baselines(
    console: Console,
    twin: Any,
    policies: list[tuple[str, Any]],
    cases: list[tuple[str, int]],
    group_size: int,
    progress: bool,
    run_store: Any,
    config: dict[str, Any],
) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """Run every ``(name, factory)`` of ``policies`` on ``cases``, print its tables, and record
    it in ``run_store`` (when given): ``({name: {summary, metrics}}, {name: run id})``."""
    from envs.catalog.report import catalog_metrics, print_tables
    from twin.rollout import run_episodes, summarize

    results: dict[str, dict[str, Any]] = {}
    run_ids: dict[str, int] = {}
    for name, make in policies:
        t1 = time.perf_counter()
        groups = run_episodes(twin, make(twin), cases, group_size=group_size, progress=progress)
        elapsed = time.perf_counter() - t1
        summary = summarize(groups, success=twin.success)
        metrics = catalog_metrics(groups, twin)
        metrics["wall_s"] = round(elapsed, 3)
        results[name] = {"summary": summary, "metrics": metrics}
        if run_store is not None:
            with run_store.track_run("demo", twin.name, name, config) as run:
                run.add_episodes([t for g in groups for t in g.trajectories])
                run.metrics = {"summary": summary, "catalog": metrics}
            run_ids[name] = run.id
        print_tables(console, name, summary, metrics)
        console.print(f"{name}: {len(cases) * group_size} episodes in {elapsed:.1f} s\n")
    return results, run_ids


def _open_store(store: str | bool | None) -> Any:
    """The run store the demo writes to: None means the default store; False, "none" or
    "false" (``--no-store``) mean no store."""
    if store is None or (store is not False and str(store).lower() not in ("none", "false")):
        from twin.store import RunStore

        return RunStore(store)
    return None


def _meta(world: Any, split: str, cases: str) -> dict[str, str]:
    """The report's header rows that describe the world and the cases."""
    return {
        "world": repr(world),
        "world digest": world.digest()[:16],
        "split": split,
        "cases": cases,
    }


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

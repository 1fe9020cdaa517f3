"""``twin bench catalog``: the catalog twin's hot path measured against its targets
(docs/benchmarks.md).

Figures (p50/p95 over repeated calls, in process, no model):

- tool-call latency per tool, called directly (validate + call) and through ``TwinEnv.step``
  (parse + validate + call + serialise);
- ``env.reset`` of a case and the step overhead beyond the tool itself;
- world build, cold (empty cache, in a fresh process) and warm (cached, in a fresh process);
- memory of 10,000 concurrent episodes (tracemalloc: envs reset on distinct cases, one step each).

Each figure is printed beside its target with met / missed and the ratio measured / target.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["TARGETS", "main"]

#: Targets (docs/benchmarks.md): name -> (limit, unit). Lower is better for all of them.
TARGETS: dict[str, tuple[float, str]] = {
    "env.step look-up tool p50": (15.0, "us"),
    "env.step search_taxonomy p50": (100.0, "us"),
    "env.reset p50": (50.0, "us"),
    "memory per live episode": (20.0, "KB"),
    "world build cold": (10.0, "s"),
    "world build warm": (0.5, "s"),
}


def _pcts(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p50 = statistics.median(ordered)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return p50, p95


def _time(fn: Callable[[], Any], n: int, warmup: int = 20) -> tuple[float, float]:
    """p50 and p95 in microseconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t = clock()
        fn()
        out.append((clock() - t) * 1e6)
    return _pcts(out)


def _time_pair(
    a: Callable[[], Any], b: Callable[[], Any], n: int
) -> tuple[tuple[float, float], ...]:
    """p50/p95 in microseconds of ``a()`` and ``b()``, called alternately (fair under noise)."""
    for _ in range(20):
        a()
        b()
    ta, tb = [], []
    clock = time.perf_counter
    for _ in range(n):
        t = clock()
        a()
        t1 = clock()
        b()
        t2 = clock()
        ta.append((t1 - t) * 1e6)
        tb.append((t2 - t1) * 1e6)
    return _pcts(ta), _pcts(tb)


def _build_in_subprocess(cache: str, seed: int, taxonomy: str | None) -> tuple[float, float, float]:
    """Seconds of a world build in a fresh process: (wall, CPU, of which CPU importing)."""
    code = (
        "import time, json\nt = time.perf_counter(); c = time.process_time()\n"
        "from envs.catalog.world import build_world\nci = time.process_time()\n"
        f"w = build_world(seed={seed}, taxonomy_path={taxonomy!r}, cache_dir={cache!r}, "
        "progress=False)\n"
        "print(json.dumps([time.perf_counter() - t, time.process_time() - c, ci - c]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall, cpu, imports = json.loads(done.stdout.strip().splitlines()[-1])
    return wall, cpu, imports


def _action(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "b0",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
        ],
    }


def main(
    n: int = 2000,
    episodes: int = 10_000,
    seed: int = 0,
    taxonomy: str | None = None,
    cold: bool = True,
    warm: bool = True,
    out: str | None = None,
    version: int = 1,
    **_: Any,
) -> int:
    """Run the benchmarks and print them beside the targets; return 0.

    Args:
        n: Timed calls per figure.
        episodes: Concurrent episodes for the memory figure.
        seed: World seed.
        taxonomy: A Shopify taxonomy checkout instead of the generated world.
        cold: Time a cold world build in a fresh process with an empty cache.
        warm: Time a warm (cached) world build in a fresh process.
        out: Write the figures as JSON to this file too.
        version: Catalog version to time (1, the latest, or 0).
    """
    from envs.catalog.demo import twin_class

    CatalogTwin = twin_class(version)  # noqa: N806 - the class of the chosen version

    console = Console(width=140) if not Console().is_terminal else Console()
    console.print(
        f"cpus {os.cpu_count()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    figures = _Figures()
    figures.world_builds(seed, taxonomy, cold=cold, warm=warm)
    twin = CatalogTwin(seed=seed, taxonomy_path=taxonomy, max_turns=10**9)
    calls = _tool_calls(twin)
    figures.tools(twin, calls, n)
    fresh = CatalogTwin(seed=seed, taxonomy_path=taxonomy, max_turns=10**9)
    figures.new_queries(fresh, n)
    figures["env.step look-up tool p50"] = dict(
        figures["env.step get_attribute_schema"], note="get_attribute_schema (a look-up)"
    )
    figures["env.step search_taxonomy p50"] = dict(figures["env.step search_taxonomy"])
    figures.resets_and_cases(CatalogTwin, seed, taxonomy, n)
    mtwin = CatalogTwin(seed=seed, taxonomy_path=taxonomy, train_size=max(episodes, 1))
    figures.memory(mtwin, _action("get_attribute_schema", calls["get_attribute_schema"]), episodes)

    _print(console, figures, twin.world)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(figures, fh, indent=2)
    return 0


def _tool_calls(twin: Any) -> dict[str, dict[str, Any]]:
    """One valid call of each tool on the twin's first test case."""
    world = twin.world
    case = twin.case("test", 0)
    task = case.task
    brand = next(iter(sorted(world.brands)))
    leaf = case.truth["category_id"]
    query = " ".join(task["title"].split()[:6])
    attrs = dict(case.truth["attributes"])
    return {
        "get_attribute_schema": {"category_id": leaf},
        "lookup_brand": {"name": brand},
        "search_taxonomy": {"query": query, "limit": 10},
        **({"get_seller": {"name": task["seller"]}} if twin.tool("get_seller") else {}),
        "submit": {"category_id": leaf, "attributes": attrs, "verdict": "ok", "reason": "bench"},
    }


class _Figures(dict[str, dict[str, Any]]):
    """The figures by name; each method times one group of them."""

    def put(
        self, name: str, value: float, unit: str, p95: float | None = None, note: str = ""
    ) -> None:
        self[name] = {"value": value, "unit": unit, "p95": p95, "note": note}

    def world_builds(self, seed: int, taxonomy: str | None, *, cold: bool, warm: bool) -> None:
        """Cold and warm world builds, each in a fresh process."""
        with tempfile.TemporaryDirectory(prefix="twinrl-bench-") as tmp:
            if cold or warm:  # a warm build needs the cold one first
                wall, cpu, imports = _build_in_subprocess(tmp, seed, taxonomy)
                if cold:
                    self.put(
                        "world build cold",
                        wall,
                        "s",
                        note=f"fresh process, empty cache; CPU {cpu:.2f} s",
                    )
            if warm:
                times = [_build_in_subprocess(tmp, seed, taxonomy) for _ in range(2)]
                wall, cpu, imports = min(times)
                self.put(
                    "world build warm",
                    wall,
                    "s",
                    note=f"fresh process, cached (best of 2); CPU {cpu:.2f} s, of which imports "
                    f"{imports:.2f} s",
                )

    def tools(self, twin: Any, calls: dict[str, dict[str, Any]], n: int) -> None:
        """Each tool directly and through env.step, interleaved so that machine noise hits
        both."""
        from twin.env import TwinEnv

        env = TwinEnv(twin)
        env.reset(options={"split": "test", "index": 0})
        task = twin.case("test", 0).task
        for tname, args in calls.items():
            t = twin.tool(tname)
            assert t is not None
            # validate + call, as the env runs a tool (the env sends plain dicts to json as they
            # are)
            extra = {"task": task} if "task" in t.injected else {}
            direct = lambda t=t, a=args, x=extra: t.fn(**t.validate(a), **x)  # noqa: E731
            if t.terminal:  # a terminal step ends the episode: time the tool directly only
                p50, p95 = _time(direct, n)
                self.put(f"direct {tname}", p50, "us", p95)
                continue
            action = _action(tname, args)
            (d50, d95), (s50, s95) = _time_pair(direct, lambda a=action: env.step(a), n)
            self.put(f"direct {tname}", d50, "us", d95)
            self.put(f"env.step {tname}", s50, "us", s95)
            self.put(
                f"env.step overhead {tname}", s50 - d50, "us", note="parse + record + serialise"
            )
            env.reset(options={"split": "test", "index": 0})  # keep the chat short between figures

    def new_queries(self, fresh: Any, n: int) -> None:
        """Searches for new queries: the figures of :meth:`tools` repeat one query (as a GRPO
        group does: the caches answer); new queries pay for tantivy's search itself."""
        from twin.env import TwinEnv

        titles = [
            fresh.case("test", i % fresh.num_cases("test")).task["title"].split()
            for i in range(200)
        ]
        queries = list(dict.fromkeys(" ".join(t[:k]) for k in (2, 4, 6, 8) for t in titles))
        fenv = TwinEnv(fresh)
        fenv.reset(options={"split": "test", "index": 0})
        qs = iter(queries * 2)
        runs = min(n, len(queries))
        for _ in range(runs):  # warm the per-word query cache, then time cold result caches
            fenv.step(_action("search_taxonomy", {"query": next(qs), "limit": 10}))
        fresh._search_cache.clear()
        fresh.world._index._cache.clear()
        fenv.reset(options={"split": "test", "index": 0})
        qs = iter(queries)
        p50, p95 = _time(
            lambda: fenv.step(_action("search_taxonomy", {"query": next(qs), "limit": 10})),
            runs,
            warmup=0,
        )
        self.put(
            "env.step search_taxonomy new queries",
            p50,
            "us",
            p95,
            note=f"{runs} distinct queries, result caches empty (the action dict built inside)",
        )

    def resets_and_cases(self, twin_cls: Any, seed: int, taxonomy: str | None, n: int) -> None:
        """``env.reset`` on memoised cases, and a case's first build."""
        from twin.env import TwinEnv

        renv = TwinEnv(twin_cls(seed=seed, taxonomy_path=taxonomy))
        size = renv.twin.num_cases("test")
        for i in range(size):  # cases are memoised: time the reset itself, not listing generation
            renv.twin.case("test", i)
        idx = iter(range(10**9))
        p50, p95 = _time(
            lambda: renv.reset(options={"split": "test", "index": next(idx) % size}), n
        )
        self.put("env.reset p50", p50, "us", p95, note="case memoised")
        gen = twin_cls(seed=seed, taxonomy_path=taxonomy, train_size=10**6)
        idx2 = iter(range(10**6))
        p50, p95 = _time(lambda: gen.case("train", next(idx2)), min(n, 2000), warmup=5)
        self.put("case generation (first build)", p50, "us", p95)

    def memory(self, mtwin: Any, action: dict[str, Any], episodes: int) -> None:
        """Memory of ``episodes`` concurrent episodes, each reset and one step in."""
        from twin.env import TwinEnv

        for i in range(episodes):  # cases built beforehand: they are the dataset, not episode state
            mtwin.case("train", i)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        envs = []
        for i in range(episodes):
            e = TwinEnv(mtwin)
            e.reset(options={"split": "train", "index": i})
            e.step(action)
            envs.append(e)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        self.put(
            "memory per live episode",
            used / max(episodes, 1) / 1024,
            "KB",
            note=f"{episodes} episodes reset + 1 step: {used / 2**20:.1f} MB in all",
        )
        del envs


def _print(console: Console, figures: dict[str, dict[str, Any]], world: Any) -> None:
    table = Table(title=f"twin bench catalog: {world!r}")
    for col, just in (
        ("figure", "left"),
        ("p50 / value", "right"),
        ("p95", "right"),
        ("target", "right"),
        ("status", "left"),
        ("ratio", "right"),
        ("note", "left"),
    ):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    met = missed = 0
    for name, fig in figures.items():
        unit = fig["unit"]
        val = f"{fig['value']:.2f} {unit}"
        p95 = f"{fig['p95']:.2f} {unit}" if fig.get("p95") is not None else ""
        target = TARGETS.get(name)
        if target is None:
            table.add_row(name, val, p95, "", "", "", fig.get("note", ""))
            continue
        limit, _ = target
        ratio = fig["value"] / limit
        ok = fig["value"] <= limit
        fig["target"], fig["met"] = limit, ok  # written to --out too
        met += ok
        missed += not ok
        status = "[green]met[/]" if ok else "[red]missed[/]"
        how = f"{ratio:.2f}x" + ("" if ok else f" ({ratio:.1f}x over)")
        table.add_row(name, val, p95, f"<= {limit:g} {unit}", status, how, fig.get("note", ""))
    console.print(table)
    console.print(f"targets: {met} met, {missed} missed (ratio = measured / target)")

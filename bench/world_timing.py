"""Time the catalog world: cold and warm builds, search and look-up latency.

Run ``python -m bench.world_timing [--taxonomy PATH] [--seed N]``. Each build runs in a
fresh process (so a warm load pays its imports and file reads, as a new worker would) against a
temporary cache; latencies are measured in this process over sampled leaf names.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

# imports are timed apart: importing envs.catalog pulls in the whole twin framework, which
# every worker pays once whatever the world costs
_BUILD = (
    "import json, sys, time; t0 = time.perf_counter(); "
    "from envs.catalog.world import build_world; t1 = time.perf_counter(); "
    "w = build_world(seed=int(sys.argv[1]), taxonomy_path=sys.argv[2] or None, "
    "cache_dir=sys.argv[3]); "
    "t2 = time.perf_counter(); "
    "print(json.dumps({'imports': t1 - t0, 'seconds': t2 - t1, 'categories': len(w.categories)}))"
)

TARGETS = {"cold_s": 10.0, "warm_s": 0.5, "search_p50_us": 100.0}


def _build(seed: int, taxonomy: str, cache: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _BUILD, str(seed), taxonomy, str(cache)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _p(samples: list[float], q: float) -> float:
    samples = sorted(samples)
    return samples[min(len(samples) - 1, int(q * len(samples)))]


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Print and return the figures beside their targets (docs/benchmarks.md)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--taxonomy", default="", help="a Shopify taxonomy checkout (default: generated)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queries", type=int, default=2000)
    args = parser.parse_args(argv)

    from envs.catalog.world import build_world

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        cold = _build(args.seed, args.taxonomy, cache)
        warm = min(
            (_build(args.seed, args.taxonomy, cache) for _ in range(3)), key=lambda r: r["seconds"]
        )
        t = time.perf_counter()
        world = build_world(seed=args.seed, taxonomy_path=args.taxonomy or None, cache_dir=cache)
        warm_in_process = time.perf_counter() - t

        rng = random.Random(0)
        # distinct queries: every one is a cache miss (the uncached cost)
        leaves = rng.sample(world.leaves, min(args.queries, len(world.leaves)))
        names = [world.categories[c].name for c in leaves]
        search, cached = [], []
        for q in names:
            t = time.perf_counter()
            world.search(q, 10)
            search.append(time.perf_counter() - t)
        for q in names:  # the same queries again, as a GRPO group replays a case
            t = time.perf_counter()
            world.search(q, 10)
            cached.append(time.perf_counter() - t)
        brands = rng.sample(sorted(world.brands), min(len(world.brands), args.queries // 2))
        lookups, msrps = [], []
        for name in brands:
            i = rng.randrange(len(name))
            typo = name[:i] + name[i + 1 :]
            t = time.perf_counter()
            world.lookup_brand(typo)
            lookups.append(time.perf_counter() - t)
            cid = rng.choice(world.leaves)
            t = time.perf_counter()
            world.msrp(name, cid)
            msrps.append(time.perf_counter() - t)

    figures = {
        "categories": float(cold["categories"]),
        "cold_s": cold["seconds"],
        "warm_s": warm["seconds"],
        "warm_in_process_s": warm_in_process,
        "imports_s": warm["imports"],
        "search_p50_us": statistics.median(search) * 1e6,
        "search_p95_us": _p(search, 0.95) * 1e6,
        "search_cached_p50_us": statistics.median(cached) * 1e6,
        "lookup_brand_p50_us": statistics.median(lookups) * 1e6,
        "msrp_p50_us": statistics.median(msrps) * 1e6,
    }
    print(f"catalog world ({world.source}, {len(world.categories):,} categories)")
    for key, value in figures.items():
        target = TARGETS.get(key)
        mark = (
            ""
            if target is None
            else f"   target <= {target:g}  {'met' if value <= target else 'MISSED'}"
        )
        print(f"  {key:<22}{value:>12,.3f}{mark}")
    return figures


if __name__ == "__main__":
    main()

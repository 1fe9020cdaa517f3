"""How fast ``twin ui`` opens its pages on a large run store.

Fills a SQLite store with ``--episodes`` episodes (default 100,000) written through
:class:`twin.store.RunStore`, the way evaluations write them: a big evaluation run holding 90% of
them, a second evaluation of the same policy spec on the first 10% of its cases (so the two can be
compared), and a training run with ``--steps`` logged metric steps. Then it asks the application
(in process, templates rendered, no network) for each page and prints the latency of the first
request and the median of ``--repeat`` more::

    python bench/ui_bench.py                          # 100,000 episodes in a temporary folder
    python bench/ui_bench.py --store /tmp/big.db      # keep (and reuse) the store

Each episode is a three-turn Catalog-like transcript of about ``--episode-kb`` KiB of JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from twin.store import RunStore
from twin.trajectory import ToolCallRecord, Trajectory

KINDS = (
    "ok_listing",
    "counterfeit_lookalike",
    "prohibited_category",
    "recalled_batch",
    "clearance",
    "gated_brand",
    "longtail",
    "art_replica",
)
VERDICTS = ("ok", "counterfeit", "prohibited")
BATCH = 5_000


def _calls(answer: str) -> list[ToolCallRecord]:
    """Search, brand look-up, then the submission of ``answer``."""
    return [
        ToolCallRecord(
            id="s",
            name="search_taxonomy",
            arguments={"query": "mug"},
            ok=True,
            result={"results": [{"id": "hg-1", "name": "Mugs"}]},
            turn=0,
        ),
        ToolCallRecord(
            id="b",
            name="lookup_brand",
            arguments={"name": "Acme"},
            ok=True,
            result={"exact": None, "similar": []},
            turn=1,
        ),
        ToolCallRecord(
            id="x",
            name="submit",
            arguments={"verdict": answer},
            ok=True,
            result={"status": "submitted"},
            terminal=True,
            turn=2,
        ),
    ]


def _messages(calls: list[ToolCallRecord], case: int, padding: str) -> list[dict[str, Any]]:
    """The chat of ``calls``: the opening messages, then each call and its result."""
    messages = [
        {"role": "system", "content": "You are a catalog analyst. " + padding},
        {"role": "user", "content": f"New listing {case}. Title: Blue mug. Brand: Acme."},
    ]
    for call in calls:
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
                    }
                ],
            }
        )
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call.id,
                "name": call.name,
                "content": json.dumps(call.result),
            }
        )
    return messages


def make_episode(rng: random.Random, case: int, policy: str, padding: str) -> Trajectory:
    """A scored three-turn episode of case ``case`` with a seeded verdict and reward."""
    kind = KINDS[case % len(KINDS)]
    truth = VERDICTS[case % 3]
    answer = truth if rng.random() < 0.6 else rng.choice(VERDICTS)
    reward = 1.0 if answer == truth else rng.choice((-1.0, -0.5, 0.2))
    calls = _calls(answer)
    messages = _messages(calls, case, padding)
    return Trajectory(
        twin="Catalog",
        case_id=f"Catalog/test/{case}",
        split="test",
        index=case,
        case_kind=kind,
        policy=policy,
        messages=messages,
        calls=calls,
        submission={"verdict": answer},
        num_turns=3,
        terminated=True,
        reward=reward,
        components={
            "policy": reward,
            "category": 1.0,
            "attributes": rng.random(),
            "submitted": 1.0,
        },
        weighted={"policy": 0.4 * reward, "category": 0.3, "attributes": 0.0, "submitted": 0.0},
        reward_notes=[f"policy: true {truth!r}, submitted {answer!r}"],
        info={"outcome": {"truth": {"verdict": truth, "category_id": "hg-1"}, "kind": kind}},
    )


class _Summary:
    """The figures :func:`twin.rollout.summarize` stores for a run (group size 1), gathered
    batch by batch instead of from every trajectory at once."""

    def __init__(self) -> None:
        self.n = 0
        self.total = self.squares = 0.0
        self.kinds: dict[str, list[float]] = {}
        self.terms: dict[str, float] = {}

    def add(self, batch: list[Trajectory]) -> None:
        for t in batch:
            reward = t.reward or 0.0
            self.n += 1
            self.total += reward
            self.squares += reward * reward
            kind = self.kinds.setdefault(t.case_kind, [0, 0.0, 0])
            kind[0] += 1
            kind[1] += reward
            kind[2] += reward >= 1.0 - 1e-6
            for name, value in t.components.items():
                self.terms[name] = self.terms.get(name, 0.0) + value

    def metrics(self) -> dict[str, object]:
        mean = self.total / self.n
        solved = sum(k[2] for k in self.kinds.values()) / self.n
        return {
            "split": "test",
            "episodes": self.n,
            "errors": 0,
            "groups": self.n,
            "group_size": 1,
            "reward_mean": mean,
            "reward_std": max(0.0, self.squares / self.n - mean**2) ** 0.5,
            "success_rate": solved,
            "pass@k": {"1": solved},
            "pass^k": {"1": solved},
            "components": {name: v / self.n for name, v in sorted(self.terms.items())},
            "by_kind": {
                kind: {"episodes": k[0], "reward_mean": k[1] / k[0], "success_rate": k[2] / k[0]}
                for kind, k in sorted(self.kinds.items())
            },
        }


def fill(
    path: Path, episodes: int, steps: int, episode_kb: float, seed: int, with_summary: bool = True
) -> dict[str, int]:
    """Write the three runs; return their ids."""
    rng = random.Random(seed)
    padding = "policy text " * max(0, int(episode_kb * 1024 - 1600) // 12)
    big = episodes * 9 // 10
    small = episodes - big
    store = RunStore(path)
    ids: dict[str, int] = {}
    started = time.perf_counter()
    for name, count, policy in (("big", big, "openai:base"), ("small", small, "openai:tuned")):
        with store.track_run("eval", "Catalog", policy, {"split": "test"}) as run:
            summary = _Summary()
            for first in range(0, count, BATCH):
                batch = [
                    make_episode(rng, c, policy, padding)
                    for c in range(first, min(count, first + BATCH))
                ]
                run.add_episodes(batch)
                summary.add(batch)
                print(f"\r{name}: {first + len(batch):,}/{count:,} episodes", end="", flush=True)
            if with_summary:  # else the run page counts the figures from the episodes
                run.metrics = summary.metrics()
            ids[name] = run.id
        print()
    with store.track_run("train", "Catalog", "tiny") as run:
        for step in range(steps):
            run.log_metrics(
                step,
                {
                    "rewards/total": rng.random(),
                    "rewards/policy": rng.random(),
                    "losses/loss": rng.random(),
                    "losses/kl": rng.random() / 100,
                    "losses/clipfrac": rng.random() / 10,
                    "perf/tokens_per_s": 1000 * rng.random(),
                },
            )
        ids["train"] = run.id
    store.close()
    print(
        f"filled {path} in {time.perf_counter() - started:.1f} s "
        f"({path.stat().st_size / 2**20:,.0f} MiB)"
    )
    return ids


def measure(path: Path, ids: dict[str, int], repeat: int) -> list[tuple[str, float, float]]:
    """``(page, first request s, median of the next ``repeat`` s)`` for each page."""
    from starlette.testclient import TestClient

    from twin.ui import create_app

    client = TestClient(create_app(path), base_url="http://127.0.0.1")
    big, small, train = ids["big"], ids["small"], ids["train"]
    last_page = (ids.get("big_episodes", 0) + 49) // 50 or 1
    pages = [
        ("runs table", "/"),
        (f"run page ({ids.get('big_episodes', 0):,} episodes)", f"/runs/{big}"),
        ("run page, last episodes page", f"/runs/{big}?page={last_page}"),
        ("run page, episodes by reward", f"/runs/{big}?order=-reward"),
        ("episode page", f"/episodes/{ids.get('first_episode', 1)}"),
        ("compare (cases in common)", f"/compare?a={big}&b={small}"),
        ("compare, one case side by side", f"/compare/case?a={big}&b={small}&case=Catalog/test/7"),
        ("training run page", f"/runs/{train}"),
    ]
    out = []
    for name, url in pages:
        t0 = time.perf_counter()
        response = client.get(url)
        first = time.perf_counter() - t0
        if response.status_code != 200:
            raise SystemExit(f"{url}: HTTP {response.status_code}")
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            client.get(url)
            times.append(time.perf_counter() - t0)
        out.append((name, first, statistics.median(times)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="SQLite file to fill (reused when it exists)")
    parser.add_argument("--episodes", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=2_000, help="metric steps of the training run")
    parser.add_argument("--episode-kb", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-summary",
        action="store_true",
        help="store the evaluations without their summary, as an unfinished run: the run page "
        "then counts every figure from the episodes (its slowest path)",
    )
    args = parser.parse_args(argv)
    if args.episodes < 10:
        parser.error(f"--episodes must be at least 10, got {args.episodes}")
    folder = None
    if args.store:
        path = Path(args.store)
    else:
        folder = tempfile.TemporaryDirectory(prefix="twin-ui-bench-")
        path = Path(folder.name) / "runs.db"
    if path.exists():
        store = RunStore(path)
        runs = store.runs(3)  # newest first: train, small, big (as fill wrote them)
        store.close()
        ids = {"train": runs[0].id, "small": runs[1].id, "big": runs[2].id}
        ids["big_episodes"] = runs[2].episodes
        print(f"reusing {path} ({sum(r.episodes for r in runs):,} episodes)")
    else:
        ids = fill(path, args.episodes, args.steps, args.episode_kb, args.seed, not args.no_summary)
        ids["big_episodes"] = args.episodes * 9 // 10
    ids["first_episode"] = 1
    rows = measure(path, ids, args.repeat)
    print(f"\n{'page':<40} {'first (s)':>10} {'median (s)':>11}")
    for name, first, median in rows:
        print(f"{name:<40} {first:>10.3f} {median:>11.3f}")
    if folder is not None:
        folder.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe a model's judgement on expert episodes: which value it prefers for the deciding argument
when the expert's evidence is given (:mod:`trainer.choice_probe`).

::

    twin collect Catalog-v2 --policy ceiling --split test --episodes 200 --out runs/probe/test \\
        --set max_turns=4
    .venv/bin/python scripts/choice_probe.py \\
        --policy hf:runs/learning-smollm2-v2/kept/sft,autocast=bfloat16,threads=2 \\
        --data runs/probe/test --out runs/probe/sft-test.json

The defaults probe the catalog's ``submit`` ``decision`` over its four values. The result is a
JSON file with the summary (accuracy overall, by true value, by case kind; the confusion counts)
and every row's log-probabilities; the summary is printed too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trainer.choice_probe import score_row, summarize
from trainer.hf_policy import HFPolicy
from twin.evaluation.collect import read_dataset

__all__ = ["main"]

CATALOG_DECISIONS = "ok,counterfeit,prohibited,escalate"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", required=True, help="hf:MODEL[,key=value...] as in twin eval")
    p.add_argument("--data", required=True, help="a twin collect dataset folder or JSONL file")
    p.add_argument("--tool", default="submit", help="the deciding tool call (default submit)")
    p.add_argument("--argument", default="decision", help="its argument to probe")
    p.add_argument("--values", default=CATALOG_DECISIONS, help="comma-separated candidates")
    p.add_argument("--start", type=int, default=0, help="first row of the dataset")
    p.add_argument("--rows", type=int, default=0, help="rows to probe (0 = all)")
    p.add_argument("--out", help="write the summary and every row's scores here (JSON)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.policy.startswith("hf:"):
        print(f"--policy must be an hf: spec (a local model), got {args.policy!r}", file=sys.stderr)
        return 2
    data = Path(args.data)
    rows = read_dataset(data / "episodes.jsonl" if data.is_dir() else data)
    rows = rows[args.start : args.start + args.rows if args.rows else None]
    values = [v.strip() for v in args.values.split(",") if v.strip()]
    policy = HFPolicy.from_spec(args.policy)
    t0 = time.monotonic()
    scores = []
    for n, row in enumerate(rows, 1):
        renderer = policy.renderer(row["tools"])
        scores.append(
            score_row(
                policy.model,
                renderer,
                row,
                tool=args.tool,
                argument=args.argument,
                values=values,
                autocast=policy.autocast,
            )
        )
        if n % 25 == 0:
            print(f"{n}/{len(rows)} rows, {time.monotonic() - t0:.0f} s", file=sys.stderr)
    summary = {
        "policy": args.policy,
        "data": str(args.data),
        "start": args.start,
        "wall_s": round(time.monotonic() - t0, 1),
        **summarize(scores, values),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        rows_out = [
            {
                "index": s.index,
                "case_kind": s.case_kind,
                "truth": s.truth,
                "choice": s.choice,
                "logprobs": s.logprobs,
            }
            for s in scores
        ]
        Path(args.out).write_text(json.dumps({**summary, "scores": rows_out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

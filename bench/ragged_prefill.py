"""Ragged prefill against one padded batch in the decoding engine, one run.

    .venv/bin/python bench/ragged_prefill.py                    # SmolLM2-135M, a catalog turn
    .venv/bin/python bench/ragged_prefill.py --model tiny --repeats 2 --json out.json

The batch is shaped like a later turn of a Catalog-v2 evaluation: ``--rows`` episodes sharing a
``--shared``-token system prompt, each with its own conversation so far already in the prefix
cache (``--own-min`` to ``--own-max`` tokens), now adding a new suffix (a tool result and the
next turn's header) of ``--new-min`` to ``--new-max`` tokens, lengths drawn uniformly with a
fixed seed. The linear layers run in bf16 under autocast, as ``hf:...,autocast=bfloat16``
evaluations do. The store is filled once, then each repeat restores it and times one
``sample(max_new_tokens=1)`` with ``Engine.ragged`` on and off, in ABBA order, so load from other
processes hits both alike (``--pass-tokens`` runs ragged prefill with each charge per pass the
planner is given). Printed: the medians and their ratios, the fed tokens each way (padding
included) and the passes ragged prefill made, and how far the first sampled token's
logprob moved (batch composition changes float round-off only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch


def _batch(
    vocab: int, rows: int, shared: int, own: tuple[int, int], new: tuple[int, int]
) -> tuple[list[list[int]], list[list[int]]]:
    """The cached prompts, and the same prompts with each row's new suffix."""
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, vocab, (n,), generator=g).tolist()

    def length(bounds: tuple[int, int]) -> int:
        return int(torch.randint(bounds[0], bounds[1] + 1, (), generator=g))

    system = tokens(shared)
    cached = [system + tokens(length(own)) for _ in range(rows)]
    return cached, [p + tokens(length(new)) for p in cached]


def run(
    model_name: str,
    rows: int,
    shared: int,
    own: tuple[int, int],
    new: tuple[int, int],
    repeats: int,
    threads: int,
    pass_tokens: list[int],
) -> dict[str, Any]:
    """Seconds to prefill the new suffixes (and sample one token): one padded batch, and ragged
    prefill with each ``pass_tokens`` (what the planner charges for one more pass)."""
    from bench.cascade import load_bf16
    from trainer.samplers import HFSampler
    from trainer.serving.kvcache import plan_buckets

    model, tok = load_bf16(model_name, threads)
    cached, prompts = _batch(model.config.vocab_size, rows, shared, own, new)
    sampler = HFSampler(model, tok, prefix_cache=True, autocast="bfloat16")
    assert sampler.store is not None
    t0 = time.perf_counter()
    sampler.sample(cached, max_new_tokens=1, temperature=0.0)
    fill_s = time.perf_counter() - t0
    filled = list(sampler.store.entries)
    # what each row feeds: its prompt after its stored entry (the cached prompt, whole)
    suffixes = [len(p) - len(c) for p, c in zip(prompts, cached, strict=True)]
    charge = {f"ragged@{p}": p for p in pass_tokens}  # mode -> its charge per pass
    modes = ["padded", *charge]
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    first: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name in modes + modes[::-1]:
            sampler.store.entries = list(filled)
            sampler.engine.ragged = name in charge
            sampler.engine.pass_tokens = charge.get(name, 0)
            t0 = time.perf_counter()
            out = sampler.sample(prompts, max_new_tokens=1, temperature=0.0)
            seconds[name].append(time.perf_counter() - t0)
            first[name] = [s.logprobs[0] for s in out]
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    passes = {  # new tokens per row, per pass
        m: [[suffixes[i] for i in p] for p in plan_buckets(suffixes, c)] for m, c in charge.items()
    }
    diffs = [abs(a - b) for m in charge for a, b in zip(first[m], first["padded"], strict=True)]
    return {
        "model": model_name, "rows": rows, "shared": shared, "own": own, "new": new,
        "threads": threads, "repeats": repeats, "fill_s": fill_s, "prefill_s": medians,
        "padded_over": {m: medians["padded"] / medians[m] for m in charge},
        "passes": passes,
        "fed_tokens": {"padded": rows * max(suffixes)} | {
            m: sum(len(p) * max(p) for p in passes[m]) for m in charge  # padding included
        },
        "max_logprob_diff": max(diffs), "all_prefill_s": seconds,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from bench.cascade import add_batch_options

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_options(ap)
    ap.add_argument("--own-min", type=int, default=400)
    ap.add_argument("--own-max", type=int, default=1200)
    ap.add_argument("--new-min", type=int, default=60)
    ap.add_argument("--new-max", type=int, default=560)
    ap.add_argument("--repeats", type=int, default=2, help="ABBA rounds")
    ap.add_argument(
        "--pass-tokens", type=int, nargs="+", default=None,
        help="ragged prefill's charge for one more pass, one run each (default: the engine's)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    from trainer.serving.kvcache import PASS_TOKENS

    result = run(
        args.model, args.rows, args.shared, (args.own_min, args.own_max),
        (args.new_min, args.new_max), args.repeats, args.threads,
        args.pass_tokens or [PASS_TOKENS],
    )  # fmt: skip
    fill, fed = result["prefill_s"], result["fed_tokens"]
    lines = [
        f"{args.model}: {args.rows} rows, {args.shared} shared tokens, {args.own_min}-"
        f"{args.own_max} cached own, {args.new_min}-{args.new_max} new, {args.threads} thread(s)",
        f"  one padded batch      {fill['padded']:7.1f} s  ({fed['padded']} tokens fed)",
    ]
    for mode, ratio in result["padded_over"].items():
        passes = result["passes"][mode]
        lines.append(
            f"  {mode + ' prefill':<20}  {fill[mode]:7.1f} s  ({fed[mode]} tokens fed, "
            f"{len(passes)} passes): padded / ragged {ratio:.2f}x"
        )
        lines.append(f"    passes (new tokens per row): {passes}")
    lines.append(f"  first token's logprob moved by at most {result['max_logprob_diff']:.4f} nats")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

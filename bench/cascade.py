"""Cascade attention against per-row attention in the decoding engine, one run.

    .venv/bin/python bench/cascade.py                           # SmolLM2-135M, a catalog batch
    .venv/bin/python bench/cascade.py --model tiny --repeats 2 --json out.json

The batch is shaped like a Catalog-v2 evaluation's late turn: ``--rows`` episodes sharing a
``--shared``-token system prompt (written policy and tool schemas), each with ``--own`` tokens of
its own conversation already in the prefix cache, sampling ``--new`` tokens greedily. The linear
layers run in bf16 under autocast, as ``hf:...,autocast=bfloat16`` evaluations do. The two engines
(``Engine(cascade=True)`` and ``cascade=False``) decode alternately, so load from other processes
hits both alike; the medians of the seconds per decoded token and their ratio are printed (and
the seconds each took to prefill the batch the first time, one reading each), with
how many rows decoded the same greedy tokens and the logprob differences on the same context
(each row up to its first differing token; bf16 round-off differs between the two paths).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def load_bf16(model_name: str, threads: int) -> tuple[Any, Any]:
    """The model in eval mode with its linear weights stored in bf16 (as ``hf:...,
    autocast=bfloat16`` evaluations run it), on ``threads`` torch threads; and its tokenizer."""
    from trainer.hf_policy import cast_linear_weights
    from trainer.models import load_model

    torch.set_num_threads(threads)
    model, tok = load_model(model_name, "float32")
    model.eval()
    cast_linear_weights(model, "bfloat16")
    return model, tok


def add_batch_options(ap: argparse.ArgumentParser) -> None:
    """The options the engine benchmarks share: the model, the batch's rows and shared prompt,
    torch threads and a JSON output."""
    ap.add_argument("--model", default="smollm2", help="tiny, smollm2 or a local HF folder")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--shared", type=int, default=1650)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)


def _prompts(vocab: int, rows: int, shared: int, own: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    system = torch.randint(5, vocab, (shared,), generator=g).tolist()
    return [system + torch.randint(5, vocab, (own,), generator=g).tolist() for _ in range(rows)]


def run(
    model_name: str, rows: int, shared: int, own: int, new: int, repeats: int, threads: int
) -> dict[str, Any]:
    """Seconds per decoded token with and without cascade attention (medians of ``repeats``)."""
    from trainer.samplers import HFSampler

    model, tok = load_bf16(model_name, threads)
    prompts = _prompts(model.config.vocab_size, rows, shared, own)
    never = [model.config.vocab_size + 1]  # every row decodes all ``new`` tokens
    samplers, fill = {}, {}
    for name, cascade in (("cascade", True), ("per_row", False)):
        sampler = HFSampler(model, tok, prefix_cache=True, autocast="bfloat16")
        sampler.engine.cascade = cascade
        t0 = time.perf_counter()  # the shared prompt once, then every row's own tokens
        sampler.sample(prompts, max_new_tokens=1, temperature=0.0, stop_ids=never)
        fill[name] = time.perf_counter() - t0
        samplers[name] = sampler
    seconds: dict[str, list[float]] = {name: [] for name in samplers}
    samples: dict[str, list[Any]] = {}
    for _ in range(repeats):
        for name, sampler in samplers.items():
            t0 = time.perf_counter()
            out = sampler.sample(prompts, max_new_tokens=new, temperature=0.0, stop_ids=never)
            seconds[name].append((time.perf_counter() - t0) / new)
            samples[name] = out
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    diffs, same = [], 0
    for a, b in zip(samples["cascade"], samples["per_row"], strict=True):
        # compare logprobs on the same context: up to and including the first differing token
        for i, (x, y) in enumerate(zip(a.ids, b.ids, strict=True)):
            diffs.append(abs(a.logprobs[i] - b.logprobs[i]))
            if x != y:
                break
        same += a.ids == b.ids
    return {
        "model": model_name, "rows": rows, "shared": shared, "own": own, "new": new,
        "threads": threads, "repeats": repeats,
        "s_per_token": medians, "prefill_s": fill,
        "per_row_over_cascade": medians["per_row"] / medians["cascade"],
        "max_logprob_diff": max(diffs), "mean_logprob_diff": statistics.mean(diffs),
        "rows_with_the_same_tokens": same, "all_s_per_token": seconds,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_options(ap)
    ap.add_argument("--own", type=int, default=1300)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    result = run(args.model, args.rows, args.shared, args.own, args.new, args.repeats, args.threads)
    per_token, fill = result["s_per_token"], result["prefill_s"]
    print(
        f"{args.model}: {args.rows} rows, {args.shared} shared + {args.own} own tokens, "
        f"{args.threads} thread(s)\n"
        f"  per-row attention  {per_token['per_row'] * 1000:8.1f} ms per decoded token\n"
        f"  cascade attention  {per_token['cascade'] * 1000:8.1f} ms per decoded token\n"
        f"  per-row / cascade  {result['per_row_over_cascade']:.2f}x\n"
        f"  prefill of the batch (one reading each): per-row {fill['per_row']:.1f} s, "
        f"cascade {fill['cascade']:.1f} s\n"
        f"  greedy tokens the same in {result['rows_with_the_same_tokens']} of {args.rows} rows; "
        f"logprob difference on the same context: mean {result['mean_logprob_diff']:.3f}, "
        f"largest {result['max_logprob_diff']:.3f}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

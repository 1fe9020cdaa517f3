"""bf16 autocast against fp32 on this machine: a matmul, the learner's update and `hf:` decoding.

    .venv/bin/python bench/autocast_bf16.py                        # SmolLM2-135M, 1 thread
    .venv/bin/python bench/autocast_bf16.py --model tiny --repeats 2 --json out.json

Both settings keep fp32 weights (``model.dtype: float32``); ``model.autocast: bfloat16`` runs the
matmuls in bf16 (trainer/scoring.py, trainer/hf_policy.py). Measured alternately (fp32, bf16,
fp32, ...) so that load from other processes hits both alike; the medians and their ratio are
printed, with the bf16-vs-fp32 logprob difference on the same tokens. The batch is SFT-shaped:
``--rows`` sequences of ``--tokens`` random tokens, the last quarter of each carrying loss, LoRA r16
on all seven projections (the SmolLM2 recipes' adapter). The decoding part is greedy, ``--rows``
prompts of ``--tokens`` tokens, ``--new`` new tokens each (no prefix cache across repeats). The
matmul line comes first: on a CPU without bf16 instructions it shows bf16 far slower than fp32.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from trainer.models import cpu_bf16_flags


def _batch(vocab: int, rows: int, tokens: int) -> Any:
    from trainer.learner import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, vocab, (tokens,), generator=g).tolist() for _ in range(rows)]
    first = tokens - tokens // 4
    mask = [[0] * first + [1] * (tokens - first) for _ in range(rows)]
    return TrainBatch(ids, mask, [[0.0] * tokens for _ in range(rows)], [1.0] * rows)


def _learner(model: Any, autocast: str | None) -> Any:
    from trainer.config import AlgorithmConfig, OptimConfig
    from trainer.learner import Learner

    return Learner(
        model,
        algorithm=AlgorithmConfig(),
        optim=OptimConfig(lr=1e-6, micro_batch_tokens=1 << 20),
        shared_prefix=False,
        autocast=autocast,
    )


def matmul_gflops(
    repeats: int = 10, shape: tuple[int, int, int] = (512, 576, 1536)
) -> dict[str, float]:
    """GFLOP/s of one ``m x k @ k x n`` matmul (SmolLM2's MLP shape) in fp32 and in bf16, the two
    alternated: where the CPU has no bf16 instructions torch emulates them, which this shows
    before any model runs."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    pairs = {"fp32": (a, b), "bf16": (a.bfloat16(), b.bfloat16())}
    times: dict[str, list[float]] = {key: [] for key in pairs}
    for x, y in pairs.values():
        x @ y  # warm-up
    for _ in range(repeats):
        for key, (x, y) in pairs.items():
            times[key].append(_timed(lambda x=x, y=y: x @ y))
    return {
        f"matmul_{key}_gflops": 2 * m * k * n / statistics.median(v) / 1e9
        for key, v in times.items()
    }


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(
    model_name: str, *, rows: int, tokens: int, new: int, repeats: int, threads: int
) -> dict[str, Any]:
    """Measure both settings; return the figures (seconds are medians over ``repeats``)."""
    from trainer.hf_policy import HFPolicy
    from trainer.learner import build_lora_model
    from trainer.models import load_model

    torch.set_num_threads(threads)
    base, tokenizer = load_model(model_name, "float32")
    model = build_lora_model(
        base,
        lora_rank=16,
        lora_alpha=32,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    batch = _batch(int(model.config.vocab_size), rows, tokens)
    learners = {"fp32": _learner(model, None), "bf16": _learner(model, "bfloat16")}
    policies = {
        k: HFPolicy(
            model,
            tokenizer,
            temperature=0.0,
            max_new_tokens=new,
            prefix_cache=False,
            autocast=None if k == "fp32" else "bfloat16",
        )
        for k in learners
    }
    lp = {k: learners[k].logprobs(batch) for k in learners}
    diffs = [abs(a - b) for ra, rb in zip(lp["fp32"], lp["bf16"]) for a, b in zip(ra[1:], rb[1:])]
    step: dict[str, list[float]] = {k: [] for k in learners}
    decode: dict[str, list[float]] = {k: [] for k in learners}
    state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for _ in range(repeats):
        for k, learner in learners.items():  # alternate, so that other load falls on both
            step[k].append(_timed(lambda learner=learner: learner.step(batch)))
            with torch.no_grad():  # the same weights for every measurement
                for n, p in model.named_parameters():
                    if n in state:
                        p.copy_(state[n])
            policy = policies[k]
            decode[k].append(
                _timed(
                    lambda policy=policy: policy.sample_batch(batch.input_ids, list(range(rows)))
                )
            )
    med = {
        f"{part}_{k}_s": statistics.median(v)
        for part, d in (("step", step), ("decode", decode))
        for k, v in d.items()
    }
    return {
        "model": model_name,
        "rows": rows,
        "tokens": tokens,
        "new_tokens": new,
        "repeats": repeats,
        "threads": threads,
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": cpu_bf16_flags(),
        "torch": torch.__version__,
        **matmul_gflops(),
        **med,
        "step_speedup": med["step_fp32_s"] / med["step_bf16_s"],
        "decode_speedup": med["decode_fp32_s"] / med["decode_bf16_s"],
        "logprob_abs_diff_mean": statistics.fmean(diffs),
        "logprob_abs_diff_max": max(diffs),
        "load_average": list(__import__("os").getloadavg()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="tiny, smollm2 or a local HF folder")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    out = run(
        args.model,
        rows=args.rows,
        tokens=args.tokens,
        new=args.new,
        repeats=args.repeats,
        threads=args.threads,
    )
    print(
        f"{out['model']}, {out['rows']} x {out['tokens']} tokens, {out['threads']} thread(s), "
        f"CPU flags {out['cpu_flags'] or 'none'}, load {out['load_average'][0]:.1f}"
    )
    print(
        f"  matmul 512x576x1536  fp32 {out['matmul_fp32_gflops']:.1f} GFLOP/s   "
        f"bf16 {out['matmul_bf16_gflops']:.1f} GFLOP/s"
    )
    print(
        f"  learner step   fp32 {out['step_fp32_s']:.2f} s   bf16 {out['step_bf16_s']:.2f} s   "
        f"x{out['step_speedup']:.2f}"
    )
    print(
        f"  greedy decode  fp32 {out['decode_fp32_s']:.2f} s   bf16 {out['decode_bf16_s']:.2f} s   "
        f"x{out['decode_speedup']:.2f}"
    )
    print(
        f"  |logprob bf16 - fp32|: mean {out['logprob_abs_diff_mean']:.4f}, max "
        f"{out['logprob_abs_diff_max']:.4f}"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

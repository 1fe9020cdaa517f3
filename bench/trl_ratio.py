"""``twin bench trl``: our synchronous GRPO step against TRL's ``GRPOTrainer``, same everything.

Both sides train the same tiny model (:func:`trainer.tiny.build_tiny`, random init, full
fine-tuning, float32, CPU) on the Toy twin's single-turn prompts (rendered with the tiny chat
template and the twin's tool schemas), with the same batch (``prompts`` x ``group``
completions per optimizer step), the same completion limit, temperature 1, top-p 1, the same
AdamW settings (constant learning rate, no weight decay, gradient clip 1), the same loss
(DAPO token-mean, clip 0.2 / 0.28, no KL, group z-score advantages) and the same reward
(the Toy reward; TRL scores the parsed completion, ours runs the episode in the twin)::

    twin bench trl                             # 5 measured steps each, after 1 warm-up step
    twin bench trl --steps 10 --prompts 4 --group 8 --max-tokens 16 --json trl.json

Ours is :class:`trainer.sync_trainer.SyncTrainer`, the loop ``twin train`` runs (sampler
``collect_groups`` + ``Learner.step``); TRL is ``GRPOTrainer.train`` with ``use_vllm=False``.
A step is timed from the end of the previous step to the end of this one on both sides
(generation, reward, update and per-step logging included; start-up and the warm-up steps
left out). Nothing is fetched from a hub: ``HF_HUB_OFFLINE=1`` is set before TRL is imported.
"""

from __future__ import annotations

import json as _json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["TARGET_RATIO", "main", "run_ours", "run_trl"]

# : Target (docs/benchmarks.md): our synchronous GRPO step vs TRL's GRPOTrainer, same tiny model and
# batch.
TARGET_RATIO = 3.0


def _recipe(s: dict[str, Any], output_dir: Path) -> Any:
    """The toy-cpu recipe with every setting that matters pinned (the shipped file may change)."""
    from trainer.config import SamplerConfig, load_recipe

    overrides = [
        "twin.config.max_turns=1",
        "lora.enabled=false",
        "model.path=tiny",
        "model.dtype=float32",
        "sampler.kind=hf",
        "sampler.temperature=1.0",
        "sampler.top_p=1.0",
        f"sampler.max_new_tokens={s['max_tokens']}",
        "algorithm.advantage=grpo",
        "algorithm.loss_aggregation=token_mean",
        "algorithm.eps_low=0.2",
        "algorithm.eps_high=0.28",
        "algorithm.kl_coef=0.0",
        # TRL has no dynamic sampling: one sampling round per step on both sides
        "algorithm.dynamic_sampling=false",
        "algorithm.overlong_buffer=0",
        f"algorithm.group_size={s['group']}",
        f"algorithm.groups_per_step={s['prompts']}",
        f"optim.lr={s['lr']}",
        "optim.weight_decay=0.0",
        "optim.grad_clip=1.0",
        "optim.mini_batches=1",
        f"seed={s['seed']}",
        f"train.steps={s['warmup'] + s['steps']}",
        "train.checkpoint_every=0",
        "train.store=false",
        f"train.output_dir={output_dir}",
        "devices.learner=cpu",
        "devices.rollout=cpu",
        f"devices.cpu_threads={s['threads']}",
        "async.max_staleness=0",
    ]
    if "length_curriculum" in SamplerConfig.model_fields:
        overrides.append("sampler.length_curriculum=none")
    return load_recipe("toy-cpu", overrides)


def run_ours(s: dict[str, Any], output_dir: Path) -> dict[str, float]:
    """Run our synchronous GRPO loop; return steps/s, completion tokens/s and tokens per step."""
    from trainer.sync_trainer import SyncTrainer

    stamps: list[float] = []
    tokens: list[float] = []

    def on_step(record: dict[str, Any]) -> None:
        stamps.append(time.perf_counter())
        per_episode = record.get("episodes/completion_tokens", 0.0)
        tokens.append(per_episode * record.get("episodes/count", 0.0))

    recipe = SyncTrainer(_recipe(s, output_dir), on_step=on_step)
    recipe.setup()
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    return _summary(stamps, tokens, s["warmup"])


def _toy_prompts(s: dict[str, Any], n: int) -> tuple[Any, Any, list[dict[str, Any]]]:
    """The Toy twin, the tiny tokenizer and ``n`` dataset rows (prompt text, split, index)."""
    from trainer.cases import draw_cases
    from trainer.models import load_model
    from trainer.renderer import Renderer
    from twin.registry import make_twin

    twin = make_twin("Toy", num_words=4, max_turns=1)
    model, tokenizer = load_model("tiny", "float32", device="cpu")
    renderer = Renderer(tokenizer, twin.tool_schemas)
    rows = []
    for _, index in draw_cases(twin, "train", s["seed"], 0, n):  # as SyncTrainer.next_cases
        case = twin.case("train", index)
        text = renderer.render(twin.prompt(case), add_generation_prompt=True)
        rows.append({"prompt": text, "split": "train", "index": index})
    return twin, (model, tokenizer), rows


def _toy_trl_reward(twin: Any) -> Any:
    """The Toy reward as a TRL reward function (the completion as the episode's first turn)."""
    from rewards.adapters import completion_trajectory

    names = [t.name for t in twin.tools]

    def toy_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        out = []
        for text, split, index in zip(completions, kwargs["split"], kwargs["index"]):
            case = twin.case(split, int(index))
            traj = completion_trajectory(text, case, tool_names=names)
            # The Toy reward reads the first assistant message; the adapter parses calls only.
            traj = traj.model_copy(update={"messages": [{"role": "assistant", "content": text}]})
            result = twin.score(traj, case)
            out.append(float(getattr(result, "total", result)))
        return out

    return toy_reward


def run_trl(s: dict[str, Any], output_dir: Path) -> dict[str, float]:
    """Run TRL's GRPOTrainer with the same settings; return the same figures as :func:`run_ours`."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.runtime import seed_everything

    seed_everything(s["seed"])
    torch.set_num_threads(s["threads"])
    total_steps = s["warmup"] + s["steps"]
    twin, (model, tokenizer), rows = _toy_prompts(s, total_steps * s["prompts"])
    for p in model.parameters():
        p.requires_grad_(True)
    dataset = Dataset.from_list(rows)
    stamps: list[float] = []

    class _Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            stamps.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=s["seed"],
        max_steps=total_steps,
        per_device_train_batch_size=s["prompts"] * s["group"],
        gradient_accumulation_steps=1,
        num_generations=s["group"],
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=s["max_tokens"],
        temperature=1.0,
        top_p=1.0,
        learning_rate=s["lr"],
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[_toy_trl_reward(twin)],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[_Clock()],
    )
    from transformers import PrinterCallback, ProgressCallback

    for cb in (PrinterCallback, ProgressCallback):  # the bench prints its own table
        trainer.remove_callback(cb)
    torch.set_num_threads(s["threads"])
    stamps.append(time.perf_counter())  # start of step 1 (set-up excluded, as for ours)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "completions/mean_length" in r]
    tokens = [r["completions/mean_length"] * s["prompts"] * s["group"] for r in logs]
    return _summary(stamps[1:], tokens, s["warmup"], first=stamps[0])


def _summary(
    stamps: list[float], tokens: list[float], warmup: int, first: float | None = None
) -> dict[str, float]:
    """Figures for the steps after ``warmup`` from the step-end time stamps."""
    if len(stamps) <= warmup:
        raise RuntimeError(f"bench: expected more than {warmup} steps, got {len(stamps)}")
    start = stamps[warmup - 1] if warmup > 0 else (first if first is not None else stamps[0])
    measured = len(stamps) - warmup
    wall = stamps[-1] - start
    toks = sum(tokens[warmup:]) if len(tokens) >= len(stamps) else float("nan")
    return {
        "steps": float(measured),
        "wall_s": wall,
        "steps_per_s": measured / wall if wall > 0 else 0.0,
        "tokens_per_s": toks / wall if wall > 0 else 0.0,
        "tokens_per_step": toks / measured,
    }


def _pool(runs: list[dict[str, float]]) -> dict[str, float]:
    """One side's figures over several runs: total steps and tokens over total measured time."""
    steps = sum(r["steps"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    tokens = sum(r["tokens_per_step"] * r["steps"] for r in runs)
    return {
        "steps": steps,
        "wall_s": wall,
        "steps_per_s": steps / wall if wall > 0 else 0.0,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "tokens_per_step": tokens / steps if steps else 0.0,
        "runs": float(len(runs)),
    }


def main(
    steps: int = 5,
    warmup: int = 1,
    prompts: int = 4,
    group: int = 8,
    max_tokens: int = 16,
    lr: float = 5e-3,
    threads: int = 1,
    seed: int = 0,
    rounds: int = 1,
    json: str | None = None,  # noqa: A002 - the CLI option is --json
    output_dir: str | None = None,
) -> int:
    """Run TRL's GRPOTrainer and our GRPO loop on the same model, prompts and batch; print both.

    Args:
        steps: Measured optimizer steps per side.
        warmup: Steps run first and left out (at least 1: first-call overheads).
        prompts: Prompts (groups) per step.
        group: Completions per prompt (TRL's ``num_generations``).
        max_tokens: Completion limit (TRL's ``max_completion_length``, our ``max_new_tokens``).
        lr: Learning rate (constant) on both sides.
        threads: torch CPU threads on both sides.
        seed: Seed of both runs and of the prompt draw.
        rounds: Runs per side, in ABBA order (TRL, ours, ours, TRL, ...); the figures pool
            them. 2 or more evens out a drift in machine load.
        json: Also write the figures as JSON here.
        output_dir: Where the runs write (default: a temporary folder).

    Returns:
        0 (the ratio is printed beside the target; it is not pass/fail here).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import warnings

    import torch
    from rich.console import Console
    from transformers.utils import logging as hf_logging

    # transformers 5 warns about renamed TrainingArguments that TRL still passes; not ours to fix
    warnings.filterwarnings("ignore", category=FutureWarning)
    hf_logging.disable_progress_bar()

    s = {
        "steps": int(steps), "warmup": max(1, int(warmup)), "prompts": int(prompts),
        "group": int(group), "max_tokens": int(max_tokens), "lr": float(lr),
        "threads": int(threads), "seed": int(seed), "rounds": max(1, int(rounds)),
    }  # fmt: skip
    root = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="twin-bench-trl-"))
    console = Console(width=110)
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    _print_settings(console, s, cores, load)
    runs = _run_abba(s, root, console)
    results = {name: _pool(rs) for name, rs in runs.items()}
    torch.set_num_threads(s["threads"])
    ratio = _print_results(console, results)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(f"  load average after the runs: {load_after:.1f}")
    if json:
        summary = {"ratio": ratio, "target": TARGET_RATIO, "settings": s, "cores": cores,
                   "load_before": load, "load_after": load_after, "runs": results,
                   "each_run": runs}  # fmt: skip
        Path(json).write_text(_json.dumps(summary, indent=2))
        console.print(f"figures: {json}")
    return 0


def _print_settings(console: Any, s: dict[str, Any], cores: int, load: float) -> None:
    """The settings both sides share, and the machine."""
    import torch
    import trl

    console.print("twin bench trl: our synchronous GRPO step vs TRL GRPOTrainer")
    console.print(
        "  settings (both sides): model tiny (random init, full fine-tune, fp32, CPU), "
        "Toy twin prompts (num_words 4, single turn), "
        f"{s['prompts']} prompts x {s['group']} completions = {s['prompts'] * s['group']} per "
        f"step, max {s['max_tokens']} completion tokens, temperature 1, top-p 1, "
        f"lr {s['lr']:g} constant, AdamW wd 0, "
        f"grad clip 1, DAPO token-mean loss, clip 0.2/0.28, no KL, group z-score advantages, "
        f"{s['steps']} measured steps after {s['warmup']} warm-up, "
        f"torch threads {s['threads']}, seed {s['seed']}, {s['rounds']} run(s) per side; "
        f"trl {trl.__version__}, torch {torch.__version__}"
    )
    console.print(
        f"  machine: {cores} CPU core(s), load average {load:.1f} before the runs "
        "(other jobs on the machine slow both sides; runs in ABBA order, --rounds 2 to balance)"
    )


def _run_abba(s: dict[str, Any], root: Path, console: Any) -> dict[str, list[dict[str, float]]]:
    """Each side's runs, in ABBA order (trl, ours, ours, trl, ...): a drift in machine load hits
    both sides alike."""
    runs: dict[str, list[dict[str, float]]] = {"trl": [], "ours": []}
    fns = {"trl": run_trl, "ours": run_ours}
    order = [
        n for r in range(s["rounds"]) for n in (("trl", "ours") if r % 2 == 0 else ("ours", "trl"))
    ]
    for i, name in enumerate(order):
        t0 = time.perf_counter()
        runs[name].append(fns[name](s, root / f"{name}-{i}"))
        took = time.perf_counter() - t0
        sps = runs[name][-1]["steps_per_s"]
        console.print(
            f"  {name}: {s['warmup'] + s['steps']} steps in {took:.1f} s (set-up included), "
            f"{sps:.3f} steps/s measured"
        )
    return runs


def _print_results(console: Any, results: dict[str, dict[str, float]]) -> float:
    """The pooled figures of both sides as a table; returns the ratio ours / TRL."""
    from rich.table import Table

    ours, theirs = results["ours"], results["trl"]
    ratio = ours["steps_per_s"] / theirs["steps_per_s"] if theirs["steps_per_s"] > 0 else 0.0
    table = Table(title="GRPO step throughput (CPU)")
    for col in ("trainer", "steps/s", "s/step", "completion tok/s", "tok/step"):
        table.add_column(col, justify="left" if col == "trainer" else "right")
    for label, r in (("TRL GRPOTrainer", theirs), ("ours (SyncTrainer)", ours)):
        table.add_row(
            label,
            f"{r['steps_per_s']:.3f}",
            f"{1 / r['steps_per_s']:.2f}" if r["steps_per_s"] else "-",
            f"{r['tokens_per_s']:.0f}",
            f"{r['tokens_per_step']:.0f}",
        )
    console.print(table)
    verdict = "meets" if ratio >= TARGET_RATIO else "below"
    console.print(
        f"ratio ours / TRL (steps/s): {ratio:.2f}x  (target >= {TARGET_RATIO}x: {verdict})"
    )
    return ratio


if __name__ == "__main__":
    raise SystemExit(main())

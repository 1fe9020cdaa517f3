"""``twin train RECIPE [--set key=value ...] [--resume | --overwrite]``: run a recipe with a
progress display.

``twinrl_cli/train.py`` calls :func:`train`; it can also be called directly (tests do)::

    from trainer.cli import train
    exit_code = train("data/recipes/toy-cpu.yaml", ["train.steps=20"], resume=False)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from twin.errors import TwinError

if TYPE_CHECKING:
    from trainer.config import Recipe

__all__ = ["Runner", "make_runner", "train"]


class Runner(Protocol):
    """What ``twin train`` drives: a recipe's runner (``setup`` / ``train`` / ``cleanup``)."""

    step: int
    output_dir: Path

    def setup(self) -> None: ...

    def train(self) -> list[dict[str, Any]]: ...

    def cleanup(self) -> Path | None: ...


def make_runner(
    cfg: Recipe,
    *,
    resume: bool = False,
    overwrite: bool = False,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> Runner:
    """The runner of a recipe: SFT, the synchronous loop, the async loop, or the async loop on Ray.

    ``algorithm.name: sft`` -> :class:`trainer.sft.SFTTrainer`; ``backend: ray`` ->
    :class:`trainer.ray_backend.RayTrainer` (``ray.learner: actor``: the whole trainer in an actor,
    :class:`trainer.ray_backend.RemoteLearner`); ``async.max_staleness >= 1``, or LoRA with rollout
    and learner on different devices -> :class:`trainer.async_trainer.AsyncTrainer` (the sampler in
    its own process); otherwise :class:`trainer.sync_trainer.SyncTrainer`.

    Raises:
        TwinError: the runner refuses the recipe (e.g. async without LoRA).
    """
    kwargs: dict[str, Any] = {"resume": resume, "overwrite": overwrite, "on_step": on_step}
    if cfg.algorithm.name == "sft":  # supervised warm start on a trajectory dataset
        from trainer.sft import SFTTrainer

        return SFTTrainer(cfg, **kwargs)
    if cfg.backend == "ray":  # the async trainer's processes as Ray actors
        from trainer.ray_backend import RayTrainer, RemoteLearner

        return (
            RemoteLearner(cfg, **kwargs)
            if cfg.ray.learner == "actor"
            else RayTrainer(cfg, **kwargs)
        )
    if cfg.async_.max_staleness > 0 or (
        cfg.lora.enabled and cfg.devices.rollout != cfg.devices.learner
    ):
        from trainer.async_trainer import AsyncTrainer  # rollout and learner in separate processes

        return AsyncTrainer(cfg, **kwargs)
    from trainer.sync_trainer import SyncTrainer

    return SyncTrainer(cfg, **kwargs)


def _fmt(record: dict[str, Any], key: str, spec: str = ".3f") -> str:
    value = record.get(key)
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def _error(console: Console, exc: BaseException) -> int:
    """Print ``exc`` as one ``error:`` line (no markup read from it, no wrapping); return 2."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    console.print(f"[red]error:[/red] {escape(text)}", soft_wrap=True)
    return 2


def train(
    recipe: str,
    overrides: list[str] | None = None,
    resume: bool = False,
    *,
    overwrite: bool = False,
    console: Console | None = None,
) -> int:
    """Load a recipe, train, and print a rising reward; return a process exit code.

    Args:
        recipe: A recipe YAML path or the name of a shipped recipe (``toy-cpu``).
        overrides: ``section.key=value`` overrides.
        resume: Continue from the newest checkpoint of the run's output folder.
        overwrite: Start a fresh run even though the output folder holds checkpoints (they are
            deleted); without it such a run is refused.
        console: Where to print (default: stderr-aware rich console on stdout).

    Returns:
        0 on success, 2 for a bad recipe or setup error, 130 when interrupted.
    """
    from trainer.config import check_devices, load_recipe

    console = console or Console()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if resume and overwrite:
        return _error(
            console,
            TwinError("give --resume (continue the run) or --overwrite (start over), not both"),
        )
    try:
        cfg = load_recipe(recipe, list(overrides or []))
        check_devices(cfg)
    except TwinError as exc:
        return _error(console, exc)
    console.print(f"[bold]twin train[/bold] {recipe}: {_describe(cfg)}")
    started = time.perf_counter()
    first: dict[str, Any] = {}
    with Progress(
        TextColumn("[bold]step[/bold]"),
        MofNCompleteColumn(),
        BarColumn(bar_width=24),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task(
            "train",
            total=cfg.train.steps if cfg.algorithm.name != "sft" else None,
            info="setting up",
        )

        on_step = _step_printer(progress, task, first, sft=cfg.algorithm.name == "sft")
        try:
            runner = make_runner(cfg, resume=resume, overwrite=overwrite, on_step=on_step)
        except TwinError as exc:
            return _error(console, exc)
        try:
            runner.setup()
            progress.update(
                task,
                completed=runner.step,
                info="sampling",
                total=getattr(runner, "total_steps", cfg.train.steps),
            )
            history = runner.train()
        except KeyboardInterrupt:
            console.print(
                "[yellow]interrupted[/yellow]; continue with --resume from the last checkpoint"
            )
            runner.cleanup()
            return 130
        except (TwinError, OSError) as exc:  # OSError: an output folder that cannot be written
            return _error(console, exc)
        plot = runner.cleanup()
    _print_summary(console, runner, history, first, time.perf_counter() - started, plot)
    return 0


def _describe(cfg: Recipe) -> str:
    """What a run trains, in one line: the twin, the model, a step's data, the output folder."""
    per_step = (
        f"SFT on {', '.join(cfg.data.paths)}, {cfg.data.batch_size} episodes per step, "
        f"{cfg.data.epochs} epochs"
        if cfg.algorithm.name == "sft"
        else f"{cfg.algorithm.groups_per_step} groups x {cfg.algorithm.group_size} per step, "
        f"{cfg.train.steps} steps"
    )
    return f"twin {cfg.twin.name}, model {cfg.model.path}, {per_step} -> {cfg.train.output_dir}"


def _sft_extras(record: dict[str, Any]) -> str:
    """An SFT step line's optional figures, where the step has them: the decision's NLL
    (``data.emphasis``) and the held-out scores."""
    keys = (("sft/emphasis_nll", "decision"), ("sft/holdout_loss", "held-out"),
            ("sft/holdout_emphasis_nll", "held-out decision"))  # fmt: skip
    return "".join(f"{label} {_fmt(record, key)}  " for key, label in keys if key in record)


def _step_printer(
    progress: Progress, task: Any, first: dict[str, Any], *, sft: bool
) -> Callable[[dict[str, Any]], None]:
    """The ``on_step`` of ``twin train``: the live bar's info and a line per step (``first``
    keeps the first record, for the summary)."""

    def on_step(record: dict[str, Any]) -> None:
        if not first:
            first.update(record)
        info = (
            f"reward {_fmt(record, 'rewards/total')}  kl {_fmt(record, 'losses/kl', '.4f')}  "
            f"entropy {_fmt(record, 'policy/entropy', '.2f')}  "
            f"tok/s {_fmt(record, 'perf/tokens_per_s', '.0f')}"
        )
        progress.update(task, completed=record["step"] + 1, info=info)
        # A line per step too, so the curve survives in logs that drop the live display.
        middle = (
            f"loss {_fmt(record, 'losses/loss')}  parse {_fmt(record, 'eval/parse_rate', '.2f')}  "
            + _sft_extras(record)
            if sft
            else f"kl {_fmt(record, 'losses/kl', '.4f')}  clip {_fmt(record, 'losses/clipfrac')}  "
        )
        progress.console.print(
            f"step {record['step']:>4}  reward {_fmt(record, 'rewards/total')}  "
            + middle
            + f"tok/s {_fmt(record, 'perf/tokens_per_s', '.0f')}  "
            f"{_fmt(record, 'perf/step_s', '.2f')}s",
            highlight=False,
        )

    return on_step


def _print_summary(
    console: Console,
    runner: Runner,
    history: list[dict[str, Any]],
    first: dict[str, Any],
    elapsed: float,
    plot: Path | None,
) -> None:
    """The end of ``twin train``: the reward from first to last step, the store, the files."""
    if history:
        last = history[-1]
        console.print(
            f"reward {_fmt(first or history[0], 'rewards/total')} -> {_fmt(last, 'rewards/total')} "
            f"in {len(history)} steps, {elapsed:.0f} s ({len(history) / max(elapsed, 1e-9):.2f} "
            "steps/s)"
        )
    writer = getattr(runner, "store_writer", None)
    if writer is not None and writer.describe() is not None:
        console.print(writer.describe())
    console.print(f"metrics: {runner.output_dir / 'metrics.jsonl'}")
    if plot is not None:
        console.print(f"reward curve: {plot}")

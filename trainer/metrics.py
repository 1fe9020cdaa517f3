"""Training metrics: JSONL always, TensorBoard, Weights & Biases and trackio on request, a PNG curve.

Names are stable and namespaced (CleanRL style): ``rewards/total``, ``rewards/<component>`` for
every reward component, ``losses/loss``, ``losses/pg_loss``, ``losses/kl``, ``losses/clipfrac``,
``policy/entropy``, ``policy/grad_norm``, ``perf/tokens_per_s``, ``perf/step_s``, ...
Each line of ``metrics.jsonl`` is ``{"step": s, "<name>": value, ...}``.

Sinks (``train.log`` in a recipe): ``jsonl`` (always written: resuming reads it back),
``tensorboard``, ``wandb`` and ``trackio``. W&B and trackio get every finite scalar per step
(``rewards/<component>`` included) and, when the trainer passes the step's episodes, a table
``episodes`` with one row per episode: case, prompt, tool calls, tool results, reward and its
breakdown. Their own settings apply (``WANDB_MODE=offline``, ``WANDB_PROJECT``, ``TRACKIO_DIR``;
trackio logs locally unless given a Space).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "LOG_SINKS",
    "MetricsLogger",
    "close_training_run",
    "episode_rows",
    "open_training_run",
    "plot_rewards",
    "read_metrics",
]

#: The metric sinks a recipe's ``train.log`` may name.
LOG_SINKS = ("jsonl", "tensorboard", "wandb", "trackio")
EPISODE_COLUMNS = ["case_id", "prompt", "calls", "tool_results", "reward", "breakdown"]
_CELL = 2000  # characters kept per table cell: a table is for reading, the run store keeps all

log = logging.getLogger("twinrl.trainer")


def open_training_run(
    cfg: Any, twin_name: str, run_id: int | None, policy: str | None = None, *, store: Any = None
) -> tuple[Any, int | None]:
    """The run store of a training run and its run id, or ``(None, run_id)``.

    Starts a ``train`` run unless ``run_id`` (a resumed one) is given. The store is a record, not
    needed to train: when it cannot be opened the run goes on and says so.

    Args:
        cfg: The recipe (``train.store`` turns the store off).
        twin_name: Recorded with the run.
        run_id: The run to continue, or None for a new one.
        policy: Recorded as the run's policy (default: the model path).
        store: The store to use (``twin.store.RunStore``'s interface; default: a ``RunStore()``,
            unless ``train.store`` is off).
    """
    if store is None and not cfg.train.store:
        return None, run_id
    try:
        if store is None:
            from twin.store import RunStore

            store = RunStore()
        if run_id is None:
            run_id = store.start_run(
                "train", twin=twin_name, policy=policy or cfg.model.path,
                config=cfg.model_dump(mode="json", by_alias=True),
            )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the store is a record, not needed to train
        log.warning("run store unavailable (%s); episodes are not stored", exc)
        return None, run_id
    return store, run_id


def close_training_run(store: Any, run_id: int | None, *, done: bool, summary: dict[str, Any]) -> None:
    """End a training run's use of the store (the other half of :func:`open_training_run`).

    A run whose steps are all done is finished with ``summary``; an unfinished one stays
    ``running`` so that ``--resume`` continues it (as a killed one does: the store reads a stale
    heartbeat as interrupted). The store is closed either way; a failing store only warns.
    """
    if store is None:
        return
    try:
        if run_id is not None and done:
            store.finish_run(run_id, metrics=summary)
    except Exception as exc:  # noqa: BLE001 - the store is a record, not needed to train
        log.warning("run store: could not finish run %s: %s", run_id, exc)
    finally:
        store.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (missing file: empty list)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Append metrics per step to ``<output_dir>/metrics.jsonl`` and the chosen sinks.

    Args:
        output_dir: The run's folder.
        resume_step: When resuming after step ``k`` (the checkpoint's step count), records of
            later steps (written after that checkpoint by the killed run) are dropped first.
        tensorboard: None = use TensorBoard when installed; False = never (without ``sinks``).
        sinks: Names from :data:`LOG_SINKS`; None = ``jsonl`` plus TensorBoard when installed.
            ``wandb`` / ``trackio`` must be installed (``pip install 'twinrl[integrations]'``).
        project: The W&B / trackio project.
        run_name: The W&B / trackio run name (default: the output folder's name).
        config: The run's configuration, stored with the W&B / trackio run.

    Raises:
        ValueError: an unknown sink name, or a sink whose library is not installed.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        resume_step: int | None = None,
        tensorboard: bool | None = None,
        sinks: Sequence[str] | None = None,
        project: str = "twinrl",
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.dir = Path(output_dir)
        unknown = [name for name in sinks or () if name not in LOG_SINKS]
        if unknown:
            raise ValueError(
                f"unknown log sink(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(LOG_SINKS)}"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        if resume_step is None:
            self.history: list[dict[str, Any]] = []
            self.path.write_text("")
        else:
            self.history = [r for r in read_metrics(self.path) if r["step"] < resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        if sinks is not None:
            tensorboard = "tensorboard" in sinks
        self._tb = None
        if tensorboard is not False:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tensorboard"))
            except Exception:  # noqa: BLE001 - tensorboard is optional
                if tensorboard:
                    log.warning("tensorboard requested but not installed (pip install tensorboard)")
        name = run_name or self.dir.resolve().name
        self._wandb = self._trackio = None
        if sinks is not None and "wandb" in sinks:
            wandb = _import_sink("wandb")
            self._wandb = wandb.init(
                project=project, name=name, dir=str(self.dir), config=config or {},
                resume="allow" if resume_step is not None else None, reinit="create_new",
            )
        if sinks is not None and "trackio" in sinks:
            self._trackio = _import_sink("trackio")
            self._trackio_run = self._trackio.init(
                project=project, name=name, config=config or {},
                resume="allow" if resume_step is not None else "never",
            )

    def log(
        self, step: int, metrics: dict[str, Any], episodes: Sequence[Any] | None = None
    ) -> dict[str, Any]:
        """Record the metrics of ``step`` (and its episodes' table, for W&B / trackio).

        Args:
            step: The optimizer step.
            metrics: ``{name: value}``; numbers become floats.
            episodes: The step's sampled :class:`twin.trajectory.Trajectory` objects.

        Returns:
            The JSONL record.
        """
        record: dict[str, Any] = {"step": int(step)}
        for k, v in metrics.items():
            record[k] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        self.history.append(record)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        scalars = {
            k: v for k, v in record.items()
            if k != "step" and isinstance(v, float) and math.isfinite(v)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        rows = episode_rows(episodes) if episodes else None
        if self._wandb is not None:
            import wandb

            payload: dict[str, Any] = dict(scalars)
            if rows:
                payload["episodes"] = wandb.Table(columns=EPISODE_COLUMNS, data=rows)
            self._wandb.log(payload, step=int(step))
        if self._trackio is not None:
            payload = dict(scalars)
            if rows:
                payload["episodes"] = self._trackio.Table(columns=EPISODE_COLUMNS, data=rows)
            self._trackio_run.log(payload, step=int(step))
        return record

    def close(self) -> None:
        """Flush and close TensorBoard, W&B and trackio."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._trackio is not None:
            self._trackio_run.finish()
            self._trackio = None


def _import_sink(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ValueError(
            f"log sink {name!r} needs the {name} package, which is not installed; "
            "pip install 'twinrl[integrations]'"
        ) from None


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= _CELL else text[: _CELL - 1] + "\u2026"


def episode_rows(episodes: Sequence[Any]) -> list[list[Any]]:
    """One table row per trajectory: case, prompt, calls, tool results, reward, breakdown.

    The prompt is the chat before the first assistant turn; calls are ``name(arguments)``
    lines; tool results are the ``tool`` messages; the breakdown is the weighted terms and
    penalties (or the raw components when nothing is weighted).
    """
    rows = []
    for t in episodes:
        messages = list(t.messages)
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        prompt = "\n\n".join(f"[{m.get('role')}] {m.get('content') or ''}" for m in messages[:first])
        calls = "\n".join(
            f"{c.name}({json.dumps(c.arguments, default=str, ensure_ascii=False)})" for c in t.calls
        )
        results = "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "tool")
        breakdown = dict(t.weighted) or dict(t.components)
        reward = float(t.reward) if t.reward is not None else float("nan")
        rows.append([t.case_id, _cell(prompt), _cell(calls), _cell(results), reward, _cell(breakdown)])
    return rows


def plot_rewards(history: list[dict[str, Any]], path: str | Path, *, title: str = "reward") -> Path | None:
    """Draw ``rewards/total`` (bold) and each ``rewards/<component>`` per step as a PNG.

    Returns:
        The PNG path, or None when there is nothing to draw.
    """
    rows = [r for r in history if "rewards/total" in r]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    names = sorted({k for r in rows for k in r if k.startswith("rewards/") and k != "rewards/total"})
    for name in names:
        if name.endswith("_std") or name.startswith("rewards/pass"):
            continue
        ax.plot(steps, [r.get(name, float("nan")) for r in rows], lw=1, alpha=0.6, label=name[8:])
    ax.plot(steps, [r["rewards/total"] for r in rows], lw=2.5, color="black", label="total")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path

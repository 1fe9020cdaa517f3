"""Training metrics: JSONL always, TensorBoard, Weights & Biases and trackio on request, a PNG
curve.

Names are stable and namespaced (CleanRL style): ``rewards/total``, ``rewards/<component>`` for
every reward component, ``losses/loss``, ``losses/pg_loss``, ``losses/kl``, ``losses/clipfrac``,
``policy/entropy``, ``policy/grad_norm``, ``perf/tokens_per_s``, ``perf/step_s``, ...
Each line of ``metrics.jsonl`` is ``{"step": s, "<name>": value, ...}``.

Sinks (``train.log`` in a recipe): ``jsonl`` (always written: resuming reads it back),
``tensorboard``, ``wandb`` and ``trackio``. W&B and trackio get every finite scalar per step
(``rewards/<component>`` included) and, every ``table_every`` steps when the trainer passes the
step's episodes, a table ``episodes`` of up to ``table_rows`` of them, picked across the reward
range (best, worst and between): case, prompt, the model's raw text per turn, tool calls, tool
results, reward, then one column per reward term (``term/<name>``, its weighted contribution).
Their own settings win over ours: W&B's ``WANDB_PROJECT``, ``WANDB_DIR``, ``WANDB_NAME``,
``WANDB_RESUME`` (and ``WANDB_MODE``, ``WANDB_ENTITY``, ...), trackio's ``TRACKIO_DIR`` and
``TRACKIO_SPACE_ID`` (trackio logs locally unless given a Space).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import Recipe
    from trainer.protocols import RunRecord

__all__ = [
    "LOG_SINKS",
    "MetricsLogger",
    "close_training_run",
    "episode_rows",
    "episode_table",
    "log_evaluation",
    "open_training_run",
    "plot_rewards",
    "read_metrics",
    "sample_episodes",
    "wandb_settings",
]

#: The metric sinks a recipe's ``train.log`` may name.
LOG_SINKS = ("jsonl", "tensorboard", "wandb", "trackio")
#: The episode table's first columns; one ``term/<name>`` column per reward term follows.
EPISODE_COLUMNS = ["case_id", "prompt", "text", "calls", "tool_results", "reward"]
TERM_PREFIX = "term/"
_CELL = 2000  # characters kept per table cell: a table is for reading, the run store keeps all

log = logging.getLogger("twinrl.trainer")


def open_training_run(
    cfg: Recipe,
    twin_name: str,
    run_id: int | None,
    policy: str | None = None,
    *,
    store: RunRecord | None = None,
) -> tuple[RunRecord | None, int | None]:
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
        if run_id is not None and not _has_run(store, run_id):
            # resumed from a checkpoint made elsewhere (another checkout or machine): its store
            # stayed there, so the steps from here on are a new run of this one
            log.warning(
                "run %s of the resumed checkpoint is not in this run store; its later steps are "
                "recorded as a new run",
                run_id,
            )
            run_id = None
        if run_id is None:
            run_id = store.start_run(
                "train", twin=twin_name, policy=policy or cfg.model.path,
                config=cfg.model_dump(mode="json", by_alias=True),
            )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the store is a record, not needed to train
        log.warning("run store unavailable (%s); episodes are not stored", exc)
        return None, run_id
    return store, run_id


def _has_run(store: RunRecord, run_id: int) -> bool:
    """Whether ``store`` holds run ``run_id``; a store that cannot say is taken to."""
    from twin.store.runs import RunNotFoundError

    lookup = getattr(store, "run", None)
    if lookup is None:
        return True
    try:
        lookup(run_id)
    except RunNotFoundError:
        return False
    return True


def close_training_run(
    store: RunRecord | None, run_id: int | None, *, done: bool, summary: dict[str, Any]
) -> None:
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
            ``wandb`` / ``trackio`` must be installed (``pip install 'twinrl[trackers]'``).
        project: The W&B / trackio project (``$WANDB_PROJECT`` wins for W&B).
        run_name: The W&B / trackio run name (default: the output folder's name; ``$WANDB_NAME``
            wins for W&B).
        config: The run's configuration, stored with the W&B / trackio run.
        table_every: Log the episode table every this many steps (the first step always).
        table_rows: Most episodes in one table (picked across the reward range).

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
        table_every: int = 10,
        table_rows: int = 16,
    ) -> None:
        if table_every < 1 or table_rows < 1:
            raise ValueError(
                f"need table_every >= 1 and table_rows >= 1, got {table_every}, {table_rows}"
            )
        self.table_every = table_every
        self.table_rows = table_rows
        self._tables = 0
        self.dir = Path(output_dir)
        unknown = [name for name in sinks or () if name not in LOG_SINKS]
        if unknown:
            raise ValueError(
                f"unknown log sink(s) {', '.join(map(repr, unknown))}; allowed: "
                f"{', '.join(LOG_SINKS)}"
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
                config=config or {},
                reinit="create_new",
                **wandb_settings(project, name, self.dir, resume=resume_step is not None),
            )
        if sinks is not None and "trackio" in sinks:
            self._trackio = _import_sink("trackio")
            self._trackio_run = self._trackio.init(
                project=project,
                name=name,
                config=config or {},
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
            k: v
            for k, v in record.items()
            if k != "step" and isinstance(v, float) and math.isfinite(v)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        table = None
        tracking = self._wandb is not None or self._trackio is not None
        if episodes and tracking and (self._tables == 0 or step % self.table_every == 0):
            table = episode_table(sample_episodes(episodes, self.table_rows))
            self._tables += 1
        self.log_trackers(scalars, step, table)
        return record

    def log_trackers(
        self, scalars: dict[str, float], step: int, table: tuple[list[str], list[list[Any]]] | None
    ) -> None:
        """Send ``scalars`` and an episode ``table`` (columns, rows) to W&B and trackio."""
        if self._wandb is not None:
            import wandb

            payload: dict[str, Any] = dict(scalars)
            if table:
                payload["episodes"] = wandb.Table(columns=table[0], data=table[1])
            self._wandb.log(payload, step=int(step))
        if self._trackio is not None:
            payload = dict(scalars)
            if table:
                payload["episodes"] = self._trackio.Table(columns=table[0], data=table[1])
            self._trackio_run.log(payload, step=int(step))

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


def wandb_settings(project: str, name: str, folder: Path, *, resume: bool) -> dict[str, Any]:
    """``wandb.init`` arguments for what W&B's own variables do not already set: W&B reads
    ``WANDB_PROJECT``, ``WANDB_NAME``, ``WANDB_DIR`` and ``WANDB_RESUME`` only when the argument
    is not given, so an argument would override the user's setting."""
    out: dict[str, Any] = {}
    if not os.environ.get("WANDB_PROJECT"):
        out["project"] = project
    if not os.environ.get("WANDB_NAME"):
        out["name"] = name
    if not os.environ.get("WANDB_DIR"):
        out["dir"] = str(folder)
    if resume and not os.environ.get("WANDB_RESUME"):
        out["resume"] = "allow"
    return out


def _import_sink(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ValueError(
            f"log sink {name!r} needs the {name} package, which is not installed; "
            "pip install 'twinrl[trackers]'"
        ) from None


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= _CELL else text[: _CELL - 1] + "\u2026"


def sample_episodes(episodes: Sequence[Any], n: int) -> list[Any]:
    """At most ``n`` of ``episodes``, spread over the reward range: sorted by reward, the best,
    the worst and evenly spaced ones between (deterministic; unscored ones count as lowest)."""
    ranked = sorted(
        episodes, key=lambda t: (t.reward if t.reward is not None else -math.inf, t.case_id)
    )
    if len(ranked) <= n:
        return ranked
    if n == 1:
        return [ranked[-1]]
    picks = sorted({round(i * (len(ranked) - 1) / (n - 1)) for i in range(n)})
    return [ranked[i] for i in picks]


def episode_table(episodes: Sequence[Any]) -> tuple[list[str], list[list[Any]]]:
    """The episode table: :data:`EPISODE_COLUMNS` then one ``term/<name>`` column per reward term.

    The prompt is the chat before the first assistant turn; ``text`` is what the model wrote in
    each turn, raw (text-format calls and unparsable output included, so an episode whose calls
    failed to parse still shows what was said); calls are ``name(arguments)`` lines; tool
    results are the ``tool`` messages; each term column holds the term's weighted contribution
    (the raw component when the reward weights nothing), empty where an episode lacks it.
    """
    terms = sorted({name for t in episodes for name in (dict(t.weighted) or dict(t.components))})
    rows = []
    for t in episodes:
        messages = list(t.messages)
        first = next(
            (i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages)
        )
        prompt = "\n\n".join(
            f"[{m.get('role')}] {m.get('content') or ''}" for m in messages[:first]
        )
        said = [m.get("content") for m in messages if m.get("role") == "assistant"]
        text = "\n\n".join(f"[turn {i}] {c}" for i, c in enumerate(said, 1) if c)
        calls = "\n".join(
            f"{c.name}({json.dumps(c.arguments, default=str, ensure_ascii=False)})" for c in t.calls
        )
        results = "\n".join(
            str(m.get("content") or "") for m in messages if m.get("role") == "tool"
        )
        values = dict(t.weighted) or dict(t.components)
        reward = float(t.reward) if t.reward is not None else float("nan")
        row = [t.case_id, _cell(prompt), _cell(text), _cell(calls), _cell(results), reward]
        rows.append(row + [float(values[k]) if k in values else None for k in terms])
    return EPISODE_COLUMNS + [TERM_PREFIX + k for k in terms], rows


def episode_rows(episodes: Sequence[Any]) -> list[list[Any]]:
    """The rows of :func:`episode_table` (every episode, in order)."""
    return episode_table(episodes)[1]


def plot_rewards(
    history: list[dict[str, Any]], path: str | Path, *, title: str = "reward"
) -> Path | None:
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
    names = sorted(
        {k for r in rows for k in r if k.startswith("rewards/") and k != "rewards/total"}
    )
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


def log_evaluation(
    tracker: str,
    summary: dict[str, Any],
    episodes: Sequence[Any],
    *,
    project: str = "twinrl",
    run_name: str | None = None,
    table_rows: int = 64,
) -> None:
    """Send one evaluation (``twin eval --tracker``) to W&B or trackio: its summary figures as
    scalars (``eval/reward_mean``, ``eval/success_rate``, ``eval/components/<name>``,
    ``eval/pass@k``, ...) and an ``episodes`` table (:func:`episode_table`) of up to
    ``table_rows`` episodes across the reward range. The trackers' own variables win
    (:func:`wandb_settings`; ``TRACKIO_DIR``, ``TRACKIO_SPACE_ID``).

    Raises:
        ValueError: an unknown tracker, or its library is not installed.
    """
    if tracker not in ("wandb", "trackio"):
        raise ValueError(f"unknown tracker {tracker!r}; allowed: wandb, trackio")
    lib = _import_sink(tracker)
    name = run_name or f"eval-{summary.get('twin')}-{summary.get('policy')}"
    scalars = {
        f"eval/{k}": float(v)
        for k, v in summary.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    for group in ("components", "pass@k", "pass^k"):
        for k, v in (summary.get(group) or {}).items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                scalars[f"eval/{group}/{k}"] = float(v)
    columns, rows = episode_table(sample_episodes(episodes, table_rows))
    config = {k: summary.get(k) for k in ("twin", "policy", "split", "run_id", "group_size")}
    # The trackers print progress lines; stdout is for the command's own output (`--json`).
    with contextlib.redirect_stdout(sys.stderr):
        _log_one_step(lib, tracker, project, name, config, scalars, columns, rows)


def _log_one_step(
    lib: Any,
    tracker: str,
    project: str,
    name: str,
    config: dict[str, Any],
    scalars: dict[str, float],
    columns: list[str],
    rows: list[list[Any]],
) -> None:
    if tracker == "wandb":
        run = lib.init(
            config=config,
            reinit="create_new",
            **wandb_settings(project, name, Path.cwd(), resume=False),
        )
        run.log({**scalars, "episodes": lib.Table(columns=columns, data=rows)}, step=0)
        run.finish()
    else:
        run = lib.init(project=project, name=name, config=config)
        run.log({**scalars, "episodes": lib.Table(columns=columns, data=rows)}, step=0)
        lib.finish()  # the module's finish: no run left for trackio's exit hook to finish again

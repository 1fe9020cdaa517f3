"""Training metrics: JSONL always, TensorBoard when installed, a PNG reward curve at the end.

Names are stable and namespaced (CleanRL style): ``rewards/total``, ``rewards/<component>`` for
every reward component, ``losses/loss``, ``losses/pg_loss``, ``losses/kl``, ``losses/clipfrac``,
``policy/entropy``, ``policy/grad_norm``, ``perf/tokens_per_s``, ``perf/step_s``, ...
Each line of ``metrics.jsonl`` is ``{"step": s, "<name>": value, ...}``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "plot_rewards", "read_metrics"]

log = logging.getLogger("twinrl.trainer")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (missing file: empty list)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLogger:
    """Append metrics per step to ``<output_dir>/metrics.jsonl`` (and TensorBoard if available).

    Args:
        output_dir: The run's folder.
        resume_step: When resuming after step ``k`` (the checkpoint's step count), records of
            later steps (written after that checkpoint by the killed run) are dropped first.
        tensorboard: None = use TensorBoard when installed; False = never.
    """

    def __init__(self, output_dir: str | Path, *, resume_step: int | None = None, tensorboard: bool | None = None) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        if resume_step is None:
            self.history: list[dict[str, Any]] = []
            self.path.write_text("")
        else:
            self.history = [r for r in read_metrics(self.path) if r["step"] < resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        self._tb = None
        if tensorboard is not False:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.dir / "tensorboard"))
            except Exception:  # noqa: BLE001 - tensorboard is optional
                if tensorboard:
                    log.warning("tensorboard requested but not installed (pip install tensorboard)")

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record the metrics of ``step``; returns the record."""
        record: dict[str, Any] = {"step": int(step)}
        for k, v in metrics.items():
            record[k] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        self.history.append(record)
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        return record

    def close(self) -> None:
        """Flush and close TensorBoard."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None


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

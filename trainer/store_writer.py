"""Write a training run's episodes and metrics to the run store off the step's critical path.

The learner does not wait for the store: :meth:`StoreWriter.submit` hands a step's episodes to
one background thread and returns. With ``train.store_tokens: off`` (the default) each episode is
stored without its token record (``Trajectory.token_turns``: prompt and sampled ids and logprobs
of every turn), which is most of its size: a Qwen3-8B step of 512 episodes of up to 16k tokens
holds 50-150 MB of them. The writer counts the bytes it stores per step for the run summary.

A full queue (the store slower than the steps) makes :meth:`submit` wait, so memory stays bounded;
a failing write only warns, as the store is a record and not needed to train.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

from trainer.protocols import RunRecord
from twin.trajectory import Trajectory

__all__ = ["StoreWriter", "stored_episode"]

log = logging.getLogger("twinrl.store")


def stored_episode(trajectory: Trajectory, tokens: str) -> Trajectory:
    """The trajectory as the store keeps it: without its token record
    unless ``tokens == "full"``."""
    if tokens == "full" or not trajectory.token_turns:
        return trajectory
    return trajectory.model_copy(update={"token_turns": []})


class StoreWriter:
    """One background thread writing steps to a run store, in the order they were submitted.

    Args:
        store: A :class:`twin.store.RunStore` (``add_episodes``, ``log_metrics``).
        run_id: The training run.
        tokens: ``train.store_tokens`` (``off`` or ``full``).
        max_pending: Steps queued before :meth:`submit` waits.
    """

    def __init__(
        self, store: RunRecord, run_id: int, *, tokens: str = "off", max_pending: int = 4
    ) -> None:
        if tokens not in ("off", "full"):
            raise ValueError(f"store_tokens must be 'off' or 'full', got {tokens!r}")
        self.store, self.run_id, self.tokens = store, run_id, tokens
        self.bytes_per_step: dict[int, int] = {}
        self._queue: queue.Queue[tuple[int, Sequence[Trajectory], dict[str, Any]] | None] = (
            queue.Queue(max_pending)
        )
        self._thread = threading.Thread(target=self._run, name="twinrl-store-writer", daemon=True)
        self._thread.start()

    def submit(self, step: int, episodes: Sequence[Trajectory], metrics: dict[str, Any]) -> None:
        """Queue a step's episodes and metrics; returns at once unless
        ``max_pending`` are queued."""
        if not self._thread.is_alive():
            raise RuntimeError("StoreWriter.submit after close()")
        self._queue.put((step, list(episodes), dict(metrics)))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                step, episodes, metrics = item
                stored = [stored_episode(t, self.tokens) for t in episodes]
                try:
                    self.store.add_episodes(self.run_id, stored, step=step)
                    self.store.log_metrics(self.run_id, step, metrics)
                except Exception as exc:  # noqa: BLE001 - keep training; say why episodes are missing
                    log.warning("run store write failed at step %d: %s", step, exc)
                    continue
                self.bytes_per_step[step] = sum(len(t.model_dump_json()) for t in stored)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every submitted step is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued and stop the thread (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def mean_bytes_per_step(self) -> float | None:
        """Mean bytes stored per step so far (None before the first write)."""
        if not self.bytes_per_step:
            return None
        return sum(self.bytes_per_step.values()) / len(self.bytes_per_step)

    def describe(self) -> str | None:
        """``run store: 1.2 MiB per step (tokens off)``, or None before the first write."""
        mean = self.mean_bytes_per_step()
        if mean is None:
            return None
        return f"run store: {_size(mean)} per step (tokens {self.tokens})"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"

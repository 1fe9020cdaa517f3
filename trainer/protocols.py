"""The trainer's collaborators that have several implementations, as the trainer uses them.

Only the methods the trainer calls are declared; anything that has them fits (a class needs
no base class to satisfy a :class:`typing.Protocol`):

- :class:`PolicyLearner`: the runtime's learner, :class:`trainer.learner.Learner` in a run, a
  stub in tests, the Ray learner actor's handle wrapper.
- :class:`RunRecord`: the run store as the trainer writes to it,
  :class:`twin.store.RunStore` in a run.
- the sampler is :class:`trainer.samplers.Sampler` (in-process engine, vLLM or the built-in
  server over HTTP, Ray engines), the weight sync :class:`trainer.weight_sync.AdapterSink`.

Collaborators with one implementation are typed by their class: the twin
(:class:`twin.core.Twin`), the recipe (:class:`trainer.config.Recipe`), the renderer
(:class:`trainer.renderer.Renderer`), the model (``torch.nn.Module``) and the tokenizer
(``transformers.PreTrainedTokenizerBase``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from trainer.scoring import TrainBatch
    from twin.trajectory import Trajectory

__all__ = ["PolicyLearner", "RunRecord"]


class PolicyLearner(Protocol):
    """The learner as the training loops, the sync check and checkpoints use it."""

    #: Optimizer steps taken (the policy version the samplers are told about).
    version: int
    #: The temperature its logprobs are of (the sync check scores at 1).
    temperature: float

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One update on ``batch``; the step's metrics."""
        ...

    def logprobs(self, batch: TrainBatch) -> list[list[float]]:
        """Each sequence's token logprobs under the current weights, no grad."""
        ...

    def save_adapter(self, path: Path) -> Path:
        """Write the trainable weights (a LoRA adapter folder) where a sampler can load them."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer state and version, for checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (resume)."""
        ...


class RunRecord(Protocol):
    """The run store as the trainer writes to it (a record of the run, never needed to train)."""

    def start_run(
        self, kind: str, twin: str, policy: str, config: dict[str, Any] | None = None
    ) -> int:
        """Record a new run; its id."""
        ...

    def add_episodes(
        self, run_id: int, trajectories: Iterable[Trajectory], step: int | None = None
    ) -> int:
        """Store a step's episodes; how many."""
        ...

    def log_metrics(self, run_id: int, step: int, values: dict[str, Any]) -> None:
        """Store a step's metrics."""
        ...

    def finish_run(
        self, run_id: int, metrics: dict[str, Any] | None = None, status: str = "finished"
    ) -> None:
        """Mark the run finished, with its summary."""
        ...

    def close(self) -> None:
        """Release the store."""
        ...

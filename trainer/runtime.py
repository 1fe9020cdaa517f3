"""The training runtime: everything the synchronous and the async loops share.

:class:`TrainingRuntime` owns a run's state and set-up; the loops are two schedules over it::

    SyncTrainer  (trainer/sync_trainer.py)        k = 0, in process: sample -> learn -> publish
    AsyncTrainer (trainer/async_trainer.py)  k >= 1 (or 0), a worker process samples while the
                                             learner learns
    RayTrainer   (trainer/ray_backend.py)   AsyncTrainer with its rollout side on Ray actors

What the runtime owns (each written once):

- set-up (:meth:`TrainingRuntime.setup_runtime`): the output folder (refusing to start over an
  earlier run's checkpoints), seeding and threads, the twin, the model (``model.init_from``),
  LoRA, the :class:`trainer.learner.Learner`, checkpoint restore, the metrics logger and the run
  store (:func:`trainer.metrics.open_training_run`);
- the data cursor (:meth:`TrainingRuntime.next_cases`), the length curriculum
  (:class:`LengthCurriculum`), the step's update (:func:`learn_from_groups`) and its episode
  metrics (:func:`episode_metrics`);
- the step's records (:meth:`TrainingRuntime.record_step`: metrics, store, ``on_step``,
  checkpoints) and one checkpoint format (:meth:`TrainingRuntime.save`; a loop adds its own
  counters through :meth:`TrainingRuntime.extra_state` / :meth:`TrainingRuntime.load_extra_state`);
- adapter publishing through one interface (``trainer/weight_sync.py``): an
  :class:`trainer.weight_sync.AdapterSink` (in process, HTTP, or Ray) behind an
  :class:`trainer.weight_sync.AdapterPublisher`.

Collaborators are constructor arguments (the learner, the adapter sink, the run store); the
defaults are built from the recipe, so tests pass fakes instead of setting private attributes.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer import objective
from trainer.checkpoint import (
    init_model_path,
    load_resumable,
    prepare_output_dir,
    restore_rng,
    save_checkpoint,
    unlock_output_dir,
)
from trainer.config import Recipe, SamplerConfig, check_devices
from trainer.episodes import episode_tokens, load_tokenizer, recipe_renderer_factory, training_cases
from trainer.learner import Learner, TrainBatch, build_lora_model
from trainer.metrics import MetricsLogger, close_training_run, open_training_run, plot_rewards
from trainer.protocols import PolicyLearner, RunRecord
from trainer.store_writer import StoreWriter
from trainer.weight_sync import AdapterPublisher, AdapterSink
from twin.cases import stable_seed
from twin.trajectory import Group

__all__ = [
    "LengthCurriculum",
    "StepUpdate",
    "TrainingRuntime",
    "build_learner",
    "episode_metrics",
    "finite",
    "learn_from_groups",
    "make_batch",
    "seed_everything",
]

log = logging.getLogger("twinrl.trainer")


# -- pure pieces -----------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def finite(value: Any) -> bool:
    """False for a float NaN / inf (the run store keeps finite numbers only)."""
    return not isinstance(value, float) or math.isfinite(value)


def make_batch(
    groups: list[Group], advantage: str, *, placebo_seed: int | None = None
) -> TrainBatch:
    """Advantages per group (on the shaped rewards), then one row per episode that sampled a token
    (an episode cut before its first turn counts in its group's advantages, and has nothing to
    learn).

    Args:
        groups: Scored groups whose trajectories carry ``info["shaped_reward"]`` and token turns.
        advantage: A key of :data:`trainer.algorithms.ADVANTAGES` (``grpo``, ``dr_grpo``, ``rloo``).
        placebo_seed: ``algorithm.placebo``: shuffle the advantages across the batch's episodes
            with this seed (the same values, each on a random episode).
    """
    shaped = torch.tensor(
        [[t.info["shaped_reward"] for t in g.trajectories] for g in groups]
    )  # [N, G]
    advantages = objective.advantages(shaped, advantage)  # [N, G]
    if placebo_seed is not None:
        advantages = objective.placebo_advantages(advantages, placebo_seed)
    ids, masks, lps, adv = [], [], [], []
    for g, row in zip(groups, advantages.tolist()):
        for t, a in zip(g.trajectories, row):
            if (
                not t.token_turns
            ):  # cut before its first turn (prompt over the budget): no sampled token
                continue
            i, m, lp = episode_tokens(t)
            ids.append(i)
            masks.append(m)
            lps.append(lp)
            adv.append(float(a))
    return TrainBatch(ids, masks, lps, adv)


def episode_metrics(groups: list[Group]) -> dict[str, float]:
    """Reward and episode statistics over every episode of ``groups``."""
    trajs = [t for g in groups for t in g.trajectories]
    rewards = [t.reward if t.reward is not None else 0.0 for t in trajs]
    out: dict[str, float] = {
        "rewards/total": statistics.fmean(rewards),
        "rewards/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rewards/shaped": statistics.fmean(t.info.get("shaped_reward", 0.0) for t in trajs),
    }
    for name in sorted({k for t in trajs for k in t.components}):
        out[f"rewards/{name}"] = statistics.fmean(t.components.get(name, 0.0) for t in trajs)
    out["episodes/count"] = float(len(trajs))
    out["episodes/turns"] = statistics.fmean(t.num_turns for t in trajs)
    out["episodes/completion_tokens"] = statistics.fmean(t.completion_tokens for t in trajs)
    out["episodes/episode_tokens"] = statistics.fmean(
        t.info.get("episode_tokens", 0) for t in trajs
    )
    out["episodes/terminated"] = statistics.fmean(float(t.terminated) for t in trajs)
    out["episodes/overlong"] = statistics.fmean(float(t.info.get("overlong", False)) for t in trajs)
    out["episodes/invalid_calls"] = statistics.fmean(t.invalid_calls for t in trajs)
    return out


@dataclass
class StepUpdate:
    """What :func:`learn_from_groups` did in one step.

    Attributes:
        learn: The last update's metrics (empty when no group was kept).
        episodes: :func:`episode_metrics` over every sampled group.
        learn_s: Seconds spent building the batch and updating.
    """

    learn: dict[str, float]
    episodes: dict[str, float]
    learn_s: float


def learn_from_groups(
    learner: PolicyLearner,
    kept: list[Group],
    every: list[Group],
    *,
    advantage: str,
    step: int,
    epochs: int = 1,
    placebo_seed: int | None = None,
) -> StepUpdate:
    """One step's learning: advantages, ``epochs`` updates on the kept groups, episode metrics.

    Args:
        learner: Takes the batch (:meth:`trainer.learner.Learner.step`).
        kept: The groups to train on (dynamic sampling already applied; may be empty).
        every: Every group sampled for this step (for the reward metrics).
        advantage: The advantage estimator's name (``algorithm.advantage``).
        step: The step index (for the log line when nothing is kept).
        epochs: Update passes over the batch (1 = GRPO as configured; the trainer benchmark
            raises it).
        placebo_seed: Shuffle the advantages across the batch (``algorithm.placebo``;
            :func:`make_batch`).
    """
    # ALGO LOGIC: advantages and the update(s)
    learn: dict[str, float] = {}
    t0 = time.perf_counter()
    batch = make_batch(kept, advantage, placebo_seed=placebo_seed) if kept else None
    if batch is not None and len(batch):
        for _ in range(max(1, epochs)):
            learn = learner.step(batch)
    elif kept:
        log.warning(
            "step %d: no kept episode sampled a token (prompts over max_episode_tokens?); "
            "no update",
            step,
        )
    else:
        log.warning("step %d: every group had equal rewards; no update", step)
    return StepUpdate(learn, episode_metrics(every), time.perf_counter() - t0)


def step_perf(
    *, rollout_s: float, sampled_tokens: int, sync_s: float, step_s: float, cursor: int
) -> dict[str, float]:
    """The ``perf/*`` and ``data/cursor`` entries of a step's record, the same in every loop.

    ``rollout_s`` is the time the lot took to sample (in the worker, for the async loop);
    ``sampled_tokens`` the completion tokens it holds; ``step_s`` the learner's wall time for the
    step.
    """
    return {
        "perf/rollout_s": rollout_s,
        "perf/sample_tokens_per_s": sampled_tokens / rollout_s if rollout_s > 0 else 0.0,
        "perf/sync_s": sync_s,
        "perf/step_s": step_s,
        "perf/tokens_per_s": sampled_tokens / step_s if step_s > 0 else 0.0,
        "data/cursor": float(cursor),
    }


def build_learner(cfg: Recipe, model_path: str, *, temperature: float) -> tuple[Learner, Any]:
    """The recipe's model (LoRA on it when ``lora.enabled``, else every weight trainable) in a
    Learner.

    Used by both GRPO loops (:class:`TrainingRuntime`) and by SFT (``trainer/sft.py``).

    Args:
        cfg: The recipe (``model``, ``lora``, ``algorithm``, ``optim``, ``devices.learner``).
        model_path: The weights to start from (``model.init_from``'s merged ones, or
            ``model.path``).
        temperature: The sampling temperature the learner's logprobs are taken at.

    Returns:
        ``(learner, tokenizer)``.
    """
    from trainer.models import load_model, resolve_autocast

    model, tokenizer = load_model(model_path, cfg.model.dtype, device=cfg.devices.learner)
    autocast = resolve_autocast(cfg.model.autocast, cfg.devices.learner)
    if cfg.lora.enabled:
        model = build_lora_model(
            model,
            lora_rank=cfg.lora.rank,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
        )
        if autocast:
            from trainer.hf_policy import cast_linear_weights

            # The frozen base layers run on weights rounded to the autocast dtype anyway: rounded
            # once here, no forward pass (a sampled token, above all) copies them again.
            cast_linear_weights(model, autocast, frozen_only=True)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    learner = Learner(
        model, algorithm=cfg.algorithm, optim=cfg.optim, temperature=temperature,
        max_tokens=cfg.sampler.max_episode_tokens, autocast=autocast,
    )  # fmt: skip
    return learner, tokenizer


class LengthCurriculum:
    """The per-turn token limit over a run (``sampler.length_curriculum``): one rule for both loops.

    ``linear`` grows from ``length_curriculum_start`` to ``max_new_tokens`` over
    ``max_new_tokens_ramp`` steps; ``plateau`` adds one token when the reward has settled at the
    current length (a step with no informative group) above the level it started from;
    ``none`` is ``max_new_tokens`` throughout.

    Args:
        sampler: The recipe's ``sampler`` section.
    """

    #: A settled length must have raised the mean reward by more than sampling noise to grow.
    MIN_GAIN = 0.01

    def __init__(self, sampler: SamplerConfig) -> None:
        self.sampler = sampler
        self.limit = float(sampler.length_curriculum_start)
        self.reward: float | None = None  # the mean reward when the current length started

    def max_new_tokens(self, step: int) -> int:
        """The per-turn token limit at ``step``."""
        s = self.sampler
        if s.length_curriculum == "linear" and s.max_new_tokens_ramp > 0:
            start = s.length_curriculum_start
            return max(
                1,
                min(
                    s.max_new_tokens,
                    start + (step * (s.max_new_tokens - start + 1)) // s.max_new_tokens_ramp,
                ),
            )
        if s.length_curriculum == "plateau":
            return int(min(s.max_new_tokens, self.limit or 1))
        return int(s.max_new_tokens)

    def grow(self, kept: Sequence[Any], mean_reward: float) -> None:
        """After a step: ``kept`` its informative groups, ``mean_reward`` its mean reward."""
        if self.reward is None:  # the level this length starts from
            self.reward = mean_reward
            return
        if (
            self.sampler.length_curriculum == "plateau"
            and not kept
            and mean_reward > self.reward + self.MIN_GAIN
        ):
            self.limit = min((self.limit or 1) + 1, float(self.sampler.max_new_tokens))
            self.reward = mean_reward

    def state_dict(self) -> dict[str, float | None]:
        """For checkpoints."""
        return {"limit": self.limit, "reward": self.reward}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.limit = float(state.get("limit") or self.limit)
        self.reward = state.get("reward")


# -- the runtime -----------------------------------------------------------------------------------
class TrainingRuntime:
    """A training run's state and set-up; :class:`trainer.sync_trainer.SyncTrainer` and
    :class:`trainer.async_trainer.AsyncTrainer` are its two loops (``setup`` / ``train`` /
    ``cleanup``).

    Args:
        cfg: The validated recipe.
        resume: Continue from the newest checkpoint of ``cfg.train.output_dir`` (starts fresh,
            with a warning, when there is none).
        overwrite: Without ``resume``, delete the checkpoints an earlier run left in
            ``cfg.train.output_dir`` (without it, set-up refuses to start over them).
        on_step: Called with each step's metrics record (the CLI's progress display).
        learner: The learner to train (default: built from the recipe in set-up; tests pass a
            stub with ``step``, ``version``, ``save_adapter``, ``logprobs``, ``state_dict``).
        adapters: Where new versions go (default: chosen by the loop from the recipe).
        store: A run store (``twin.store.RunStore`` interface; default: the recipe's
            ``train.store``).
    """

    #: The title suffix of the reward plot.
    plot_label = ""

    def __init__(
        self, cfg: Recipe, *, resume: bool = False, overwrite: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        learner: PolicyLearner | None = None, adapters: AdapterSink | None = None,
        store: RunRecord | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.resume = resume
        self.overwrite = overwrite
        self.on_step = on_step
        self.output_dir = Path(cfg.train.output_dir)
        self.step = 0  # steps completed
        self.cursor = 0  # cases drawn so far
        self.run_id: int | None = None
        self.learner: Any = learner  # a PolicyLearner; the in-process sampler reads its model
        self.adapters: Any = adapters  # an AdapterSink once set up
        self.store: RunRecord | None = store
        self._given_store = store
        self.store_writer: StoreWriter | None = None  # writes the store off the step's path
        self.server: Any = None  # a sampler server this run started
        self.publisher: AdapterPublisher | None = None
        self.metrics: MetricsLogger | None = None
        self.curriculum = LengthCurriculum(cfg.sampler)

    # -- set-up ----------------------------------------------------------------------------------
    def place_threads(self) -> None:
        """Threads of this process (the async trainer also pins cores: ``trainer/placement.py``)."""
        from trainer.threads import place_cpu_threads

        place_cpu_threads(self.cfg.devices.cpu_threads)

    def setup_runtime(self) -> None:
        """Output folder, seeds, twin, model and learner, checkpoint restore, metrics, store."""
        from twin.registry import make_twin

        cfg = self.cfg
        check_devices(cfg)
        # before the model loads: a refused output folder should cost nothing
        checkpoint = prepare_output_dir(
            self.output_dir, resume=self.resume, overwrite=self.overwrite
        )
        if self.resume and checkpoint is None:
            log.warning("--resume: no checkpoint in %s; starting a fresh run", self.output_dir)
        # TRY NOT TO MODIFY: seeding, threads, the twin
        seed_everything(cfg.seed)
        self.place_threads()
        self.twin = make_twin(cfg.twin.name, **cfg.twin.config)
        self.twin.num_cases(cfg.twin.split)  # fails early on an unknown split
        # a twin without a reward has no penalty to check (it fails when an episode is scored)
        objective.check_overlong_owner(
            getattr(self.twin, "reward", None), cfg.algorithm.overlong_buffer
        )
        # model.init_from: the checkpoint's weights (merged) are the model this run trains
        self.model_path = init_model_path(
            cfg.model.path, cfg.model.init_from, self.output_dir, cfg.model.dtype
        )
        if self.learner is None:
            self.learner, self.tokenizer = self._build_learner()
        else:
            self.tokenizer = load_tokenizer(self.model_path)
        tokenizer = self.tokenizer
        self.renderer_factory = recipe_renderer_factory(cfg, tokenizer, self.model_path)

        # adapters are saved again from the learner (a killed run may have left one half written)
        shutil.rmtree(self.output_dir / "adapters", ignore_errors=True)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "recipe.yaml").write_text(cfg.to_yaml())
        if (
            checkpoint is not None
        ):  # the newest that loads: a damaged one falls back to the one before
            checkpoint, state = load_resumable(self.output_dir, checkpoint)
            self.restore(state)
            log.info("resumed from %s (step %d)", checkpoint, self.step)
        self.metrics = MetricsLogger(
            self.output_dir, resume_step=self.step if checkpoint else None, sinks=cfg.train.log,
            config=cfg.model_dump(mode="json", by_alias=True),
        )  # fmt: skip
        self.store, self.run_id = open_training_run(
            cfg, self.twin.name, self.run_id, store=self._given_store
        )

    def _build_learner(self) -> tuple[Learner, Any]:
        return build_learner(self.cfg, self.model_path, temperature=self.cfg.sampler.temperature)

    # -- checkpoints -----------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        """A loop's own counters, saved with every checkpoint (override; default none)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state` from a checkpoint's state (override)."""

    def save(self) -> Path:
        """Write a checkpoint of the current state (one format for every loop)."""
        assert self.metrics is not None, "save() before setup()"
        return save_checkpoint(
            self.output_dir,
            self.step,
            learner=self.learner,
            state={
                "cursor": self.cursor,
                "run_id": self.run_id,
                "curriculum": self.curriculum.state_dict(),
                "metrics": list(self.metrics.history),
                **self.extra_state(),
            },
            recipe_yaml=self.cfg.to_yaml(),
        )

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state (:meth:`save`'s format)."""
        self.learner.load_state_dict(state["learner"])
        self.step = int(state["step"])
        self.cursor = int(state["cursor"])
        self.run_id = state.get("run_id")
        self.curriculum.load_state_dict(state.get("curriculum", {}))
        self.load_extra_state(state)
        restore_rng(state["rng"])

    # -- one step --------------------------------------------------------------------------------
    def next_cases(self, n: int) -> list[tuple[str, int]]:
        """The next ``n`` training cases: a seeded, kind-balanced draw per cursor position."""
        cases = training_cases(self.cfg, self.twin, self.cursor, n)
        self.cursor += n
        return cases

    def max_new_tokens(self, step: int) -> int:
        """The per-turn token limit at ``step`` (:class:`LengthCurriculum`)."""
        return self.curriculum.max_new_tokens(step)

    def learn(
        self, kept: list[Group], every: list[Group], step: int, *, epochs: int = 1
    ) -> StepUpdate:
        """The step's update (:func:`learn_from_groups`, ``epochs`` passes); the length curriculum
        moves after it."""
        algo_cfg = self.cfg.algorithm
        placebo = stable_seed("placebo", self.cfg.seed, step) if algo_cfg.placebo else None
        update = learn_from_groups(
            self.learner, kept, every, advantage=algo_cfg.advantage, step=step, epochs=epochs,
            placebo_seed=placebo,
        )  # fmt: skip
        self.curriculum.grow(kept, update.episodes["rewards/total"])
        return update

    def record_step(self, step: int, record: dict[str, Any], every: list[Group]) -> dict[str, Any]:
        """Log the record, store the episodes, tell ``on_step``, checkpoint every N steps."""
        assert self.metrics is not None, "record_step() before setup()"
        episodes = [t for g in every for t in g.trajectories]
        record = self.metrics.log(step, record, episodes=episodes)
        if self.store is not None and self.run_id is not None:
            if self.store_writer is None:
                self.store_writer = StoreWriter(
                    self.store, self.run_id, tokens=self.cfg.train.store_tokens
                )
            self.store_writer.submit(
                step, episodes, {k: v for k, v in record.items() if k != "step" and finite(v)}
            )
        if self.on_step is not None:
            self.on_step(record)
        every_n = self.cfg.train.checkpoint_every
        if (every_n and self.step % every_n == 0) or self.step == self.cfg.train.steps:
            if self.store_writer is not None:
                self.store_writer.flush()  # a checkpoint's steps are in the store before it exists
            self.save()
        return record

    # -- the end ---------------------------------------------------------------------------------
    def stop_workers(self) -> None:
        """Stop what the loop started (override; idempotent)."""
        if self.publisher is not None:
            self.publisher.close()
        if self.server is not None:
            self.server.stop()

    def cleanup(self) -> Path | None:
        """Stop the loop's processes, plot the reward curve, close the store; return the plot's
        path."""
        plot = None
        metrics = self.metrics
        try:
            self.stop_workers()
            if metrics is not None:
                plot = plot_rewards(
                    metrics.history, self.output_dir / "rewards.png",
                    title=f"{self.cfg.twin.name}: {self.cfg.model.path}{self.plot_label}",
                )  # fmt: skip
        finally:
            if metrics is not None:
                metrics.close()
            last = metrics.history[-1] if metrics is not None and metrics.history else {}
            summary = {k: v for k, v in last.items() if finite(v)}
            if self.store_writer is not None:
                self.store_writer.close()  # every step written before the run is closed
                if self.store_writer.mean_bytes_per_step() is not None:
                    summary["store/bytes_per_step"] = self.store_writer.mean_bytes_per_step()
            close_training_run(
                self.store, self.run_id, done=self.step >= self.cfg.train.steps, summary=summary
            )
            unlock_output_dir(self.output_dir)  # another process may now train into the folder
        return plot

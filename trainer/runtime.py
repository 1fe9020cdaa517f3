"""The training runtime: everything the synchronous and the async loops share.

:class:`TrainingRuntime` owns a run's state and set-up; the loops are two schedules over it::

    SyncTrainer  (trainer/recipe.py)        k = 0, in process: sample -> learn -> publish
    AsyncTrainer (trainer/orchestrator.py)  k >= 1 (or 0), a worker process samples while the learner learns
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
- adapter publishing through one interface, :class:`AdapterSink`: :class:`InProcessAdapters` when
  the sampler shares the learner's model (``sampler.kind: hf`` in the synchronous loop),
  :class:`AdapterClient` for a sampler server (``twin serve``, vLLM), and Ray's own client in
  ``trainer/ray_backend.py``; :class:`AdapterPublisher` saves, loads and retires versions over it.

Collaborators are constructor arguments (the learner, the adapter sink, the run store); the
defaults are built from the recipe, so tests pass fakes instead of setting private attributes.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx
import numpy as np
import torch

from trainer import objective
from trainer.cases import draw_cases
from trainer.checkpoint import init_model_path, load_checkpoint, prepare_output_dir, restore_rng, save_checkpoint
from trainer.config import Recipe, check_devices
from trainer.learner import Learner, TrainBatch, build_lora_model
from trainer.metrics import MetricsLogger, open_training_run, plot_rewards
from trainer.rollouts import episode_tokens, load_tokenizer
from trainer.serving.http import auth_headers
from trainer.serving.process import ServerProcess
from trainer.vllm import VLLMServer
from trainer.workers import AdapterSyncError, adapter_name, guarded_command
from twin.errors import ConfigError
from twin.http import tls_context
from twin.trajectory import Group

__all__ = [
    "AdapterClient",
    "AdapterPublisher",
    "AdapterSink",
    "InProcessAdapters",
    "LengthCurriculum",
    "StepUpdate",
    "TrainingRuntime",
    "episode_metrics",
    "finite",
    "make_sampler_server",
    "require_lora_for_server",
    "learn_from_groups",
    "make_batch",
    "seed_everything",
]

log = logging.getLogger("twinrl.trainer")


# -- pure pieces ---------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def finite(value: Any) -> bool:
    """False for a float NaN / inf (the run store keeps finite numbers only)."""
    return not isinstance(value, float) or math.isfinite(value)


def make_batch(groups: list[Group], advantage: str) -> TrainBatch:
    """Advantages per group (on the shaped rewards), then one row per episode.

    Args:
        groups: Scored groups whose trajectories carry ``info["shaped_reward"]`` and token turns.
        advantage: A key of :data:`trainer.algorithms.ADVANTAGES` (``grpo``, ``dr_grpo``, ``rloo``).
    """
    shaped = torch.tensor([[t.info["shaped_reward"] for t in g.trajectories] for g in groups])  # [N, G]
    advantages = objective.advantages(shaped, advantage)  # [N, G]
    ids, masks, lps, adv = [], [], [], []
    for g, row in zip(groups, advantages.tolist()):
        for t, a in zip(g.trajectories, row):
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
    out["episodes/episode_tokens"] = statistics.fmean(t.info.get("episode_tokens", 0) for t in trajs)
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
    learner: Any, kept: list[Group], every: list[Group], *, advantage: str, step: int, epochs: int = 1
) -> StepUpdate:
    """One step's learning: advantages, ``epochs`` updates on the kept groups, episode metrics.

    Args:
        learner: Takes the batch (:meth:`trainer.learner.Learner.step`).
        kept: The groups to train on (dynamic sampling already applied; may be empty).
        every: Every group sampled for this step (for the reward metrics).
        advantage: The advantage estimator's name (``algorithm.advantage``).
        step: The step index (for the log line when nothing is kept).
        epochs: Update passes over the batch (1 = GRPO as configured; the trainer benchmark raises it).
    """
    # ALGO LOGIC: advantages and the update(s)
    learn: dict[str, float] = {}
    t0 = time.perf_counter()
    if kept:
        batch = make_batch(kept, advantage)
        for _ in range(max(1, epochs)):
            learn = learner.step(batch)
    else:
        log.warning("step %d: every group had equal rewards; no update", step)
    return StepUpdate(learn, episode_metrics(every), time.perf_counter() - t0)


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

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.limit = float(sampler.length_curriculum_start)
        self.reward: float | None = None  # the mean reward when the current length started

    def max_new_tokens(self, step: int) -> int:
        """The per-turn token limit at ``step``."""
        s = self.sampler
        if s.length_curriculum == "linear" and s.max_new_tokens_ramp > 0:
            start = s.length_curriculum_start
            return max(1, min(s.max_new_tokens, start + (step * (s.max_new_tokens - start + 1)) // s.max_new_tokens_ramp))
        if s.length_curriculum == "plateau":
            return int(min(s.max_new_tokens, self.limit or 1))
        return int(s.max_new_tokens)

    def grow(self, kept: Sequence[Any], mean_reward: float) -> None:
        """After a step: ``kept`` its informative groups, ``mean_reward`` its mean reward."""
        if self.reward is None:  # the level this length starts from
            self.reward = mean_reward
            return
        if self.sampler.length_curriculum == "plateau" and not kept and mean_reward > self.reward + self.MIN_GAIN:
            self.limit = min((self.limit or 1) + 1, float(self.sampler.max_new_tokens))
            self.reward = mean_reward

    def state_dict(self) -> dict[str, float | None]:
        """For checkpoints."""
        return {"limit": self.limit, "reward": self.reward}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.limit = float(state.get("limit") or self.limit)
        self.reward = state.get("reward")


# -- adapter publishing -------------------------------------------------------------------------------
@runtime_checkable
class AdapterSink(Protocol):
    """Where each new policy version goes (the sampler's side of weight sync).

    ``needs_files``: whether :meth:`load` reads a saved adapter folder (a server) or not (a sampler
    that shares the learner's model, which has the new weights already).
    """

    needs_files: bool

    def load(self, name: str, path: str | Path | None) -> float:
        """Make adapter ``name`` (saved at ``path``) sampleable; return the seconds it took.

        Raises:
            AdapterSyncError: it was refused or could not be delivered.
        """
        ...

    def unload(self, name: str) -> None:
        """Drop adapter ``name`` (a failure is logged only)."""
        ...


class InProcessAdapters:
    """The sink of a sampler that samples with the learner's own model (``sampler.kind: hf``).

    Nothing is saved or sent: the model the sampler runs is the one the learner just updated.
    ``versions`` lists the names published, in order (what a server would have loaded).
    """

    needs_files = False

    def __init__(self) -> None:
        self.versions: list[str] = []

    def load(self, name: str, path: str | Path | None) -> float:
        self.versions.append(name)
        return 0.0

    def unload(self, name: str) -> None:
        return None


class AdapterClient:
    """Loads and unloads named LoRA adapters in a vLLM-compatible server (``twin serve``, vLLM).

    Args:
        base_url: Server root or OpenAI base URL (``/v1`` is handled either way).
        transport: An httpx transport (tests pass ``httpx.MockTransport``).
        timeout: Seconds per request.
    """

    needs_files = True

    def __init__(self, base_url: str, *, transport: httpx.BaseTransport | None = None, timeout: float = 120.0) -> None:
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.transport = transport
        self.timeout = timeout

    def _post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(transport=self.transport, timeout=self.timeout, verify=tls_context(),
                          headers=auth_headers()) as client:  # fmt: skip
            return client.post(f"{self.root}{route}", json=body)

    def load(self, name: str, path: str | Path | None) -> float:
        """Load the adapter folder ``path`` as ``name``; return the seconds it took.

        Raises:
            AdapterSyncError: the server refused it or could not be reached (never ignored: a
                sampler left on an older adapter would train on the wrong policy).
        """
        started = time.perf_counter()
        try:
            response = self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        except httpx.HTTPError as exc:
            raise AdapterSyncError(
                f"could not load adapter {name} from {path}: the sampler at {self.root} is unreachable "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        if response.status_code != 200:
            raise AdapterSyncError(
                f"the sampler at {self.root} refused adapter {name} from {path}: HTTP "
                f"{response.status_code} {response.text[:300]}. Is the server started with LoRA "
                "enabled (vLLM: --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) and a "
                "--max-lora-rank >= lora.rank?"
            )
        return time.perf_counter() - started

    def unload(self, name: str) -> None:
        """Unload ``name`` (a failure is logged only: an extra resident adapter is harmless)."""
        try:
            response = self._post("/v1/unload_lora_adapter", {"lora_name": name})
            if response.status_code != 200:
                log.debug("unload %s: HTTP %d %s", name, response.status_code, response.text[:200])
        except httpx.HTTPError as exc:
            log.debug("unload %s failed: %s", name, exc)


class AdapterPublisher:
    """Saves the learner's adapter as ``policy@<version>`` and loads it through an :class:`AdapterSink`.

    The newest ``keep`` versions stay loaded (a lot in progress may still ask for them); older
    ones are unloaded and deleted on a background thread (an unload waits for the server's batch
    in flight). :meth:`load` may run on another thread than :meth:`save` (the async trainer's
    load thread), never on two at once.

    Args:
        output_dir: The run folder (adapters go to ``<output_dir>/adapters/policy@<v>``).
        sink: Where versions go.
        keep: Versions kept loaded (the synchronous loop: 1; the async one: ``max_staleness + 2``).
        before_save: Called with the version before its adapter is written (the 9B rehearsal
            moves the weights there, ``trainer/rehearsal.py``).
    """

    def __init__(
        self, output_dir: Path, sink: AdapterSink, *, keep: int = 1,
        before_save: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self.output_dir = Path(output_dir)
        self.sink = sink
        self.keep = max(1, keep)
        self.before_save = before_save
        self.loaded: list[int] = []  # versions resident in the sampler, oldest first
        self.last_save_s = 0.0
        self._retirer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twin-adapter-retire")

    def adapter_dir(self, version: int) -> Path:
        """Where version ``version`` is saved."""
        return (self.output_dir / "adapters" / adapter_name(version)).resolve()

    def save(self, learner: Any, version: int) -> Path | None:
        """Write the learner's adapter as ``version`` (on the learner: the next update changes the weights).

        Returns None when the sink needs no files.
        """
        if not self.sink.needs_files:
            return None
        started = time.perf_counter()
        path = self.adapter_dir(version)
        if not (path / "adapter_config.json").exists():
            if self.before_save is not None:
                self.before_save(version)
            learner.save_adapter(path)
        self.last_save_s = time.perf_counter() - started
        return path

    def load(self, version: int, path: Path | None) -> float:
        """Load a saved version in the sampler; return the seconds it took (0 when already there)."""
        if version in self.loaded:
            return 0.0
        seconds = self.sink.load(adapter_name(version), path)
        self.loaded.append(version)
        while len(self.loaded) > self.keep:
            self._retirer.submit(self._retire, self.loaded.pop(0))
        return seconds

    def push(self, learner: Any, version: int) -> float:
        """:meth:`save` then :meth:`load`, here; return the seconds the load took."""
        if version in self.loaded:
            return 0.0
        return self.load(version, self.save(learner, version))

    def forget(self, keep_version: int) -> None:
        """After a sampler restart nothing is loaded: delete every saved version but ``keep_version``."""
        for old in self.loaded:
            if old != keep_version:
                shutil.rmtree(self.adapter_dir(old), ignore_errors=True)
        self.loaded.clear()

    def _retire(self, version: int) -> None:
        self.sink.unload(adapter_name(version))
        shutil.rmtree(self.adapter_dir(version), ignore_errors=True)

    def close(self) -> None:
        """Wait for the retirements in flight."""
        self._retirer.shutdown(wait=True)


# -- the runtime --------------------------------------------------------------------------------------
class TrainingRuntime:
    """A training run's state and set-up; :class:`trainer.recipe.SyncTrainer` and
    :class:`trainer.orchestrator.AsyncTrainer` are its two loops (``setup`` / ``train`` / ``cleanup``).

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
        store: A run store (``twin.store.RunStore`` interface; default: the recipe's ``train.store``).
    """

    #: The title suffix of the reward plot.
    plot_label = ""

    def __init__(
        self, cfg: Recipe, *, resume: bool = False, overwrite: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None, learner: Any = None,
        adapters: AdapterSink | None = None, store: Any = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.resume = resume
        self.overwrite = overwrite
        self.on_step = on_step
        self.output_dir = Path(cfg.train.output_dir)
        self.step = 0  # steps completed
        self.cursor = 0  # cases drawn so far
        self.run_id: int | None = None
        self.learner: Any = learner
        self.adapters: Any = adapters
        self.store: Any = store
        self._given_store = store
        self.server: Any = None  # a sampler server this run started
        self.publisher: AdapterPublisher | None = None
        self.metrics: MetricsLogger | None = None
        self.curriculum = LengthCurriculum(cfg.sampler)

    # -- set-up ----------------------------------------------------------------------------------
    def place_threads(self) -> None:
        """Threads of this process (the async trainer also pins cores: ``trainer/placement.py``)."""
        if self.cfg.devices.cpu_threads:
            torch.set_num_threads(self.cfg.devices.cpu_threads)

    def setup_runtime(self) -> None:
        """Output folder, seeds, twin, model and learner, checkpoint restore, metrics, store."""
        from trainer.renderer import Renderer
        from twin.registry import make_twin

        cfg = self.cfg
        check_devices(cfg)
        # before the model loads: a refused output folder should cost nothing
        checkpoint = prepare_output_dir(self.output_dir, resume=self.resume, overwrite=self.overwrite)
        if self.resume and checkpoint is None:
            log.warning("--resume: no checkpoint in %s; starting a fresh run", self.output_dir)
        # TRY NOT TO MODIFY: seeding, threads, the twin
        seed_everything(cfg.seed)
        self.place_threads()
        self.twin = make_twin(cfg.twin.name, **cfg.twin.config)
        self.twin.num_cases(cfg.twin.split)  # fails early on an unknown split
        # model.init_from: the checkpoint's weights (merged) are the model this run trains
        self.model_path = init_model_path(cfg.model.path, cfg.model.init_from, self.output_dir, cfg.model.dtype)
        if self.learner is None:
            self.learner, self.tokenizer = self._build_learner()
        else:
            self.tokenizer = load_tokenizer(self.model_path)
        tokenizer = self.tokenizer
        self.renderer_factory = lambda tools: Renderer(tokenizer, tools, chat_template=cfg.model.chat_template, template_kwargs=cfg.model.template_kwargs)  # fmt: skip

        # adapters are saved again from the learner (a killed run may have left one half written)
        shutil.rmtree(self.output_dir / "adapters", ignore_errors=True)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "recipe.yaml").write_text(cfg.to_yaml())
        if checkpoint is not None:
            self.restore(load_checkpoint(checkpoint))
            log.info("resumed from %s (step %d)", checkpoint, self.step)
        self.metrics = MetricsLogger(
            self.output_dir, resume_step=self.step if checkpoint else None, sinks=cfg.train.log,
            config=cfg.model_dump(mode="json", by_alias=True),
        )  # fmt: skip
        self.store, self.run_id = open_training_run(cfg, self.twin.name, self.run_id, store=self._given_store)

    def _build_learner(self) -> tuple[Learner, Any]:
        from trainer.models import load_model

        cfg = self.cfg
        model, tokenizer = load_model(self.model_path, cfg.model.dtype, device=cfg.devices.learner)
        if cfg.lora.enabled:
            model = build_lora_model(
                model, lora_rank=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                target_modules=cfg.lora.target_modules,
            )  # fmt: skip
        else:
            for p in model.parameters():
                p.requires_grad_(True)
        learner = Learner(
            model, algorithm=cfg.algorithm, optim=cfg.optim, temperature=cfg.sampler.temperature,
            max_tokens=cfg.sampler.max_episode_tokens,
        )  # fmt: skip
        return learner, tokenizer

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
        cfg = self.cfg
        cases = draw_cases(self.twin, cfg.twin.split, cfg.seed, self.cursor, n, balance=cfg.twin.balance)
        self.cursor += n
        return cases

    def max_new_tokens(self, step: int) -> int:
        """The per-turn token limit at ``step`` (:class:`LengthCurriculum`)."""
        return self.curriculum.max_new_tokens(step)

    def learn(self, kept: list[Group], every: list[Group], step: int, *, epochs: int = 1) -> StepUpdate:
        """The step's update (:func:`learn_from_groups`, ``epochs`` passes); the length curriculum moves after it."""
        update = learn_from_groups(
            self.learner, kept, every, advantage=self.cfg.algorithm.advantage, step=step, epochs=epochs
        )
        self.curriculum.grow(kept, update.episodes["rewards/total"])
        return update

    def record_step(self, step: int, record: dict[str, Any], every: list[Group]) -> dict[str, Any]:
        """Log the record, store the episodes, tell ``on_step``, checkpoint every N steps."""
        assert self.metrics is not None, "record_step() before setup()"
        episodes = [t for g in every for t in g.trajectories]
        record = self.metrics.log(step, record, episodes=episodes)
        if self.store is not None and self.run_id is not None:
            try:
                self.store.add_episodes(self.run_id, episodes, step=step)
                self.store.log_metrics(self.run_id, step, {k: v for k, v in record.items() if k != "step" and finite(v)})
            except Exception as exc:  # noqa: BLE001 - keep training; say why episodes are missing
                log.warning("run store write failed at step %d: %s", step, exc)
        if self.on_step is not None:
            self.on_step(record)
        every_n = self.cfg.train.checkpoint_every
        if (every_n and self.step % every_n == 0) or self.step == self.cfg.train.steps:
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
        """Stop the loop's processes, plot the reward curve, close the store; return the plot's path."""
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
            if self.store is not None:
                if self.run_id is not None and self.step >= self.cfg.train.steps:
                    # an unfinished run stays 'running' (resumable), as a killed one does
                    last = metrics.history[-1] if metrics is not None and metrics.history else {}
                    try:
                        self.store.finish_run(self.run_id, metrics={k: v for k, v in last.items() if finite(v)})
                    except Exception as exc:  # noqa: BLE001
                        log.warning("run store: could not finish run %s: %s", self.run_id, exc)
                self.store.close()
        return plot


def require_lora_for_server(cfg: Recipe, who: str) -> None:
    """Refuse a recipe whose new weights would have to reach a server without LoRA.

    Raises:
        ConfigError: ``lora.enabled`` is false.
    """
    if not cfg.lora.enabled:
        raise ConfigError(
            f"{who} sends new weights to the sampler as LoRA adapters; set lora.enabled: true "
            "(or use async.max_staleness: 0 with sampler.kind: hf for full fine-tuning)"
        )


# -- the sampler server a run starts -------------------------------------------------------------------
#: vLLM's ``--gpu-memory-utilization`` for the sampler the trainer starts (unset: vLLM's 0.9);
#: lower it when rollout and learner share a GPU (``twin plan --vllm-utilization`` sizes it).
VLLM_UTILIZATION_ENV = "TWINRL_VLLM_GPU_MEMORY_UTILIZATION"


class GuardedServerProcess(ServerProcess):
    """``twin serve`` as the trainer starts it: it gets SIGTERM when the trainer dies (Linux)."""

    def command(self) -> list[str]:
        return guarded_command(super().command())


class GuardedVLLMServer(VLLMServer):
    """vLLM as the trainer starts it: it gets SIGTERM when the trainer dies (Linux)."""

    def command(self) -> list[str]:
        return guarded_command(super().command())


def make_sampler_server(cfg: Recipe, output_dir: Path, model_path: str | None = None, *, max_loras: int = 2) -> Any:
    """The sampler server a run starts (not started yet), or None for ``sampler.kind: server`` (external).

    Args:
        cfg: The recipe (``sampler.kind``: ``hf`` starts ``twin serve``, ``vllm`` vLLM).
        output_dir: The run folder (server logs; every adapter is written under it).
        model_path: The base model the learner trains (``model.init_from``'s merged weights;
            default ``model.path``).
        max_loras: Adapters the server keeps resident at once.

    Raises:
        ConfigError: ``$TWINRL_VLLM_GPU_MEMORY_UTILIZATION`` is not a fraction.
    """
    model_path = model_path or cfg.model.path
    kind = cfg.sampler.kind
    device = cfg.devices.rollout
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    if kind == "server":
        return None
    if kind == "hf":
        return GuardedServerProcess(
            model_path, dtype=dtype, max_loras=max_loras + 1, served_model_name="base", device=device,
            threads=cfg.devices.cpu_threads, seed=cfg.seed, log_path=output_dir / "sampler.log",
            adapter_root=output_dir,  # the learner writes every adapter under it
        )  # fmt: skip
    from trainer.models import resolve_model_path

    # rollout and learner sharing one GPU: vLLM must leave the learner room (its default takes 90 %)
    utilization = os.environ.get(VLLM_UTILIZATION_ENV)
    try:
        extra = {"gpu_memory_utilization": float(utilization)} if utilization else {}
    except ValueError:
        raise ConfigError(f"${VLLM_UTILIZATION_ENV} must be a fraction in (0, 1], got {utilization!r}") from None
    # from_recipe also passes the LoRA target modules (without them vLLM wraps lm_head and crashes
    # on prompt_logprobs beside generating requests: docs/serving.md)
    return GuardedVLLMServer.from_recipe(
        cfg, model=resolve_model_path(model_path), python=os.environ.get("TWINRL_VLLM_PYTHON", ".venv-vllm"),
        served_model_name="base", max_loras=max_loras, log_path=output_dir / "vllm.log", **extra,
    )  # fmt: skip

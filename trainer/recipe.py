"""The GRPO recipe: ``setup()``, ``train()``, ``cleanup()``, with the loop in plain view.

::

    recipe = GRPORecipe(load_recipe("toy-cpu"))
    recipe.setup()
    history = recipe.train()        # one metrics dict per step
    recipe.cleanup()

One step (``train()``)::

    cases   = next N cases of the split (data cursor)
    groups  = collect_groups(twin, cases, sampler, ...)           # G episodes per case
    rewards = env reward + overlong shaping                        # [N, G]
    keep groups whose rewards differ; sample more (bounded)        # dynamic sampling
    A       = advantages(rewards)                                  # grpo | dr_grpo | rloo
    metrics = learner.step(TrainBatch(tokens, masks, sampler logprobs, A))
    push the new adapter to the sampler server (server samplers)
    log metrics; checkpoint every N steps

The rollout side (:func:`trainer.rollouts.collect_groups`) and the learner side
(:meth:`trainer.learner.Learner.step`) meet only through :class:`twin.trajectory.Group` objects,
so the async trainer can run them in separate processes.
"""

from __future__ import annotations

import logging
import random
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer import objective
from trainer.cases import draw_cases
from trainer.checkpoint import init_model_path, load_checkpoint, prepare_output_dir, restore_rng, save_checkpoint
from trainer.config import Recipe, check_devices
from trainer.learner import Learner, TrainBatch, build_lora_model
from trainer.metrics import MetricsLogger, open_training_run, plot_rewards
from trainer.rollouts import RolloutSettings, collect_groups, episode_tokens
from trainer.serving.http import auth_headers
from twin.cases import stable_seed
from twin.errors import ConfigError
from twin.http import tls_context
from twin.trajectory import Group

__all__ = ["GRPORecipe", "StepUpdate", "learn_from_groups", "make_batch", "seed_everything"]

log = logging.getLogger("twinrl.trainer")


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


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


@dataclass
class StepUpdate:
    """What :func:`learn_from_groups` did in one step.

    Attributes:
        learn: The last update's metrics (empty when no group was kept).
        episodes: :meth:`GRPORecipe.episode_metrics` over every sampled group.
        learn_s: Seconds spent building the batch and updating.
    """

    learn: dict[str, float]
    episodes: dict[str, float]
    learn_s: float


def learn_from_groups(
    learner: Learner, kept: list[Group], every: list[Group], *, advantage: str, step: int, epochs: int = 1
) -> StepUpdate:
    """One step's learning: advantages, ``epochs`` updates on the kept groups, episode metrics.

    The body shared by the synchronous loop (:meth:`GRPORecipe.train`) and the async learner
    (:meth:`trainer.orchestrator.AsyncTrainer.train`); sampling and weight sync stay with them.

    Args:
        learner: Takes the batch (:meth:`trainer.learner.Learner.step`).
        kept: The groups to train on (dynamic sampling already applied; may be empty).
        every: Every group sampled for this step (for the reward metrics).
        advantage: The advantage estimator's name (``algorithm.advantage``).
        step: The step index (for the log line when nothing is kept).
        epochs: Update passes over the batch (1 = GRPO as configured).
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
    learn_s = time.perf_counter() - t0
    return StepUpdate(learn, GRPORecipe.episode_metrics(every), learn_s)


class GRPORecipe:
    """Synchronous GRPO / DAPO / Dr. GRPO training of a policy in a twin.

    Args:
        cfg: The validated recipe.
        resume: Continue from the newest checkpoint in ``cfg.train.output_dir`` (starts fresh,
            with a warning, when there is none).
        overwrite: Without ``resume``, delete the checkpoints an earlier run left in
            ``cfg.train.output_dir`` (without it, :meth:`setup` refuses to start over them).
        on_step: Called with each step's metrics record (the CLI's progress display).
    """

    def __init__(
        self, cfg: Recipe, *, resume: bool = False, overwrite: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.resume = resume
        self.overwrite = overwrite
        self.on_step = on_step
        self.output_dir = Path(cfg.train.output_dir)
        self.step = 0  # steps completed
        self.cursor = 0  # cases drawn so far
        self.run_id: int | None = None
        self.store: Any = None
        self.server: Any = None
        self._adapter_name: str | None = None
        # length curriculum ('plateau'): current per-turn limit and the reward at its last growth
        self.curriculum: dict[str, float | None] = {"limit": float(cfg.sampler.length_curriculum_start), "reward": None}

    # ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Seed, build the twin, model, learner, sampler, metrics and store; restore a checkpoint."""
        cfg = self.cfg
        check_devices(cfg)
        # before the model loads: a refused output folder should cost nothing
        checkpoint = prepare_output_dir(self.output_dir, resume=self.resume, overwrite=self.overwrite)
        if self.resume and checkpoint is None:
            log.warning("--resume: no checkpoint in %s; starting a fresh run", self.output_dir)
        # TRY NOT TO MODIFY: seeding and threads
        seed_everything(cfg.seed)
        if cfg.devices.cpu_threads:
            torch.set_num_threads(cfg.devices.cpu_threads)
        from trainer.models import load_model
        from trainer.renderer import Renderer
        from twin.registry import make_twin

        self.twin = make_twin(cfg.twin.name, **cfg.twin.config)
        self.twin.num_cases(cfg.twin.split)  # fails early on an unknown split
        # model.init_from: the checkpoint's weights (merged) are the model this run trains
        self.model_path = init_model_path(cfg.model.path, cfg.model.init_from, self.output_dir, cfg.model.dtype)
        model, self.tokenizer = load_model(self.model_path, cfg.model.dtype, device=cfg.devices.learner)
        if cfg.lora.enabled:
            model = build_lora_model(
                model,
                lora_rank=cfg.lora.rank,
                lora_alpha=cfg.lora.alpha,
                lora_dropout=cfg.lora.dropout,
                target_modules=cfg.lora.target_modules,
            )
        else:
            for p in model.parameters():
                p.requires_grad_(True)
        self.learner = Learner(
            model,
            algorithm=cfg.algorithm,
            optim=cfg.optim,
            temperature=cfg.sampler.temperature,
            max_tokens=cfg.sampler.max_episode_tokens,
        )
        tokenizer = self.tokenizer
        self.renderer_factory = lambda tools: Renderer(tokenizer, tools, chat_template=cfg.model.chat_template, template_kwargs=cfg.model.template_kwargs)  # fmt: skip
        self.settings = RolloutSettings(
            max_new_tokens=cfg.sampler.max_new_tokens,
            max_episode_tokens=cfg.sampler.max_episode_tokens,
            temperature=cfg.sampler.temperature,
            top_p=cfg.sampler.top_p,
            policy_name=f"{cfg.model.path}",
        )

        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "recipe.yaml").write_text(cfg.to_yaml())
        if checkpoint is not None:
            state = load_checkpoint(checkpoint)
            self.learner.load_state_dict(state["learner"])
            self.step = int(state["step"])
            self.cursor = int(state["cursor"])
            self.run_id = state.get("run_id")
            self.curriculum = dict(state.get("curriculum", self.curriculum))
            restore_rng(state["rng"])
            log.info("resumed from %s (step %d)", checkpoint, self.step)
        self.metrics = MetricsLogger(
            self.output_dir, resume_step=self.step if checkpoint else None, sinks=self.cfg.train.log,
            config=self.cfg.model_dump(mode="json", by_alias=True),
        )
        self.sampler = self._setup_sampler(model, tokenizer)
        if cfg.sampler.kind != "hf":  # a server sampler: no request may ask for more than its context
            from trainer.workers import sampler_context_length

            context = sampler_context_length(self.sampler.base_url)
            self.settings = RolloutSettings(**{**self.settings.__dict__, "context_length": context})
        self._setup_store()

    def _setup_sampler(self, model: Any, tokenizer: Any) -> Any:
        cfg = self.cfg
        from trainer.samplers import HFSampler, ServerSampler

        if cfg.sampler.kind == "hf":
            if cfg.devices.rollout != cfg.devices.learner:
                log.warning(
                    "sampler.kind 'hf' samples with the learner's own model on %s; devices.rollout "
                    "(%s) is used by server samplers only", cfg.devices.learner, cfg.devices.rollout,
                )
            return HFSampler(model, tokenizer)
        if not cfg.lora.enabled:
            raise ConfigError(
                f"sampler.kind {cfg.sampler.kind!r} receives new weights as LoRA adapters; set "
                "lora.enabled: true (or use sampler.kind: hf for full fine-tuning)"
            )
        if cfg.sampler.kind == "vllm":
            import os

            from trainer.models import resolve_model_path
            from trainer.vllm import VLLMServer

            # from_recipe also passes the LoRA target modules (without them vLLM wraps lm_head
            # and crashes on prompt_logprobs beside generating requests: docs/serving.md)
            self.server = VLLMServer.from_recipe(
                cfg,
                model=resolve_model_path(self.model_path),
                python=os.environ.get("TWINRL_VLLM_PYTHON", ".venv-vllm"),
                served_model_name="base",
                log_path=self.output_dir / "vllm.log",
            )
            self.server.start()
            base_url, name = self.server.url, "base"
        else:
            base_url = str(cfg.sampler.base_url)
            import httpx

            try:
                models = httpx.get(base_url.rstrip("/").removesuffix("/v1") + "/v1/models", timeout=30,
                                   verify=tls_context(), headers=auth_headers()).json()
                name = models["data"][0]["id"]
            except Exception as exc:  # noqa: BLE001 - say which server failed and how
                raise ConfigError(f"sampler server {base_url} did not list its models ({exc}); is it running?") from None
        sampler = ServerSampler(base_url, name)
        if self.step > 0:  # resumed: the server must sample with the restored adapter
            self._push_adapter(sampler)
        return sampler

    def _push_adapter(self, sampler: Any) -> float:
        """Save the adapter as ``policy@<version>`` and load it into the sampler server."""
        import httpx

        started = time.perf_counter()
        name = f"policy@{self.learner.version}"
        path = self.learner.save_adapter(self.output_dir / "adapters" / name).resolve()
        root = sampler.base_url.removesuffix("/v1")
        response = httpx.post(
            f"{root}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=120,
            verify=tls_context(), headers=auth_headers(),
        )
        if response.status_code != 200:
            raise ConfigError(
                f"the sampler server refused adapter {name} from {path}: HTTP {response.status_code} "
                f"{response.text[:300]}"
            )
        previous, self._adapter_name = self._adapter_name, name
        sampler.model_name = name
        if previous is not None:
            httpx.post(f"{root}/v1/unload_lora_adapter", json={"lora_name": previous}, timeout=30, verify=tls_context(),
                       headers=auth_headers())
            shutil.rmtree(self.output_dir / "adapters" / previous, ignore_errors=True)
        return time.perf_counter() - started

    def _setup_store(self) -> None:
        self.store, self.run_id = open_training_run(self.cfg, self.twin.name, self.run_id)

    # ------------------------------------------------------------------------------------------
    def _next_cases(self, n: int) -> list[tuple[str, int]]:
        """The next ``n`` training cases: a seeded draw per cursor position."""
        cfg = self.cfg
        cases = draw_cases(self.twin, cfg.twin.split, cfg.seed, self.cursor, n, balance=cfg.twin.balance)
        self.cursor += n
        return cases

    def _shaped_rewards(self, group: Group) -> list[float]:
        """Env reward plus DAPO's soft overlong penalty (on the tokens the policy wrote)."""
        return objective.group_rewards(group, self.cfg).tolist()

    def collect(self, step: int) -> tuple[list[Group], list[Group], dict[str, float]]:
        """Sample this step's groups with dynamic sampling.

        Returns:
            ``(kept, all_groups, stats)``: the groups to train on (at most ``groups_per_step``),
            every group sampled this step, and batch statistics.
        """
        cfg = self.cfg
        n = cfg.algorithm.groups_per_step
        version = self.learner.version
        settings = RolloutSettings(**{
            **self.settings.__dict__,
            "policy_name": f"{cfg.model.path}@{version}",
            "max_new_tokens": self.max_new_tokens(step),
        })
        kept: list[Group] = []
        every: list[Group] = []
        rounds = 0
        while True:
            need = n - len(kept)
            groups = collect_groups(
                self.twin, self._next_cases(need), self.sampler, self.renderer_factory,
                group_size=cfg.algorithm.group_size, settings=settings,
                seed=stable_seed("step", cfg.seed, step, rounds), policy_version=version,
            )
            every.extend(groups)
            for g in groups:
                shaped = self._shaped_rewards(g)
                for t, r in zip(g.trajectories, shaped):
                    t.info["shaped_reward"] = r
                informative = bool(objective.informative(torch.tensor([shaped]))[0])
                if informative or not cfg.algorithm.dynamic_sampling:
                    kept.append(g)
            if len(kept) >= n or not cfg.algorithm.dynamic_sampling or rounds >= cfg.algorithm.max_refill_rounds:
                break
            rounds += 1
        stats = {
            "batch/max_new_tokens": float(settings.max_new_tokens),
            "batch/groups": float(len(kept[:n])),
            "batch/groups_sampled": float(len(every)),
            "batch/refill_rounds": float(rounds),
        }
        return kept[:n], every, stats

    def max_new_tokens(self, step: int) -> int:
        """The per-turn token limit at ``step`` (the length curriculum, when configured)."""
        sampler = self.cfg.sampler
        limit = sampler.max_new_tokens
        if sampler.length_curriculum == "linear" and sampler.max_new_tokens_ramp > 0:
            start = sampler.length_curriculum_start
            return max(1, min(limit, start + (step * (limit - start + 1)) // sampler.max_new_tokens_ramp))
        if sampler.length_curriculum == "plateau":
            return int(min(limit, self.curriculum["limit"] or 1))
        return limit

    def _grow_length(self, kept: list[Group], mean_reward: float) -> None:
        """'plateau' curriculum: one more token when this length is settled (see SamplerConfig)."""
        cur = self.curriculum
        if cur["reward"] is None:  # the level this length starts from
            cur["reward"] = mean_reward
            return
        # 0.01: a settled length must have raised the reward by more than sampling noise
        if self.cfg.sampler.length_curriculum == "plateau" and not kept and mean_reward > cur["reward"] + 0.01:
            cur["limit"] = min((cur["limit"] or 1) + 1, float(self.cfg.sampler.max_new_tokens))
            cur["reward"] = mean_reward

    def make_batch(self, groups: list[Group]) -> TrainBatch:
        """Advantages per group, then one row per episode (see :func:`make_batch`)."""
        return make_batch(groups, self.cfg.algorithm.advantage)

    @staticmethod
    def episode_metrics(groups: list[Group]) -> dict[str, float]:
        """Reward and episode statistics over every episode of ``groups``."""
        trajs = [t for g in groups for t in g.trajectories]
        rewards = [t.reward if t.reward is not None else 0.0 for t in trajs]
        out: dict[str, float] = {
            "rewards/total": statistics.fmean(rewards),
            "rewards/std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "rewards/shaped": statistics.fmean(t.info.get("shaped_reward", 0.0) for t in trajs),
        }
        names = sorted({k for t in trajs for k in t.components})
        for name in names:
            out[f"rewards/{name}"] = statistics.fmean(t.components.get(name, 0.0) for t in trajs)
        out["episodes/count"] = float(len(trajs))
        out["episodes/turns"] = statistics.fmean(t.num_turns for t in trajs)
        out["episodes/completion_tokens"] = statistics.fmean(t.completion_tokens for t in trajs)
        out["episodes/episode_tokens"] = statistics.fmean(t.info.get("episode_tokens", 0) for t in trajs)
        out["episodes/terminated"] = statistics.fmean(float(t.terminated) for t in trajs)
        out["episodes/overlong"] = statistics.fmean(float(t.info.get("overlong", False)) for t in trajs)
        out["episodes/invalid_calls"] = statistics.fmean(t.invalid_calls for t in trajs)
        return out

    # ------------------------------------------------------------------------------------------
    def train(self) -> list[dict[str, Any]]:
        """Run the remaining steps; return the metrics history (earlier steps included)."""
        cfg = self.cfg
        while self.step < cfg.train.steps:
            step = self.step
            t_step = time.perf_counter()

            # ROLLOUT: G episodes per case, dynamic sampling
            t0 = time.perf_counter()
            kept, every, batch_stats = self.collect(step)
            rollout_s = time.perf_counter() - t0
            sampled_tokens = sum(t.completion_tokens for g in every for t in g.trajectories)

            # ALGO LOGIC: advantages and one update (the body the async learner runs too)
            update = learn_from_groups(self.learner, kept, every, advantage=cfg.algorithm.advantage, step=step)
            learn, episodes = update.learn, update.episodes
            sync_s = 0.0
            if kept and (self.server is not None or self.cfg.sampler.kind == "server"):
                sync_s = self._push_adapter(self.sampler)
            self._grow_length(kept, episodes["rewards/total"])

            # TRY NOT TO MODIFY: record
            self.step = step + 1
            step_s = time.perf_counter() - t_step
            record = {
                **episodes,
                **batch_stats,
                **learn,
                "batch/skipped": float(not kept),
                "policy/version": float(self.learner.version),
                "perf/rollout_s": rollout_s,
                "perf/sample_tokens_per_s": sampled_tokens / rollout_s if rollout_s > 0 else 0.0,
                "perf/sync_s": sync_s,
                "perf/step_s": step_s,
                "perf/tokens_per_s": sampled_tokens / step_s if step_s > 0 else 0.0,
                "data/cursor": float(self.cursor),
            }
            record = self.metrics.log(step, record, episodes=[t for g in every for t in g.trajectories])
            if self.store is not None and self.run_id is not None:
                try:
                    self.store.add_episodes(self.run_id, [t for g in every for t in g.trajectories], step=step)
                    self.store.log_metrics(self.run_id, step, {k: v for k, v in record.items() if k != "step"})
                except Exception as exc:  # noqa: BLE001 - keep training; say why episodes are missing
                    log.warning("run store write failed at step %d: %s", step, exc)
            if self.on_step is not None:
                self.on_step(record)
            every_n = cfg.train.checkpoint_every
            if (every_n and self.step % every_n == 0) or self.step == cfg.train.steps:
                self.save()
        return list(self.metrics.history)

    def save(self) -> Path:
        """Write a checkpoint of the current state."""
        return save_checkpoint(
            self.output_dir,
            self.step,
            learner=self.learner,
            state={
                "cursor": self.cursor,
                "run_id": self.run_id,
                "curriculum": dict(self.curriculum),
                "metrics": list(self.metrics.history),
            },
            recipe_yaml=self.cfg.to_yaml(),
        )

    def cleanup(self) -> Path | None:
        """Plot the reward curve, close the store and any server; return the plot's path."""
        plot = None
        try:
            plot = plot_rewards(
                self.metrics.history, self.output_dir / "rewards.png",
                title=f"{self.twin.name}: {self.cfg.model.path}",
            )
        finally:
            self.metrics.close()
            if self.store is not None:
                if self.run_id is not None and self.step >= self.cfg.train.steps:
                    # an unfinished run stays 'running' (resumable), as a killed one does
                    last = self.metrics.history[-1] if self.metrics.history else {}
                    try:
                        self.store.finish_run(self.run_id, metrics=last)
                    except Exception as exc:  # noqa: BLE001
                        log.warning("run store: could not finish run %s: %s", self.run_id, exc)
                self.store.close()
            if self.server is not None:
                self.server.stop()
        return plot

"""The synchronous loop: sample, learn, publish, in one process, with the loop in plain view.

::

    trainer = SyncTrainer(load_recipe("toy-cpu"))
    trainer.setup()
    history = trainer.train()        # one metrics dict per step
    trainer.cleanup()

One step (``train()``)::

    cases   = next N cases of the split (data cursor)
    groups  = collect_groups(twin, cases, sampler, ...)           # G episodes per case
    rewards = env reward + overlong shaping                        # [N, G]
    keep groups whose rewards differ; sample more (bounded)        # dynamic sampling
    A       = advantages(rewards)                                  # grpo | dr_grpo | rloo
    metrics = learner.step(TrainBatch(tokens, masks, sampler logprobs, A))
    publish policy@<version> to the sampler (AdapterSink)
    log metrics; checkpoint every N steps

Set-up, checkpoints, the run store, the curriculum and the update are the runtime's
(:class:`trainer.runtime.TrainingRuntime`), shared with the async loop
(:class:`trainer.async_trainer.AsyncTrainer`); sampling a step is
:func:`trainer.episodes.sample_step`, which the rollout worker runs too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from trainer.config import Recipe
from trainer.episodes import StepSample, rollout_settings, sample_step
from trainer.protocols import PolicyLearner, RunRecord
from trainer.runtime import TrainingRuntime, step_perf
from trainer.samplers import Sampler
from trainer.serving.http import auth_headers
from trainer.weight_sync import (
    AdapterClient,
    AdapterPublisher,
    AdapterSink,
    InProcessAdapters,
    make_sampler_server,
    require_lora_for_server,
)
from trainer.workers import adapter_name, sampler_context_length
from twin.errors import ConfigError
from twin.policies.http import tls_context

__all__ = ["SyncTrainer"]

log = logging.getLogger("twinrl.trainer")


class SyncTrainer(TrainingRuntime):
    """Synchronous GRPO / DAPO / Dr. GRPO training of a policy in a twin (``async.max_staleness:
    0``).

    Args:
        cfg: The validated recipe.
        resume: Continue from the newest checkpoint in ``cfg.train.output_dir``.
        overwrite: Without ``resume``, delete the checkpoints an earlier run left there.
        on_step: Called with each step's metrics record (the CLI's progress display).
        learner: The learner (default: built from the recipe).
        sampler: Samples the episodes (default: ``sampler.kind: hf`` an in-process
            :class:`trainer.samplers.HFSampler` on the learner's model; ``vllm`` a vLLM server
            this run starts; ``server`` the one at ``sampler.base_url``).
        adapters: Where each new version goes (default:
            :class:`trainer.weight_sync.InProcessAdapters` for ``hf``, else an
            :class:`trainer.weight_sync.AdapterClient` of the server).
        store: A run store (default: the recipe's ``train.store``).

    Raises:
        ConfigError: a server sampler without LoRA (new weights reach a server as adapters only).
    """

    def __init__(
        self,
        cfg: Recipe,
        *,
        resume: bool = False,
        overwrite: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        learner: PolicyLearner | None = None,
        sampler: Sampler | None = None,
        adapters: AdapterSink | None = None,
        store: RunRecord | None = None,
    ) -> None:
        if cfg.sampler.kind != "hf" and adapters is None:
            require_lora_for_server(cfg, f"sampler.kind {cfg.sampler.kind!r}")
        super().__init__(cfg, resume=resume, overwrite=overwrite, on_step=on_step, learner=learner,
                         adapters=adapters, store=store)  # fmt: skip
        self.sampler: Any = sampler  # a Sampler once set up

    # -- set-up ----------------------------------------------------------------------------------
    def setup(self) -> None:
        """The runtime's set-up, then the sampler, the rollout settings and the first version
        published."""
        cfg = self.cfg
        self.setup_runtime()
        if self.sampler is None:
            self.sampler = self._default_sampler()
        base_url = getattr(self.sampler, "base_url", None)
        if self.adapters is None:
            self.adapters = InProcessAdapters() if base_url is None else AdapterClient(base_url)
        # a server sampler: no request may ask for more than its context holds
        context = sampler_context_length(base_url) if base_url is not None else None
        self.settings = rollout_settings(cfg, context_length=context)
        self.publisher = AdapterPublisher(self.output_dir, self.adapters, keep=1)
        self.publish()  # the sampler starts on the learner's weights (restored ones after --resume)

    def _default_sampler(self) -> Any:
        from trainer.samplers import HFSampler, ServerSampler

        cfg = self.cfg
        if cfg.sampler.kind == "hf":
            if cfg.devices.rollout != cfg.devices.learner:
                log.warning(
                    "sampler.kind 'hf' samples with the learner's own model on %s; devices.rollout "
                    "(%s) is used by server samplers only",
                    cfg.devices.learner,
                    cfg.devices.rollout,
                )
            # Keys/values kept across an episode's turns and a group's shared prompt (a turn
            # then prefills its new messages only); publish() forgets them when weights change.
            return HFSampler(
                self.learner.model, self.tokenizer, prefix_cache=True, autocast=cfg.model.autocast
            )
        if cfg.sampler.kind == "vllm":
            self.server = make_sampler_server(cfg, self.output_dir, self.model_path, max_loras=2)
            self.server.start()
            base_url = self.server.url
        else:
            base_url = str(cfg.sampler.base_url)
            try:
                httpx.get(
                    base_url.rstrip("/").removesuffix("/v1") + "/v1/models",
                    timeout=30,
                    verify=tls_context(),
                    headers=auth_headers(),
                ).raise_for_status()
            except httpx.HTTPError as exc:
                raise ConfigError(
                    f"sampler server {base_url} did not list its models ({exc}); is it running?"
                ) from None
        return ServerSampler(base_url, adapter_name(0))

    def publish(self) -> float:
        """Send the learner's current version to the sampler; return the seconds it took."""
        assert self.publisher is not None, "publish() before setup()"
        started = time.perf_counter()
        version = self.learner.version
        self.publisher.push(self.learner, version)
        clear = getattr(self.sampler, "clear_cache", None)
        if clear is not None:  # cached keys/values belong to the weights they were computed with
            clear()
        if self.adapters.needs_files:  # a server: ask it for the adapter just loaded
            self.sampler.model_name = adapter_name(version)
        return time.perf_counter() - started

    # -- one step --------------------------------------------------------------------------------
    def collect(self, step: int) -> StepSample:
        """Sample this step's groups with the current version (dynamic
        sampling, bounded refills)."""
        cfg = self.cfg
        version = self.learner.version
        settings = dataclasses.replace(
            self.settings,
            policy_name=f"{cfg.model.path}@{version}",
            max_new_tokens=self.max_new_tokens(step),
        )
        return sample_step(
            cfg, self.twin, self.next_cases, self.sampler, self.renderer_factory, settings,
            seed_key=("step", cfg.seed, step), policy_version=version,
        )  # fmt: skip

    def train(self) -> list[dict[str, Any]]:
        """Run the remaining steps; return the metrics history (earlier steps included)."""
        assert self.metrics is not None, "train() before setup()"
        while self.step < self.cfg.train.steps:
            step = self.step
            t_step = time.perf_counter()

            # ROLLOUT: G episodes per case, dynamic sampling
            t0 = time.perf_counter()
            sample = self.collect(step)
            rollout_s = time.perf_counter() - t0
            every, kept = sample.groups, sample.kept_groups
            sampled_tokens = sum(t.completion_tokens for g in every for t in g.trajectories)

            # ALGO LOGIC: advantages and one update (the body the async learner runs too)
            update = self.learn(kept, every, step)
            sync_s = self.publish() if kept else 0.0

            # TRY NOT TO MODIFY: record
            self.step = step + 1
            step_s = time.perf_counter() - t_step
            record = {
                **update.episodes,
                **sample.stats(),
                **update.learn,
                "batch/skipped": float(not kept),
                "policy/version": float(self.learner.version),
                **step_perf(
                    rollout_s=rollout_s,
                    sampled_tokens=sampled_tokens,
                    sync_s=sync_s,
                    step_s=step_s,
                    cursor=self.cursor,
                ),  # fmt: skip
            }
            self.record_step(step, record, every)
        return list(self.metrics.history)

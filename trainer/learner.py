"""The learner: a causal LM (LoRA or full fine-tuning), AdamW, and one GRPO-family update per batch.

The learning side of the trainer. :meth:`Learner.step` takes a :class:`TrainBatch` (token
sequences with loss masks, the sampler's logprobs and one advantage per sequence) and runs::

    old  = logprobs under the current weights (no grad)     # the proximal policy; mini_batches > 1
    ref  = logprobs with the adapter disabled (no grad)     # only when kl_coef > 0
    for each mini-batch (optim.mini_batches):
        for scored in learner.score(mini-batch):            # micro-batches, shared prompts run once
            loss = objective(scored, settings)              # trainer/objective.py: the equations
            loss.backward()                                 # gradients accumulate
        clip_grad_norm_; optimizer.step() unless the loss or the norm is not finite

With one mini-batch ``old`` is ``logp.detach()`` of the same forward pass (the ratio is 1 and its
gradient is the policy gradient), so no extra forward pass is spent.

How the model is read (token-budget micro-batches, prompts shared by a group's rows run once,
gradient checkpointing) is :class:`trainer.scoring.BatchScorer`'s business: ``learner.scorer``.

The KL reference is the same model with the LoRA adapter disabled
(``with model.disable_adapter():``): no second copy. fp32 on CPU, bf16 on GPU (``model.dtype``
decides).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer import algorithms as algo
from trainer.config import AlgorithmConfig, OptimConfig
from trainer.objective import LossSettings, ScoredBatch, objective
from trainer.scoring import BatchScorer, TrainBatch, pad_to
from twin.errors import ConfigError

__all__ = ["Learner", "TrainBatch", "build_lora_model", "trainable_parameters"]

log = logging.getLogger("twinrl.trainer")


def build_lora_model(
    model: torch.nn.Module,
    *,
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
) -> torch.nn.Module:
    """Wrap a causal LM in a peft LoRA adapter (only the adapter is trainable).

    ``W x + (alpha / r) * B A x`` on every target module, ``B`` initialised to zero (so the
    wrapped model starts equal to the base model).

    Args:
        model: A transformers causal LM.
        lora_rank: Rank ``r`` of ``A`` and ``B``.
        lora_alpha: Scale numerator (``alpha / r`` scales the update; usually ``alpha = 2 r``).
        lora_dropout: Dropout on the adapter's input.
        target_modules: Names of the linear layers that get an adapter.

    Returns:
        The peft model (adapter named ``"default"``).

    Raises:
        ConfigError: no module of the model matches ``target_modules``.
    """
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in target_modules if t not in names]
    if len(missing) == len(list(target_modules)):
        linear = sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, mod in model.named_modules()
                if isinstance(mod, torch.nn.Linear)
            }
        )
        raise ConfigError(
            f"lora.target_modules {list(target_modules)} match no module of "
            f"{type(model).__name__}; "
            f"its linear layers are named: {', '.join(linear)}"
        )
    config = LoraConfig(
        r=lora_rank,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=list(target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters with ``requires_grad`` (the adapter, or every weight for full fine-tuning)."""
    return [p for p in model.parameters() if p.requires_grad]


class Learner:
    """Holds the trainable model and its optimizer; runs updates.

    Args:
        model: A causal LM, already wrapped by :func:`build_lora_model` for LoRA training.
        algorithm: The objective's settings (clip range, KL, TIS, aggregation).
        optim: AdamW settings, token budget per micro-batch, mini-batches per step.
        temperature: The sampler's temperature (logprobs are of ``logits / temperature``).
        max_tokens: The constant ``L`` of the Dr. GRPO normaliser (the episode token budget).
        shared_prefix: Run each prompt shared by several rows (a GRPO group's) once per
            micro-batch and let the rows attend to its KV cache (same loss and gradients).
        autocast: ``model.autocast``: forward passes under ``torch.autocast`` to this dtype.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        algorithm: AlgorithmConfig,
        optim: OptimConfig,
        temperature: float = 1.0,
        max_tokens: int = 1024,
        shared_prefix: bool = True,
        autocast: str | None = None,
    ) -> None:
        self.model = model
        self.algorithm = algorithm
        #: What the objective reads, built once from ``algorithm`` (trainer/objective.py).
        self.loss_settings = LossSettings.of(algorithm)
        self.optim_config = optim
        self.max_tokens = int(max_tokens)
        #: How the model is read: micro-batches, shared prompts, checkpointing (trainer/scoring.py).
        self.scorer = BatchScorer(
            model, temperature=temperature, micro_batch_tokens=optim.micro_batch_tokens,
            shared_prefix=shared_prefix, gradient_checkpointing=optim.gradient_checkpointing,
            logit_chunk=optim.logit_chunk_tokens, autocast=autocast,
        )  # fmt: skip
        self.is_peft = self.scorer.is_peft
        if algorithm.kl_coef > 0 and not self.is_peft:
            raise ConfigError(
                "kl_coef > 0 needs a LoRA model: the KL reference is the base model with the "
                "adapter disabled (set lora.enabled: true, or kl_coef: 0)"
            )
        self.params = trainable_parameters(model)
        if not self.params:
            raise ConfigError("Learner: the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(
            self.params, lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas)
        )
        self.version = 0  # optimizer steps taken (the policy version)
        #: Updates dropped because their loss or gradient norm was not finite (whole run).
        self.skipped_updates = 0

    @property
    def device(self) -> torch.device:
        """Device of the model."""
        return self.scorer.device

    @property
    def temperature(self) -> float:
        """The temperature of the logprobs the learner computes (the sampler's)."""
        return self.scorer.temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.scorer.temperature = float(value)

    def logprobs(self, batch: TrainBatch, *, reference: bool = False) -> list[list[float]]:
        """Each sequence's token logprobs now, no grad
        (:meth:`trainer.scoring.BatchScorer.logprobs`)."""
        return self.scorer.logprobs(batch, reference=reference)

    # -- the update ----------------------------------------------------------------------------
    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One update on ``batch`` (``optim.mini_batches`` optimizer steps).

        Per mini-batch: score each micro-batch with grad (:meth:`score`), take its share of
        the objective (:func:`trainer.objective.objective`), backpropagate, then one guarded
        optimizer step (:meth:`apply_gradients`).

        Returns:
            Metrics: ``losses/loss``, ``losses/kl``, ``losses/clipfrac`` (and ``_low``/``_high``),
            ``losses/ratio_mean``, ``policy/entropy``, ``policy/grad_norm``,
            ``policy/tis_weight``, ``policy/tis_capped_frac`` (truncated or masked tokens),
            ``policy/logprob_mismatch`` (mean ``|learner - sampler|`` logprob on sampled tokens,
            before the update), ``policy/sampler_kl`` (mean k3 KL(sampler || learner) on the same
            tokens, :func:`trainer.algorithms.sampler_kl`),
            ``perf/learner_tokens_per_s``, ``perf/learner_s``, ``optim/skipped_nonfinite``
            (optimizer steps of this call dropped because their loss or gradient norm was NaN or
            infinite: the weights and AdamW state stay as they were) and
            ``optim/skipped_nonfinite_total`` (the same over the learner's life).
        """
        started = time.perf_counter()
        self._check_fits(batch)
        settings, n = self.loss_settings, len(batch)
        mini = max(1, min(self.optim_config.mini_batches, n))
        # pi_old and pi_ref are scored before any update (pi_old = this pass's own with one
        # mini-batch)
        old = self.scorer.frozen_logprobs(batch, reference=False) if mini > 1 else None
        ref = self.scorer.frozen_logprobs(batch, reference=True) if settings.kl_coef > 0 else None
        aggregate = algo.aggregation(self.algorithm.loss_aggregation, max_tokens=self.max_tokens)
        meter = _Meter()
        self.model.train()
        for chunk in (list(range(k, n, mini)) for k in range(mini)):
            counts = {
                "num_seqs": len(chunk),
                "num_tokens": sum(sum(batch.loss_mask[i]) for i in chunk),
            }
            self.optimizer.zero_grad(set_to_none=True)
            chunk_loss = 0.0
            for scored in self.score(batch, chunk, old=old, ref=ref):
                loss, stats = objective(scored, settings, aggregate=aggregate, **counts)
                loss.backward()  # gradients accumulate over the micro-batches
                chunk_loss += float(loss.detach())
                meter.add(stats)
            meter.update(chunk_loss, *self.apply_gradients(chunk_loss))
        self.model.eval()
        elapsed = time.perf_counter() - started
        metrics = meter.metrics()
        metrics["optim/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["optim/skipped_nonfinite"] = float(meter.skipped)
        metrics["optim/skipped_nonfinite_total"] = float(self.skipped_updates)
        total_tokens = sum(len(ids) for ids in batch.input_ids)
        metrics["perf/learner_tokens_per_s"] = total_tokens / elapsed if elapsed > 0 else 0.0
        metrics["perf/learner_s"] = elapsed
        return metrics

    def score(
        self,
        batch: TrainBatch,
        rows: Sequence[int],
        *,
        old: dict[int, torch.Tensor] | None = None,
        ref: dict[int, torch.Tensor] | None = None,
    ) -> Iterator[ScoredBatch]:
        """The rows' logprobs under the current weights, with grad, one micro-batch at a time.

        Micro-batches hold at most ``optim.micro_batch_tokens``
        (:meth:`trainer.scoring.BatchScorer.plan`); a prompt that several rows share runs once per
        micro-batch (``shared_prefix``). Each micro-batch's graph is freed once the caller has
        backpropagated its loss and asks for the next.

        Args:
            batch: The episodes.
            rows: Which of them.
            old: Per row, logprobs before the update (from
                :meth:`trainer.scoring.BatchScorer.frozen_logprobs`).
            ref: Per row, reference logprobs (adapter disabled).

        Yields:
            :class:`trainer.objective.ScoredBatch` micro-batches; the entropy carries grad only
            when ``algorithm.entropy_coef > 0`` (it is logged either way).
        """
        bonus = self.loss_settings.entropy_coef > 0
        scorer = self.scorer
        for mrows, units in scorer.plan(rows, batch):
            mb = scorer.pad(mrows, batch, units)
            logp, ent = scorer.forward(mb, entropy=True, entropy_grad=bonus)  # [B, T-1]

            yield ScoredBatch(
                logprobs=logp, mask=mb["mask"], advantages=mb["advantages"],
                sampler_logprobs=mb["sampler_logprobs"], old_logprobs=_stacked(old, mrows, logp),
                ref_logprobs=_stacked(ref, mrows, logp), entropy=ent, weights=mb.get("weights"),
                rows=list(mrows),
            )  # fmt: skip

    def _check_fits(self, batch: TrainBatch) -> None:
        if len(batch) == 0:
            raise ValueError("Learner.step: empty batch")
        budget = self.optim_config.micro_batch_tokens
        longest = max(len(ids) for ids in batch.input_ids)
        if longest > budget:
            raise ConfigError(
                f"Learner.step: an episode of {longest} tokens exceeds optim.micro_batch_tokens "
                f"({budget}); an episode is never split across micro-batches: raise "
                "micro_batch_tokens "
                "(optim.gradient_checkpointing: true makes room) or lower "
                "sampler.max_episode_tokens"
            )

    def apply_gradients(self, loss: float) -> tuple[float, bool]:
        """Clip and apply the gradients accumulated by ``backward()``; ``(gradient norm, applied)``.

        The one guarded optimizer step of every objective (GRPO's, SFT's): the learning rate is a
        function of :attr:`version`, and the update is not applied when ``loss`` or the norm is
        not finite (the weights and AdamW state stay; :attr:`skipped_updates` counts it). The
        version advances either way.
        """
        if self.optim_config.grad_clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.optim_config.grad_clip))
        else:
            grads = [p.grad.detach().norm() for p in self.params if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0
        lr = self.optim_config.lr_at(self.version)  # a function of the version: resumes exactly
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        applied = math.isfinite(loss) and math.isfinite(norm)
        if applied:
            self.optimizer.step()
        else:
            # One NaN/inf (a bad advantage, an overflowing logit) would poison every weight
            # and AdamW moment for good: drop the update, keep the weights, count it.
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            log.warning(
                "learner: update %d skipped: loss %s, gradient norm %s (not finite); %d skipped so "
                "far",
                self.version,
                loss,
                norm,
                self.skipped_updates,
            )
        # The version advances either way: every update attempt names a new policy version
        # (the sync protocol expects that); a skipped one has the previous weights.
        self.version += 1
        return norm, applied

    # -- saving --------------------------------------------------------------------------------
    def save_adapter(self, path: str | Path) -> Path:
        """Save the trainable weights: a peft adapter folder (LoRA; loadable by vLLM's
        ``/v1/load_lora_adapter``) or, for full fine-tuning, a whole Hugging Face model folder."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        return path

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable tensors by name (the adapter for LoRA), on CPU."""
        return {
            n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad
        }

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load tensors saved by :meth:`trainable_state_dict`.

        Raises:
            ConfigError: names differ (a checkpoint from another model or LoRA setting).
        """
        params = dict(self.model.named_parameters())
        expected = {n for n, p in params.items() if p.requires_grad}
        if set(state) != expected:
            extra = sorted(set(state) - expected)[:3]
            missing = sorted(expected - set(state))[:3]
            raise ConfigError(
                f"checkpoint weights do not match the model (unexpected: {extra}, missing: "
                f"{missing}); resume with the recipe the checkpoint was made with"
            )
        with torch.no_grad():
            for n, t in state.items():
                params[n].copy_(t.to(params[n].device, params[n].dtype))

    def state_dict(self) -> dict[str, Any]:
        """Weights, optimizer state and version, for checkpoints."""
        return {
            "weights": self.trainable_state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "skipped_updates": self.skipped_updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.load_trainable_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.skipped_updates = int(state.get("skipped_updates", 0))


#: ``LossStats`` field -> metric name; each a token-weighted mean over the step's micro-batches.
_STAT_METRICS = {
    "kl": "losses/kl",
    "clip_frac": "losses/clipfrac",
    "clip_frac_low": "losses/clipfrac_low",
    "clip_frac_high": "losses/clipfrac_high",
    "ratio_mean": "losses/ratio_mean",
    "tis_mean": "policy/tis_weight",
    "tis_capped_frac": "policy/tis_capped_frac",
    "logprob_mismatch": "policy/logprob_mismatch",
    "sampler_kl": "policy/sampler_kl",
}


def _stacked(
    per_row: dict[int, torch.Tensor] | None, rows: Sequence[int], like: torch.Tensor
) -> torch.Tensor | None:
    """The rows' frozen logprobs padded to ``like``'s length and stacked (None: none given)."""
    if per_row is None:
        return None
    return torch.stack([pad_to(per_row[i], like.shape[1]) for i in rows])


class _Meter:
    """The step's metrics: stats weighted by their micro-batch's loss tokens, one loss and
    gradient norm per optimizer step."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.skipped = 0

    def _add(self, name: str, value: float, weight: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + value * weight
        self.weights[name] = self.weights.get(name, 0.0) + weight

    def add(self, stats: algo.LossStats) -> None:
        tokens = float(stats.num_tokens)
        for field_name, metric in _STAT_METRICS.items():
            self._add(metric, float(getattr(stats, field_name)), tokens)
        if tokens > 0:
            self._add("policy/entropy", float(stats.entropy), tokens)

    def update(self, loss: float, norm: float, applied: bool) -> None:
        self.losses.append(loss)
        self.norms.append(norm)
        self.skipped += not applied

    def metrics(self) -> dict[str, float]:
        out = {k: self.totals[k] / self.weights[k] if self.weights[k] else 0.0 for k in self.totals}
        out["losses/loss"] = sum(self.losses) / len(self.losses)
        out["policy/grad_norm"] = sum(self.norms) / len(self.norms)
        return out

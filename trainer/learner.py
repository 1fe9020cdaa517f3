"""The learner: a causal LM (LoRA or full fine-tuning), AdamW, and one GRPO-family update per batch.

The learning side of the trainer. :meth:`Learner.step` takes a :class:`TrainBatch` (token
sequences with loss masks, the sampler's logprobs and one advantage per sequence) and runs::

    old  = logprobs under the current weights (no grad)     # the proximal policy; mini_batches > 1
    ref  = logprobs with the adapter disabled (no grad)     # only when kl_coef > 0
    for each mini-batch (optim.mini_batches):
        for scored in learner.score(mini-batch):            # micro-batches, shared prompts run once
            loss = objective(scored, algorithm)             # trainer/objective.py: the equations
            loss.backward()                                 # gradients accumulate
        clip_grad_norm_; optimizer.step() unless the loss or the norm is not finite

With one mini-batch ``old`` is ``logp.detach()`` of the same forward pass (the ratio is 1 and its
gradient is the policy gradient), so no extra forward pass is spent.

Shared prefixes: the episodes of a GRPO group share their prompt (system prompt, tool schemas,
task) up to their first sampled token. With ``shared_prefix`` (the default) each distinct prompt
goes through the decoder once per micro-batch, its KV cache is expanded to the rows that share it,
and the rows' remaining tokens attend to it; gradients flow back through the cache into the prompt's
forward pass, so loss and gradients are those of the padded per-row pass (to float rounding),
at a fraction of the tokens when prompts are long and completions short.

The KL reference is the same model with the LoRA adapter disabled
(``with model.disable_adapter():``): no second copy. fp32 on CPU, bf16 on GPU (``model.dtype``
decides).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer import algorithms as algo
from trainer.config import AlgorithmConfig, OptimConfig
from trainer.objective import Scored, objective
from twin.errors import ConfigError

__all__ = ["Learner", "TrainBatch", "build_lora_model", "trainable_parameters"]

log = logging.getLogger("twinrl.trainer")

#: Rows that share a loss-free prefix: ``(prefix length, rows)`` per unit.
_Units = list[tuple[int, list[int]]]


@dataclass
class TrainBatch:
    """Episodes ready for an update.

    Attributes:
        input_ids: One token sequence per episode.  # N x [T_i]
        loss_mask: 1 on sampled tokens.  # N x [T_i]
        sampler_logprobs: The sampler's logprob of each sampled token, 0.0 elsewhere.  # N x [T_i]
        advantages: One advantage per sequence.  # [N]
    """

    input_ids: list[list[int]]
    loss_mask: list[list[int]]
    sampler_logprobs: list[list[float]]
    advantages: list[float]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if not (len(self.loss_mask) == len(self.sampler_logprobs) == len(self.advantages) == n):
            raise ValueError(
                f"TrainBatch: {n} sequences but {len(self.loss_mask)} masks, "
                f"{len(self.sampler_logprobs)} logprob rows and {len(self.advantages)} advantages"
            )
        for i, (ids, m, lp) in enumerate(zip(self.input_ids, self.loss_mask, self.sampler_logprobs)):
            if not len(ids) == len(m) == len(lp):
                raise ValueError(
                    f"TrainBatch row {i}: {len(ids)} ids, {len(m)} mask values, {len(lp)} logprobs"
                )
            if m and m[0]:
                raise ValueError(f"TrainBatch row {i}: the first token cannot carry loss (nothing predicts it)")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that carry loss."""
        return sum(sum(m) for m in self.loss_mask)


def build_lora_model(
    model: Any,
    *,
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
) -> Any:
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
        linear = sorted({n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)})
        raise ConfigError(
            f"lora.target_modules {list(target_modules)} match no module of {type(model).__name__}; "
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


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """Parameters with ``requires_grad`` (the adapter, or every weight for full fine-tuning)."""
    return [p for p in model.parameters() if p.requires_grad]


def _is_peft(model: Any) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


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
    """

    def __init__(
        self,
        model: Any,
        *,
        algorithm: AlgorithmConfig,
        optim: OptimConfig,
        temperature: float = 1.0,
        max_tokens: int = 1024,
        shared_prefix: bool = True,
    ) -> None:
        self.model = model
        self.shared_prefix = bool(shared_prefix)
        self.algorithm = algorithm
        self.optim_config = optim
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.is_peft = _is_peft(model)
        self.gradient_checkpointing = bool(optim.gradient_checkpointing)
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
        self._split: tuple[Any, Any] | tuple[()] | None = None
        self._kappa: float | None = None

    @property
    def device(self) -> torch.device:
        """Device of the model."""
        return next(self.model.parameters()).device

    # -- batching ------------------------------------------------------------------------------
    def _micro_batches(self, rows: Sequence[int], batch: TrainBatch) -> Iterator[list[int]]:
        """Pack rows (longest first) so that rows x longest row <= micro_batch_tokens."""
        budget = self.optim_config.micro_batch_tokens
        order = sorted(rows, key=lambda i: (-len(batch.input_ids[i]), i))
        current: list[int] = []
        width = 0
        for i in order:
            length = len(batch.input_ids[i])
            new_width = max(width, length)
            if current and new_width * (len(current) + 1) > budget:
                yield current
                current, new_width = [], length
            current.append(i)
            width = new_width
        if current:
            yield current

    def _plan(self, rows: Sequence[int], batch: TrainBatch) -> Iterator[tuple[list[int], _Units | None]]:
        """Micro-batches as ``(rows, units)``; ``units`` is None for the padded per-row pass.

        A unit is ``(L, rows)``: rows whose first ``L`` tokens are equal and carry no loss, with
        ``L`` one short of the first loss token (the position that predicts it must be in the
        suffix). Rows of a micro-batch are listed unit by unit. A micro-batch costs
        ``units x longest prefix + rows x (longest suffix + kappa x longest prefix)`` tokens,
        within the budget, where ``kappa`` (:func:`trainer.plan.shared_prompt_weight`) is what a
        row's copy of a prompt token's keys and values costs in tokens' activations.
        """
        units = self._units(rows, batch) if self.shared_prefix and self._parts() is not None else None
        if units is None:
            for mrows in self._micro_batches(rows, batch):
                yield mrows, None
            return
        budget = self.optim_config.micro_batch_tokens
        kappa = self._shared_prompt_weight()
        current: list[tuple[int, list[int]]] = []
        prefix_w = suffix_w = count = 0
        for length, urows in units:
            opened = False  # this unit has an entry in ``current``
            for i in urows:
                suffix = len(batch.input_ids[i]) - length
                new_pw, new_sw = max(prefix_w, length), max(suffix_w, suffix)
                n_units = len(current) + (0 if opened else 1)
                # every row also holds the prompt's keys/values, expanded to it: kappa tokens each
                if current and n_units * new_pw + (count + 1) * (new_sw + kappa * new_pw) > budget:
                    yield [r for _, rs in current for r in rs], current
                    current, count, opened = [], 0, False
                    new_pw, new_sw = length, suffix
                if not opened:
                    current.append((length, []))
                    opened = True
                current[-1][1].append(i)
                prefix_w, suffix_w, count = new_pw, new_sw, count + 1
        if current:
            yield [r for _, rs in current for r in rs], current

    def _shared_prompt_weight(self) -> float:
        """Budget tokens charged per row and shared-prompt token (0 when the shapes are unknown)."""
        if self._kappa is None:
            from trainer.plan import dims_from_hf_config, shared_prompt_weight

            base = self.model.get_base_model() if self.is_peft else self.model
            try:
                dims = dims_from_hf_config(base.config)
            except (ConfigError, AttributeError, TypeError, ValueError):
                self._kappa = 0.0
                return self._kappa
            targets, rank = None, 8
            if self.is_peft:
                cfg = self.model.peft_config.get("default")
                targets, rank = sorted(getattr(cfg, "target_modules", None) or []), int(getattr(cfg, "r", 8))
            b = next(base.parameters()).element_size()
            self._kappa = shared_prompt_weight(
                dims, b, lora_targets=targets, lora_rank=rank, checkpointing=self.gradient_checkpointing
            )
        return self._kappa

    @staticmethod
    def _units(rows: Sequence[int], batch: TrainBatch) -> list[tuple[int, list[int]]] | None:
        """Rows grouped by their shared loss-free prefix; None when sharing saves nothing."""
        by_key: dict[tuple[int, ...], list[int]] = {}
        for i in rows:
            mask = batch.loss_mask[i]
            first = mask.index(1) if 1 in mask else len(mask)
            length = first - 1  # the token before the first loss token predicts it: suffix
            if length < 1:
                return None  # an empty prefix would be a fully masked attention row
            by_key.setdefault(tuple(batch.input_ids[i][:length]), []).append(i)
        if all(len(v) == 1 for v in by_key.values()):
            return None
        units = [(len(k), sorted(v, key=lambda i: (-len(batch.input_ids[i]), i))) for k, v in by_key.items()]
        units.sort(key=lambda u: (-(u[0] + max(len(batch.input_ids[i]) - u[0] for i in u[1])), u[1][0]))
        return units

    def _pad(
        self, rows: list[int], batch: TrainBatch, units: list[tuple[int, list[int]]] | None = None
    ) -> dict[str, torch.Tensor]:
        width = max(len(batch.input_ids[i]) for i in rows)
        n = len(rows)
        ids = torch.zeros((n, width), dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.float32)
        slp = torch.zeros((n, width), dtype=torch.float32)
        for r, i in enumerate(rows):
            length = len(batch.input_ids[i])
            ids[r, :length] = torch.tensor(batch.input_ids[i], dtype=torch.long)
            attn[r, :length] = 1
            mask[r, :length] = torch.tensor(batch.loss_mask[i], dtype=torch.float32)
            slp[r, :length] = torch.tensor(batch.sampler_logprobs[i], dtype=torch.float32)
        adv = torch.tensor([batch.advantages[i] for i in rows], dtype=torch.float32)
        dev = self.device
        # Shift: position t predicts token t+1; drop the first token's (empty) target.
        out = {
            "input_ids": ids.to(dev),
            "attention_mask": attn.to(dev),
            "mask": mask[:, 1:].to(dev),  # [B, T-1]
            "sampler_logprobs": slp[:, 1:].to(dev),  # [B, T-1]
            "advantages": adv.to(dev),  # [B]
        }
        if units is not None:
            out.update({k: v.to(dev) for k, v in self._split_prefix(rows, batch, units).items()})
        return out

    @staticmethod
    def _split_prefix(rows: list[int], batch: TrainBatch, units: _Units) -> dict[str, torch.Tensor]:
        """Right-padded prefixes (one per unit) and suffixes (one per row) of a micro-batch."""
        pw = max(length for length, _ in units)
        lengths = [length for length, urows in units for _ in urows]  # per row, in ``rows`` order
        sw = max(len(batch.input_ids[i]) - length for i, length in zip(rows, lengths))
        pre_ids = torch.zeros((len(units), pw), dtype=torch.long)
        pre_attn = torch.zeros((len(units), pw), dtype=torch.long)
        for u, (length, urows) in enumerate(units):
            pre_ids[u, :length] = torch.tensor(batch.input_ids[urows[0]][:length], dtype=torch.long)
            pre_attn[u, :length] = 1
        suf_ids = torch.zeros((len(rows), sw), dtype=torch.long)
        suf_attn = torch.zeros((len(rows), sw), dtype=torch.long)
        for r, (i, length) in enumerate(zip(rows, lengths)):
            tail = batch.input_ids[i][length:]
            suf_ids[r, : len(tail)] = torch.tensor(tail, dtype=torch.long)
            suf_attn[r, : len(tail)] = 1
        unit_of_row = torch.tensor([u for u, (_, urows) in enumerate(units) for _ in urows], dtype=torch.long)
        return {
            "prefix_ids": pre_ids,  # [U, P]
            "prefix_attention_mask": pre_attn,  # [U, P]
            "prefix_len": torch.tensor(lengths, dtype=torch.long),  # [B]
            "unit_of_row": unit_of_row,  # [B]
            "suffix_ids": suf_ids,  # [B, S]
            "suffix_attention_mask": suf_attn,  # [B, S]
        }

    def _shared_hidden(self, decoder: Any, mb: dict[str, torch.Tensor], select: torch.Tensor) -> torch.Tensor:
        """Hidden states at the ``select``-ed positions, each prompt run once.  # [M, H]

        The prefix pass's KV cache is indexed out to the rows (a differentiable gather, so the
        prompt's forward pass receives the gradients of every row attending to it); the suffix
        pass continues at each row's own positions, with the prefix padding masked out.
        """
        pre = decoder(
            input_ids=mb["prefix_ids"], attention_mask=mb["prefix_attention_mask"], use_cache=True
        )
        cache = getattr(pre, "cache", None) or pre.past_key_values
        cache.batch_select_indices(mb["unit_of_row"])
        prefix_len = mb["prefix_len"]  # [B]
        width = mb["suffix_ids"].shape[1]
        positions = prefix_len[:, None] + torch.arange(width, device=prefix_len.device)[None]  # [B, S]
        attn = torch.cat([mb["prefix_attention_mask"][mb["unit_of_row"]], mb["suffix_attention_mask"]], dim=1)
        cache_kw = "cache" if "cache" in self._decoder_params(decoder) else "past_key_values"
        hidden = decoder(
            input_ids=mb["suffix_ids"], attention_mask=attn, position_ids=positions, use_cache=True,
            **{cache_kw: cache},
        ).last_hidden_state  # [B, S, H]
        # suffix column s of row b is full-layout position prefix_len[b] + s; nothing before the
        # prefix's end is selected (the prefix ends before the first loss token's predictor)
        last = select.shape[1] - 1
        sel = select.gather(1, positions.clamp(max=last)) & (positions <= last)
        return hidden[sel]

    @staticmethod
    def _decoder_params(decoder: Any) -> set[str]:
        import inspect

        return set(inspect.signature(decoder.forward).parameters)

    def _parts(self) -> tuple[Any, Any] | None:
        """``(decoder, lm_head)`` when logits can be computed on selected positions only."""
        if self._split is None:
            base = self.model.get_base_model() if self.is_peft else self.model
            cfg = getattr(base, "config", None)
            special = any(getattr(cfg, k, None) for k in ("final_logit_softcapping", "logit_scale"))
            try:
                decoder, head = base.get_decoder(), base.get_output_embeddings()
            except (AttributeError, NotImplementedError):
                decoder = head = None
            ok = decoder is not None and isinstance(head, torch.nn.Linear) and not special
            self._split = (decoder, head) if ok else ()
        return self._split or None

    def _forward(
        self,
        mb: dict[str, torch.Tensor],
        *,
        entropy: bool = False,
        every_position: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs of ``logits / T`` for each next token, 0 where not computed.  # [B, T-1]

        Only positions with loss (``mb["mask"]``) go through the output layer unless
        ``every_position``: on a multi-turn episode most tokens are prompt and tool results,
        and the vocabulary projection is the largest matmul of a small model.
        """
        ckpt = self.gradient_checkpointing and torch.is_grad_enabled()
        with _checkpointed_layers(self.model) if ckpt else contextlib.nullcontext():
            return self._forward_body(mb, entropy=entropy, every_position=every_position, entropy_grad=entropy_grad)

    def _forward_body(
        self, mb: dict[str, torch.Tensor], *, entropy: bool, every_position: bool, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        targets = mb["input_ids"][:, 1:]  # [B, T-1]
        select = torch.ones_like(mb["mask"], dtype=torch.bool) if every_position else mb["mask"] > 0
        parts = self._parts()
        if parts is not None and "prefix_ids" in mb and not every_position:
            decoder, head = parts
            logits = head(self._shared_hidden(decoder, mb, select))  # [M, V]
        elif parts is None:
            out = self.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False)
            logits = out.logits[:, :-1][select]  # [M, V]
        else:
            decoder, head = parts
            hidden = decoder(
                input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False
            ).last_hidden_state  # [B, T, H]
            logits = head(hidden[:, :-1][select])  # [M, V]
        logits = logits.float() / self.temperature
        logp_sel = algo.token_logprobs(logits, targets[select])  # [M]
        logp = torch.zeros(select.shape, dtype=logp_sel.dtype, device=logp_sel.device)
        logp = logp.masked_scatter(select, logp_sel)
        ent = None
        if entropy:
            # With grad only when the entropy bonus needs it (it is logged either way).
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent_sel = algo.entropy_from_logits(logits)
                ent = torch.zeros(select.shape, dtype=ent_sel.dtype, device=ent_sel.device)
                ent = ent.masked_scatter(select, ent_sel)
        return logp, ent

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, *, reference: bool = False) -> list[list[float]]:
        """Each sequence's token logprobs under the current weights (or the base model).

        Args:
            batch: The sequences.
            reference: Use the base model (LoRA adapter disabled).

        Returns:
            One list per sequence, aligned with ``input_ids`` (the first entry is 0.0).
        """
        out: list[list[float]] = [[] for _ in range(len(batch))]
        for rows, logp in self._no_grad_logprobs(
            batch, list(range(len(batch))), reference=reference, every_position=True
        ):
            for r, i in enumerate(rows):
                length = len(batch.input_ids[i])
                out[i] = [0.0] + logp[r, : length - 1].tolist()
        return out

    def _no_grad_logprobs(
        self, batch: TrainBatch, rows: list[int], *, reference: bool, every_position: bool = False
    ) -> Iterator[tuple[list[int], torch.Tensor]]:
        ctx = self.model.disable_adapter() if reference and self.is_peft else contextlib.nullcontext()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), ctx:
                if every_position:  # every position's logits: the prefix cannot be skipped
                    plan: Iterator[tuple[list[int], Any]] = ((m, None) for m in self._micro_batches(rows, batch))
                else:
                    plan = self._plan(rows, batch)
                for mrows, units in plan:
                    logp, _ = self._forward(self._pad(mrows, batch, units), every_position=every_position)
                    yield mrows, logp
        finally:
            self.model.train(was_training)

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
        cfg, n = self.algorithm, len(batch)
        mini = max(1, min(self.optim_config.mini_batches, n))
        # pi_old and pi_ref are scored before any update (pi_old = this pass's own with one mini-batch)
        old = self._frozen_logprobs(batch, reference=False) if mini > 1 else None
        ref = self._frozen_logprobs(batch, reference=True) if cfg.kl_coef > 0 else None
        aggregate = algo.aggregation(cfg.loss_aggregation, max_tokens=self.max_tokens)
        meter = _Meter()
        self.model.train()
        for chunk in (list(range(k, n, mini)) for k in range(mini)):
            counts = {"num_seqs": len(chunk), "num_tokens": sum(sum(batch.loss_mask[i]) for i in chunk)}
            self.optimizer.zero_grad(set_to_none=True)
            chunk_loss = 0.0
            for scored in self.score(batch, chunk, old=old, ref=ref):
                loss, stats = objective(scored, cfg, aggregate=aggregate, **counts)
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
    ) -> Iterator[Scored]:
        """The rows' logprobs under the current weights, with grad, one micro-batch at a time.

        Micro-batches hold at most ``optim.micro_batch_tokens`` (:meth:`_plan`); a prompt that
        several rows share runs once per micro-batch (``shared_prefix``). Each micro-batch's
        graph is freed once the caller has backpropagated its loss and asks for the next.

        Args:
            batch: The episodes.
            rows: Which of them.
            old: Per row, logprobs before the update (from :meth:`_frozen_logprobs`).
            ref: Per row, reference logprobs (adapter disabled).

        Yields:
            :class:`trainer.objective.Scored` micro-batches; the entropy carries grad only
            when ``algorithm.entropy_coef > 0`` (it is logged either way).
        """
        bonus = self.algorithm.entropy_coef > 0
        for mrows, units in self._plan(rows, batch):
            mb = self._pad(mrows, batch, units)
            logp, ent = self._forward(mb, entropy=True, entropy_grad=bonus)  # [B, T-1]

            def stacked(per_row: dict[int, torch.Tensor] | None) -> torch.Tensor | None:
                if per_row is None:
                    return None
                return torch.stack([_pad_to(per_row[i], logp.shape[1]) for i in mrows])

            yield Scored(
                logprobs=logp, mask=mb["mask"], advantages=mb["advantages"],
                sampler_logprobs=mb["sampler_logprobs"], old_logprobs=stacked(old),
                ref_logprobs=stacked(ref), entropy=ent,
            )  # fmt: skip

    def _check_fits(self, batch: TrainBatch) -> None:
        if len(batch) == 0:
            raise ValueError("Learner.step: empty batch")
        budget = self.optim_config.micro_batch_tokens
        longest = max(len(ids) for ids in batch.input_ids)
        if longest > budget:
            raise ConfigError(
                f"Learner.step: an episode of {longest} tokens exceeds optim.micro_batch_tokens "
                f"({budget}); an episode is never split across micro-batches: raise micro_batch_tokens "
                "(optim.gradient_checkpointing: true makes room) or lower sampler.max_episode_tokens"
            )

    def _frozen_logprobs(self, batch: TrainBatch, *, reference: bool) -> dict[int, torch.Tensor]:
        """Every row's logprobs without grad (``reference``: with the adapter disabled)."""
        out: dict[int, torch.Tensor] = {}
        for mrows, logp in self._no_grad_logprobs(batch, list(range(len(batch))), reference=reference):
            for r, i in enumerate(mrows):
                out[i] = logp[r, : len(batch.input_ids[i]) - 1].clone()
        return out

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
                "learner: update %d skipped: loss %s, gradient norm %s (not finite); %d skipped so far",
                self.version, loss, norm, self.skipped_updates,
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
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters() if p.requires_grad}

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
                f"checkpoint weights do not match the model (unexpected: {extra}, missing: {missing}); "
                "resume with the recipe the checkpoint was made with"
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


def _decoder_layers(model: Any) -> list[torch.nn.Module]:
    base = model.get_base_model() if _is_peft(model) else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ConfigError(
            f"optim.gradient_checkpointing: {type(base).__name__} has no decoder.layers to checkpoint; "
            "set gradient_checkpointing: false"
        )
    return list(layers)


@contextlib.contextmanager
def _checkpointed_layers(model: Any) -> Iterator[None]:
    """Run every decoder layer under non-reentrant activation checkpointing while inside.

    Only each layer's inputs are kept for backward; the layer is recomputed there. Not
    transformers' own switch: it turns the KV cache off, and the shared-prompt path needs the
    prompt's cache. A layer writes its keys and values into that cache, so before a recompute
    the cache is put back as it was when the layer first ran (else the replay would append them
    a second time and see other shapes).
    """
    from torch.utils.checkpoint import checkpoint

    from trainer.saved_tensors import note_kept

    layers = _decoder_layers(model)
    for index, layer in enumerate(layers):
        original = layer.forward

        def forward(*args: Any, _original: Any = original, _index: int = index, **kwargs: Any) -> Any:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            saved = _cache_state(cache, _index)
            calls = [0]

            note_kept(*args, *(v for v in kwargs.values() if isinstance(v, torch.Tensor)))
            if saved is not None and saved[1] is not None:
                note_kept(*(t for t in saved[1].values() if isinstance(t, torch.Tensor)))

            def run(*inner: Any) -> Any:
                if calls[0]:
                    _restore_cache(cache, saved)
                calls[0] += 1
                return _original(*inner, **kwargs)

            return checkpoint(run, *args, use_reentrant=False)

        layer.forward = forward  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _cache_state(cache: Any, index: int) -> tuple[int, dict[str, Any] | None] | None:
    """Layer ``index``'s cache entry as it is now (None: no cache; ``(index, None)``: no entry yet)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    return index, (dict(layers[index].__dict__) if index < len(layers) else None)


def _restore_cache(cache: Any, state: tuple[int, dict[str, Any] | None] | None) -> None:
    if state is None:
        return
    index, saved = state
    if saved is None:
        del cache.layers[index:]  # appended by the first run; the replay appends it again
        return
    layer = cache.layers[index]
    layer.__dict__.clear()
    layer.__dict__.update(saved)


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    if t.shape[0] >= width:
        return t[:width]
    return torch.cat([t, t.new_zeros(width - t.shape[0])])

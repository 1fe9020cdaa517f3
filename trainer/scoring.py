# Just over 500 lines: the scorer and the pure micro-batch planning it runs are one unit, tested
# together (tests/trainer/test_learner_shared.py).
"""Token logprobs of a batch of episodes under a causal LM, in token-budget micro-batches.

:class:`BatchScorer` is how the learner reads its model: :meth:`BatchScorer.plan` packs rows into
micro-batches of at most ``micro_batch_tokens`` (longest first), :meth:`BatchScorer.pad` lays a
micro-batch out as tensors, and :meth:`BatchScorer.forward` returns each next token's logprob of
``logits / temperature`` (and the entropy when asked). The objective
(:mod:`trainer.objective`) never sees any of that: it takes the scored micro-batches.

Shared prefixes: the episodes of a GRPO group share their prompt (system prompt, tool schemas,
task) up to their first sampled token. With ``shared_prefix`` (the default) each distinct prompt
goes through the decoder once per micro-batch, its KV cache is expanded to the rows that share it,
and the rows' remaining tokens attend to it; gradients flow back through the cache into the prompt's
forward pass, so loss and gradients are those of the padded per-row pass (to float rounding),
at a fraction of the tokens when prompts are long and completions short.

Gradient checkpointing (``optim.gradient_checkpointing``) wraps the decoder layers while a
forward pass with grad runs (:func:`checkpointed_layers`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.logits import DEFAULT_CHUNK, chunked_logprobs
from trainer.models import cache_keyword, resolve_autocast, warn_emulated_bf16
from twin.errors import ConfigError

__all__ = [
    "BatchScorer",
    "TrainBatch",
    "autocast_context",
    "checkpointed_layers",
    "decoder_layers",
    "is_peft",
    "pad_to",
    "padded_micro_batches",
    "plan_micro_batches",
    "shared_units",
]

#: Rows that share a loss-free prefix: ``(prefix length, rows)`` per unit.
_SharedPrefixUnits = list[tuple[int, list[int]]]


@dataclass
class TrainBatch:
    """Episodes ready for an update.

    Attributes:
        input_ids: One token sequence per episode.  # N x [T_i]
        loss_mask: 1 on sampled tokens.  # N x [T_i]
        sampler_logprobs: The sampler's logprob of each sampled token, 0.0 elsewhere.  # N x [T_i]
        advantages: One advantage per sequence.  # [N]
        token_weights: Optional per-token loss weights, read where the mask is 1 (SFT's
            ``data.emphasis``); None: every loss token weighs 1.  # N x [T_i]
    """

    input_ids: list[list[int]]
    loss_mask: list[list[int]]
    sampler_logprobs: list[list[float]]
    advantages: list[float]
    meta: dict[str, Any] = field(default_factory=dict)
    token_weights: list[list[float]] | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        if not (len(self.loss_mask) == len(self.sampler_logprobs) == len(self.advantages) == n):
            raise ValueError(
                f"TrainBatch: {n} sequences but {len(self.loss_mask)} masks, "
                f"{len(self.sampler_logprobs)} logprob rows and {len(self.advantages)} advantages"
            )
        for i, (ids, m, lp) in enumerate(
            zip(self.input_ids, self.loss_mask, self.sampler_logprobs)
        ):
            if not len(ids) == len(m) == len(lp):
                raise ValueError(
                    f"TrainBatch row {i}: {len(ids)} ids, {len(m)} mask values, {len(lp)} logprobs"
                )
            if m and m[0]:
                raise ValueError(
                    f"TrainBatch row {i}: the first token cannot carry loss (nothing predicts it)"
                )
            if self.token_weights is not None and len(self.token_weights[i]) != len(ids):
                raise ValueError(
                    f"TrainBatch row {i}: {len(ids)} ids but {len(self.token_weights[i])} weights"
                )
        if self.token_weights is not None and len(self.token_weights) != n:
            raise ValueError(f"TrainBatch: {n} sequences but {len(self.token_weights)} weight rows")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that carry loss."""
        return sum(sum(m) for m in self.loss_mask)


class BatchScorer:
    """Scores a :class:`TrainBatch` under ``model``: micro-batching, shared prompts, checkpointing.

    Args:
        model: A causal LM (peft-wrapped for LoRA).
        temperature: Logprobs are of ``logits / temperature`` (the sampler's temperature).
        micro_batch_tokens: Token budget of one micro-batch (rows x longest row, or the shared
            layout's cost when prompts are shared).
        shared_prefix: Run each prompt that several rows share once per micro-batch.
        gradient_checkpointing: Recompute decoder layers in backward instead of keeping their
            activations (forward passes with grad only).
        logit_chunk: Positions whose vocabulary logits exist at once
            (:func:`trainer.logits.chunked_logprobs`).
        autocast: Run forward passes under ``torch.autocast`` to this dtype (``"bfloat16"``;
            ``"auto"``: :func:`trainer.models.resolve_autocast` on the model's device); the
            weights, their gradients and the log-softmax stay in the weights' dtype / fp32.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        temperature: float = 1.0,
        micro_batch_tokens: int = 8192,
        shared_prefix: bool = True,
        gradient_checkpointing: bool = False,
        logit_chunk: int = DEFAULT_CHUNK,
        autocast: str | None = None,
    ) -> None:
        self.model = model
        self.logit_chunk = int(logit_chunk)
        self.autocast = resolve_autocast(autocast, next(model.parameters()).device)
        self.temperature = float(temperature)
        self.micro_batch_tokens = int(micro_batch_tokens)
        self.shared_prefix = bool(shared_prefix)
        self.gradient_checkpointing = bool(gradient_checkpointing)
        self.is_peft = is_peft(model)
        self._split: tuple[Any, Any] | tuple[()] | None = None
        self._kappa: float | None = None

    @property
    def device(self) -> torch.device:
        """Device of the model."""
        return next(self.model.parameters()).device

    # -- micro-batches -----------------------------------------------------------------------------
    def micro_batches(self, rows: Sequence[int], batch: TrainBatch) -> Iterator[list[int]]:
        """Pack rows (longest first) so that rows x longest row <= micro_batch_tokens."""
        return padded_micro_batches(rows, batch, self.micro_batch_tokens)

    def plan(
        self, rows: Sequence[int], batch: TrainBatch
    ) -> Iterator[tuple[list[int], _SharedPrefixUnits | None]]:
        """Micro-batches as ``(rows, units)`` (:func:`plan_micro_batches`): prompts are shared
        when ``shared_prefix`` is on and the model's decoder and output layer can run apart."""
        share = self.shared_prefix and self._parts() is not None
        weight = self.shared_prompt_weight() if share else 0.0
        return plan_micro_batches(
            rows, batch, self.micro_batch_tokens, share=share, prompt_weight=weight
        )

    def shared_prompt_weight(self) -> float:
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
                targets, rank = (
                    sorted(getattr(cfg, "target_modules", None) or []),
                    int(getattr(cfg, "r", 8)),
                )
            b = next(base.parameters()).element_size()
            self._kappa = shared_prompt_weight(
                dims,
                b,
                lora_targets=targets,
                lora_rank=rank,
                checkpointing=self.gradient_checkpointing,
            )
        return self._kappa

    def pad(
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
        if batch.token_weights is not None:
            weights = torch.zeros((n, width), dtype=torch.float32)
            for r, i in enumerate(rows):
                weights[r, : len(batch.token_weights[i])] = torch.tensor(batch.token_weights[i])
            out["weights"] = weights[:, 1:].to(dev)  # [B, T-1]
        if units is not None:
            out.update({k: v.to(dev) for k, v in self._split_prefix(rows, batch, units).items()})
        return out

    @staticmethod
    def _split_prefix(
        rows: list[int], batch: TrainBatch, units: _SharedPrefixUnits
    ) -> dict[str, torch.Tensor]:
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
        unit_of_row = torch.tensor(
            [u for u, (_, urows) in enumerate(units) for _ in urows], dtype=torch.long
        )
        return {
            "prefix_ids": pre_ids,  # [U, P]
            "prefix_attention_mask": pre_attn,  # [U, P]
            "prefix_len": torch.tensor(lengths, dtype=torch.long),  # [B]
            "unit_of_row": unit_of_row,  # [B]
            "suffix_ids": suf_ids,  # [B, S]
            "suffix_attention_mask": suf_attn,  # [B, S]
        }

    def _shared_hidden(
        self, decoder: Any, mb: dict[str, torch.Tensor], select: torch.Tensor
    ) -> torch.Tensor:
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
        positions = (
            prefix_len[:, None] + torch.arange(width, device=prefix_len.device)[None]
        )  # [B, S]
        attn = torch.cat(
            [mb["prefix_attention_mask"][mb["unit_of_row"]], mb["suffix_attention_mask"]], dim=1
        )
        hidden = decoder(
            input_ids=mb["suffix_ids"],
            attention_mask=attn,
            position_ids=positions,
            use_cache=True,
            **{cache_keyword(decoder): cache},
        ).last_hidden_state  # [B, S, H]
        # suffix column s of row b is full-layout position prefix_len[b] + s; nothing before the
        # prefix's end is selected (the prefix ends before the first loss token's predictor)
        last = select.shape[1] - 1
        sel = select.gather(1, positions.clamp(max=last)) & (positions <= last)
        return hidden[sel]

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

    def forward(
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
        with (
            checkpointed_layers(self.model) if ckpt else contextlib.nullcontext(),
            autocast_context(self.autocast, self.device),
        ):
            return self._forward_body(
                mb, entropy=entropy, every_position=every_position, entropy_grad=entropy_grad
            )

    def _forward_body(
        self,
        mb: dict[str, torch.Tensor],
        *,
        entropy: bool,
        every_position: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        targets = mb["input_ids"][:, 1:]  # [B, T-1]
        select = torch.ones_like(mb["mask"], dtype=torch.bool) if every_position else mb["mask"] > 0
        parts = self._parts()
        if parts is not None and "prefix_ids" in mb and not every_position:
            decoder, head = parts
            hidden = self._shared_hidden(decoder, mb, select)  # [M, H]
        elif parts is None:
            # no separate output layer: the model's own logits, then the same chunked log-softmax
            out = self.model(
                input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False
            )
            hidden, head = out.logits[:, :-1][select], _identity  # [M, V]
        else:
            decoder, head = parts
            hidden = decoder(
                input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False
            ).last_hidden_state[:, :-1][select]  # [M, H]
        # the M x V logits exist one chunk of positions at a time (trainer/logits.py)
        logp_sel, ent_sel = chunked_logprobs(
            hidden, head, targets[select], temperature=self.temperature, chunk=self.logit_chunk,
            entropy=entropy, entropy_grad=entropy_grad,
        )  # fmt: skip
        logp = torch.zeros(select.shape, dtype=logp_sel.dtype, device=logp_sel.device)
        logp = logp.masked_scatter(select, logp_sel)
        ent = None
        if ent_sel is not None:
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
        for rows, logp in self.no_grad_logprobs(
            batch, list(range(len(batch))), reference=reference, every_position=True
        ):
            for r, i in enumerate(rows):
                length = len(batch.input_ids[i])
                out[i] = [0.0] + logp[r, : length - 1].tolist()
        return out

    def no_grad_logprobs(
        self, batch: TrainBatch, rows: list[int], *, reference: bool, every_position: bool = False
    ) -> Iterator[tuple[list[int], torch.Tensor]]:
        ctx = (
            self.model.disable_adapter() if reference and self.is_peft else contextlib.nullcontext()
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), ctx:
                if every_position:  # every position's logits: the prefix cannot be skipped
                    plan: Iterator[tuple[list[int], Any]] = (
                        (m, None) for m in self.micro_batches(rows, batch)
                    )
                else:
                    plan = self.plan(rows, batch)
                for mrows, units in plan:
                    logp, _ = self.forward(
                        self.pad(mrows, batch, units), every_position=every_position
                    )
                    yield mrows, logp
        finally:
            self.model.train(was_training)

    def frozen_logprobs(self, batch: TrainBatch, *, reference: bool) -> dict[int, torch.Tensor]:
        """Every row's logprobs without grad (``reference``: with the adapter disabled)."""
        out: dict[int, torch.Tensor] = {}
        for mrows, logp in self.no_grad_logprobs(
            batch, list(range(len(batch))), reference=reference
        ):
            for r, i in enumerate(mrows):
                out[i] = logp[r, : len(batch.input_ids[i]) - 1].clone()
        return out


def padded_micro_batches(
    rows: Sequence[int], batch: TrainBatch, budget: int
) -> Iterator[list[int]]:
    """Pack rows (longest first) so that rows x longest row <= ``budget`` (a
    longer row goes alone)."""
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


def plan_micro_batches(
    rows: Sequence[int],
    batch: TrainBatch,
    budget: int,
    *,
    share: bool = True,
    prompt_weight: float = 0.0,
) -> Iterator[tuple[list[int], _SharedPrefixUnits | None]]:
    """Micro-batches as ``(rows, units)``; ``units`` is None for the padded per-row pass.

    A unit is ``(L, rows)``: rows whose first ``L`` tokens are equal and carry no loss, with
    ``L`` one short of the first loss token (the position that predicts it must be in the
    suffix). Rows of a micro-batch are listed unit by unit. A micro-batch costs
    ``units x longest prefix + rows x (longest suffix + kappa x longest prefix)`` tokens,
    within ``budget``, where ``kappa`` = ``prompt_weight``
    (:func:`trainer.plan.shared_prompt_weight`) is what a row's copy of a prompt token's keys and
    values costs in tokens' activations. Without ``share``, or when no prompt is shared, this is
    :func:`padded_micro_batches`.
    """
    units = shared_units(rows, batch) if share else None
    if units is None:
        for mrows in padded_micro_batches(rows, batch, budget):
            yield mrows, None
        return
    kappa = prompt_weight
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


def shared_units(rows: Sequence[int], batch: TrainBatch) -> _SharedPrefixUnits | None:
    """Rows grouped by their shared loss-free prefix; when no two rows share a whole one, every
    row over their longest common prefix (:func:`_common_prefix_unit`); None when sharing saves
    nothing."""
    by_key: dict[tuple[int, ...], list[int]] = {}
    for i in rows:
        mask = batch.loss_mask[i]
        first = mask.index(1) if 1 in mask else len(mask)
        length = first - 1  # the token before the first loss token predicts it: suffix
        if length < 1:
            return None  # an empty prefix would be a fully masked attention row
        by_key.setdefault(tuple(batch.input_ids[i][:length]), []).append(i)
    if all(len(v) == 1 for v in by_key.values()):
        return _common_prefix_unit(rows, batch)
    units = [
        (len(k), sorted(v, key=lambda i: (-len(batch.input_ids[i]), i))) for k, v in by_key.items()
    ]
    units.sort(key=lambda u: (-(u[0] + max(len(batch.input_ids[i]) - u[0] for i in u[1])), u[1][0]))
    return units


#: Shortest common prefix worth a shared pass when rows share no whole prompt (an SFT batch's
#: system prompt and tool schemas are hundreds of tokens).
MIN_COMMON_PREFIX = 16


def _common_prefix_unit(rows: Sequence[int], batch: TrainBatch) -> _SharedPrefixUnits | None:
    """One unit of every row over their longest common loss-free prefix: rows of different cases
    (an SFT batch) still share the system prompt and the tool schemas, run once per micro-batch."""
    if len(rows) < 2:
        return None
    first = rows[0]
    limit = min(
        (batch.loss_mask[i].index(1) if 1 in batch.loss_mask[i] else len(batch.loss_mask[i])) - 1
        for i in rows
    )  # fmt: skip
    ref = batch.input_ids[first]
    length = 0
    while length < limit and all(batch.input_ids[i][length] == ref[length] for i in rows):
        length += 1
    if length < MIN_COMMON_PREFIX:
        return None
    return [(length, sorted(rows, key=lambda i: (-len(batch.input_ids[i]), i)))]


def is_peft(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a peft model (it has an adapter to disable)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = model.get_base_model() if is_peft(model) else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ConfigError(
            f"optim.gradient_checkpointing: {type(base).__name__} has no decoder.layers to "
            "checkpoint; set gradient_checkpointing: false"
        )
    return list(layers)


@contextlib.contextmanager
def checkpointed_layers(model: torch.nn.Module) -> Iterator[None]:
    """Run every decoder layer under non-reentrant activation checkpointing while inside.

    Only each layer's inputs are kept for backward; the layer is recomputed there. Not
    transformers' own switch: it turns the KV cache off, and the shared-prompt path needs the
    prompt's cache. A layer writes its keys and values into that cache, so before a recompute
    the cache is put back as it was when the layer first ran (else the replay would append them
    a second time and see other shapes).
    """
    from torch.utils.checkpoint import checkpoint

    from trainer.saved_tensors import note_kept

    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        original = layer.forward

        def forward(
            *args: Any, _original: Any = original, _index: int = index, **kwargs: Any
        ) -> Any:
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
    """Layer ``index``'s cache entry as it is now (None: no cache; ``(index,
    None)``: no entry yet)."""
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


def autocast_context(
    dtype: str | None, device: torch.device | str
) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` to ``dtype`` on ``device`` (``None``: a no-op context).

    Raises:
        ConfigError: a dtype autocast does not support on that device type.
    """
    dtype = resolve_autocast(dtype, device)
    if not dtype:
        return contextlib.nullcontext()
    kind = torch.device(device).type
    if dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"model.autocast {dtype!r}: expected bfloat16, float16, auto or null")
    if kind == "cpu" and dtype == "float16":
        raise ConfigError("model.autocast float16 is GPU only; on CPU use bfloat16")
    if kind == "cpu":
        warn_emulated_bf16()
    return torch.autocast(device_type=kind, dtype=getattr(torch, dtype))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` cut or zero-padded to ``width`` entries."""
    if t.shape[0] >= width:
        return t[:width]
    return torch.cat([t, t.new_zeros(width - t.shape[0])])

"""Batched decoding: the one decode path of ``twin serve``, ``HFSampler`` and ``hf:`` policies.

A :class:`Row` is one sequence to sample: its prompt, length limit, temperature, top-p, stop ids
and random generator. :meth:`Engine.decode` puts the rows in one batch over preallocated KV
buffers (``trainer/serving/kvcache.py``): it prefills the batch's common prefix once, each
distinct prompt once (a GRPO group repeats its prompt G times) and, with a prefix store, only
the part of a prompt not seen in an earlier call (the next turn of an episode); suffixes of very
different lengths are prefilled in passes of similar lengths rather than padded to the longest
(:func:`~trainer.serving.kvcache.prefill_ragged`). Then it samples
every row to its stop. Each row draws one uniform per token from its own generator
(inverse-CDF sampling), so a seeded row gives the same tokens whatever else shares its batch.

Users: :class:`trainer.serving.completions.CompletionServer` (the sampler server),
:class:`trainer.samplers.HFSampler` (in-process sampling for the trainer) and, through it,
:class:`trainer.hf_policy.HFPolicy` (``hf:`` policies).

Logprobs are ``processed_logprobs`` by default (after temperature and top-p: the distribution
that was sampled from) or ``raw_logprobs`` (before them, vLLM's default); a greedy row
(temperature 0) reports raw logprobs either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer.models import cache_keyword
from trainer.serving.api import LogprobsMode
from trainer.serving.kvcache import (
    PASS_TOKENS,
    CacheBatch,
    PrefixStore,
    build_batch,
    prefill_common_prefix,
    prefill_ragged,
)

__all__ = ["Engine", "PrefixStore", "Row", "top_p_filter"]

#: vLLM's floor for a logprob: -inf (a token top-p removed) is not JSON.
LOGPROB_FLOOR = -9999.0


@dataclass(eq=False)
class Row:
    """One sequence to sample, and what was sampled.

    Attributes:
        prompt: Token ids to continue (non-empty).
        max_tokens: Most tokens to sample (0: none, finish ``length``).
        temperature: 0 = greedy.
        top_p: Nucleus threshold in (0, 1].
        generator: The row's random stream (CPU); None: the engine's shared one.
        stop_ids: Ids that end the row (kept as its last id).
        logprobs: Alternatives to record per sampled token (None or 0: none).
        prompt_logprobs: With a value, the logprob, rank and that many alternatives of each prompt
            token after the first (``prompt_lps``).
        ids: Sampled ids.
        token_logprobs: Logprob of each sampled id.
        top: Per sampled token, ``(id, logprob)`` alternatives (with ``logprobs``).
        finish_reason: ``stop`` or ``length`` once done.
        stop_token: The stop id that ended the row.
        prompt_lps: Per prompt position after the first, ``(logprob, rank, alternatives)``.
    """

    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    stop_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_token: int | None = None
    prompt_lps: list[tuple[float, int, list[tuple[int, float]]]] | None = None


class Engine:
    """Decodes batches of :class:`Row` on one model (whatever adapter is active on it).

    Args:
        model: A transformers causal LM, or a peft model around one.
        pad_id: Id written into padding positions (never attended to).
        logprobs_mode: ``processed_logprobs`` or ``raw_logprobs``.
        seed: Seed of the generator rows without their own use.
        cascade: Attend a batch's stored common prefix once for all rows (cascade attention,
            ``trainer/serving/cascade.py``) rather than once per row, where the model's attention
            allows it (:func:`~trainer.serving.cascade.supports_cascade`). None: on CPU only,
            where it was measured (``docs/benchmarks.md``); a GPU keeps its SDPA kernels.
        ragged: Prefill rows whose new suffixes differ in length in passes of similar lengths
            (:func:`~trainer.serving.kvcache.prefill_ragged`) instead of padding every row to
            the longest. It holds a second copy of the batch's keys/values while it assembles
            the batch. None: on CPU only, where it was measured.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_id: int,
        logprobs_mode: LogprobsMode = "processed_logprobs",
        seed: int = 0,
        cascade: bool | None = None,
        ragged: bool | None = None,
    ) -> None:
        from trainer.serving.cascade import supports_cascade

        self.model = model
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.cascade = (on_cpu if cascade is None else cascade) and supports_cascade(model)
        self.ragged = on_cpu if ragged is None else ragged
        self.pass_tokens = PASS_TOKENS  # ragged prefill's charge for one more pass
        self.pad_id = int(pad_id)
        self.logprobs_mode = logprobs_mode
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._cache_kw = cache_keyword(model)

    @property
    def device(self) -> torch.device:
        """Device of the model's parameters."""
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def decode(
        self, rows: list[Row], *, store: PrefixStore | None = None, share_prefill: bool = True
    ) -> None:
        """Sample every row to its stop (filling in its outputs).

        Args:
            rows: The rows; each is sampled on its own generator, so its tokens do not depend on
                the others (up to float round-off of batched matrix products).
            store: Keys/values kept across calls (:class:`~trainer.serving.kvcache.PrefixStore`):
                prompts continue their longest stored prefix and finished rows are stored. Only
                valid while the weights stay the same. None: nothing is kept after the call.
            share_prefill: Prefill each distinct prompt once (a GRPO group repeats its prompt)
                and the batch's common prefix once, and suffixes of different lengths in
                passes (``ragged``). False: one padded batch of every row, the plain path.
        """
        if not rows:
            return
        for row in rows:
            if not row.prompt:
                raise ValueError("every prompt needs at least one token")
            row.ids, row.token_logprobs, row.top = [], [], []
            row.finish_reason = "length" if row.max_tokens <= 0 else None
        work = store if store is not None else PrefixStore()  # scratch: the common prefix only
        batch, logits = self._prefill(rows, work, share_prefill=share_prefill)
        order = list(range(len(rows)))  # batch position -> row
        while True:
            live = [b for b, i in enumerate(order) if rows[i].finish_reason is None]
            if not live:
                break
            tokens = self._sample_step([rows[order[b]] for b in live], logits[live])
            feed = [self.pad_id] * len(order)
            for b, token in zip(live, tokens, strict=True):
                row = rows[order[b]]
                feed[b] = token
                if token in row.stop_ids:
                    row.finish_reason, row.stop_token = "stop", token
                elif len(row.ids) >= row.max_tokens:
                    row.finish_reason = "length"
                if row.finish_reason is not None and store is not None:
                    store.add(batch.take_row(b, row.ids))
            alive = [rows[i].finish_reason is None for i in order]
            if not any(alive):
                break
            if sum(alive) <= 3 * len(order) // 4:  # worth the copy: a quarter of the rows are done
                keep = [b for b, a in enumerate(alive) if a]
                batch.keep(keep)
                order, feed, alive = (
                    [order[b] for b in keep],
                    [feed[b] for b in keep],
                    [True] * len(keep),
                )
            column = batch.length
            positions = []
            for slot, a in zip(batch.slots, alive, strict=True):
                positions.append([slot.position])
                if a:
                    slot.columns.append(column)
                    slot.position += 1
            device = batch.device
            logits = batch.forward(
                torch.tensor([[t] for t in feed], dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device),
                torch.tensor([[a] for a in alive], dtype=torch.bool, device=device),
            )

    def _prefill(
        self, rows: list[Row], work: PrefixStore, *, share_prefill: bool
    ) -> tuple[CacheBatch, torch.Tensor]:
        """Prefill the rows' prompts (each distinct one once, and the common prefix once, when
        ``share_prefill`` and no row asks for prompt logprobs); the batch and its next-token
        logits, one row per row."""
        # prompt logprobs need every prompt position's logits
        full = any(row.prompt_logprobs is not None for row in rows)
        prompts = [row.prompt for row in rows]
        if share_prefill and not full and len(rows) > 1:
            prefill_common_prefix(self.model, work, prompts, self._cache_kw)
        index: dict[tuple[int, ...], int] = {}
        if share_prefill and not full:
            unit = [index.setdefault(tuple(p), len(index)) for p in prompts]
            distinct = [list(p) for p in index]
        else:
            unit, distinct = list(range(len(rows))), prompts
        limits = [0 if full else len(p) - 1 for p in distinct]
        room = max(row.max_tokens for row in rows)
        cascade = self.cascade and not full and len(rows) > 1
        staged = None
        if self.ragged and share_prefill and not full and len(distinct) > 1:
            staged = prefill_ragged(
                self.model, work, distinct, self._cache_kw,
                cascade=self.cascade, pass_tokens=self.pass_tokens,
            )  # fmt: skip
        if staged is None:
            batch, ids, pos, new = build_batch(
                self.model, work, distinct, limits, room, self._cache_kw, cascade=cascade
            )
            logits = batch.forward(ids, pos, new, all_logits=full)
        else:  # every prompt is in the staged store whole: nothing is left to feed
            source, logits = staged
            whole = [len(p) for p in distinct]
            batch, *_ = build_batch(
                self.model, source, distinct, whole, room, self._cache_kw, cascade=cascade
            )
        if full:
            width = ids.shape[1]
            for b, row in enumerate(rows):
                if row.prompt_logprobs is not None:
                    scores = logits[b, width - len(row.prompt) :]
                    row.prompt_lps = _prompt_logprobs(scores, row.prompt, row.prompt_logprobs)
            logits = logits[:, -1]
        if len(distinct) < len(rows):
            batch.expand(unit)
            logits = logits[torch.tensor(unit, device=logits.device)]
        return batch, logits

    def _sample_step(self, rows: list[Row], logits: torch.Tensor) -> list[int]:
        """Sample one token for each row (batched), append it and its logprob to the row."""
        logits = logits.cpu()
        raw = torch.log_softmax(logits, dim=-1)
        temps = torch.tensor([r.temperature or 1.0 for r in rows]).unsqueeze(1)
        scaled = logits / temps
        top_p = torch.tensor([r.top_p for r in rows]).unsqueeze(1)
        if bool((top_p < 1.0).any()):
            scaled = torch.where(top_p < 1.0, top_p_filter(scaled, top_p), scaled)
        processed = torch.log_softmax(scaled, dim=-1)
        # Inverse-CDF sampling with one uniform per row from the row's own generator: a seeded
        # request draws the same numbers whatever else shares its batch.
        cdf = processed.exp().cumsum(dim=-1)
        u = torch.stack([torch.rand((), generator=r.generator or self.generator) for r in rows])
        sampled = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        sampled = sampled.clamp(max=logits.shape[-1] - 1)
        greedy = torch.tensor([r.temperature == 0.0 for r in rows])
        tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
        processed = torch.where(greedy.unsqueeze(1), raw, processed)
        table = raw if self.logprobs_mode == "raw_logprobs" else processed
        table = table.clamp(min=LOGPROB_FLOOR)
        chosen = table.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        token_list = tokens.tolist()
        for j, row in enumerate(rows):
            token = token_list[j]
            row.ids.append(token)
            row.token_logprobs.append(chosen[j])
            if row.logprobs:
                values, indices = torch.topk(table[j], min(row.logprobs, table.shape[-1]))
                top = list(zip(indices.tolist(), values.tolist(), strict=True))
                if token not in {t for t, _ in top}:
                    top.insert(0, (token, chosen[j]))
                row.top.append(top)
        return token_list


#: Per prompt position: the token's logprob, its rank, the top alternatives ``(id, logprob)``.
PromptLogprobs = list[tuple[float, int, list[tuple[int, float]]]]


def _prompt_logprobs(logits: torch.Tensor, prompt: list[int], k: int) -> PromptLogprobs:
    """Per prompt token after the first: its logprob, its rank and the ``k`` most likely tokens."""
    lps = torch.log_softmax(logits[:-1], dim=-1)
    out = []
    for pos, token in enumerate(prompt[1:]):
        row = lps[pos]
        value = float(row[token])
        rank = int((row > row[token]).sum()) + 1
        top: list[tuple[int, float]] = []
        if k > 0:
            values, indices = torch.topk(row, k)
            top = list(zip(indices.tolist(), values.tolist(), strict=True))
        out.append((value, rank, top))
    return out


def top_p_filter(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches ``top_p`` (at least one).

    Works on the last dimension; ``top_p`` may be a tensor that broadcasts against ``[..., 1]``.
    """
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches top_p
    drop[..., 0] = False  # the top token always stays (a top_p that rounds to 0 would drop all)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)

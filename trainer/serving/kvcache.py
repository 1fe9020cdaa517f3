"""Prefix KV caching for the decoding engine (``trainer/serving/engine.py``).

An agent episode is one growing token sequence (:mod:`trainer.renderer`): turn ``t+1``'s prompt
is turn ``t``'s prompt, its sample and the new messages. Re-running the model over the whole
conversation every turn makes CPU evaluation of a 1.4k-token catalog prompt take minutes per
turn, so with a :class:`PrefixStore` the engine keeps the keys and values of what it has already
seen and runs the model only over tokens it has not:

- **Across turns**: when a row finishes, its keys/values (prompt + sample, all but the last
  sampled token, which was never fed) are stored under its token ids; the next prompt that
  starts with those ids prefills only its new suffix.
- **Across episodes**: the prompts of one batch usually share a long prefix (the system prompt
  with the tool schemas); it is prefilled once and every row starts from it (also without a
  store: the engine then uses a scratch one for the call).

A batch mixes rows with cached prefixes of different lengths. Each row's cache is copied
right-aligned into one preallocated buffer per layer (``[batch, kv_heads, capacity, head_dim]``,
written in place as tokens arrive: no per-step concatenation), new tokens are left-padded after
it, and the model gets explicit position ids (RoPE positions of each row's own sequence) and an
explicit 4-D mask (causal in buffer order, padding columns masked; boolean for SDPA, additive
for eager attention; a padding query sees its own column, so no row is all masked). Rows that finish
leave the batch when enough have finished to be worth the copy (:meth:`CacheBatch.keep`); rows
that repeat a prompt are prefilled once and copied out (:meth:`CacheBatch.expand`). With
``build_batch(cascade=True)`` the stored prefix every row starts with is not copied into the
buffers at all: it is held once and attended once for all rows (``trainer/serving/cascade.py``),
and the buffers hold what follows it.

Rows are left-padded to the longest uncached suffix of their batch, and a padding query costs what
a real one does (its products, and its attention over the whole context). In a late turn the new
suffixes differ a lot (a 559-token search result beside a 65-token seller record), so
:func:`prefill_ragged` prefills such a batch in passes of rows of similar length
(:func:`plan_buckets`), each row's whole prompt then sits in the cache and decoding starts from
the logits those passes gave.

The outputs are the model's own: logprobs equal a teacher-forced forward pass up to float
round-off (tested against an uncached forward pass).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = [
    "CacheBatch",
    "KVEntry",
    "PrefixStore",
    "build_batch",
    "common_prefix",
    "plan_buckets",
    "prefill_ragged",
]

#: A shared batch prefix is prefilled on its own only when it adds at least this many tokens.
MIN_SHARED = 32

#: What one more forward pass costs, counted in fed tokens, when a ragged batch is split into
#: passes (the layers' fixed per-call work; ``bench/ragged_prefill.py`` measures the trade).
PASS_TOKENS = 32


@dataclass
class KVEntry:
    """Keys and values of a token sequence, one ``[kv_heads, len, head_dim]`` pair per layer.

    Attributes:
        ids: The tokens whose keys/values are stored.
        keys: Per layer keys.
        values: Per layer values.
        shared: A batch's common prefix (kept when a row's entry extends it).
    """

    ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    shared: bool = False

    @property
    def nbytes(self) -> int:
        """Memory held by the tensors."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


class PrefixStore:
    """Least-recently-used store of :class:`KVEntry`, bounded in bytes.

    Args:
        max_bytes: Evict the least recently used entries beyond this size.
    """

    def __init__(self, max_bytes: int = 4 << 30) -> None:
        self.max_bytes = max_bytes
        self.entries: list[KVEntry] = []  # least recently used first
        self.hits = 0  # prompt tokens served from the store
        self.misses = 0  # prompt tokens the model had to run over

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """Memory held by all entries."""
        return sum(e.nbytes for e in self.entries)

    def best(self, ids: Sequence[int], *, limit: int) -> tuple[KVEntry | None, int]:
        """The entry sharing the longest usable prefix with ``ids``, and that prefix's length.

        Only entries whose first ``n = min(len(entry), limit)`` ids equal ``ids[:n]`` count.

        Args:
            ids: The token sequence to continue.
            limit: Most cached tokens usable (``len(ids) - 1`` when the last token's logits are
                needed).
        """
        best: KVEntry | None = None
        best_n = 0
        for entry in self.entries:
            n = min(len(entry.ids), limit)
            if n > best_n and entry.ids[:n] == list(ids[:n]):
                best, best_n = entry, n
        if best is not None:
            self.entries.remove(best)
            self.entries.append(best)  # most recently used
        return best, best_n

    def take(self, entry: KVEntry) -> None:
        """Remove a row's own (not shared) entry: its batch is about to supersede it."""
        if not entry.shared and entry in self.entries:
            self.entries.remove(entry)

    def add(self, entry: KVEntry) -> None:
        """Store ``entry``; drop row entries it extends, then evict down to ``max_bytes``."""
        n = len(entry.ids)
        self.entries = [
            e
            for e in self.entries
            if e.shared or not (len(e.ids) <= n and entry.ids[: len(e.ids)] == e.ids)
        ]
        self.entries.append(entry)
        total = self.nbytes
        while total > self.max_bytes and len(self.entries) > 1:
            total -= self.entries.pop(0).nbytes

    def clear(self) -> None:
        """Drop every entry (e.g. after the weights changed)."""
        self.entries.clear()


class _BufferLayer(DynamicLayer):
    """One layer's keys/values in a preallocated buffer, written in place.

    The buffer is allocated on the first ``update`` (when the head count, head size and dtype are
    known); rows with a cached prefix are copied in right-aligned at that moment.
    """

    def __init__(
        self, batch: int, capacity: int, start: int, rows: list[tuple[int, Any, Any]]
    ) -> None:
        super().__init__()
        self.batch = batch
        self.capacity = capacity
        self.length = start  # columns in use (the cached segment is [0, start))
        self._rows = rows  # (row, keys [H, n, D], values [H, n, D]) to copy in
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        heads, dk, dv = key_states.shape[1], key_states.shape[-1], value_states.shape[-1]
        opts = {"dtype": key_states.dtype, "device": key_states.device}
        self._k = torch.zeros(self.batch, heads, self.capacity, dk, **opts)
        self._v = torch.zeros(self.batch, heads, self.capacity, dv, **opts)
        for row, k, v in self._rows:
            n = k.shape[1]
            self._k[row, :, self.length - n : self.length] = k
            self._v[row, :, self.length - n : self.length] = v
        self._rows = []
        self.device = key_states.device
        self.is_initialized = True

    def _allocate_pending(self) -> None:
        """Allocate from the rows to copy in, before any token was fed (a batch whose prompts
        were all prefilled already, :func:`prefill_ragged`)."""
        if self._k is None and self._rows:
            _, k, v = self._rows[0]
            self._allocate(k[None], v[None])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._k is None:
            self._allocate(key_states, value_states)
        assert self._k is not None and self._v is not None
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV buffer overflow: {end} > capacity {self.capacity}")
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self.keys = self._k[:, :, :end]
        self.values = self._v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, *args: Any) -> tuple[int, int]:
        return self.length + query_length, 0

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows in ``index`` (in that order)."""
        self._allocate_pending()
        if self._k is None or self._v is None:  # nothing cached and nothing fed yet
            self.batch = len(index)
            return
        self._k = self._k.index_select(0, index)
        self._v = self._v.index_select(0, index)
        self.batch = self._k.shape[0]
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def row(self, row: int, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one row's keys and values at ``columns``."""
        self._allocate_pending()
        if self._k is None or self._v is None:
            raise RuntimeError("no keys or values yet: nothing was cached or fed")
        return self._k[row].index_select(1, columns), self._v[row].index_select(1, columns)


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every prompt starts with."""
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for p in prompts[1:]:
        if list(p[:n]) == list(first[:n]):
            continue
        lo, hi = 0, n  # binary search on the longest equal prefix
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if list(p[:mid]) == list(first[:mid]):
                lo = mid
            else:
                hi = mid - 1
        n = lo
    return n


@dataclass
class Slot:
    """One batch row's place in the buffers.

    Attributes:
        prompt: The row's prompt.
        columns: Buffer columns holding the row's tokens, in order.
        position: RoPE position of the next token to feed.
    """

    prompt: list[int]
    columns: list[int]
    position: int


class CacheBatch:
    """A batch's cache, mask and rows; runs forward passes and hands finished rows their KV.

    Args:
        model: The causal LM.
        slots: One per row, in batch order.
        layers: One buffer per decoder layer.
        mask: ``[B, capacity]`` bool, the columns each row may attend to.
        cache_kw: The name the model's forward takes its cache under (``cache`` or
            ``past_key_values``, by transformers version).
        prefix: Per layer, the keys/values ``[kv_heads, m, head_dim]`` of the prefix every row
            starts with, held once and attended by cascade attention
            (``trainer/serving/cascade.py``); the buffers then hold each row's tokens after it.
            None: the buffers hold whole rows.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        slots: list[Slot],
        layers: list[_BufferLayer],
        mask: torch.Tensor,
        cache_kw: str,
        prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        self.model = model
        self.slots = slots
        self.cache = Cache(layers=list(layers))
        self.layers = layers
        self.mask = mask
        self.device = mask.device
        self.cache_kw = cache_kw
        self.prefix = prefix
        # the model's attention: SDPA and cascade attention take the boolean mask; eager
        # attention adds it, so it gets the additive form (the dtype's minimum where masked)
        config = getattr(model, "config", None)
        self.bool_mask = bool(prefix) or getattr(config, "_attn_implementation", None) == "sdpa"

    @property
    def length(self) -> int:
        """Buffer columns in use."""
        return self.layers[0].length if self.layers else 0

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        new_mask: torch.Tensor,
        *,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Feed ``input_ids`` [B, q] at the next ``q`` columns.

        Returns:
            Logits of the last column [B, V], or of every column [B, q, V] with ``all_logits``.
        """
        start = self.length
        q = input_ids.shape[1]
        self.mask[:, start : start + q] = new_mask
        keys = self.mask[:, : start + q]  # [B, kv]
        causal = torch.ones(q, start + q, dtype=torch.bool, device=self.device).tril(start)
        allowed = keys[:, None, :] & causal[None]  # [B, q, kv]
        # A padding query sees its own column: no query row is all masked, which SDPA would
        # answer with NaN (and a NaN value times a zero weight is still NaN in later rows).
        diagonal = torch.arange(q, device=self.device)
        allowed[:, diagonal, start + diagonal] = True
        if self.bool_mask:
            mask = allowed[
                :, None
            ]  # SDPA takes a boolean mask: a quarter of the float one's memory
        else:
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            mask.masked_fill_(~allowed, torch.finfo(dtype).min)
            mask = mask[:, None]
        extra: dict[str, Any] = {} if all_logits else {"logits_to_keep": 1}
        if self.prefix:
            from trainer.serving.cascade import cascade_forward

            context: Any = cascade_forward(self.model)
            extra["twinrl_prefix"] = self.prefix
        else:
            context = contextlib.nullcontext()
        with context:
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self.cache_kw: self.cache},
                **extra,
            )
        return out.logits.float() if all_logits else out.logits[:, -1].float()

    def take_row(self, b: int, sampled: list[int]) -> KVEntry:
        """The stored form of row ``b``: keys/values of its prompt and all but its last sample."""
        slot = self.slots[b]
        cols = torch.tensor(slot.columns, dtype=torch.long, device=self.device)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            k, v = layer.row(b, cols)
            if self.prefix:
                pk, pv = self.prefix[i]
                k, v = torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)
            keys.append(k)
            values.append(v)
        return KVEntry(slot.prompt + sampled[:-1], keys, values)

    def keep(self, index: list[int]) -> None:
        """Keep the rows in ``index``, in that order (a row listed twice is copied)."""
        idx = torch.tensor(index, dtype=torch.long, device=self.device)
        for layer in self.layers:
            layer.select_rows(idx)
        self.mask = self.mask.index_select(0, idx)
        old = self.slots
        self.slots = [
            Slot(list(old[i].prompt), list(old[i].columns), old[i].position) for i in index
        ]

    expand = keep  # rows that repeat a prompt: prefilled once, then copied out


def build_batch(
    model: torch.nn.Module,
    store: PrefixStore,
    prompts: list[list[int]],
    limits: list[int],
    room: int,
    cache_kw: str,
    *,
    cascade: bool = False,
) -> tuple[CacheBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch whose cache holds each row's best stored prefix, and the uncached suffixes to feed.

    Args:
        model: The causal LM.
        store: Where prefixes come from.
        prompts: The rows' prompts.
        limits: Per row, the most cached tokens usable (``len(prompt) - 1``: the last prompt
            token's logits are needed; 0: prefill the whole prompt).
        room: Columns to leave for sampled tokens.
        cache_kw: See :class:`CacheBatch`.
        cascade: When every row's cached prefix covers at least ``MIN_SHARED`` tokens that
            every prompt starts with, keep their keys/values once for cascade attention instead
            of a copy per row (the batch will grow to more rows than ``prompts``, or ``prompts``
            has several).

    Returns:
        The batch, and the ``input_ids``, ``position_ids`` and new-column mask of the suffixes
        (left-padded) for its first :meth:`CacheBatch.forward`.
    """
    device = next(model.parameters()).device
    n_layers = model.config.num_hidden_layers if hasattr(model, "config") else 0
    found = [store.best(p, limit=lim) for p, lim in zip(prompts, limits, strict=True)]
    shared, prefix = _shared_prefix(prompts, found, n_layers) if cascade else (0, None)
    for entry, _ in found:
        if entry is not None:
            store.take(entry)
    cached = [n for _, n in found]
    suffixes = [p[n:] for p, n in zip(prompts, cached, strict=True)]
    width_c = max(cached) - shared  # the buffers hold what follows the shared prefix
    width_n = max(len(s) for s in suffixes)
    capacity = width_c + width_n + room
    per_layer: list[list[tuple[int, Any, Any]]] = [[] for _ in range(n_layers)]
    for b, (entry, n) in enumerate(found):
        if entry is not None and n > shared:
            for i in range(n_layers):
                per_layer[i].append((b, entry.keys[i][:, shared:n], entry.values[i][:, shared:n]))
    layers = [_BufferLayer(len(prompts), capacity, width_c, per_layer[i]) for i in range(n_layers)]
    mask = torch.zeros(len(prompts), capacity, dtype=torch.bool, device=device)
    input_ids = torch.zeros(len(prompts), width_n, dtype=torch.long, device=device)
    positions = torch.zeros(len(prompts), width_n, dtype=torch.long, device=device)
    new_mask = torch.zeros(len(prompts), width_n, dtype=torch.bool, device=device)
    slots = []
    for b, (p, n, s) in enumerate(zip(prompts, cached, suffixes, strict=True)):
        own = n - shared
        mask[b, width_c - own : width_c] = True
        pad = width_n - len(s)
        if s:
            input_ids[b, pad:] = torch.tensor(s, dtype=torch.long)
            positions[b, pad:] = torch.arange(n, len(p))
            new_mask[b, pad:] = True
        columns = list(range(width_c - own, width_c))
        columns += list(range(width_c + pad, width_c + width_n))
        slots.append(Slot(list(p), columns, len(p)))
        store.hits += n
        store.misses += len(s)
    batch = CacheBatch(model, slots, layers, mask, cache_kw, prefix=prefix)
    return batch, input_ids, positions, new_mask


def _shared_prefix(
    prompts: list[list[int]], found: list[tuple[KVEntry | None, int]], n_layers: int
) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
    """The cached prefix every row continues (at least ``MIN_SHARED`` tokens): its length and
    per-layer keys/values (views of row 0's entry), or ``(0, None)``.

    ``found``: each row's entry and cached length (:meth:`PrefixStore.best`). The prefix is no
    longer than any row's cached length: the buffers hold each row's tokens after the prefix, so
    a row that had cached fewer would feed part of the prefix again (attending to it twice).
    """
    most = min(common_prefix(prompts), *(n for _, n in found))
    entry = found[0][0]
    if most < MIN_SHARED or n_layers == 0 or entry is None:
        return 0, None
    return most, [(entry.keys[i][:, :most], entry.values[i][:, :most]) for i in range(n_layers)]


def prefill_common_prefix(
    model: torch.nn.Module, store: PrefixStore, prompts: list[list[int]], cache_kw: str
) -> None:
    """Prefill the batch's common prefix (system prompt + tool schemas) once and store it as shared.

    Skipped when the store already has most of it (fewer than ``MIN_SHARED`` new tokens).
    """
    shared = common_prefix(prompts)
    _, have = store.best(prompts[0][:shared], limit=shared)
    if shared - have < MIN_SHARED:
        return
    batch, ids, pos, new = build_batch(model, store, [prompts[0][:shared]], [shared], 0, cache_kw)
    batch.forward(ids, pos, new)
    entry = batch.take_row(0, [0])  # take_row keeps prompt + sampled[:-1] = the whole prefix
    entry.shared = True
    store.add(entry)


def plan_buckets(lengths: Sequence[int], pass_tokens: int = PASS_TOKENS) -> list[list[int]]:
    """Split rows into prefill passes that waste the least on padding.

    A pass is left-padded to its longest row, so it costs ``rows x longest`` fed tokens, and every
    pass costs ``pass_tokens`` more. Some cheapest split puts the rows in passes of consecutive
    lengths (moving a longer row into the pass with the longer maximum never costs more), so a
    dynamic programme over the sorted lengths finds it exactly.

    Args:
        lengths: Per row, the tokens it has to feed.
        pass_tokens: The cost of one more pass, in fed tokens.

    Returns:
        The passes, as row indices, shortest rows first; one pass holding every row when
        splitting saves nothing.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sizes = [lengths[i] for i in order]
    best = [0] + [sys.maxsize] * len(sizes)  # best[j]: cheapest plan of the j shortest rows
    cut = [0] * (len(sizes) + 1)
    for j in range(1, len(sizes) + 1):
        for i in range(j):
            cost = best[i] + (j - i) * sizes[j - 1] + pass_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    passes = []
    j = len(sizes)
    while j > 0:
        passes.append(order[cut[j] : j])
        j = cut[j]
    return passes[::-1]


def prefill_ragged(
    model: torch.nn.Module,
    store: PrefixStore,
    prompts: list[list[int]],
    cache_kw: str,
    *,
    cascade: bool = False,
    pass_tokens: int = PASS_TOKENS,
) -> tuple[PrefixStore, torch.Tensor] | None:
    """Prefill prompts whose uncached suffixes differ in length in passes of similar lengths.

    Each prompt continues its best entry in ``store`` as :func:`build_batch` would (entries are
    taken out of ``store`` and its hit/miss counts updated the same way), but the suffixes are fed
    in the passes :func:`plan_buckets` picks instead of one batch padded to the longest.

    Args:
        model: The causal LM.
        store: Where cached prefixes come from.
        prompts: The rows' prompts (distinct ones; their last token's logits are wanted).
        cache_kw: See :class:`CacheBatch`.
        cascade: Cascade attention in passes of more than one row (see :func:`build_batch`).
        pass_tokens: What one more pass costs, in fed tokens (:func:`plan_buckets`).

    Returns:
        A private store holding exactly each prompt's whole keys/values, for a :func:`build_batch`
        with ``limits = len(prompt)`` (nothing left to feed), and the prompts' next-token logits
        ``[len(prompts), vocab]``. None when one padded pass costs no more: nothing was run.
    """
    limits = [len(p) - 1 for p in prompts]
    found = [store.best(p, limit=lim) for p, lim in zip(prompts, limits, strict=True)]
    lengths = [len(p) - n for p, (_, n) in zip(prompts, found, strict=True)]
    passes = plan_buckets(lengths, pass_tokens)
    if len(passes) < 2:
        return None
    # Every pass reads the store as it was, as one batch would: an entry two rows continue is not
    # gone for the second row's pass because the first row's pass took it.
    view = PrefixStore(sys.maxsize)
    staged = PrefixStore(sys.maxsize)
    logits: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    for rows in passes:
        view.entries = list(store.entries)
        group, group_limits = [prompts[i] for i in rows], [limits[i] for i in rows]
        batch, ids, pos, new = build_batch(
            model, view, group, group_limits, 0, cache_kw, cascade=cascade and len(rows) > 1
        )
        out = batch.forward(ids, pos, new)
        for b, i in enumerate(rows):
            # take_row keeps prompt + sampled[:-1]: the whole prompt
            staged.entries.append(batch.take_row(b, [0]))
            logits[i] = out[b]
    for entry, _ in found:
        if entry is not None:
            store.take(entry)
    store.hits += view.hits
    store.misses += view.misses
    return staged, torch.stack(logits)

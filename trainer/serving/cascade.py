"""Cascade attention: the batch's shared prefix attended once for every row's queries.

The rows of a decoding batch (``trainer/serving/kvcache.py``) usually share a long prefix: the
system prompt with the written policy and tool schemas, 1,650 of a catalog episode's ~3,000
tokens. Plain attention reads those keys and values once per row; on CPU that was 76% of an
evaluation's forward pass. Here the prefix's keys/values are kept once (``[kv_heads, m, dim]``)
and attention is split in two:

- the prefix part: every row's queries stacked against the one copy of the prefix (one matmul
  per kv head, no mask: every query sees the whole prefix);
- the row part: each row's queries against its own keys after the prefix, under the batch mask.

Each part's softmax is normalised on its own and the two are merged by their log-sum-exp, which
gives softmax over the concatenation exactly (up to float round-off). Scores and softmax
accumulate in float32 whatever the compute dtype.

The engine selects it per forward pass (:func:`cascade_forward`), so the same model object keeps
its own attention for everything else (a learner sharing it included).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["NAME", "attend_with_prefix", "cascade_forward", "supports_cascade"]

#: The name registered with transformers' attention interface.
NAME = "twinrl_cascade"

#: Most float32 scores held at once per part (query rows are processed in chunks beyond it).
_MAX_SCORES = 1 << 24


def attend_with_prefix(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention over a shared prefix and each row's own keys.

    Args:
        query: ``[B, Hq, q, D]``.
        key: The rows' own keys ``[B, Hkv, n, D]`` (``Hq`` a multiple of ``Hkv``).
        value: ``[B, Hkv, n, Dv]``.
        allowed: ``[B, 1, q, n]`` booleans, the own columns each query may see (at least one per
            query).
        prefix_key: ``[Hkv, m, D]``, seen by every query.
        prefix_value: ``[Hkv, m, Dv]``.
        scaling: Score scale (``head_dim ** -0.5``).

    Returns:
        ``[B, q, Hq, Dv]`` (transformers' attention output layout).
    """
    # autocast off: each product runs in its operands' dtype (float32 scores; see _part)
    with torch.autocast(query.device.type, enabled=False):
        b, hq, q, d = query.shape
        hkv = key.shape[1]
        g = hq // hkv
        dv = value.shape[-1]
        # query head h reads kv head h // g: group the g query heads of a kv head together
        grouped = query.reshape(b, hkv, g * q, d)
        stacked = grouped.transpose(0, 1).reshape(hkv, b * g * q, d)  # every row against one prefix
        out_p, lse_p = _part(stacked[None], prefix_key[None], prefix_value[None], None, scaling)
        out_p, lse_p = out_p[0], lse_p[0]
        out_p = out_p.reshape(hkv, b, g * q, dv).transpose(0, 1)
        lse_p = lse_p.reshape(hkv, b, g * q).transpose(0, 1)
        mask = allowed[:, :, None].expand(b, 1, g, q, allowed.shape[-1]).reshape(b, 1, g * q, -1)
        out_r, lse_r = _part(grouped, key, value, mask, scaling)
        top = torch.maximum(lse_p, lse_r)
        w_p, w_r = (lse_p - top).exp(), (lse_r - top).exp()
        merged = (out_p * w_p[..., None] + out_r * w_r[..., None]) / (w_p + w_r)[..., None]
        merged = merged.to(query.dtype).reshape(b, hkv, g, q, dv).reshape(b, hq, q, dv)
        return merged.transpose(1, 2).contiguous()


def _part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 attention output and log-sum-exp of ``q [B, H, L, D]`` against ``k``/``v``
    ``[B, H, n, D]`` under the boolean ``mask`` ``[B, 1, L, n]`` (None: every key).

    On CPU, PyTorch's fused flash kernel (the one behind SDPA, which also returns the
    log-sum-exp): in the values' dtype with float32 accumulation, like SDPA under autocast, and
    3x faster than the unfused products on a prefill. Elsewhere the products below.
    """
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        dtype = v.dtype if v.dtype in (torch.bfloat16, torch.float32) else torch.float32
        add = None
        if mask is not None:
            add = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        out, lse = _CPU_FLASH(
            q.to(dtype), k.to(dtype), v.to(dtype), 0.0, False, attn_mask=add, scale=scaling
        )
        return out.float(), lse.float()
    return _chunked(q, k, v, mask, scaling)


#: PyTorch's CPU flash attention, returning ``(output, logsumexp)``; None where this build lacks it.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 attention output and log-sum-exp of ``q [..., L, D]`` against ``k``/``v``
    ``[..., n, D]``, over chunks of query rows when the scores would be large; autocast is off
    (the caller turns it off), so each product runs in its operands' dtype."""
    rows, cols = q.shape[-2], k.shape[-2]
    lead = q.numel() // max(1, rows * q.shape[-1])
    step = max(1, _MAX_SCORES // max(1, lead * cols))
    outs, lses = [], []
    # Scores in float32 from float32 operands: a bf16 product rounds a score of 20 to a step of
    # 0.125 (a 6% error in its weight). Decoding is bound by reading the keys, not by the
    # multiply, and the keys after RoPE are float32 already.
    kt = k.float().transpose(-1, -2)
    q = q.float() * scaling
    for start in range(0, rows, step):
        scores = torch.matmul(q[..., start : start + step, :], kt)
        if mask is not None:
            scores.masked_fill_(~mask[..., start : start + step, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = (scores - lse[..., None]).exp()
        outs.append(torch.matmul(probs.to(v.dtype), v).float())
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    twinrl_prefix: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: the engine's forward passes with a shared prefix."""
    if twinrl_prefix is None or attention_mask is None:
        raise RuntimeError(
            f"the {NAME!r} attention runs inside cascade_forward() only, with a prefix and a mask"
        )
    prefix_key, prefix_value = twinrl_prefix[module.layer_idx]
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attend_with_prefix(query, key, value, allowed, prefix_key, prefix_value, scale)
    return out, None


def supports_cascade(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention is plain softmax attention over every earlier token (what
    cascade attention computes): no sliding window, no logit soft-capping, no attention sinks."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    windowed = getattr(config, "sliding_window", None) and getattr(
        config, "use_sliding_window", True
    )
    special = any(
        getattr(config, k, None)
        for k in ("attn_logit_softcapping", "final_logit_softcapping", "attention_sink")
    )
    return types == {"full_attention"} and not windowed and not special


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # only reached without a 4-D mask


_register()


@contextlib.contextmanager
def cascade_forward(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model``'s attention as cascade attention inside the block (the engine's forward
    passes, which pass ``twinrl_prefix``); its own implementation is restored after."""
    config = getattr(model, "config", None)
    if config is None:
        raise RuntimeError("cascade attention needs a transformers model (one with a config)")
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before

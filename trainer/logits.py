"""Token logprobs and entropies through the output layer, a chunk of positions at a time.

The learner needs, for ``M`` selected positions, ``log softmax(head(h) / T)[target]`` and the
entropy of the same distribution. Computed in one go that is an ``M x V`` logit matrix (fp32,
151,936 columns for Qwen3) plus its log-softmax and, with grad, everything autograd keeps for
backward: 14-18 bytes per element, the learner's largest tensor. Here the positions go through
the output layer ``chunk`` at a time::

    for each chunk c of rows of h:                          # h: [M, H]
        z   = head(h_c) / T                                 # [c, V], freed after the chunk
        lse = logsumexp(z)                                  # [c]
        logp_c = z[target] - lse
        H_c    = lse - sum(exp(z - lse) * z)                # no softmax kept beside z

With grad each chunk runs under non-reentrant activation checkpointing: only ``h_c`` is kept, and
backward recomputes one chunk's logits at a time. So the logits' peak is one chunk's
(:data:`LOGIT_BYTES_PER_ELEMENT` x ``chunk x V``, what ``twin plan`` charges), whatever ``M`` is;
the recompute costs one more output-layer matmul per position with grad.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["DEFAULT_CHUNK", "LOGIT_BYTES_PER_ELEMENT", "chunked_logprobs", "logit_peak_bytes"]

#: Positions whose logits are computed at once (the recipes' ``optim.logit_chunk_tokens`` default).
DEFAULT_CHUNK = 1024

#: Peak bytes per ``chunk x V`` element of the logprob path with grad: the chunk's fp32 logits
#: (kept for backward) and one ``[c, V]`` buffer beside them (logsumexp's temporary in forward,
#: the entropy's in no-grad, the logits' gradient in backward). Measured on CPU, fp32 and bf16
#: output layers alike (a bf16 head's output is cast and freed before the peak), by
#: :func:`bench.memory.measure_logprob_peak` in ``tests/trainer/test_logits.py``.
LOGIT_BYTES_PER_ELEMENT = 8


def logit_peak_bytes(tokens: int, vocab: int, chunk: int = DEFAULT_CHUNK) -> int:
    """Peak bytes of the logprob path for ``tokens`` positions (:func:`chunked_logprobs`)."""
    return int(min(max(tokens, 1), max(chunk, 1)) * vocab * LOGIT_BYTES_PER_ELEMENT)


class _TokenLogprob(torch.autograd.Function):
    """``log softmax(z)[target]`` whose backward writes ``onehot - softmax`` into one buffer.

    autograd's own logsumexp + gather keep the logits and build three more ``[c, V]`` tensors in
    backward (the scatter, the softmax, their sum); this keeps the logits and builds one.
    """

    @staticmethod
    def forward(ctx: Any, z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        lse = torch.logsumexp(z, dim=-1)  # [c]
        logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        ctx.save_for_backward(z, lse, targets)
        ctx.mark_non_differentiable(lse)
        return logp, lse

    @staticmethod
    def backward(ctx: Any, g: Tensor, _g_lse: Tensor | None) -> tuple[Tensor, None]:
        z, lse, targets = ctx.saved_tensors
        grad = (z - lse.unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))  # -g softmax(z)
        grad.scatter_add_(-1, targets.unsqueeze(-1), g.unsqueeze(-1))  # + g onehot
        return grad, None


def _chunk_body(
    head: Callable[[Tensor], Tensor], temperature: float, entropy: bool, entropy_grad: bool
) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    calls = [0]

    def body(h: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        calls[0] += 1
        z = head(h).float()
        if temperature != 1.0:
            z = z / temperature
        logp, lse = _TokenLogprob.apply(z, targets)  # [c], [c]
        if not entropy or (calls[0] > 1 and not entropy_grad):
            # backward's recompute of a chunk: the detached entropy was returned the first time
            return logp, logp.new_zeros(())
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            if torch.is_grad_enabled():  # an entropy bonus: autograd's formula, lse with grad
                lse_g = torch.logsumexp(z, dim=-1)
                ent = lse_g - (torch.exp(z - lse_g.unsqueeze(-1)) * z).sum(-1)
            else:  # in place: one [c, V] temporary
                p = (z.detach() - lse.detach().unsqueeze(-1)).exp_()
                ent = lse.detach() - p.mul_(z.detach()).sum(-1)
        return logp, ent

    return body


def chunked_logprobs(
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logprob of each target under ``head(hidden) / temperature``, ``chunk`` positions at a time.

    Args:
        hidden: The decoder's last hidden state at the selected positions.  # [M, H]
        head: The output layer (``hidden -> logits``).
        targets: The next token of each position.  # [M]
        temperature: Logprobs are of ``logits / temperature``.
        chunk: Positions per output-layer call (the logits' peak is one chunk's).
        entropy: Also return each position's entropy (nats).
        entropy_grad: The entropy carries grad (an entropy bonus); else it is detached.

    Returns:
        ``(logp [M], entropy [M] or None)``, fp32.
    """
    grad = torch.is_grad_enabled()
    step = max(1, int(chunk))
    logps: list[Tensor] = []
    ents: list[Tensor] = []
    for start in range(0, hidden.shape[0], step):
        h, t = hidden[start : start + step], targets[start : start + step]
        body = _chunk_body(head, float(temperature), entropy, entropy_grad)  # one per chunk
        if grad and hidden.shape[0] > 0:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(body, h, t, use_reentrant=False)
        else:
            lp, ent = body(h, t)
        logps.append(lp)
        ents.append(ent)
    if not logps:
        empty = hidden.new_zeros((0,), dtype=torch.float32)
        return empty, (empty if entropy else None)
    logp = torch.cat(logps)
    return logp, (torch.cat(ents) if entropy else None)

# Over 500 lines on purpose: the GRPO family's pieces, each a short pure function beside its
# equation (docs/algorithms.md); trainer/objective.py composes them on one screen.
"""GRPO-family advantages and losses as pure functions.

Each function reads like its equation (see ``docs/algorithms.md``); a recipe picks variants by
name through the small dicts at the bottom (:data:`ADVANTAGES`, :data:`LOSS_AGGREGATIONS`),
never through a string switch inside a loss. Shapes: ``N`` groups of ``G`` samples; ``B``
sequences of ``T`` tokens (``B = N * G`` after dynamic sampling); ``V`` vocabulary.

- Advantages over groups: :func:`grpo_advantages` (z-score), :func:`dr_grpo_advantages`
  (mean-centred), :func:`rloo_advantages` (leave-one-out baseline).
- Per-token clipped surrogate with asymmetric clipping (DAPO clip-higher):
  :func:`clipped_surrogate`.
- Loss aggregations: :func:`token_mean` (DAPO), :func:`seq_mean_token_mean` (GRPO),
  :func:`constant_normalizer` (Dr. GRPO).
- :func:`kl_k3` (KL to the reference, k3 estimator), :func:`tis_weights` (truncated importance
  sampling against the sampler), :func:`keep_informative_groups` (DAPO dynamic sampling),
  :func:`overlong_penalty` (DAPO soft overlong punishment), :func:`entropy_from_logits`,
  :func:`token_logprobs`.
- :func:`trainer.objective.objective` composes them and returns ``(loss, LossStats)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from rewards import overlong_fraction
from twin.errors import ConfigError

__all__ = [
    "ADVANTAGES",
    "IS_CORRECTIONS",
    "LOSS_AGGREGATIONS",
    "AdvantageFn",
    "Aggregation",
    "LossStats",
    "SurrogateOut",
    "aggregation",
    "clipped_surrogate",
    "constant_normalizer",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "grpo_advantages",
    "importance_ratio",
    "is_weights",
    "keep_informative_groups",
    "kl_k3",
    "overlong_penalty",
    "rloo_advantages",
    "sampler_kl",
    "sequence_mask_weights",
    "seq_mean_token_mean",
    "tis_weights",
    "token_mask_weights",
    "token_logprobs",
    "token_mean",
]


# ==================================================================== advantages
AdvantageFn = Callable[[Tensor], Tensor]


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: the group z-score ``A_i = (r_i - mean(r)) / (std(r) + eps)``.

    ``std`` is the sample standard deviation (Bessel-corrected, as TRL and verl compute it).
    A constant group gets zeros; a group of one gets zeros.

    Args:
        rewards: Rewards, one row per group.  # [N, G]
        eps: Added to the std (keeps nearly constant groups finite; constant ones give 0).

    Returns:
        Advantages.  # [N, G]
    """
    r = _as_groups(rewards)
    if r.shape[-1] < 2:
        return torch.zeros_like(rewards, dtype=torch.float32)
    centred = r - r.mean(dim=-1, keepdim=True)  # [N, G]
    std = r.std(dim=-1, keepdim=True)  # [N, 1]
    return _zero_constant_groups(centred / (std + eps), r)


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO: mean-centred rewards, no std division ``A_i = r_i - mean(r)``.

    Dividing by the std up-weights groups that are nearly all right or all wrong (question-level
    difficulty bias); Dr. GRPO drops it.

    Args:
        rewards: Rewards, one row per group.  # [N, G]

    Returns:
        Advantages.  # [N, G]
    """
    r = _as_groups(rewards)
    return _zero_constant_groups(r - r.mean(dim=-1, keepdim=True), r)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO: baseline = mean of the OTHER samples of the group.

    ``A_i = r_i - (sum_j r_j - r_i) / (G - 1)``, which equals ``G / (G - 1) * (r_i - mean(r))``.
    A group of one has no baseline and gets zeros.

    Args:
        rewards: Rewards, one row per group.  # [N, G]

    Returns:
        Advantages.  # [N, G]
    """
    r = _as_groups(rewards)
    g = r.shape[-1]
    if g < 2:
        return torch.zeros_like(rewards, dtype=torch.float32)
    baseline = (r.sum(dim=-1, keepdim=True) - r) / (g - 1)  # [N, G]
    return _zero_constant_groups(r - baseline, r)


def _as_groups(rewards: Tensor) -> Tensor:
    if rewards.dim() != 2:
        raise ConfigError(
            f"advantages: expected rewards of shape [num_groups, group_size], got "
            f"{tuple(rewards.shape)}; reshape with rewards.view(num_groups, group_size)"
        )
    # float64 inside: the group mean of float32 rewards is not exact, and the rounding noise
    # would become a spurious advantage once divided by a tiny std
    return rewards.double()


def _zero_constant_groups(adv: Tensor, r: Tensor) -> Tensor:
    constant = (r == r[:, :1]).all(dim=-1, keepdim=True)  # [N, 1]
    return torch.where(constant, adv.new_zeros(()), adv).float()


# ==================================================================== group filters and shaping
def keep_informative_groups(rewards: Tensor, atol: float = 1e-6) -> Tensor:
    """DAPO dynamic sampling: which groups carry a learning signal.

    A group whose rewards are all equal has zero advantage for every sample (for every
    estimator above), so it only dilutes the batch; the loop drops it and samples more groups.

    Args:
        rewards: Rewards, one row per group.  # [N, G]
        atol: Rewards closer than this count as equal.

    Returns:
        True for groups to keep.  # [N] bool
    """
    r = _as_groups(rewards)
    spread = r.max(dim=-1).values - r.min(dim=-1).values  # [N]
    return spread > atol


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment, added to the reward: ``-factor * overlong_fraction(L)``.

    ``0`` for ``L <= max_len - buffer``; then linear down to ``-factor`` at ``L = max_len``;
    ``-factor`` beyond (DAPO's ``R_length``). ``buffer = 0`` leaves only the last case, a hard
    cut: ``-factor`` for ``L > max_len``, else 0. The fraction is the reward library's
    (:func:`rewards.overlong_fraction`), so a reward's ``overlong_penalty`` term and the
    trainer's shaping agree everywhere. The trainer passes the tokens the policy wrote and the
    episode budget, which holds the prompt too: ``L < max_len``, so ``overlong_buffer: 0`` is off.

    Args:
        lengths: Tokens the policy wrote in each episode (its sampled tokens; not the
            prompt or tool results).  # [B]
        max_len: The generation budget ``L_max``.
        buffer: The soft zone ``L_cache`` before the budget.
        factor: Penalty at (and beyond) the budget.

    Returns:
        Penalties, ``<= 0``.  # like ``lengths``

    Raises:
        ConfigError: ``buffer > max_len`` or ``buffer < 0``.
    """
    if not 0 <= buffer <= max_len:
        raise ConfigError(
            f"overlong_penalty: buffer ({buffer}) must be in [0, max_len ({max_len})]; "
            "set algorithm.overlong_buffer within sampler.max_episode_tokens"
        )
    fractions = [overlong_fraction(float(n), max_len, buffer) for n in lengths.reshape(-1).tolist()]
    return -factor * torch.tensor(fractions, dtype=torch.float32).reshape(lengths.shape)


# ==================================================================== per-token pieces
def token_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """Log-probability of each given id under the logits (log-softmax gathered, in fp32).

    Args:
        logits: Next-token logits aligned with ``ids`` (already shifted).  # [B, T, V]
        ids: The tokens whose logprob is wanted.  # [B, T]

    Returns:
        ``log softmax(logits)[b, t, ids[b, t]]``.  # [B, T]
    """
    logits = logits.float()
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution ``H = logsumexp(z) - sum softmax(z) * z``.

    Args:
        logits: Logits.  # [B, T, V]

    Returns:
        Entropy in nats.  # [B, T]
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(pi || pi_ref), k3 estimator: ``exp(ref - lp) - (ref - lp) - 1 >= 0``.

    Unbiased for KL(pi || pi_ref) on tokens sampled from pi, and never negative (Schulman,
    "Approximating KL divergence"); GRPO's choice.

    Args:
        logprobs: Policy logprobs of the sampled tokens.  # [B, T]
        ref_logprobs: Reference (base model, adapter disabled) logprobs.  # [B, T]

    Returns:
        Per-token KL estimate.  # [B, T]
    """
    log_ratio = ref_logprobs - logprobs  # [B, T]
    return torch.exp(log_ratio) - log_ratio - 1.0


def importance_ratio(old_logprobs: Tensor, sampler_logprobs: Tensor) -> Tensor:
    """Learner over sampler probability of each sampled token ``rho = exp(lp_old - lp_sampler)``.

    Args:
        old_logprobs: The learner's logprobs of the sampled tokens (before this update).  # [B, T]
        sampler_logprobs: The sampler's logprobs of the same tokens.  # [B, T]

    Returns:
        ``rho``, detached.  # [B, T]
    """
    return torch.exp(old_logprobs.detach() - sampler_logprobs.detach())


def tis_weights(old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling against the sampler: ``w_t = min(rho_t, C)``.

    Corrects for the sampler (vLLM, bf16, a stale adapter) not being exactly the learner's
    policy; the weight is detached and multiplies the per-token policy loss.

    Args:
        old_logprobs: The learner's logprobs of the sampled tokens (before this update).  # [B, T]
        sampler_logprobs: The sampler's logprobs of the same tokens.  # [B, T]
        cap: Upper bound ``C`` of the weight (e.g. 2.0).

    Returns:
        Weights, detached.  # [B, T]
    """
    return importance_ratio(old_logprobs, sampler_logprobs).clamp(max=cap)


def token_mask_weights(
    old_logprobs: Tensor, sampler_logprobs: Tensor, high: float, low: float = 0.0
) -> Tensor:
    """Token-level masked importance sampling: ``w_t = rho_t * 1[low <= rho_t <= high]``.

    A token the two policies disagree on too much is dropped instead of down-weighted (its
    gradient would be mostly sampler noise); the others keep their full ratio.

    Args:
        old_logprobs: The learner's logprobs of the sampled tokens.  # [B, T]
        sampler_logprobs: The sampler's logprobs of the same tokens.  # [B, T]
        high: Largest ratio kept.
        low: Smallest ratio kept (0 = no lower bound).

    Returns:
        Weights, detached; 0 on dropped tokens.  # [B, T]
    """
    rho = importance_ratio(old_logprobs, sampler_logprobs)
    keep = (rho >= low) & (rho <= high)
    return torch.where(keep, rho, rho.new_zeros(()))


def sequence_mask_weights(
    old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, high: float, low: float = 0.0
) -> Tensor:
    """Sequence-level masked importance sampling: ``w_t = rho_t * 1[low <= rho_seq <= high]``
    with ``rho_seq = exp(mean_t log rho_t)`` over the sequence's sampled tokens.

    The geometric mean does not grow with the sequence's length (the product of the ratios
    would); one sequence far off the learner's policy is dropped whole.

    Args:
        old_logprobs: The learner's logprobs of the sampled tokens.  # [B, T]
        sampler_logprobs: The sampler's logprobs of the same tokens.  # [B, T]
        mask: 1 on sampled tokens.  # [B, T]
        high: Largest sequence ratio kept.
        low: Smallest sequence ratio kept (0 = no lower bound).

    Returns:
        Weights, detached; 0 on every token of a dropped sequence.  # [B, T]
    """
    log_rho = old_logprobs.detach() - sampler_logprobs.detach()  # [B, T]
    m = mask.to(log_rho.dtype)
    rho_seq = torch.exp((log_rho * m).sum(-1) / m.sum(-1).clamp(min=1.0))  # [B]
    keep = ((rho_seq >= low) & (rho_seq <= high)).unsqueeze(-1)  # [B, 1]
    return torch.where(keep, torch.exp(log_rho), log_rho.new_zeros(()))


def is_weights(
    correction: str,
    old_logprobs: Tensor,  # [B, T]
    sampler_logprobs: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    *,
    high: float,
    low: float = 0.0,
) -> Tensor:
    """The importance weights a config names (``algorithm.is_correction``).

    Args:
        correction: ``truncate``, ``token_mask`` or ``sequence_mask``.
        old_logprobs: The learner's logprobs of the sampled tokens.  # [B, T]
        sampler_logprobs: The sampler's logprobs.  # [B, T]
        mask: 1 on sampled tokens.  # [B, T]
        high: ``tis_cap``: the cap (truncate) or the upper bound (masks).
        low: ``is_mask_low``: the masks' lower bound (ignored by truncate).

    Returns:
        Weights, detached.  # [B, T]

    Raises:
        ConfigError: unknown correction.
    """
    if correction == "truncate":
        return tis_weights(old_logprobs, sampler_logprobs, high)
    if correction == "token_mask":
        return token_mask_weights(old_logprobs, sampler_logprobs, high, low)
    if correction == "sequence_mask":
        return sequence_mask_weights(old_logprobs, sampler_logprobs, mask, high, low)
    raise ConfigError(
        f"algorithm.is_correction: unknown {correction!r}; expected one of {list(IS_CORRECTIONS)}"
    )


#: Config names of :func:`is_weights` (``algorithm.is_correction``).
IS_CORRECTIONS = ("truncate", "token_mask", "sequence_mask")


def sampler_kl(logprobs: Tensor, sampler_logprobs: Tensor) -> Tensor:
    """Per-token KL(pi_sampler || pi_learner), k3 estimator on the sampler's tokens:
    ``rho - 1 - log rho`` with ``rho = exp(lp - lp_sampler)``, never negative.

    Zero when the learner scores the sampled tokens exactly as the sampler did; grows with
    the mismatch the importance weights correct for (a stale adapter, bf16 kernels, a wrong
    chat template).

    Args:
        logprobs: Learner logprobs of the sampled tokens.  # [B, T]
        sampler_logprobs: The sampler's logprobs of the same tokens.  # [B, T]

    Returns:
        Per-token KL estimate.  # [B, T]
    """
    log_rho = logprobs.detach() - sampler_logprobs.detach()
    return torch.exp(log_rho) - 1.0 - log_rho


class SurrogateOut(NamedTuple):
    """Per-token outputs of :func:`clipped_surrogate` (all ``[B, T]``)."""

    loss: Tensor
    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor


def clipped_surrogate(
    logprobs: Tensor,  # [B, T]
    old_logprobs: Tensor,  # [B, T]
    advantages: Tensor,  # [B] or [B, T]
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> SurrogateOut:
    """PPO's clipped surrogate per token, with DAPO's asymmetric clip (clip-higher).

    ``rho = exp(lp - lp_old)``;
    ``loss = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)``.
    A larger ``eps_high`` lets low-probability tokens with positive advantage grow more
    (against entropy collapse). A token is *clipped* when the clipped term wins the min, i.e.
    gets no gradient: ``rho > 1 + eps_high`` with ``A > 0`` (high) or ``rho < 1 - eps_low``
    with ``A < 0`` (low).

    Args:
        logprobs: Current policy logprobs of the sampled tokens (with grad).  # [B, T]
        old_logprobs: Logprobs of the same tokens under the policy that sampled them.  # [B, T]
        advantages: One per sequence or one per token.  # [B] or [B, T]
        eps_low: Lower clip range.
        eps_high: Upper clip range.

    Returns:
        :class:`SurrogateOut` with the per-token loss, ratio and clip masks.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B, 1]
    advantages = advantages.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs.detach())  # [B, T]
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    clipped_high = (ratio > 1.0 + eps_high) & (advantages > 0)
    clipped_low = (ratio < 1.0 - eps_low) & (advantages < 0)
    return SurrogateOut(loss, ratio, clipped_low, clipped_high)


# ==================================================================== loss aggregations
class Aggregation(Protocol):
    """``(values [B, T], mask [B, T], *, num_seqs=None, num_tokens=None) -> scalar``.

    ``num_seqs`` / ``num_tokens`` are the WHOLE batch's counts when a batch is split into
    micro-batches for gradient accumulation: the micro-batch losses then sum to the loss of
    the whole batch. They default to the counts of ``mask`` itself.
    """

    def __call__(
        self,
        values: Tensor,
        mask: Tensor,
        *,
        num_seqs: int | None = None,
        num_tokens: float | None = None,
    ) -> Tensor: ...


def token_mean(
    values: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    *,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    """DAPO: every token of the batch weighs the same, ``sum(x * m) / sum(m)``.

    Long sequences are not down-weighted per token (GRPO's sequence mean makes a token of a
    long wrong answer count less than one of a short one).

    Args:
        values: Per-token values.  # [B, T]
        mask: 1 on tokens that count.  # [B, T]
        num_seqs: Unused (same signature as the other aggregations).
        num_tokens: Token count of the whole batch (default: ``mask.sum()``).

    Returns:
        Scalar.
    """
    denom = mask.sum() if num_tokens is None else values.new_tensor(float(num_tokens))
    return _masked(values, mask).sum() / denom.to(values.dtype).clamp(min=1.0)


def seq_mean_token_mean(
    values: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    *,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    """GRPO: mean over sequences of each sequence's token mean.

    ``(1 / B) * sum_i (sum_t x_it * m_it / sum_t m_it)``; a sequence without masked-in tokens
    contributes 0.

    Args:
        values: Per-token values.  # [B, T]
        mask: 1 on tokens that count.  # [B, T]
        num_seqs: Sequence count of the whole batch (default: ``B``).
        num_tokens: Unused.

    Returns:
        Scalar.
    """
    lengths = mask.to(values.dtype).sum(dim=-1).clamp(min=1.0)  # [B]
    per_seq = _masked(values, mask).sum(dim=-1) / lengths  # [B]
    b = values.shape[0] if num_seqs is None else num_seqs
    return per_seq.sum() / max(b, 1)


def constant_normalizer(
    values: Tensor,  # [B, T]
    mask: Tensor,  # [B, T]
    *,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """Dr. GRPO: ``sum(x * m) / (B * L)`` with a constant ``L`` (the generation budget).

    No length-dependent normaliser, so no length bias: a token's weight is the same in a short
    or a long answer and in a full or sparse batch.

    Args:
        values: Per-token values.  # [B, T]
        mask: 1 on tokens that count.  # [B, T]
        num_seqs: Sequence count of the whole batch (default: ``B``).
        num_tokens: Unused.
        max_tokens: The constant ``L`` (default: ``T``, the padded length; pass the sampler's
            token budget so that the normaliser does not depend on the batch).

    Returns:
        Scalar.
    """
    b = values.shape[0] if num_seqs is None else num_seqs
    length = values.shape[-1] if max_tokens is None else max_tokens
    return _masked(values, mask).sum() / max(b * length, 1)


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    # where, not multiply: a non-finite value at a padded position must not turn the sum NaN
    # (the values there must still be finite for backward, as for any torch.where)
    return torch.where(mask > 0, values, values.new_zeros(()))


#: Config name -> aggregation (``algorithm.loss_aggregation``).
LOSS_AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "constant_normalizer": constant_normalizer,
}

#: Config name -> advantage estimator (``algorithm.advantage``).
ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def aggregation(name: str, *, max_tokens: int | None = None) -> Aggregation:
    """The aggregation a config names, with Dr. GRPO's constant bound in.

    Args:
        name: A key of :data:`LOSS_AGGREGATIONS`.
        max_tokens: ``L`` of :func:`constant_normalizer` (ignored by the others).

    Returns:
        The aggregation function.

    Raises:
        ConfigError: Unknown name.
    """
    if name not in LOSS_AGGREGATIONS:
        raise ConfigError(
            f"algorithm.loss_aggregation: unknown {name!r}; expected one of "
            f"{sorted(LOSS_AGGREGATIONS)}"
        )
    if name == "constant_normalizer" and max_tokens is not None:
        return functools.partial(constant_normalizer, max_tokens=max_tokens)
    return LOSS_AGGREGATIONS[name]


# ==================================================================== the composed loss
class LossStats(NamedTuple):
    """Diagnostics of one :func:`trainer.objective.objective` call (0-d detached tensors, token
    means over the mask of this call).

    Attributes:
        policy_loss: The aggregated clipped-surrogate part.
        kl: Mean per-token k3 KL to the reference (0 without reference logprobs).
        clip_frac: Fraction of tokens clipped (either side).
        clip_frac_low: Fraction clipped at ``1 - eps_low`` (negative advantage).
        clip_frac_high: Fraction clipped at ``1 + eps_high`` (positive advantage).
        ratio_mean: Mean importance ratio ``exp(lp - lp_old)``.
        ratio_max: Largest ratio.
        tis_mean: Mean importance weight (1 without sampler logprobs).
        tis_capped_frac: Fraction of tokens whose weight was truncated at the cap or masked out.
        sampler_kl: Mean per-token KL(sampler || learner), :func:`sampler_kl` (0 without
            sampler logprobs).
        num_tokens: Masked-in tokens in this call.
        entropy: Mean per-token entropy (0 without entropies).
        logprob_mismatch: Mean ``|lp_old - lp_sampler|`` (0 without sampler logprobs).
    """

    policy_loss: Tensor
    kl: Tensor
    clip_frac: Tensor
    clip_frac_low: Tensor
    clip_frac_high: Tensor
    ratio_mean: Tensor
    ratio_max: Tensor
    tis_mean: Tensor
    tis_capped_frac: Tensor
    sampler_kl: Tensor
    num_tokens: Tensor
    entropy: Tensor
    logprob_mismatch: Tensor

    def metrics(self, prefix: str = "losses/") -> dict[str, float]:
        """Stats as floats under stable names (``losses/clip_frac``, ...)."""
        return {f"{prefix}{k}": float(v) for k, v in self._asdict().items()}

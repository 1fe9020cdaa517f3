"""The GRPO-family objective on one screen: what one update minimises, equation by equation.

Per group (the ``G`` episodes of one case), where the rollouts are collected
(``trainer.sync_trainer``)::

    r~_i = r_i + overlong(L_i)                     shaped reward; L_i = tokens the policy wrote
    keep the group iff max(r~) - min(r~) > 0       dynamic sampling (DAPO)
    A_i  = advantage(r~)_i                         grpo | dr_grpo | rloo
    A    = A[permutation]                          algorithm.placebo only: a control without signal

Per micro-batch of scored episodes (:meth:`trainer.learner.Learner.step`), ``m`` the loss mask::

    rho_t = exp(logp_t - logp_old_t)               policy ratio (exactly 1 with one mini-batch)
    w_t   = is_weight(logp_old, logp_sampler)_t    truncate | token_mask | sequence_mask, detached
    l_t   = w_t * -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) + beta * k3_t
    loss  = aggregate(l, m) - c_H * sum_t m_t H_t / n_tokens

Each piece is a pure function of :mod:`trainer.algorithms`; this module composes them with the
recipe's ``algorithm:`` settings. How the logprobs were computed (micro-batches, a group's
shared prompt run once) is the learner's business: the objective sees :class:`ScoredBatch` tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from trainer import algorithms as algo
from twin.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import AlgorithmConfig, Recipe
    from twin.trajectory import Group

__all__ = [
    "LossSettings", "ScoredBatch", "advantages", "check_overlong_owner", "group_rewards",
    "informative", "objective", "placebo_advantages", "shaped_rewards",
]  # fmt: skip


@dataclass(frozen=True)
class LossSettings:
    """What :func:`objective` reads, as plain values (the defaults are the recipe's, i.e. DAPO's).

    The one way to pass them: a run builds it once from its recipe (:meth:`of`); a test writes
    the values it needs.
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    tis_cap: float | None = 2.0
    is_correction: str = "truncate"
    is_mask_low: float = 0.0

    @classmethod
    def of(cls, algorithm: AlgorithmConfig) -> LossSettings:
        """The settings of a recipe's ``algorithm:`` section."""
        return cls(
            eps_low=algorithm.eps_low,
            eps_high=algorithm.eps_high,
            kl_coef=algorithm.kl_coef,
            entropy_coef=algorithm.entropy_coef,
            tis_cap=algorithm.tis_cap,
            is_correction=algorithm.is_correction,
            is_mask_low=algorithm.is_mask_low,
        )


@dataclass(frozen=True)
class ScoredBatch:
    """One micro-batch as the learner scored it: everything the objective reads.

    Attributes:
        logprobs: Learner logprobs of the next tokens, with grad.  # [B, T]
        mask: 1 on sampled tokens (the loss mask).  # [B, T]
        advantages: One per sequence or one per token.  # [B] or [B, T]
        sampler_logprobs: The sampler's logprobs of the same tokens (None: no IS correction).
        old_logprobs: Learner logprobs before this update (None: ``logprobs.detach()``).
        ref_logprobs: Reference (adapter disabled) logprobs (None: no KL).
        entropy: Per-token entropy of ``logits / T``; with grad when ``entropy_coef > 0``.
        weights: Per-token loss weights (:attr:`trainer.scoring.TrainBatch.token_weights`;
            None: all 1).  # [B, T]
        rows: Which rows of the scored batch these are, in order (None: not said).
    """

    logprobs: Tensor
    mask: Tensor
    advantages: Tensor
    sampler_logprobs: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    weights: Tensor | None = None
    rows: list[int] | None = None


# ==================================================================== per group
def shaped_rewards(
    rewards: Tensor, lengths: Tensor, *, max_len: int, buffer: int, factor: float
) -> Tensor:
    """``r~ = r + overlong(L)``: DAPO's soft overlong penalty
    (:func:`trainer.algorithms.overlong_penalty`).

    Args:
        rewards: Env rewards.  # [G] or [N, G]
        lengths: Tokens the policy wrote in each episode.  # like ``rewards``
        max_len: The episode token budget ``L_max`` (``sampler.max_episode_tokens``).
        buffer: The soft zone before it (``algorithm.overlong_buffer``).
        factor: The penalty at and beyond it (``algorithm.overlong_penalty``).
    """
    return rewards.float() + algo.overlong_penalty(lengths, max_len, buffer, factor)


def check_overlong_owner(reward: Any, overlong_buffer: int) -> None:
    """Refuse a twin whose reward charges length when the recipe's overlong shaping is on.

    One owner per run: with ``algorithm.overlong_buffer > 0`` the recipe shapes every episode's
    reward by its length (:func:`shaped_rewards`), so a reward penalty marked
    :attr:`rewards.Penalty.overlong` would charge the same episode twice. With the buffer at 0
    the shaping changes no reward (the policy's tokens stay under the budget) and the reward's
    penalty is the only one.

    Args:
        reward: The twin's reward (only a :class:`rewards.Reward` declares its penalties; any
            other callable holds none this check can see).
        overlong_buffer: ``algorithm.overlong_buffer``.

    Raises:
        ConfigError: Both would charge; names the reward's penalties and the two ways out.
    """
    if overlong_buffer <= 0:
        return
    names = [p.name for p in getattr(reward, "penalties", ()) if getattr(p, "overlong", False)]
    if names:
        raise ConfigError(
            f"the twin's reward holds the overlong penalty {names} and the recipe's overlong "
            f"shaping is on (algorithm.overlong_buffer={overlong_buffer}): one episode would be "
            "charged twice; set algorithm.overlong_buffer: 0 or drop the penalty from the reward"
        )


def group_rewards(group: Group, recipe: Recipe) -> Tensor:
    """A sampled group's shaped rewards ``r~`` under a recipe: :func:`shaped_rewards` of the env
    rewards on the tokens each episode's policy wrote (both training loops call this).  # [G]

    Args:
        group: A :class:`twin.trajectory.Group`.
        recipe: The recipe (its ``sampler.max_episode_tokens`` and ``algorithm`` overlong settings).
    """
    rewards = torch.tensor(group.rewards, dtype=torch.float32)
    lengths = torch.tensor([t.completion_tokens for t in group.trajectories])
    return shaped_rewards(
        rewards, lengths, max_len=recipe.sampler.max_episode_tokens,
        buffer=recipe.algorithm.overlong_buffer, factor=recipe.algorithm.overlong_penalty,
    )  # fmt: skip


def placebo_advantages(advantages: Tensor, seed: int) -> Tensor:
    """The control of ``algorithm.placebo``: the same advantages on a seeded random permutation of
    the batch's episodes, so the update keeps GRPO's size and statistics but carries no signal
    about which episode earned what.  # [N, G] -> [N, G]"""
    flat = advantages.reshape(-1)
    g = torch.Generator().manual_seed(int(seed) % (2**63))
    perm = torch.randperm(flat.numel(), generator=g)
    return flat[perm.to(flat.device)].reshape(advantages.shape)


def informative(shaped: Tensor) -> Tensor:
    """Dynamic sampling: True for groups whose shaped rewards differ.  # [N, G] -> [N] bool"""
    return algo.keep_informative_groups(shaped)


def advantages(shaped: Tensor, estimator: str) -> Tensor:
    """``A = advantage(r~)`` per group (``algorithm.advantage``).  # [N, G] -> [N, G]

    Raises:
        ConfigError: unknown estimator.
    """
    if estimator not in algo.ADVANTAGES:
        raise ConfigError(
            f"algorithm.advantage: unknown {estimator!r}; expected one of {sorted(algo.ADVANTAGES)}"
        )
    return algo.ADVANTAGES[estimator](shaped)


# ==================================================================== per micro-batch
def objective(
    b: ScoredBatch,
    cfg: LossSettings,
    *,
    aggregate: algo.Aggregation = algo.token_mean,
    num_seqs: int | None = None,
    num_tokens: float | None = None,
) -> tuple[Tensor, algo.LossStats]:
    """The loss to backpropagate for one micro-batch, and its diagnostics.

    ``num_seqs`` / ``num_tokens`` are the whole mini-batch's counts (default: this micro-batch's),
    so the micro-batch losses of a gradient accumulation sum to the mini-batch's loss.

    Raises:
        ConfigError: mismatched shapes, ``kl_coef > 0`` without reference logprobs, or
            ``entropy_coef > 0`` without entropies.
    """
    _check(b, cfg)
    lp, m = b.logprobs, b.mask.to(b.logprobs.dtype)
    counts = {"num_seqs": num_seqs, "num_tokens": num_tokens}
    old = lp.detach() if b.old_logprobs is None else b.old_logprobs  # pi_old: no grad
    # l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)
    surr = algo.clipped_surrogate(lp, old, b.advantages, cfg.eps_low, cfg.eps_high)
    # w_t: importance weight against the sampler, detached (1 without a correction)
    corrected = b.sampler_logprobs is not None and cfg.tis_cap is not None
    w = (
        algo.is_weights(
            cfg.is_correction, old, b.sampler_logprobs, m, high=cfg.tis_cap, low=cfg.is_mask_low
        )
        if corrected
        else torch.ones_like(lp)
    )
    # k3_t: KL to the reference (logged whenever a reference is given, trained on when beta > 0)
    kl = algo.kl_k3(lp, b.ref_logprobs) if b.ref_logprobs is not None else torch.zeros_like(lp)
    per_token = surr.loss * w  # [B, T]
    pg = aggregate(per_token, m, **counts)
    loss = aggregate(per_token + cfg.kl_coef * kl, m, **counts) if cfg.kl_coef > 0 else pg
    if cfg.entropy_coef > 0:  # a token mean whatever the aggregation (CleanRL's ent_coef)
        n = float(m.sum()) if num_tokens is None else float(num_tokens)
        loss = loss - cfg.entropy_coef * (b.entropy * m).sum() / max(n, 1.0)
    return loss, _stats(b, m, old, surr, w, kl, pg, cap=cfg.tis_cap if corrected else None)


def _check(b: ScoredBatch, cfg: LossSettings) -> None:
    if b.mask.shape != b.logprobs.shape:
        raise ConfigError(
            f"objective: mask {tuple(b.mask.shape)} must have the shape of logprobs "
            f"{tuple(b.logprobs.shape)} ([B, T])"
        )
    if cfg.kl_coef > 0 and b.ref_logprobs is None:
        raise ConfigError(
            "objective: kl_coef > 0 needs ref_logprobs (score the batch with the adapter "
            "disabled), or set algorithm.kl_coef: 0"
        )
    if cfg.entropy_coef > 0 and b.entropy is None:
        raise ConfigError(
            "objective: entropy_coef > 0 needs the per-token entropy, or set "
            "algorithm.entropy_coef: 0"
        )


@torch.no_grad()
def _stats(
    b: ScoredBatch,
    m: Tensor,
    old: Tensor,
    surr: algo.SurrogateOut,
    w: Tensor,
    kl: Tensor,
    pg: Tensor,
    *,
    cap: float | None,
) -> algo.LossStats:
    """Token means over this micro-batch's mask (``cap``: the IS threshold
    when a correction ran)."""
    n = m.sum().clamp(min=1.0)

    def mean(x: Tensor) -> Tensor:
        return torch.where(m > 0, x.detach().to(m.dtype), m.new_zeros(())).sum() / n

    on = m > 0
    zero = m.new_zeros(())
    sampled = b.sampler_logprobs
    return algo.LossStats(
        policy_loss=pg.detach(),
        kl=mean(kl),
        clip_frac=mean(surr.clipped_low | surr.clipped_high),
        clip_frac_low=mean(surr.clipped_low),
        clip_frac_high=mean(surr.clipped_high),
        ratio_mean=mean(surr.ratio),
        ratio_max=surr.ratio.detach()[on].max() if on.any() else m.new_ones(()),
        tis_mean=mean(w),
        tis_capped_frac=mean((w >= cap) | (w == 0)) if cap is not None else zero,
        sampler_kl=mean(algo.sampler_kl(old, sampled)) if sampled is not None else zero,
        num_tokens=m.sum(),
        entropy=mean(b.entropy) if b.entropy is not None else zero,
        logprob_mismatch=mean((old - sampled).abs()) if sampled is not None else zero,
    )

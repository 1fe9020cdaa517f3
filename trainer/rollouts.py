"""Collect token-exact multi-turn episodes: TwinEnv + Renderer + Sampler -> Groups.

This is the rollout side of the trainer. Each episode runs the real :class:`twin.env.TwinEnv`::

    ids = renderer.start(obs)                       # system + user + assistant header
    loop:
        sample = sampler.sample([renderer.ids])     # the whole episode so far is the prompt
        renderer.add_completion(sample.ids, sample.logprobs)
        obs, reward, terminated, truncated, info = env.step(decoded text)
        renderer.add_messages(obs)                  # tool results + next assistant header

All episodes of a call advance together: their next turns go to the sampler as one batch, each
prompt with its own ``max_new_tokens``: the least of ``max_new_tokens``, the episode's token
budget left (``max_episode_tokens`` minus the episode so far) and the context left
(``context_length`` minus the episode so far), so no request ever asks a server for more than
its context holds. An episode with no budget left ends as overlong (truncated, scored). The
G episodes of a case open with the same messages, so their prompt is rendered once and forked
(``Renderer.fork``), and an :class:`~trainer.samplers.HFSampler` prefills it once. The
token record of each episode is stored in ``Trajectory.token_turns`` (prompt ids, sampled ids,
sampler logprobs per assistant turn), so a :class:`twin.trajectory.Group` alone carries
everything the learner needs (:func:`episode_tokens` rebuilds the sequence) and can cross a
process boundary as JSON.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainer.samplers import Sampler
from twin.cases import stable_seed
from twin.core import Twin
from twin.trajectory import Group, Trajectory

__all__ = ["RolloutSettings", "collect_group", "collect_groups", "episode_tokens"]


@dataclass(frozen=True)
class RolloutSettings:
    """How episodes are sampled.

    Attributes:
        max_new_tokens: Most tokens per assistant turn.
        max_episode_tokens: Most tokens per episode (prompt included); the episode is cut there,
            scored as it stands, and marked ``info["overlong"] = True``.
        temperature: Sampling temperature.
        top_p: Nucleus threshold.
        policy_name: Written to ``Trajectory.policy``.
        context_length: The sampler's context length (prompt + completion), when it is shorter
            than ``max_episode_tokens``; None = ``max_episode_tokens`` is the limit.
    """

    max_new_tokens: int = 64
    max_episode_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    policy_name: str = "policy"
    context_length: int | None = None

    @property
    def token_limit(self) -> int:
        """Most tokens an episode may hold: ``max_episode_tokens`` or the context, the smaller."""
        if self.context_length is None:
            return self.max_episode_tokens
        return min(self.max_episode_tokens, self.context_length)

    def budget(self, episode_len: int) -> int:
        """``max_new_tokens`` of the next turn, an ``episode_len``-token episode (0: none left)."""
        return max(0, min(self.max_new_tokens, self.token_limit - episode_len))


#: The reward note of an episode the token budget cut short.
CUT_NOTE = "episode cut at max_episode_tokens"


@dataclass
class _Live:
    env: Any
    renderer: Any
    done: bool = False
    overlong: bool = False
    sample_s: float = 0.0


def collect_groups(
    twin: Twin,
    cases: Sequence[tuple[str, int]],
    sampler: Sampler,
    renderer_factory: Callable[[list[dict[str, Any]]], Any],
    *,
    group_size: int,
    settings: RolloutSettings,
    seed: int,
    policy_version: int = 0,
    decode: Callable[[list[int]], str] | None = None,
) -> list[Group]:
    """Run ``group_size`` episodes of every case, all turns batched through ``sampler``.

    Args:
        twin: The twin (one env per episode is made from it; the world is shared).
        cases: ``(split, index)`` of each group's case.
        sampler: Continues token-id prompts.
        renderer_factory: ``tools -> Renderer`` (one fresh renderer per episode).
        group_size: Episodes per case (G).
        settings: Lengths, temperature, policy name.
        seed: Seeds every sampler call of this collection (call ``k`` uses a derived seed).
        policy_version: Stored on each group (async training).
        decode: ``ids -> text`` for the env (default: the renderer's tokenizer, special
            tokens kept).

    Returns:
        One :class:`Group` per case, trajectories scored, each with its ``token_turns``.
    """
    from twin.env import TwinEnv

    started = time.perf_counter()
    live: list[_Live] = []
    for split, index in cases:
        opening: tuple[Any, Any, Any] | None = None  # (obs, tools, renderer) of the group's first episode
        for _ in range(group_size):
            env = TwinEnv(twin)
            obs, info = env.reset(options={"split": split, "index": int(index)})
            if opening is not None and opening[0] == obs and opening[1] == info["tools"]:
                renderer = opening[2].fork()  # the same opening: render and tokenize it once
            else:
                renderer = renderer_factory(info["tools"])
                renderer.start(obs)
                if hasattr(renderer, "fork"):
                    opening = (obs, info["tools"], renderer)
            env.trajectory.policy = settings.policy_name
            item = _Live(env, renderer)
            if settings.budget(len(renderer.ids)) == 0:
                item.done = item.overlong = True
                env.truncate(CUT_NOTE)  # the env counts turns, not tokens
            live.append(item)
    if decode is None and live:
        tok = live[0].renderer.tokenizer

        def decode(ids: list[int]) -> str:
            return str(tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    stop_ids = sorted(live[0].renderer.stop_ids) if live else None
    call = 0
    while True:
        active = [e for e in live if not e.done]
        if not active:
            break
        budgets = [settings.budget(len(e.renderer.ids)) for e in active]
        t0 = time.perf_counter()
        samples = sampler.sample(
            [e.renderer.ids for e in active],
            # one number when all agree: any Sampler takes it, and a server gets one batch
            max_new_tokens=budgets[0] if len(set(budgets)) == 1 else budgets,
            temperature=settings.temperature,
            top_p=settings.top_p,
            stop_ids=stop_ids,
            seed=stable_seed("rollout", seed, call),
        )
        dt = time.perf_counter() - t0
        call += 1
        for item, sample, budget in zip(active, samples, budgets):
            item.sample_s += dt / len(active)
            ids, lps = list(sample.ids[:budget]), list(sample.logprobs[:budget])
            item.renderer.add_completion(ids, lps)
            body = ids[:-1] if ids and ids[-1] in item.renderer.stop_ids else ids
            refusal = getattr(item.renderer, "refusal", None)
            if refusal:  # the template cannot hold this turn: the env records it and runs nothing
                obs, _reward, terminated, truncated, _info = item.env.refuse(decode(body), refusal)
            else:
                obs, _reward, terminated, truncated, _info = item.env.step(decode(body))
            if terminated or truncated:
                item.done = True
                continue
            item.renderer.add_messages(obs)
            if settings.budget(len(item.renderer.ids)) == 0:
                item.done = item.overlong = True
                item.env.truncate(CUT_NOTE)

    total_s = time.perf_counter() - started
    groups: list[Group] = []
    for g, (split, index) in enumerate(cases):
        trajs: list[Trajectory] = []
        for item in live[g * group_size : (g + 1) * group_size]:
            traj = item.env.trajectory
            traj.token_turns = item.renderer.token_turns()
            traj.completion_tokens = sum(len(t.completion_ids) for t in traj.token_turns)
            traj.info["overlong"] = item.overlong
            traj.info["episode_tokens"] = len(item.renderer.ids)
            traj.info["renderer"] = dict(item.renderer.stats)
            traj.timings["policy"] = item.sample_s
            traj.timings["total"] = total_s
            trajs.append(traj)
        groups.append(Group(case_id=trajs[0].case_id, trajectories=trajs, policy_version=policy_version))
    return groups


def collect_group(
    twin: Twin,
    case: tuple[str, int],
    sampler: Sampler,
    renderer_factory: Callable[[list[dict[str, Any]]], Any],
    *,
    group_size: int,
    settings: RolloutSettings,
    seed: int,
    policy_version: int = 0,
) -> Group:
    """One case's group (see :func:`collect_groups`)."""
    return collect_groups(
        twin, [case], sampler, renderer_factory, group_size=group_size, settings=settings,
        seed=seed, policy_version=policy_version,
    )[0]


def episode_tokens(trajectory: Trajectory) -> tuple[list[int], list[int], list[float]]:
    """Rebuild ``(input_ids, loss_mask, sampler_logprobs)`` from ``trajectory.token_turns``.

    Raises:
        ValueError: the trajectory has no token turns (it was not produced by a sampler).
    """
    if not trajectory.token_turns:
        raise ValueError(
            f"trajectory {trajectory.case_id} has no token_turns: only episodes collected by "
            "trainer.rollouts carry the token record the learner needs"
        )
    ids: list[int] = []
    mask: list[int] = []
    lps: list[float] = []
    for turn in trajectory.token_turns:
        ids.extend(turn.prompt_ids)
        mask.extend([0] * len(turn.prompt_ids))
        lps.extend([0.0] * len(turn.prompt_ids))
        ids.extend(turn.completion_ids)
        mask.extend([1] * len(turn.completion_ids))
        lps.extend(turn.logprobs)
    return ids, mask, lps

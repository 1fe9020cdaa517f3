"""Collect token-exact multi-turn episodes: TwinEnv + Renderer + Sampler -> Groups.

This is the rollout side of the trainer. Each episode runs the real :class:`twin.env.TwinEnv`::

    ids = renderer.start(obs)                       # system + user + assistant header
    loop:
        sample = sampler.sample([renderer.ids])     # the whole episode so far is the prompt
        renderer.add_completion(sample.ids, sample.logprobs)
        obs, reward, terminated, truncated, info = env.step(decoded text)
        renderer.add_messages(obs)                  # tool results + next assistant header

With a sampler that sends each prompt as its own request (:class:`~trainer.samplers.ServerSampler`
on vLLM: ``streams_turns``), episodes advance independently: an episode's next turn is requested
as soon as its tool results are in, so a fast episode never waits for the slowest one of the lot
and the server always has ``concurrency`` requests to batch. Each request is seeded from the
episode's index and turn number, so the samples do not depend on the order answers arrive in.
With other samplers (the in-process engine, ``twin serve``'s batched lots) all episodes of a call
advance together: their next turns go to the sampler as one batch. Either way each prompt has its
own ``max_new_tokens``: the least of ``max_new_tokens``, the episode's token
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
from typing import TYPE_CHECKING, Any

from trainer.samplers import Sample, Sampler
from twin.cases import stable_seed
from twin.core import Twin
from twin.trajectory import Group, Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trainer.config import Recipe
    from trainer.renderer import Renderer
    from twin.env import TwinEnv

__all__ = [
    "RolloutSettings",
    "StepSample",
    "collect_group",
    "collect_groups",
    "episode_tokens",
    "load_tokenizer",
    "recipe_renderer_factory",
    "rollout_settings",
    "sample_step",
    "training_cases",
]


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
class _RunningEpisode:
    """One episode while it is being collected: its env, its token record, whether it ended."""

    env: TwinEnv
    renderer: Renderer
    done: bool = False
    overlong: bool = False
    sample_s: float = 0.0


def collect_groups(
    twin: Twin,
    cases: Sequence[tuple[str, int]],
    sampler: Sampler,
    renderer_factory: Callable[[list[dict[str, Any]]], Renderer],
    *,
    group_size: int,
    settings: RolloutSettings,
    seed: int,
    policy_version: int = 0,
    decode: Callable[[list[int]], str] | None = None,
    new_judge_step: bool = True,
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
        new_judge_step: When the twin's reward scores episodes against their group
            (``twin.needs_group``), start its judges' next budget step before scoring these
            groups (False for a refill round of the same training step).

    Returns:
        One :class:`Group` per case, trajectories scored, each with its ``token_turns``. A reward
        with group terms (RULER-style judges) scores each group's episodes together once all of
        them have ended (:meth:`twin.core.Twin.score_groups`), in one batch for all groups.
    """
    started = time.perf_counter()
    live = _open_episodes(twin, cases, renderer_factory, group_size, settings)
    if decode is None and live:
        decode = _decoder(live[0].renderer.tokenizer)
    stop_ids = sorted(live[0].renderer.stop_ids) if live else None
    if getattr(sampler, "streams_turns", False):
        _advance_independently(live, sampler, settings, seed, stop_ids, decode)
    else:
        _advance_together(live, sampler, settings, seed, stop_ids, decode)
    total_s = time.perf_counter() - started
    groups = [
        _close_group(live[g * group_size : (g + 1) * group_size], total_s, policy_version)
        for g in range(len(cases))
    ]
    if twin.needs_group and live:
        cases_of = [(item.env.trajectory, item.env.case) for item in live]
        twin.score_groups(
            [cases_of[g * group_size : (g + 1) * group_size] for g in range(len(cases))],
            new_step=new_judge_step,
        )
    return groups


def _open_episodes(
    twin: Twin,
    cases: Sequence[tuple[str, int]],
    renderer_factory: Callable[[list[dict[str, Any]]], Renderer],
    group_size: int,
    settings: RolloutSettings,
) -> list[_RunningEpisode]:
    """Reset ``group_size`` envs per case and render their openings (once per group when the
    renderer can fork); an opening already over the token budget ends its episode, overlong."""
    from twin.env import TwinEnv

    live: list[_RunningEpisode] = []
    for split, index in cases:
        opening: tuple[Any, Any, Any] | None = None  # (obs, tools, renderer) of the first episode
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
            item = _RunningEpisode(env, renderer)
            if settings.budget(len(renderer.ids)) == 0:
                item.done = item.overlong = True
                env.truncate(CUT_NOTE)  # the env counts turns, not tokens
            live.append(item)
    return live


def _decoder(tok: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """``ids -> text`` with the tokenizer, special tokens kept (what the env parses)."""

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    return decode


def _close_group(items: list[_RunningEpisode], total_s: float, policy_version: int) -> Group:
    """One case's ended episodes as a :class:`Group`: each trajectory gets its token turns, token
    counts, overlong flag, renderer stats and timings."""
    trajs: list[Trajectory] = []
    for item in items:
        traj = item.env.trajectory
        traj.token_turns = item.renderer.token_turns()
        traj.completion_tokens = sum(len(t.completion_ids) for t in traj.token_turns)
        traj.info["overlong"] = item.overlong
        traj.info["episode_tokens"] = len(item.renderer.ids)
        traj.info["renderer"] = dict(item.renderer.stats)
        traj.timings["policy"] = item.sample_s
        traj.timings["total"] = total_s
        trajs.append(traj)
    return Group(case_id=trajs[0].case_id, trajectories=trajs, policy_version=policy_version)


def _take_turn(
    item: _RunningEpisode,
    sample: Sample,
    budget: int,
    settings: RolloutSettings,
    decode: Callable[[list[int]], str],
) -> None:
    """Record a sampled turn, run it in the env, and append the env's
    answer (or end the episode)."""
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
        return
    item.renderer.add_messages(obs)
    if settings.budget(len(item.renderer.ids)) == 0:
        item.done = item.overlong = True
        item.env.truncate(CUT_NOTE)


def _advance_together(
    live: list[_RunningEpisode],
    sampler: Sampler,
    settings: RolloutSettings,
    seed: int,
    stop_ids: list[int] | None,
    decode: Callable[[list[int]], str],
) -> None:
    """Every unfinished episode's next turn in one sampler call, until all are done."""
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
            _take_turn(item, sample, budget, settings, decode)


def _advance_independently(
    live: list[_RunningEpisode],
    sampler: Sampler,
    settings: RolloutSettings,
    seed: int,
    stop_ids: list[int] | None,
    decode: Callable[[list[int]], str],
) -> None:
    """Each episode in its own task: its next turn is requested as soon as its last one ran.

    At most ``sampler.concurrency`` requests are in flight. The env steps run on the event loop's
    thread, one at a time, while the server keeps decoding the other requests.
    """
    import asyncio

    async def run_all() -> None:
        limit = asyncio.Semaphore(sampler.concurrency)
        async with sampler.client() as client:

            async def episode(k: int, item: _RunningEpisode) -> None:
                turn = 0
                while not item.done:
                    budget = settings.budget(len(item.renderer.ids))
                    t0 = time.perf_counter()
                    async with limit:
                        sample = await sampler.asample_one(
                            client,
                            item.renderer.ids,
                            max_new_tokens=budget,
                            temperature=settings.temperature,
                            top_p=settings.top_p,
                            stop_ids=stop_ids,
                            seed=stable_seed("rollout-episode", seed, k, turn),
                        )
                    item.sample_s += time.perf_counter() - t0
                    turn += 1
                    _take_turn(item, sample, budget, settings, decode)

            tasks = [asyncio.ensure_future(episode(k, e)) for k, e in enumerate(live) if not e.done]
            try:
                await asyncio.gather(*tasks)
            finally:  # one failed request ends the collection: stop the others' requests too
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run_all())


def collect_group(
    twin: Twin,
    case: tuple[str, int],
    sampler: Sampler,
    renderer_factory: Callable[[list[dict[str, Any]]], Renderer],
    *,
    group_size: int,
    settings: RolloutSettings,
    seed: int,
    policy_version: int = 0,
) -> Group:
    """One case's group (see :func:`collect_groups`)."""
    return collect_groups(
        twin,
        [case],
        sampler,
        renderer_factory,
        group_size=group_size,
        settings=settings,
        seed=seed,
        policy_version=policy_version,
    )[0]


def episode_tokens(trajectory: Trajectory) -> tuple[list[int], list[int], list[float]]:
    """Rebuild ``(input_ids, loss_mask, sampler_logprobs)`` from ``trajectory.token_turns``.

    Raises:
        ValueError: the trajectory has no token turns (it was not produced by a sampler).
    """
    if not trajectory.token_turns:
        raise ValueError(
            f"trajectory {trajectory.case_id} has no token_turns: only episodes collected by "
            "trainer.episodes carry the token record the learner needs"
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


# -- one step's sampling, as both training loops run it --------------------------------------------
def rollout_settings(
    cfg: Recipe, *, policy_name: str | None = None, context_length: int | None = None
) -> RolloutSettings:
    """The recipe's :class:`RolloutSettings` (the synchronous loop and the rollout worker both call
    this).

    Args:
        cfg: The recipe (its ``sampler`` section; ``model.path`` names the policy by default).
        policy_name: Written to each trajectory (default: ``model.path``).
        context_length: The sampler's context length, when it has one (:class:`RolloutSettings`).
    """
    s = cfg.sampler
    return RolloutSettings(
        max_new_tokens=s.max_new_tokens,
        max_episode_tokens=s.max_episode_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        policy_name=policy_name or str(cfg.model.path),
        context_length=context_length,
    )


@dataclass
class StepSample:
    """The groups sampled for one learner step.

    Attributes:
        groups: Every group sampled (dynamic sampling's refills included), in order.
        kept: Indexes into ``groups`` of the groups to train on (at most ``groups_per_step``).
        rounds: Refill rounds taken (0 = the first draw was enough).
        max_new_tokens: The per-turn limit the groups were sampled with.
    """

    groups: list[Group]
    kept: list[int]
    rounds: int
    max_new_tokens: int

    @property
    def kept_groups(self) -> list[Group]:
        """The groups to train on."""
        return [self.groups[i] for i in self.kept]

    def stats(self) -> dict[str, float]:
        """The ``batch/*`` metrics of this sample."""
        return {
            "batch/max_new_tokens": float(self.max_new_tokens),
            "batch/groups": float(len(self.kept)),
            "batch/groups_sampled": float(len(self.groups)),
            "batch/refill_rounds": float(self.rounds),
        }


def training_cases(cfg: Recipe, twin: Twin, start: int, n: int) -> list[tuple[str, int]]:
    """The ``n`` training cases at data-cursor position ``start``: the recipe's seeded draw of its
    split (``twin.balance``; :func:`trainer.cases.draw_cases`). Every loop and worker takes its
    cases here."""
    from trainer.cases import draw_cases

    return draw_cases(twin, cfg.twin.split, cfg.seed, start, n, balance=cfg.twin.balance)


def sample_step(
    cfg: Recipe,
    twin: Twin,
    next_cases: Callable[[int], list[tuple[str, int]]],
    sampler: Sampler,
    renderer_factory: Callable[[Any], Renderer],
    settings: RolloutSettings,
    *,
    seed_key: tuple[Any, ...],
    policy_version: int,
) -> StepSample:
    """Sample one step's groups with dynamic sampling: ``groups_per_step`` informative ones, bounded
    refills.

    Each group's trajectories get ``info["shaped_reward"]`` (the env reward plus overlong
    shaping, :func:`trainer.objective.group_rewards`). Without ``algorithm.dynamic_sampling``
    the first draw is kept whole.

    Args:
        cfg: The recipe (``algorithm`` and ``sampler`` sections).
        twin: The twin the episodes run in.
        next_cases: ``n -> the next n (split, index) cases`` (the caller owns the data cursor).
        sampler: Samples the assistant turns.
        renderer_factory: ``tools -> Renderer``.
        settings: This step's rollout settings (its ``max_new_tokens`` is reported in the stats).
        seed_key: Prefix of each round's seed, ``stable_seed(*seed_key, round)`` (the loops keep
            their own prefixes so that a run's samples are what they were).
        policy_version: Written to each group.
    """
    import torch

    from trainer import objective

    n = cfg.algorithm.groups_per_step
    dynamic = cfg.algorithm.dynamic_sampling
    every: list[Group] = []
    kept: list[int] = []
    rounds = 0
    while True:
        groups = collect_groups(
            twin,
            next_cases(n - len(kept)),
            sampler,
            renderer_factory,
            group_size=cfg.algorithm.group_size,
            settings=settings,
            seed=stable_seed(*seed_key, rounds),
            policy_version=policy_version,
            new_judge_step=rounds == 0,
        )
        for g in groups:
            shaped = objective.group_rewards(g, cfg)
            for t, r in zip(g.trajectories, shaped.tolist()):
                t.info["shaped_reward"] = r
            informative = bool(objective.informative(torch.as_tensor(shaped)[None, :])[0])
            if (informative or not dynamic) and len(kept) < n:
                kept.append(len(every))
            every.append(g)
        if len(kept) >= n or not dynamic or rounds >= cfg.algorithm.max_refill_rounds:
            break
        rounds += 1
    return StepSample(every, kept, rounds, settings.max_new_tokens)


def recipe_renderer_factory(
    cfg: Recipe, tokenizer: PreTrainedTokenizerBase, model: str | None = None
) -> Callable[[Any], Renderer]:
    """``tools -> Renderer`` for the recipe's template, ending turns on every id vLLM stops on.

    Args:
        cfg: The recipe (``model.chat_template``, ``model.template_kwargs``, ``model.path``).
        tokenizer: The model's tokenizer.
        model: The model spec or folder whose ``generation_config.json`` names more eos ids
            (default: ``model.path``); see :func:`trainer.samplers.turn_stop_ids`.
    """
    from trainer.models import resolve_model_path
    from trainer.renderer import Renderer
    from trainer.samplers import turn_stop_ids

    stop_ids = turn_stop_ids(tokenizer, resolve_model_path(str(model or cfg.model.path)))

    def factory(tools: Any) -> Renderer:
        return Renderer(
            tokenizer, tools, stop_ids=stop_ids, chat_template=cfg.model.chat_template,
            template_kwargs=cfg.model.template_kwargs,
        )  # fmt: skip

    return factory


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of model ``spec`` (a path or a packaged name such as ``tiny``), with a pad
    token.

    The rollout worker renders with it (it loads no model); the learner gets the same tokenizer
    from :func:`trainer.models.load_model`.
    """
    from transformers import AutoTokenizer

    from trainer.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(spec), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer

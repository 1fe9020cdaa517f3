"""Supervised warm start: train on a trajectory dataset before GRPO (``algorithm: sft``).

::

    twin collect returns --policy oracle --episodes 128 --out runs/datasets/returns-oracle
    twin sft data/recipes/returns-sft-cpu.yaml       # = twin train with algorithm: sft
    twin train returns-sft-cpu.yaml --set algorithm.name=grpo --set model.init_from=runs/returns-sft

The same parts as GRPO: each row's messages are rendered by :class:`trainer.renderer.Renderer`
(:func:`render_row`: the prompt, then every assistant turn as the ids the chat template writes for
it, then the tool results), so the loss mask is the renderer's: 1 on the assistant turns' tokens
(their end-of-turn token included), 0 on the prompt and the tool results, exactly as on a GRPO
episode. Batches go through :meth:`trainer.learner.Learner.score` (token-budget micro-batches,
shared prompts run once), LoRA or full fine-tuning as in the recipe, and the loss is the mean
negative log-likelihood over the step's assistant tokens::

    loss = - sum(mask * log p(token)) / sum(mask)          # one optimizer step per batch

With ``data.emphasis`` the decision's tokens in each demonstration (:func:`emphasis_span`) weigh
``w`` and the rest 1: ``- sum(w * mask * log p) / sum(w * mask)``; their NLL is logged on its own.

Every ``eval.every`` steps (and before the first and after the last) the current weights act in
the twin as an in-process policy (:class:`trainer.hf_policy.HFPolicy`) on cases ``0..eval.cases-1``
of ``eval.split``: ``eval/reward``, ``eval/parse_rate`` (share of assistant turns holding a call
that parses), ``eval/kind/<kind>`` and ``rewards/*`` (so the reward plot is the held-out curve).
Metrics go to ``metrics.jsonl`` (:class:`trainer.metrics.MetricsLogger`), the held-out episodes to
the run store as a ``train`` run of policy ``sft:<model>``, checkpoints to
``<output_dir>/checkpoints/step-N`` (what ``model.init_from`` and ``hf:<checkpoint>`` load).
"""

from __future__ import annotations

import json
import logging
import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.checkpoint import (
    init_model_path,
    load_resumable,
    prepare_output_dir,
    restore_rng,
    save_checkpoint,
    unlock_output_dir,
)
from trainer.config import EmphasisConfig, Recipe, check_devices
from trainer.learner import Learner, TrainBatch
from trainer.metrics import MetricsLogger, close_training_run, open_training_run, plot_rewards
from trainer.renderer import EpisodeTokens, Renderer
from trainer.rows import render_row
from trainer.threads import place_cpu_threads
from twin.cases import stable_seed
from twin.errors import ConfigError
from twin.trajectory import Trajectory

if TYPE_CHECKING:
    from trainer.protocols import RunRecord

__all__ = [
    "SFTEpisode", "SFTTrainer", "emphasis_span", "eval_metrics", "holdout_scores", "parse_rate",
    "render_row", "sft_step",
]  # fmt: skip

log = logging.getLogger("twinrl.trainer")

Message = dict[str, Any]


def parse_rate(trajectories: Sequence[Trajectory]) -> float:
    """Share of the assistant turns that hold at least one tool call and no unparseable one."""
    from twin.parsing import parse_tool_calls

    turns = ok = 0
    for t in trajectories:
        for m in t.messages:
            if m.get("role") != "assistant":
                continue
            turns += 1
            parsed = parse_tool_calls(m)
            ok += (
                bool(parsed.calls) and not parsed.errors and not any(c.error for c in parsed.calls)
            )
    return ok / turns if turns else 0.0


def eval_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """The held-out figures: ``eval/reward``, ``eval/parse_rate``, ``eval/submit_rate`` (share of
    episodes that ended with a valid submit), ``eval/kind/<kind>``, and
    ``rewards/total`` plus ``rewards/<component>`` (the same values, for the reward plot)."""
    if not trajectories:
        return {}
    rewards = [t.reward if t.reward is not None else 0.0 for t in trajectories]
    out = {
        "eval/reward": statistics.fmean(rewards),
        "eval/parse_rate": parse_rate(trajectories),
        "eval/submit_rate": statistics.fmean(float(t.submission is not None) for t in trajectories),
        "eval/episodes": float(len(trajectories)),
        "eval/turns": statistics.fmean(t.num_turns for t in trajectories),
        "eval/invalid_calls": statistics.fmean(t.invalid_calls for t in trajectories),
        "rewards/total": statistics.fmean(rewards),
    }
    by_kind: dict[str, list[float]] = defaultdict(list)
    for t, r in zip(trajectories, rewards):
        by_kind[t.case_kind].append(r)
    for kind, values in sorted(by_kind.items()):
        out[f"eval/kind/{kind}"] = statistics.fmean(values)
    for name in sorted({k for t in trajectories for k in t.components}):
        out[f"rewards/{name}"] = statistics.fmean(t.components.get(name, 0.0) for t in trajectories)
    return out


@dataclass
class SFTEpisode(EpisodeTokens):
    """A rendered demonstration with the span of its decision's tokens (``data.emphasis``).

    Attributes:
        emphasis: ``(start, end)`` of the decision value's ids in ``input_ids`` (end exclusive);
            None where the demonstration has no such decision or no emphasis is set.
        decision: The value those ids spell (one of ``data.emphasis.values``), or None.
    """

    emphasis: tuple[int, int] | None = None
    decision: str | None = None


def emphasis_span(
    renderer: Renderer, messages: Sequence[Message], emphasis: EmphasisConfig, ids: Sequence[int]
) -> tuple[int, int] | None:
    """Where the decision's value lies in ``ids`` (``messages`` rendered by :func:`render_row`).

    The span is the ids the rendering would change had the last ``emphasis.tool`` call given
    ``emphasis.argument`` another of ``emphasis.values``
    (:func:`trainer.choice_probe.candidate_ids`), so it holds exactly the value's tokens however
    the tokenizer merged them with the quotes.

    Returns:
        ``(start, end)`` (end exclusive), or None where the demonstration has no such call, its
        value is not one of ``values``, or its rendering differs from the candidates' before the
        span ends (a template that writes the arguments otherwise).
    """
    from trainer.choice_probe import candidate_ids, truth_of

    try:
        truth = truth_of(messages, emphasis.tool, emphasis.argument)
    except ConfigError:
        return None
    if truth not in emphasis.values:
        return None
    prefix, values = candidate_ids(
        renderer, messages, emphasis.tool, emphasis.argument, emphasis.values
    )
    start, end = len(prefix), len(prefix) + len(values[truth])
    if end == start or list(ids[:end]) != prefix + values[truth]:
        return None
    return start, end


def _weights(episode: EpisodeTokens, weight: float) -> list[float]:
    """Per-token loss weights: ``weight`` on the episode's emphasis span, 1 elsewhere."""
    out = [1.0] * len(episode.input_ids)
    span = getattr(episode, "emphasis", None)
    if span is not None:
        out[span[0] : span[1]] = [weight] * (span[1] - span[0])
    return out


def _span_nll(logp: torch.Tensor, span: tuple[int, int]) -> float:
    """The summed NLL of ``span``'s tokens; ``logp[t]`` is the logprob of token ``t + 1``."""
    return -float(logp[span[0] - 1 : span[1] - 1].float().sum())


def _decision_scores(scored: list[tuple[str | None, float]], prefix: str) -> dict[str, float]:
    """From ``(decision, its NLL)`` per emphasised episode: ``<prefix>`` (the mean NLL) and, per
    decision value, ``<prefix>/<value>`` (its mean) and ``<prefix>_count/<value>`` (its
    episodes), so a report can pool steps by value; nothing without episodes."""
    if not scored:
        return {}
    out = {prefix: sum(v for _, v in scored) / len(scored)}
    for value in sorted({d for d, _ in scored if d is not None}):
        mine = [v for d, v in scored if d == value]
        out[f"{prefix}/{value}"] = sum(mine) / len(mine)
        out[f"{prefix}_count/{value}"] = float(len(mine))
    return out


def sft_step(
    learner: Learner, episodes: Sequence[EpisodeTokens], *, emphasis_weight: float = 1.0
) -> dict[str, float]:
    """One optimizer step of mean token negative log-likelihood on ``episodes``' loss masks.

    Args:
        learner: The learner (its micro-batching, LoRA or full weights, AdamW).
        episodes: Rendered rows (:func:`render_row`; :class:`SFTEpisode` with their emphasis).
        emphasis_weight: The loss weight of the emphasis spans' tokens (1: unweighted).

    Returns:
        ``losses/loss`` (the loss minimised: ``losses/nll`` unless an emphasis weight is set),
        ``losses/nll`` (per assistant token), ``sft/emphasis_nll`` (where some episodes have an
        emphasis span: the decision's summed NLL per such episode; per decision value too,
        ``sft/emphasis_nll/<value>`` with ``sft/emphasis_nll_count/<value>``),
        ``sft/token_confident``
        (share of assistant tokens the model gives a probability above 0.5),
        ``policy/entropy``, ``policy/grad_norm``, ``optim/lr``, ``optim/skipped_nonfinite``,
        ``sft/tokens``, ``perf/learner_s``, ``perf/learner_tokens_per_s``.
    """
    started = time.perf_counter()
    spans = [getattr(e, "emphasis", None) for e in episodes]
    weighted = emphasis_weight != 1.0 and any(spans)
    batch = TrainBatch(
        [list(e.input_ids) for e in episodes], [list(e.loss_mask) for e in episodes],
        [[0.0] * len(e.input_ids) for e in episodes], [1.0] * len(episodes),
        token_weights=[_weights(e, emphasis_weight) for e in episodes] if weighted else None,
    )  # fmt: skip
    tokens = sum(map(sum, batch.loss_mask))
    if tokens == 0:
        raise ValueError("sft_step: the episodes hold no assistant tokens")
    total_weight = (
        sum(w for ws, m in zip(batch.token_weights, batch.loss_mask) for w, k in zip(ws, m) if k)
        if batch.token_weights is not None
        else tokens
    )
    longest = max(len(ids) for ids in batch.input_ids)
    if longest > learner.optim_config.micro_batch_tokens:
        raise ConfigError(
            f"sft: an episode of {longest} tokens exceeds optim.micro_batch_tokens "
            f"({learner.optim_config.micro_batch_tokens}); raise it or lower "
            "sampler.max_episode_tokens"
        )
    learner.model.train()
    learner.optimizer.zero_grad(set_to_none=True)
    loss_sum = nll = confident = entropy = 0.0
    decisions: list[tuple[str | None, float]] = []
    for scored in learner.score(batch, range(len(batch))):
        mask = scored.mask
        weighted_mask = mask if scored.weights is None else mask * scored.weights
        loss = -(scored.logprobs * weighted_mask).sum() / total_weight
        loss.backward()
        loss_sum += float(loss.detach())
        nll -= float((scored.logprobs.detach() * mask).sum()) / tokens
        confident += float(((scored.logprobs > math.log(0.5)).float() * mask).sum())
        if scored.entropy is not None:
            entropy += float((scored.entropy.detach() * mask).sum())
        for r, i in enumerate(scored.rows or ()):
            if spans[i] is not None:
                nll_i = _span_nll(scored.logprobs.detach()[r], spans[i])
                decisions.append((getattr(episodes[i], "decision", None), nll_i))
    norm, applied = learner.apply_gradients(loss_sum)
    learner.model.eval()
    elapsed = time.perf_counter() - started
    return {
        "losses/loss": loss_sum,
        "losses/nll": nll,
        **_decision_scores(decisions, "sft/emphasis_nll"),
        "sft/token_confident": confident / tokens,
        "sft/tokens": float(tokens),
        "sft/episodes": float(len(batch)),
        "policy/entropy": entropy / tokens,
        "policy/grad_norm": norm,
        "optim/lr": float(learner.optimizer.param_groups[0]["lr"]),
        "optim/skipped_nonfinite": float(not applied),
        "perf/learner_s": elapsed,
        "perf/learner_tokens_per_s": sum(len(i) for i in batch.input_ids) / elapsed
        if elapsed > 0
        else 0.0,
    }


def holdout_scores(learner: Learner, episodes: Sequence[EpisodeTokens]) -> dict[str, float]:
    """Under the current weights (no grad; the learner's micro-batches and shared prompts):
    ``loss``, the mean negative log-likelihood per assistant token of ``episodes``, and, where
    some have an emphasis span (:class:`SFTEpisode`), ``emphasis_nll``, its summed NLL averaged
    over those episodes (minus the log-probability of the right decision), and the same per
    decision value (``emphasis_nll/<value>``, ``emphasis_nll_count/<value>``)."""
    batch = TrainBatch(
        [list(e.input_ids) for e in episodes], [list(e.loss_mask) for e in episodes],
        [[0.0] * len(e.input_ids) for e in episodes], [0.0] * len(episodes),
    )  # fmt: skip
    logp = learner.scorer.frozen_logprobs(batch, reference=False)
    total = tokens = 0.0
    decisions: list[tuple[str | None, float]] = []
    for i, mask in enumerate(batch.loss_mask):
        m = torch.tensor(mask[1:], dtype=torch.float32)
        total -= float((logp[i].float().cpu() * m).sum())
        tokens += float(m.sum())
        span = getattr(episodes[i], "emphasis", None)
        if span is not None:
            decisions.append(
                (getattr(episodes[i], "decision", None), _span_nll(logp[i].cpu(), span))
            )
    return {
        "loss": total / tokens if tokens else 0.0,
        **_decision_scores(decisions, "emphasis_nll"),
    }


class SFTTrainer:
    """Supervised fine-tuning on trajectory datasets; the interface of
    :class:`trainer.sync_trainer.SyncTrainer`.

    Args:
        cfg: A recipe with ``algorithm.name: sft`` and ``data.paths``.
        resume: Continue from the newest checkpoint in ``train.output_dir``.
        overwrite: Delete the checkpoints an earlier run left there (else :meth:`setup` refuses).
        on_step: Called with each step's metrics record.
    """

    def __init__(
        self, cfg: Recipe, *, resume: bool = False, overwrite: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:  # fmt: skip
        if cfg.algorithm.name != "sft":
            raise ConfigError(f"SFTTrainer needs algorithm.name: sft, got {cfg.algorithm.name!r}")
        self.cfg = cfg
        self.resume = resume
        self.overwrite = overwrite
        self.on_step = on_step
        self.output_dir = Path(cfg.train.output_dir)
        self.step = 0
        self.run_id: int | None = None
        self.store: RunRecord | None = None
        self.episodes: list[EpisodeTokens] = []
        self.held_out: list[EpisodeTokens] = []
        self.dropped: dict[str, int] = {}
        #: Early stopping's state: the best watched held-out figure (data.patience_on), evaluations
        #: since it, stopped or not.
        self.best_holdout: float | None = None
        self.since_best = 0
        self.stopped_early = False

    # ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Seed; build the twin, model, learner and renderer; render the dataset; metrics, store."""
        from trainer.runtime import build_learner, seed_everything
        from twin.registry import make_twin

        cfg = self.cfg
        check_devices(cfg)
        checkpoint = prepare_output_dir(
            self.output_dir, resume=self.resume, overwrite=self.overwrite
        )
        seed_everything(cfg.seed)
        place_cpu_threads(cfg.devices.cpu_threads)
        self.twin = make_twin(cfg.twin.name, **cfg.twin.config)
        if cfg.eval.cases:
            self.twin.num_cases(cfg.eval.split)  # an unknown split fails before the model loads
        rows = self._read_rows()
        self.model_path = init_model_path(
            cfg.model.path, cfg.model.init_from, self.output_dir, cfg.model.dtype
        )
        # the GRPO loops' model, LoRA and learner; NLL is taken at temperature 1
        self.learner, self.tokenizer = build_learner(cfg, self.model_path, temperature=1.0)
        self.episodes, self.held_out = self._split_holdout(self._render(rows))
        self.total_steps = math.ceil(cfg.data.epochs * len(self.episodes) / cfg.data.batch_size)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "recipe.yaml").write_text(cfg.to_yaml())
        if (
            checkpoint is not None
        ):  # the newest that loads: a damaged one falls back to the one before
            checkpoint, state = load_resumable(self.output_dir, checkpoint)
            self.learner.load_state_dict(state["learner"])
            self.step = int(state["step"])
            self.run_id = state.get("run_id")
            self.best_holdout = state.get("best_holdout")
            self.since_best = int(state.get("since_best", 0))
            self.stopped_early = bool(state.get("stopped_early", False))
            if self.stopped_early:
                self.total_steps = self.step
            restore_rng(state["rng"])
            log.info("resumed from %s (step %d)", checkpoint, self.step)
        self.metrics = MetricsLogger(
            self.output_dir, resume_step=self.step if checkpoint else None, sinks=cfg.train.log,
            config=cfg.model_dump(mode="json", by_alias=True),
        )  # fmt: skip
        self._setup_store()

    def renderer(self, tools: Sequence[dict[str, Any]]) -> Renderer:
        """A renderer for this model, the recipe's chat template and ``tools``."""
        cfg = self.cfg
        return Renderer(
            self.tokenizer, list(tools), chat_template=cfg.model.chat_template,
            template_kwargs=cfg.model.template_kwargs,
        )  # fmt: skip

    def _read_rows(self) -> list[dict[str, Any]]:
        from twin.evaluation.collect import read_dataset

        rows: list[dict[str, Any]] = []
        for path in self.cfg.data.paths:
            rows.extend(read_dataset(path, min_reward=self.cfg.data.min_reward))
        if not rows:
            raise ConfigError(
                f"data.paths {self.cfg.data.paths} hold no rows"
                + (
                    f" with reward >= {self.cfg.data.min_reward}"
                    if self.cfg.data.min_reward is not None
                    else ""
                )
                + "; collect some with `twin collect`"
            )
        return rows

    def _render(self, rows: list[dict[str, Any]]) -> list[EpisodeTokens]:
        limit = self.cfg.sampler.max_episode_tokens
        out: list[EpisodeTokens] = []
        dropped = {"too_long": 0, "no_assistant_turn": 0}
        renderers: dict[str, Renderer] = {}
        for row in rows:
            tools = row.get("tools") or []
            key = json.dumps(tools, sort_keys=True)
            if key not in renderers:
                renderers[key] = self.renderer(tools)
            if not any(m.get("role") == "assistant" for m in row["messages"]):
                dropped["no_assistant_turn"] += 1
                continue
            episode = render_row(renderers[key], row["messages"])
            if len(episode) > limit:
                dropped["too_long"] += 1
                continue
            out.append(self._emphasised(renderers[key], row["messages"], episode))
        self.dropped = dropped
        self._check_emphasis(out)
        if dropped["too_long"]:
            log.warning(
                "sft: %d of %d episodes are longer than sampler.max_episode_tokens (%d) and are "
                "left out",
                dropped["too_long"],
                len(rows),
                limit,
            )
        if not out:
            raise ConfigError(
                f"sft: none of the {len(rows)} dataset rows fits sampler.max_episode_tokens "
                f"({limit}) or has an assistant turn; raise max_episode_tokens (and "
                "optim.micro_batch_tokens)"
            )
        return out

    def _emphasised(
        self, renderer: Renderer, messages: Sequence[Message], episode: EpisodeTokens
    ) -> EpisodeTokens:
        """``episode`` with its decision's span (``data.emphasis``), or as it is without one."""
        emphasis = self.cfg.data.emphasis
        if emphasis is None:
            return episode
        from trainer.choice_probe import truth_of

        span = emphasis_span(renderer, messages, emphasis, episode.input_ids)
        # a span exists only where the call and its value do, so truth_of finds them
        decision = truth_of(messages, emphasis.tool, emphasis.argument) if span else None
        return SFTEpisode(
            list(episode.input_ids), list(episode.loss_mask), list(episode.sampler_logprobs),
            list(episode.turn_spans), episode.prompt_len, emphasis=span, decision=decision,
        )  # fmt: skip

    def _check_emphasis(self, episodes: list[EpisodeTokens]) -> None:
        """Refuse an emphasis no demonstration has; say how many lack it."""
        emphasis = self.cfg.data.emphasis
        if emphasis is None:
            return
        without = sum(getattr(e, "emphasis", None) is None for e in episodes)
        said = (
            f"data.emphasis: {without} of {len(episodes)} demonstrations have no "
            f"{emphasis.tool!r} call whose {emphasis.argument!r} is one of {emphasis.values}"
        )
        if without == len(episodes):
            raise ConfigError(said + "; check the tool, the argument and the values")
        if without:
            log.warning("%s; they train unweighted and are not scored on their own", said)

    def _split_holdout(
        self, episodes: list[EpisodeTokens]
    ) -> tuple[list[EpisodeTokens], list[EpisodeTokens]]:
        """``data.holdout`` episodes drawn with a seed (the same on every resume) and the rest."""
        n = self.cfg.data.holdout
        if not n:
            return episodes, []
        if n >= len(episodes):
            raise ConfigError(
                f"data.holdout {n} leaves no training episode (the dataset renders "
                f"{len(episodes)}); lower it"
            )
        idx = list(range(len(episodes)))
        random.Random(stable_seed("sft-holdout", self.cfg.seed)).shuffle(idx)
        held = set(idx[:n])
        held_out = [episodes[i] for i in sorted(held)]
        if self.cfg.data.patience_on == "emphasis_nll" and all(
            getattr(e, "emphasis", None) is None for e in held_out
        ):
            raise ConfigError(
                f"data.patience_on: emphasis_nll, but none of the {n} held-out demonstrations "
                "has the emphasised decision, so there is nothing to watch; raise data.holdout "
                "or set patience_on: loss"
            )
        return [e for i, e in enumerate(episodes) if i not in held], held_out

    def _setup_store(self) -> None:
        self.store, self.run_id = open_training_run(
            self.cfg, self.twin.name, self.run_id, policy=f"sft:{self.cfg.model.path}"
        )

    # ------------------------------------------------------------------------------------------
    def order(self) -> list[int]:
        """Every step's episodes in order: one seeded shuffle per epoch, epochs back to back."""
        cfg = self.cfg
        seed = cfg.data.shuffle_seed if cfg.data.shuffle_seed is not None else cfg.seed
        out: list[int] = []
        for epoch in range(cfg.data.epochs):
            idx = list(range(len(self.episodes)))
            random.Random(stable_seed("sft-shuffle", seed, epoch)).shuffle(idx)
            out.extend(idx)
        return out

    def evaluate(self) -> tuple[dict[str, float], list[Trajectory]]:
        """The current weights as an in-process policy on ``eval.cases`` cases of ``eval.split``."""
        from trainer.hf_policy import HFPolicy
        from twin.evaluation import evaluate

        cfg = self.cfg
        n = min(cfg.eval.cases, self.twin.num_cases(cfg.eval.split))
        if n <= 0:
            return {}, []
        policy = HFPolicy(
            self.learner.model,
            self.tokenizer,
            name=f"sft:{cfg.model.path}@{self.learner.version}",
            temperature=cfg.eval.temperature,
            max_new_tokens=cfg.sampler.max_new_tokens,
            seed=cfg.seed,
            chat_template=cfg.model.chat_template,
            template_kwargs=cfg.model.template_kwargs,
            autocast=cfg.model.autocast,
        )
        result = evaluate(
            self.twin, policy, [(cfg.eval.split, i) for i in range(n)], store=None, progress=False
        )
        trajectories = [t for g in result.groups for t in g.trajectories]
        return eval_metrics(trajectories), trajectories

    def _holdout_due(self, step: int) -> bool:
        """After each epoch's last step, every ``data.holdout_every`` steps, and after the last."""
        if not self.held_out:
            return False
        per_epoch = len(self.episodes) / self.cfg.data.batch_size
        epoch_end = math.floor(step / per_epoch) > math.floor((step - 1) / per_epoch)
        every = self.cfg.data.holdout_every
        return epoch_end or step == self.total_steps or bool(every and step % every == 0)

    def _holdout_record(self) -> dict[str, float]:
        """``sft/holdout_loss`` now, the best so far of the figure early stopping watches
        (``data.patience_on``), its verdict and, with ``data.emphasis``,
        ``sft/holdout_emphasis_nll`` (and per decision value, as :func:`holdout_scores`)."""
        scores = holdout_scores(self.learner, self.held_out)
        watched = scores[self.cfg.data.patience_on]
        if self.best_holdout is None or watched < self.best_holdout:
            self.best_holdout, self.since_best = watched, 0
        else:
            self.since_best += 1
        patience = self.cfg.data.patience
        self.stopped_early = bool(patience) and self.since_best >= patience
        record = {"sft/holdout_loss": scores["loss"], "sft/holdout_best": float(self.best_holdout),
                  "sft/stopped_early": float(self.stopped_early)}  # fmt: skip
        record.update({f"sft/holdout_{k}": v for k, v in scores.items() if k != "loss"})
        return record

    def _due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return step == 0 or step == self.total_steps or (every > 0 and step % every == 0)

    def train(self) -> list[dict[str, Any]]:
        """Run the remaining steps; return the metrics history.

        The record of step ``s`` holds the update made at ``s`` and, on evaluation steps, the
        held-out figures of the weights *before* it (as a GRPO record's rewards are of the weights
        that sampled them); one last record at ``step = total_steps`` holds the final evaluation.
        """
        cfg = self.cfg
        order = self.order()
        bs = cfg.data.batch_size
        while self.step < self.total_steps:
            step = self.step
            t_step = time.perf_counter()
            record: dict[str, Any] = {}
            held_out: list[Trajectory] = []
            if cfg.eval.cases and self._due(step):
                t0 = time.perf_counter()
                ev, held_out = self.evaluate()
                record.update(ev)
                record["perf/eval_s"] = time.perf_counter() - t0
            rows = order[step * bs : (step + 1) * bs]
            emphasis = cfg.data.emphasis
            record.update(
                sft_step(
                    self.learner,
                    [self.episodes[i] for i in rows],
                    emphasis_weight=emphasis.weight if emphasis else 1.0,
                )
            )
            self.step = step + 1
            if self._holdout_due(self.step):
                record.update(self._holdout_record())
            record["sft/epoch"] = step * bs / max(1, len(self.episodes))
            record["policy/version"] = float(self.learner.version)
            record["perf/step_s"] = time.perf_counter() - t_step
            self._record(step, record, held_out)
            if self.stopped_early:
                log.info(
                    "sft: held-out loss has not improved for %d evaluations; stopped at step %d",
                    self.since_best,
                    self.step,
                )
                self.total_steps = self.step
            every_n = cfg.train.checkpoint_every
            if (every_n and self.step % every_n == 0) or self.step == self.total_steps:
                self.save()
        if cfg.eval.cases and not any(r["step"] == self.total_steps for r in self.metrics.history):
            ev, held_out = self.evaluate()
            # the evaluation after the last update: a record of its own, not a step's progress
            self._record(
                self.total_steps,
                {**ev, "policy/version": float(self.learner.version)},
                held_out,
                progress=False,
            )
        return list(self.metrics.history)

    def _record(
        self,
        step: int,
        record: dict[str, Any],
        held_out: list[Trajectory],
        *,
        progress: bool = True,
    ) -> None:
        record = self.metrics.log(step, record, episodes=held_out or None)
        if self.store is not None and self.run_id is not None:
            try:
                if held_out:
                    self.store.add_episodes(self.run_id, held_out, step=step)
                self.store.log_metrics(
                    self.run_id, step, {k: v for k, v in record.items() if k != "step"}
                )
            except Exception as exc:  # noqa: BLE001 - keep training; say why episodes are missing
                log.warning("run store write failed at step %d: %s", step, exc)
        if self.on_step is not None and progress:
            self.on_step(record)

    def save(self) -> Path:
        """Write a checkpoint (``adapter/`` is what ``model.init_from`` and ``hf:`` load)."""
        return save_checkpoint(
            self.output_dir,
            self.step,
            learner=self.learner,
            state={
                "run_id": self.run_id,
                "metrics": list(self.metrics.history),
                "dropped": dict(self.dropped),
                "total_steps": self.total_steps,
                "best_holdout": self.best_holdout,
                "since_best": self.since_best,
                "stopped_early": self.stopped_early,
            },
            recipe_yaml=self.cfg.to_yaml(),
        )

    def cleanup(self) -> Path | None:
        """Plot the held-out reward curve, finish the store run; return the plot's path."""
        plot = None
        try:
            plot = plot_rewards(
                self.metrics.history,
                self.output_dir / "rewards.png",
                title=f"{self.twin.name}: SFT {self.cfg.model.path} (held-out "
                f"{self.cfg.eval.split})",
            )
        finally:
            self.metrics.close()
            last = next((r for r in reversed(self.metrics.history) if "eval/reward" in r), {})
            close_training_run(
                self.store, self.run_id, done=self.step >= self.total_steps, summary=last
            )
            unlock_output_dir(self.output_dir)  # another process may now train into the folder
        return plot

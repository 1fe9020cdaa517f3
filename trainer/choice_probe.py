"""Judgement with the evidence given: which value a model prefers for one argument of a final
tool call, teacher-forced on an expert's episode.

An agent that scores badly may fail at the procedure (it never gathers the evidence, or never
submits) or at the judgement (it has the evidence and still decides wrong). A greedy evaluation
mixes the two; this probe separates them. For each expert episode (a ``twin collect`` dataset
row), the expert's own conversation is rendered up to the call that decides (the catalog's
``submit``), the decided argument (``decision``) is set to each candidate value in turn, and the
model scores each candidate's tokens after that shared prefix::

    logprob(value) = sum log p(token | expert's conversation so far, call up to the value)

The model's choice is the candidate with the highest sum. Everything before the value is the
expert's, so a model that picks the expert's value on held-out cases has learned the judgement;
one that does on its training cases only has memorised it; one that does on neither has not
learned it.

Each episode costs one forward pass over the shared prefix (its keys and values kept) and one
short pass per candidate over the tokens where the candidates differ (:func:`choice_logprobs`).
``scripts/choice_probe.py`` runs it on a dataset and prints accuracy by true value and by case
kind.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trainer.models import cache_keyword
from trainer.rows import render_row
from trainer.scoring import autocast_context
from twin.errors import ConfigError

if TYPE_CHECKING:
    from trainer.renderer import Renderer

__all__ = [
    "ChoiceScore",
    "candidate_ids",
    "choice_logprobs",
    "score_row",
    "summarize",
    "truth_of",
]

Message = dict[str, Any]


@dataclass(frozen=True)
class ChoiceScore:
    """The model's log-probability of each candidate value on one expert episode.

    Attributes:
        index: The case index of the row.
        case_kind: The row's case kind (None when the dataset has none).
        truth: The value the expert chose.
        logprobs: Candidate value -> summed log-probability of its tokens after the shared prefix.
    """

    index: int
    case_kind: str | None
    truth: str
    logprobs: dict[str, float]

    @property
    def choice(self) -> str:
        """The candidate the model scores highest."""
        return max(self.logprobs, key=lambda v: self.logprobs[v])

    @property
    def truth_prob(self) -> float:
        """The probability of the expert's value among the candidates (softmax of the sums)."""
        top = max(self.logprobs.values())
        weights = {v: math.exp(lp - top) for v, lp in self.logprobs.items()}
        return weights[self.truth] / sum(weights.values())


def _deciding_call(messages: Sequence[Message], tool: str) -> tuple[int, int]:
    """``(message index, call index)`` of the last call to ``tool`` in an assistant turn."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.get("role") != "assistant":
            continue
        for j, call in enumerate(m.get("tool_calls") or ()):
            if call.get("function", {}).get("name") == tool:
                return i, j
    raise ConfigError(f"choice probe: no assistant turn calls {tool!r}; the row cannot be probed")


def _with_value(
    messages: Sequence[Message], at: tuple[int, int], argument: str, value: str
) -> list[Message]:
    """The conversation up to the deciding turn, with ``argument`` of its call set to ``value``."""
    i, j = at
    msgs = [dict(m) for m in messages[: i + 1]]
    turn = dict(msgs[i])
    calls = [dict(c) for c in turn["tool_calls"]]
    function = dict(calls[j]["function"])
    raw = function.get("arguments") or "{}"
    args = _arguments(function, argument)
    args[argument] = value
    function["arguments"] = json.dumps(args) if isinstance(raw, str) else args
    calls[j] = {**calls[j], "function": function}
    turn["tool_calls"] = calls
    msgs[i] = turn
    return msgs


def _arguments(function: dict[str, Any], argument: str) -> dict[str, Any]:
    """A call's arguments (a JSON string or a dict) as a new dict that holds ``argument``."""
    raw = function.get("arguments") or "{}"
    args = json.loads(raw) if isinstance(raw, str) else dict(raw)
    if argument not in args:
        raise ConfigError(
            f"choice probe: the {function.get('name')!r} call has no argument {argument!r} "
            f"(it has {sorted(args)})"
        )
    return args


def truth_of(messages: Sequence[Message], tool: str, argument: str) -> str:
    """The value the episode's last ``tool`` call gave ``argument``."""
    i, j = _deciding_call(messages, tool)
    return str(_arguments(messages[i]["tool_calls"][j]["function"], argument)[argument])


def candidate_ids(
    renderer: Renderer,
    messages: Sequence[Message],
    tool: str,
    argument: str,
    values: Sequence[str],
) -> tuple[list[int], dict[str, list[int]]]:
    """The shared prefix's ids and, per candidate, the ids where the candidates differ.

    Each candidate's conversation is rendered whole (:func:`trainer.rows.render_row`, the tokens a
    model trained on it saw); the prefix is the longest run of ids all of them start with and
    the common suffix (the rest of the call, the end of the turn) is dropped, so each candidate
    keeps exactly the ids its value changed, however the tokenizer merged them with the quotes.
    """
    if len(set(values)) < 2:
        raise ConfigError(f"choice probe: give at least two different values, got {list(values)}")
    at = _deciding_call(messages, tool)
    rendered = {
        v: render_row(renderer, _with_value(messages, at, argument, v)).input_ids for v in values
    }
    seqs = list(rendered.values())
    shortest = min(len(s) for s in seqs)
    start = 0
    while start < shortest and all(s[start] == seqs[0][start] for s in seqs):
        start += 1
    tail = 0
    while tail < shortest - start and all(s[-1 - tail] == seqs[0][-1 - tail] for s in seqs):
        tail += 1
    prefix = seqs[0][:start]
    if not prefix:
        raise ConfigError("choice probe: the candidates share no prefix to condition on")
    return prefix, {v: s[start : len(s) - tail] for v, s in rendered.items()}


@torch.no_grad()
def choice_logprobs(
    model: torch.nn.Module,
    prefix: list[int],
    continuations: dict[str, list[int]],
    *,
    autocast: str | None = None,
) -> dict[str, float]:
    """Summed log-probability of each continuation after ``prefix``, the prefix run once.

    Args:
        model: A causal LM (peft models too).
        prefix: Ids every continuation follows.
        continuations: Candidate -> its ids (at least one id each).
        autocast: Run under ``torch.autocast`` to this dtype (``"bfloat16"``), as the evaluation
            that this is compared with did.
    """
    device = next(model.parameters()).device
    cache_kw = cache_keyword(model)
    with autocast_context(autocast, device):
        # only the last position's logits: the vocabulary head over the whole prefix is wasted
        out = model(
            input_ids=torch.tensor([prefix], device=device), use_cache=True, logits_to_keep=1
        )
        cache = getattr(out, "cache", None) or out.past_key_values
        last = out.logits[0, -1].float().log_softmax(-1)
        scores: dict[str, float] = {}
        for value, ids in continuations.items():
            if not ids:
                raise ConfigError(f"choice probe: the candidate {value!r} adds no tokens")
            total = float(last[ids[0]])
            if len(ids) > 1:
                ids_t = torch.tensor([ids], device=device)
                step = model(input_ids=ids_t, use_cache=True, **{cache_kw: cache})
                logp = step.logits[0, :-1].float().log_softmax(-1)
                total += float(logp.gather(1, torch.tensor(ids[1:], device=device)[:, None]).sum())
                cache.crop(-len(ids))  # back to the shared prefix for the next candidate
            scores[value] = total
    return scores


def score_row(
    model: torch.nn.Module,
    renderer: Renderer,
    row: dict[str, Any],
    *,
    tool: str,
    argument: str,
    values: Sequence[str],
    autocast: str | None = None,
) -> ChoiceScore:
    """Probe one dataset row: the model's log-probability of each value of ``argument``."""
    messages = row["messages"]
    truth = truth_of(messages, tool, argument)
    if truth not in values:
        raise ConfigError(
            f"choice probe: row {row.get('index')} chose {truth!r}, which is not among the "
            f"candidates {list(values)}"
        )
    prefix, continuations = candidate_ids(renderer, messages, tool, argument, values)
    return ChoiceScore(
        index=int(row.get("index", -1)),
        case_kind=row.get("case_kind"),
        truth=truth,
        logprobs=choice_logprobs(model, prefix, continuations, autocast=autocast),
    )


def summarize(scores: Sequence[ChoiceScore], values: Sequence[str]) -> dict[str, Any]:
    """Accuracy overall, by true value and by case kind, the confusion counts (true value ->
    chosen value -> count) and the mean probability of the true value."""
    if not scores:
        raise ConfigError("choice probe: no rows were scored")
    by_truth: dict[str, list[bool]] = defaultdict(list)
    by_kind: dict[str, list[bool]] = defaultdict(list)
    confusion: dict[str, Counter[str]] = {v: Counter() for v in values}
    for s in scores:
        right = s.choice == s.truth
        by_truth[s.truth].append(right)
        by_kind[s.case_kind or "?"].append(right)
        confusion.setdefault(s.truth, Counter())[s.choice] += 1
    return {
        "rows": len(scores),
        "accuracy": sum(s.choice == s.truth for s in scores) / len(scores),
        "truth_prob": sum(s.truth_prob for s in scores) / len(scores),
        "chosen": dict(Counter(s.choice for s in scores)),
        "by_truth": {k: {"rows": len(v), "accuracy": sum(v) / len(v)} for k, v in by_truth.items()},
        "by_kind": {
            k: {"rows": len(v), "accuracy": sum(v) / len(v)} for k, v in sorted(by_kind.items())
        },
        "confusion": {k: dict(c) for k, c in confusion.items()},
    }

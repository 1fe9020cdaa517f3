"""Judge terms: a pointwise rubric and a RULER-style group ranking, weighted like any term.

::

    from rewards import Reward
    from rewards.judge import Judge
    from rewards.judge_terms import group_term, rubric_term, score_episodes

    judge = Judge("openai:gpt-4o-mini", max_calls_per_step=512)
    tone = rubric_term("tone", judge, "Is the reply polite and clear?", scale=(1, 5))
    best = group_term("ranked", judge, "Which attempt solves the customer's problem best?")
    reward = Reward({correct: 0.7, tone: 0.1, best: 0.2})
    results = score_episodes(reward, [(trajectory, case), ...])   # batched, concurrent, cached

**Rubric term** (:func:`rubric_term`): one question and an integer scale asked about one
episode; the answer must end in ``SCORE: <n>`` (a lone integer in range is accepted too). The
value is ``(n - lo) / (hi - lo)`` in ``[0, 1]``. Called as a plain term it asks the judge
(cached); :func:`score_episodes` first asks for every episode at once.

**Group term** (:func:`group_term`, after OpenPipe ART's RULER): the episodes of one case are
shown to the judge together, each under a label, and scored 0-10 relative to each other; the
scores are normalised within the group (``rank``: average ranks scaled to ``[0, 1]``;
``minmax``; ``none``: score / 10). The group is shown in a canonical order (distinct episodes
sorted by the hash of what the judge reads; duplicates shown once and scored alike), so the
prompt, and so the order of the scores, do not depend on the order the episodes arrive in. A
group term has a value only inside :func:`score_episodes` (or :func:`score_group`): alone, one
episode has no group, and calling it is an error that says so.

**Stored with the episode.** Each judge answer is written to ``trajectory.info["judge"][term]``
(judge spec, cache key, prompt key, answer, whether it was cached) and summarised in the
reward's notes, which the episode store keeps.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rewards._reward import Reward, RewardResult
from rewards._terms import Scored, Term, TermError
from rewards.judge import JudgeAnswer, JudgeLike, Messages, active_judge
from twin.errors import ConfigError

__all__ = [
    "GroupTerm",
    "RubricTerm",
    "group_term",
    "parse_group_scores",
    "parse_score",
    "render_episode",
    "rubric_term",
    "score_episodes",
    "score_group",
    "score_groups",
]

#: ``render(trajectory, case) -> str``: what the judge reads about one episode.
Render = Callable[[Any, Any], str]

_SCORE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_LONE_INT = re.compile(r"^\s*\**\s*(-?\d+)\s*\**\s*\.?\s*$")
_LEADING_INT = re.compile(r"^\s*\**\s*(-?\d+)\b(?![.,]\d)")  # "4 - it cites...", "4. The reason..."
RUBRIC_INTRO = "You grade the work of an AI agent against one question."
GROUP_SYSTEM = (
    "You compare several attempts by AI agents at the same task and score each from 0 "
    "to 10 relative to the others: better attempts get higher scores. Answer with JSON "
    'only: {"scores": {"A": <0-10>, "B": <0-10>, ...}} with one score per attempt.'
)


def _clip(text: Any, limit: int) -> str:
    text = str(text)
    return text if len(text) <= limit else text[:limit] + "..."


def render_episode(trajectory: Any, case: Any, limit: int = 6000) -> str:
    """The default text a judge reads: the user's messages, each tool call with its result or
    error, the agent's text, and the submission."""
    lines: list[str] = []
    for m in getattr(trajectory, "messages", None) or []:
        role, content = m.get("role"), m.get("content")
        if role == "user" and content:
            lines.append(f"USER: {_clip(content, 800)}")
        elif role == "assistant" and content:
            lines.append(f"AGENT: {_clip(content, 800)}")
    for c in getattr(trajectory, "calls", None) or []:
        args = (
            json.dumps(c.arguments, ensure_ascii=False, default=str)
            if c.arguments is not None
            else ""
        )
        outcome = (
            f"-> {_clip(json.dumps(c.result, default=str), 400)}"
            if c.ok
            else f"-> error: {c.error}"
        )
        lines.append(f"CALL {c.name}({_clip(args, 400)}) {outcome}")
    sub = getattr(trajectory, "submission", None)
    lines.append(
        "SUBMISSION: " + (json.dumps(sub, ensure_ascii=False, default=str) if sub else "(none)")
    )
    return _clip("\n".join(lines), limit)


def parse_score(text: str, lo: int, hi: int) -> int:
    """The score in a rubric answer: the last ``SCORE: n``; else an answer that is or starts with
    an integer (``4``, ``4 - it cites...``); else ``n/hi`` or ``n out of hi``; else the answer's
    only number.

    Raises:
        ValueError: no score, or one outside ``[lo, hi]``.
    """
    found = _SCORE.findall(text)
    if found:
        raw = found[-1]
    else:
        lone = (
            _LONE_INT.match(text)
            or _LEADING_INT.match(text)
            or re.search(rf"\b(-?\d+)\s*(?:/|out of)\s*{hi}\b", text)
        )
        numbers = re.findall(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.]*\d)", text)
        if lone is not None:
            raw = lone.group(1)
        elif len(numbers) == 1:  # "The reason is polite: 4." - the only number is the score
            raw = numbers[0]
        else:
            raise ValueError(f"no 'SCORE: <integer>' line (the scale is {lo}-{hi})")
    value = float(raw)
    if not value.is_integer() or not lo <= value <= hi:
        raise ValueError(f"score {raw} is not an integer in {lo}-{hi}")
    return int(value)


def parse_group_scores(text: str, labels: Sequence[str]) -> dict[str, float]:
    """The scores in a group answer: JSON ``{"scores": {label: n}}`` (or a list in label order),
    or lines ``A: 7``; every label needs a number in ``[0, 10]``.

    Raises:
        ValueError: a label without a score, a score out of range, or no scores at all.
    """
    scores: dict[str, float] = {}
    for match in re.finditer(r"\{.*\}", text, re.DOTALL):
        try:
            data = json.loads(match.group(0))
        except ValueError:
            continue
        raw = data.get("scores", data) if isinstance(data, dict) else None
        if isinstance(raw, list) and len(raw) == len(labels):
            raw = dict(zip(labels, raw))
        if isinstance(raw, dict):
            scores = {str(k).strip().upper(): v for k, v in raw.items()}
            break
    if not scores:
        scores = {
            k.upper(): float(v) for k, v in re.findall(r"\b([A-Z])\s*[:=]\s*(\d+(?:\.\d+)?)", text)
        }
    out: dict[str, float] = {}
    for label in labels:
        value = scores.get(label)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 10:
            raise ValueError(f"no score in 0-10 for attempt {label} (got {value!r})")
        out[label] = float(value)
    return out


def _remember(trajectory: Any, name: str, record: dict[str, Any]) -> None:
    info = getattr(trajectory, "info", None)
    if isinstance(info, dict):
        info.setdefault("judge", {})[name] = record


# -- rubric --------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RubricTerm(Term):
    """A term asked of a judge about one episode (build with :func:`rubric_term`)."""

    judge: Any = None
    question: str = ""
    scale: tuple[int, int] = (1, 5)
    render: Render = render_episode

    def request(self, trajectory: Any, case: Any) -> Messages:
        """The judge request for one episode."""
        lo, hi = self.scale
        mid = (lo + hi) // 2
        user = (
            f"{RUBRIC_INTRO}\n\nEpisode:\n{self.render(trajectory, case)}\n\nQuestion: "
            f"{self.question} "
            f"Answer with a number from {lo} (worst) to {hi} (best), like this: SCORE: {mid}"
        )
        return [{"role": "user", "content": user}]  # one message: small judges follow it best

    def parse(self, text: str) -> int:
        """The integer score in an answer (raises ``ValueError`` when malformed)."""
        return parse_score(text, *self.scale)

    def scored(self, trajectory: Any, answer: JudgeAnswer) -> Scored:
        """The term's value for an answer; the answer is stored with the episode."""
        lo, hi = self.scale
        try:
            n = self.parse(answer.text)
        except ValueError as exc:  # a recorded answer that never went through the parser
            raise TermError(
                f"judge term {self.name!r}: {exc}; answer {answer.text[:200]!r}"
            ) from None
        _remember(trajectory, self.name, {**answer.record(), "score": n})
        tag = "cached" if answer.cached else "asked"
        return Scored(
            (n - lo) / (hi - lo),
            f"{self.name}: judge {answer.judge} said {n}/{hi} ({tag} {answer.key[:12]})",
        )


def rubric_term(
    name: str,
    judge: JudgeLike,
    question: str,
    *,
    scale: tuple[int, int] = (1, 5),
    render: Render = render_episode,
    description: str | None = None,
) -> RubricTerm:
    """A pointwise judge term in ``[0, 1]``: ``question`` asked about one episode on ``scale``.

    Args:
        name: The term's name.
        judge: A :class:`rewards.judge.Judge` (or a stand-in with ``spec`` and ``ask_many``).
        question: What the judge grades, e.g. "Does the reason cite the listing's evidence?".
        scale: Inclusive integer scale ``(lo, hi)``, lo < hi.
        render: ``render(trajectory, case) -> str``, what the judge reads (default
            :func:`render_episode`).
        description: One line for docs (default: the question).

    Raises:
        ConfigError: an empty question, a bad scale or a judge without ``ask_many``.
    """
    if not isinstance(question, str) or not question.strip():
        raise ConfigError(f"rubric term {name!r}: the question must be non-empty text")
    lo, hi = scale
    if not (isinstance(lo, int) and isinstance(hi, int) and lo < hi):
        raise ConfigError(
            f"rubric term {name!r}: scale must be two integers lo < hi, got {scale!r}"
        )
    if not callable(getattr(judge, "ask_many", None)):
        raise ConfigError(
            f"rubric term {name!r}: judge must be a rewards.judge.Judge, got {judge!r}"
        )

    def fn(trajectory: Any, case: Any) -> Scored:
        t: RubricTerm = holder[0]
        answer = active_judge(t.judge).ask_many([t.request(trajectory, case)], t.parse)[0]
        return t.scored(trajectory, answer)

    holder: list[RubricTerm] = []
    made = RubricTerm(
        name=name,
        fn=fn,
        low=0.0,
        high=1.0,
        description=description or question,
        judge=judge,
        question=question,
        scale=(lo, hi),
        render=render,
    )
    holder.append(made)
    return made


# -- group ---------------------------------------------------------------------------------------
_GROUP_SCORES: contextvars.ContextVar[dict[tuple[str, int], Scored] | None] = (
    contextvars.ContextVar("group_scores", default=None)
)


@dataclass(frozen=True, eq=False)
class GroupTerm(Term):
    """A term scored over a group of episodes of one case (build with :func:`group_term`)."""

    judge: Any = None
    rubric: str = ""
    render: Render = render_episode
    normalize: str = "rank"
    max_group: int = 26

    #: Read by ``Reward``: this term is scored against its group, so an episode's end scoring
    #: may defer it (``Reward.__call__(..., defer_group=True)``) and ``Reward.score_groups``
    #: scores it through :meth:`score_reward_groups`.
    needs_group: ClassVar[bool] = True

    def score_reward_groups(
        self, reward: Reward, groups: Sequence[Sequence[tuple[Any, Any]]], *, new_step: bool = False
    ) -> list[list[RewardResult]]:
        """Score every term of ``reward`` on ``groups`` (:func:`score_groups`)."""
        return score_groups(reward, groups, new_step=new_step)

    def layout(
        self, trajectories: Sequence[Any], case: Any
    ) -> tuple[Messages, list[str], list[str]]:
        """The request, the labels in the order shown, and each episode's label."""
        texts = [self.render(t, case) for t in trajectories]
        digest = {x: hashlib.sha256(x.encode()).hexdigest() for x in set(texts)}
        unique = sorted(
            set(texts), key=lambda x: digest[x]
        )  # canonical: arrival order plays no part
        if len(unique) > self.max_group:
            raise TermError(
                f"group term {self.name!r}: {len(unique)} distinct episodes, at most "
                f"{self.max_group} fit one judge request"
            )
        labels = [chr(ord("A") + i) for i in range(len(unique))]
        label_of = dict(zip(unique, labels))
        task = getattr(case, "task", None)
        body = "\n\n".join(f"=== Attempt {lab} ===\n{txt}" for lab, txt in zip(labels, unique))
        user = (
            f"Rubric: {self.rubric}\n\nTask: "
            f"{_clip(json.dumps(task, default=str), 1500)}\n\n{body}\n\n"
            f"Score every attempt ({', '.join(labels)}) from 0 to 10."
        )
        request = [{"role": "system", "content": GROUP_SYSTEM}, {"role": "user", "content": user}]
        return request, labels, [label_of[x] for x in texts]

    def values(self, raw: dict[str, float]) -> dict[str, float]:
        """Normalise the judge's raw scores within the group."""
        labels = list(raw)
        if self.normalize == "none":
            return {k: v / 10.0 for k, v in raw.items()}
        if self.normalize == "minmax":
            lo, hi = min(raw.values()), max(raw.values())
            return {k: 0.5 if hi == lo else (v - lo) / (hi - lo) for k, v in raw.items()}
        n = len(labels)
        if n == 1:
            return {labels[0]: 0.5}
        ranks = {}
        for k, v in raw.items():  # average rank of ties, 0-based, scaled to [0, 1]
            below = sum(1 for x in raw.values() if x < v)
            equal = sum(1 for x in raw.values() if x == v)
            ranks[k] = (below + (equal - 1) / 2) / (n - 1)
        return ranks

    def group_values(
        self, trajectories: Sequence[Any], case: Any, answer: JudgeAnswer
    ) -> list[Scored]:
        """Each episode's value from the judge's answer; the answer is stored with each episode."""
        _, labels, mine = self.layout(trajectories, case)
        try:
            raw = parse_group_scores(answer.text, labels)
        except ValueError as exc:
            raise TermError(
                f"group term {self.name!r}: {exc}; answer {answer.text[:200]!r}"
            ) from None
        values = self.values(raw)
        out = []
        for t, lab in zip(trajectories, mine):
            _remember(t, self.name, {**answer.record(), "label": lab, "scores": raw})
            out.append(
                Scored(
                    values[lab],
                    f"{self.name}: attempt {lab} scored {raw[lab]:g}/10 "
                    f"among {len(labels)} ({answer.key[:12]})",
                )
            )
        return out


def group_term(
    name: str,
    judge: JudgeLike,
    rubric: str,
    *,
    render: Render = render_episode,
    normalize: str = "rank",
    description: str | None = None,
) -> GroupTerm:
    """A RULER-style group-relative judge term in ``[0, 1]`` (see the module docstring).

    Args:
        name: The term's name.
        judge: A :class:`rewards.judge.Judge`.
        rubric: What makes one attempt better than another.
        render: What the judge reads about each episode.
        normalize: ``rank`` (default), ``minmax`` or ``none``.
        description: One line for docs (default: the rubric).

    Raises:
        ConfigError: an empty rubric, an unknown normalisation or a judge without ``ask_many``.
    """
    if not isinstance(rubric, str) or not rubric.strip():
        raise ConfigError(f"group term {name!r}: the rubric must be non-empty text")
    if normalize not in ("rank", "minmax", "none"):
        raise ConfigError(
            f"group term {name!r}: normalize must be rank, minmax or none, got {normalize!r}"
        )
    if not callable(getattr(judge, "ask_many", None)):
        raise ConfigError(
            f"group term {name!r}: judge must be a rewards.judge.Judge, got {judge!r}"
        )

    def fn(trajectory: Any, case: Any) -> Scored:
        found = (_GROUP_SCORES.get() or {}).get((name, id(trajectory)))
        if found is None:
            raise TermError(
                f"group term {name!r} scores an episode against its group: score with "
                "rewards.judge_terms.score_episodes(reward, episodes) or score_group(...)"
            )
        return found

    return GroupTerm(
        name=name,
        fn=fn,
        low=0.0,
        high=1.0,
        description=description or rubric,
        judge=judge,
        rubric=rubric,
        render=render,
        normalize=normalize,
    )


# -- batched scoring -----------------------------------------------------------------------------
@contextlib.contextmanager
def _group_scores(values: dict[tuple[str, int], Scored]) -> Iterator[None]:
    token = _GROUP_SCORES.set(values)
    try:
        yield
    finally:
        _GROUP_SCORES.reset(token)


def _passes_gates(reward: Reward, trajectory: Any, case: Any) -> bool:
    return all(g.passed(trajectory, case) for g in reward.gates)


def score_episodes(
    reward: Reward, episodes: Sequence[tuple[Any, Any]], *, new_step: bool = False
) -> list[RewardResult]:
    """Score many episodes, asking every judge term's questions in one concurrent batch.

    Rubric questions of every episode that passes the reward's gates are asked together (cached
    ones cost nothing); group terms see the episodes grouped by case id, one request per group.
    With ``new_step``, each judge of the reward starts a new budget step first (one batch = one
    step, as a trainer scoring a step's episodes would want).

    Raises:
        JudgeBudgetError: the batch does not fit a judge's budget (the answers received are
            cached; the episodes are unchanged and may be scored again).
        JudgeError, TermError: a judge gave no usable answer.
    """
    keys: dict[str, int] = {}
    group_of = [keys.setdefault(str(getattr(c, "id", id(c))), len(keys)) for _, c in episodes]
    return _score(reward, list(episodes), group_of, new_step)


def score_groups(
    reward: Reward, groups: Sequence[Sequence[tuple[Any, Any]]], *, new_step: bool = False
) -> list[list[RewardResult]]:
    """Score groups of episodes (as :func:`score_episodes`), each group ranked as given: two
    groups of the same case stay two groups. What ``Reward.score_groups`` runs for a reward
    that holds group terms; results come back in the shape of ``groups``."""
    flat = [pair for g in groups for pair in g]
    group_of = [i for i, g in enumerate(groups) for _ in g]
    results = iter(_score(reward, flat, group_of, new_step))
    return [[next(results) for _ in g] for g in groups]


def _score(
    reward: Reward, episodes: list[tuple[Any, Any]], group_of: list[int], new_step: bool
) -> list[RewardResult]:
    if new_step:
        for judge in {
            id(t.judge): t.judge for t in reward.terms if isinstance(t, (RubricTerm, GroupTerm))
        }.values():
            if callable(getattr(judge, "new_step", None)):
                judge.new_step()
    live = [(t, c) for t, c in episodes if _passes_gates(reward, t, c)]
    for term in reward.terms:
        if isinstance(term, RubricTerm) and live:
            active_judge(term.judge).ask_many([term.request(t, c) for t, c in live], term.parse)
    values: dict[tuple[str, int], Scored] = {}
    groups: dict[int, list[tuple[Any, Any]]] = {}
    for pair, g in zip(episodes, group_of):
        groups.setdefault(g, []).append(pair)
    for term in reward.terms:
        if not isinstance(term, GroupTerm):
            continue
        layouts = [(g, term.layout([t for t, _ in g], g[0][1])) for g in groups.values()]
        checks = [
            functools.partial(parse_group_scores, labels=labels) for _, (_, labels, _) in layouts
        ]
        answers = active_judge(term.judge).ask_many([req for _, (req, _, _) in layouts], checks)
        for (g, _), answer in zip(layouts, answers):
            trajs = [t for t, _ in g]
            for t, scored in zip(trajs, term.group_values(trajs, g[0][1], answer)):
                values[(term.name, id(t))] = scored
    with _group_scores(values):
        return [reward(t, c) for t, c in episodes]


def score_group(reward: Reward, trajectories: Sequence[Any], case: Any) -> list[RewardResult]:
    """Score the episodes of one case together (:func:`score_episodes` on one group)."""
    return score_episodes(reward, [(t, case) for t in trajectories])

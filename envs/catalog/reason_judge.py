"""An optional catalog term: does the submitted ``reason`` cite the evidence that decided the case?

The catalog's reward checks the category, the attributes and the verdict; the ``reason`` is
accepted whatever it says. ``reason_cites`` asks a judge model (any policy spec, see
:class:`rewards.judge.Judge`) whether the reason names the evidence behind the true decision
(the case's ``truth.reason``, its signals and the brands and sellers involved), on a 1-5 scale
mapped to ``[0, 1]``.

It is off by default. :class:`CatalogJudgeTwin` (``twin/CatalogJudge-v0``) is Catalog v1 with
the options below; without ``reason_judge`` it has Catalog v1's world, tools, case kinds and
reward (its cases are drawn under its own name, so they are not v1's case for case). With it,
the reward becomes::

    R = (1 - w) * R_v1_terms + w * reason_cites - penalties     (same gates and clip as v1)

so a perfect answer still scores 1.0 only when its reason cites the evidence. The recipe
``data/recipes/catalog-judge-tiny-cpu.yaml`` turns it on.

Options (:class:`CatalogJudgeConfig`): ``reason_judge`` (a policy spec, None = off),
``reason_judge_weight`` (w, default 0.1), ``reason_judge_base_url``,
``reason_judge_timeout``, ``reason_judge_max_calls_per_step``,
``reason_judge_max_tokens_per_step``, ``reason_judge_cache_dir`` (default
``$TWINRL_CACHE/judge``). The twin's reward asks episode by episode and is never told where a
training step ends, so the two budgets cap the judge's calls and tokens over the whole run.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from envs.catalog.reward import CLIP_V1, VERDICT_COSTS_V1, make_catalog_reward
from envs.catalog.v1.twin import CatalogConfigV1, CatalogTwinV1
from rewards import Reward
from rewards.judge import Judge
from rewards.judge_terms import RubricTerm, rubric_term

__all__ = [
    "REASON_QUESTION",
    "CatalogJudgeConfig",
    "CatalogJudgeTwin",
    "reason_judge_reward",
    "reason_term",
    "render_reason",
    "with_reason_term",
]

REASON_QUESTION = (
    "Does the agent's reason cite the evidence that decided this case? 5: it names the deciding "
    "evidence (the signal and the brand, seller or "
    "recall involved); 3: it points at the right kind "
    "of evidence but vaguely; 1: it cites nothing, or evidence that did not decide the case."
)


def render_reason(trajectory: Any, case: Any) -> str:
    """What the judge reads: the deciding evidence (from the case's truth) and the submission's
    verdict and reason. The listing's category and attributes play no part."""
    truth = case.truth
    entities = truth.get("entities") or {}
    sub = getattr(trajectory, "submission", None) or {}
    lines = [
        f"True decision: {truth.get('verdict')}",
        f"Evidence that decided it: {truth.get('reason')}",
        f"Signals: {', '.join(truth.get('signals') or []) or '(none)'}",
        "Involved: "
        + json.dumps({k: list(v) for k, v in dict(entities).items()}, ensure_ascii=False),
        f"Agent's verdict: {sub.get('verdict', '(no submission)')}",
        f"Agent's reason: {sub.get('reason', '') or '(empty)'}",
    ]
    return "\n".join(lines)


def reason_term(judge: Any) -> RubricTerm:
    """The ``reason_cites`` rubric term asked of ``judge``."""
    return rubric_term(
        "reason_cites",
        judge,
        REASON_QUESTION,
        scale=(1, 5),
        render=render_reason,
        description="judge: the submitted reason cites the evidence that decided the case",
    )


def with_reason_term(base: Reward, term: RubricTerm, weight: float) -> Reward:
    """``base`` with ``term`` added at ``weight`` and its own terms scaled by ``1 - weight``
    (penalties, gates and clip kept), so the best total stays the same."""
    if not 0.0 < weight < 1.0:
        raise ValueError(f"reason_judge_weight must be in (0, 1), got {weight}")
    terms = {t: w * (1.0 - weight) for t, w in zip(base.terms, base.weights.values())}
    terms[term] = weight
    return Reward(terms, penalties=base.penalties, gates=base.gates, clip=base.clip, name=base.name)


def reason_judge_reward(judge: Any = None, weight: float = 0.1) -> Reward:
    """Catalog v1's reward with ``reason_cites`` (every category id counts as existing: for
    rollout files, whose truths name categories directly). The default judge is a placeholder
    (``openai:judge``, no disk cache) that a recorded judge replaces in rollout files."""
    base = make_catalog_reward(lambda cid: True, costs=VERDICT_COSTS_V1, clip=CLIP_V1)
    judge = judge if judge is not None else Judge("openai:judge", cache_dir=None)
    return with_reason_term(base, reason_term(judge), weight)


class CatalogJudgeConfig(CatalogConfigV1):
    """Catalog v1's options and the reason judge's (see the module docstring)."""

    reason_judge: str | None = None
    reason_judge_weight: float = Field(0.1, gt=0.0, lt=1.0)
    reason_judge_base_url: str | None = None
    reason_judge_timeout: float = Field(60.0, gt=0)
    reason_judge_max_calls_per_step: int | None = Field(None, ge=1)
    reason_judge_max_tokens_per_step: int | None = Field(None, ge=1)
    reason_judge_cache_dir: str | None = None


class CatalogJudgeTwin(CatalogTwinV1):
    """Catalog v1 with the optional ``reason_cites`` judge term (off unless ``reason_judge`` is
    set)."""

    name = "CatalogJudge"
    version = 0
    description = (
        "Catalog v1 with an optional judge term: does the submitted reason cite the evidence "
        "that decided the case? Off unless `reason_judge` names a judge policy spec."
    )
    config_model = CatalogJudgeConfig

    def __init__(self, **config: Any) -> None:
        super().__init__(**config)
        cfg: CatalogJudgeConfig = self.config  # type: ignore[assignment]
        self.judge: Judge | None = None
        if cfg.reason_judge:
            options: dict[str, Any] = {}
            if cfg.reason_judge_cache_dir is not None:
                options["cache_dir"] = cfg.reason_judge_cache_dir
            self.judge = Judge(
                cfg.reason_judge,
                base_url=cfg.reason_judge_base_url,
                timeout=cfg.reason_judge_timeout,
                max_calls_per_step=cfg.reason_judge_max_calls_per_step,
                max_tokens_per_step=cfg.reason_judge_max_tokens_per_step,
                **options,
            )
            self.reward = with_reason_term(
                self.reward, reason_term(self.judge), cfg.reason_judge_weight
            )

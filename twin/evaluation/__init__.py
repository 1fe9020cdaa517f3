"""Evaluation: run a policy over a twin's cases and record the run (``twin eval``), on this
process or a Ray cluster, and turn runs into datasets (``twin collect``).

- :mod:`twin.evaluation.runner`: :func:`evaluate`, :func:`plan_evaluation` and their results.
- :mod:`twin.evaluation.ray_eval`: the same episodes on a Ray cluster.
- :mod:`twin.evaluation.collect`: episodes to a chat dataset (JSONL or a Hugging Face folder).
"""

from twin.evaluation.runner import (
    BACKENDS,
    Backend,
    EvalInterrupted,
    EvalJob,
    EvalResult,
    evaluate,
    plan_evaluation,
    score_group,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "EvalInterrupted",
    "EvalJob",
    "EvalResult",
    "evaluate",
    "plan_evaluation",
    "score_group",
]

"""twinrl's reward library: named, weighted terms; asymmetric costs; shaping; a testing kit.

::

    from rewards import Reward, term, invalid_call_penalty, submitted_gate

    @term(low=0.0, high=1.0)
    def correct(trajectory, case):
        \"\"\"1 when the submitted answer is the true one.\"\"\"
        return float(trajectory.submission["answer"] == case.truth["answer"])

    reward = Reward({correct: 1.0}, penalties=[invalid_call_penalty(0.01, cap=0.05)],
                    gates=[submitted_gate()], clip=(-0.05, 1.0))
    print(reward(trajectory, case).explain())

Imported on demand: the property checks and their hypothesis strategies (``rewards.properties``,
``rewards.strategies``; a twin passes its own oracle, mistakes and cost ratios), the TRL adapters
(``rewards.adapters``), and the rollout-testing kit with its pytest plugin (``rewards.testing``,
``rewards.pytest_plugin``), which sits above the rest: it makes twins through ``twin.registry``
and replays episodes through ``TwinEnv``; nothing else here makes or runs a twin.
"""

from rewards._costs import CostMatrix
from rewards._credit import (
    attribute_f1,
    attribute_pairs,
    category_credit,
    common_ancestor_depth,
    id_depth,
    normalize_value,
    set_f1,
)
from rewards._reward import Gate, Penalty, Reward, RewardResult
from rewards._shaping import (
    completion_tokens,
    invalid_call_penalty,
    overlong_fraction,
    overlong_penalty,
    submitted_gate,
    turn_cost,
    useful_tool_bonus,
)
from rewards._terms import RewardError, Scored, Term, TermError, term

__all__ = [
    # composition
    "Gate",
    "Penalty",
    "Reward",
    "RewardResult",
    "Scored",
    "Term",
    "term",
    # decisions and partial credit
    "CostMatrix",
    "attribute_f1",
    "attribute_pairs",
    "category_credit",
    "common_ancestor_depth",
    "id_depth",
    "normalize_value",
    "set_f1",
    # penalties, bonuses, gates
    "completion_tokens",
    "invalid_call_penalty",
    "overlong_fraction",
    "overlong_penalty",
    "submitted_gate",
    "turn_cost",
    "useful_tool_bonus",
    # errors
    "RewardError",
    "TermError",
]

"""Returns desk: look up an order, check the return policy, decide refund / partial / deny.

The small twin that proves the public API (``twin`` and ``rewards`` only); see
``docs/define_your_own_twin.md``.
"""

from envs.returns.twin import ReturnsTwin, expected_decision, returns_reward

__all__ = ["ReturnsTwin", "expected_decision", "returns_reward"]

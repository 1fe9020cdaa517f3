"""SupportDesk: a support desk where a simulated customer (rules or an LLM) is in the loop.

See ``docs/support_desk.md`` and :mod:`envs.support.twin`.
"""

from envs.support.twin import SupportDeskConfig, SupportDeskTwin, final_changes, support_reward

__all__ = ["SupportDeskConfig", "SupportDeskTwin", "final_changes", "support_reward"]

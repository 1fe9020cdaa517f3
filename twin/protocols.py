"""The collaborators the core drives, declared as Protocols: any object with these members
will do (the shipped ones live in :mod:`twin.policies` and :mod:`twin.store`).

A policy is any object with a ``name`` and an async ``act(messages, tools)`` that returns an
assistant message dict (OpenAI format; ``tool_calls`` or text the env parses). Policies must not
mutate ``messages``. A policy that needs per-episode randomness may define
``for_episode(key: str) -> Policy``; the runner then calls it once per episode with a stable key
(``"<case id>#<k>"``) and acts through the returned object.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Message", "Policy", "PolicyHost", "policy_for_episode"]

#: A chat message in OpenAI's format (``role``, ``content``, ``tool_calls``, ...).
Message = dict[str, Any]


@runtime_checkable
class Policy(Protocol):
    """What the runner drives: a name and an async ``act``."""

    name: str

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """Return the next assistant message for the chat ``messages`` (do not mutate it)."""
        ...


class PolicyHost(Protocol):
    """What a policy spec reads from the twin it is made for (:class:`twin.core.Twin` is one):
    its named policies, ``{name: factory(twin) -> policy}`` (or a policy)."""

    def baselines(self) -> dict[str, Any]:
        """Named policies of the twin."""
        ...


def policy_for_episode(policy: Policy, key: str) -> Policy:
    """``policy.for_episode(key)`` when the policy defines it, else the policy itself."""
    fork = getattr(policy, "for_episode", None)
    return fork(key) if callable(fork) else policy

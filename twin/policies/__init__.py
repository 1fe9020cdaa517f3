"""Policies: whatever writes the assistant's turns (the contract is
:class:`twin.protocols.Policy`: a ``name`` and an async ``act(messages, tools)``).

Shipped here:

- :class:`ReplayPolicy`: hand-written assistant turns, e.g. for reward tests and demos
  (:mod:`twin.policies.scripted`).
- :class:`RandomPolicy`: random tool calls with arguments built from the tool schemas.
- :class:`OpenAIChatPolicy`: any OpenAI-compatible ``/chat/completions`` server, over httpx
  (:mod:`twin.policies.openai_chat`).
- ``anthropic:`` and ``openai-responses:`` (:mod:`twin.policies.providers`): Anthropic's
  Messages API and OpenAI's Responses API through the providers' SDKs.
- :func:`make_policy`: a policy from a command-line spec (``random``, ``openai:gpt-4o-mini``,
  ...), and :class:`PolicySettings`, a policy spec file (:mod:`twin.policies.specs`).
- :func:`~twin.policies.http.tls_context`: the one TLS context every httpx client shares.
"""

from twin.policies.chat_wire import PolicyError
from twin.policies.openai_chat import OpenAIChatPolicy
from twin.policies.scripted import RandomPolicy, ReplayPolicy, tool_call
from twin.policies.specs import (
    POLICY_ENTRY_POINT_GROUP,
    PolicySettings,
    load_policy_file,
    make_policy,
    policy_kinds,
)
from twin.protocols import Policy, policy_for_episode

__all__ = [
    "OpenAIChatPolicy",
    "POLICY_ENTRY_POINT_GROUP",
    "Policy",
    "PolicyError",
    "PolicySettings",
    "RandomPolicy",
    "ReplayPolicy",
    "load_policy_file",
    "make_policy",
    "policy_for_episode",
    "policy_kinds",
    "tool_call",
]

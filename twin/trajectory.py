"""What an episode leaves behind: tool-call records, token turns, trajectories and groups.

These pydantic models are the contract between twins, the reward library and the trainer
(``rewards`` imports only this module and :mod:`twin.cases` from ``twin``). All of them round
trip through JSON: ``Trajectory.model_validate_json(t.model_dump_json()) == t``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

__all__ = ["Group", "TokenTurn", "ToolCallRecord", "Trajectory"]


class ToolCallRecord(BaseModel):
    """One tool call the agent made, and what came of it.

    Attributes:
        id: The call id (from the model, or generated).
        name: Tool name as the agent wrote it (may be unknown).
        arguments: Arguments as parsed (a dict), or the raw text when it was not valid JSON.
        ok: True when the tool ran and returned a result.
        error: The message shown to the agent when ``ok`` is False.
        result: The tool's JSON-able result when ``ok``.
        terminal: The call was to a terminal tool and succeeded (the episode ended on it).
        turn: Index of the assistant turn that made it (0-based).
        latency_s: Wall time of the tool itself.
    """

    id: str
    name: str
    arguments: Any = None
    ok: bool
    error: str | None = None
    result: Any = None
    terminal: bool = False
    turn: int = 0
    latency_s: float = 0.0


class TokenTurn(BaseModel):
    """Token-level record of one assistant turn, filled in when a trainer's sampler produced it.

    Attributes:
        prompt_ids: Tokens added before the sample (tool results, the assistant header).
        completion_ids: The sampled tokens.
        logprobs: The sampler's logprob of each sampled token.
    """

    prompt_ids: list[int] = Field(default_factory=list)
    completion_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)


class Trajectory(BaseModel):
    """One episode of an agent in a twin.

    Attributes:
        twin: Twin name.
        case_id: ``<twin>/<split>/<index>``.
        split: Split of the case.
        index: Index of the case.
        case_kind: Planted case type.
        policy: Name of the policy that acted.
        messages: The whole chat, OpenAI format, prompt included.
        calls: Every tool call, valid or not, in order.
        submission: Arguments of the successful terminal call, or None if there was none.
        invalid_calls: Calls that failed (unknown tool, bad JSON, bad arguments, tool errors,
            a second terminal call) plus assistant turns that contained no tool call.
        num_turns: Assistant turns taken.
        terminated: A terminal tool succeeded.
        truncated: The turn or token budget ran out first (never for a one-turn twin, whose
            single answer is the whole episode).
        completion_tokens: Tokens the agent generated (0 when unknown).
        token_turns: Token-level turns when a trainer's sampler acted.
        reward: Total reward, once scored.
        components: Named reward components (unweighted), once scored.
        weighted: Weighted contributions, once scored.
        reward_notes: Human-readable notes from the reward.
        timings: Seconds spent, e.g. ``{"policy": .., "tools": .., "total": ..}``.
        info: Anything else (e.g. the outcome the twin reports at the end).
    """

    twin: str
    case_id: str
    split: str = "train"
    index: int = 0
    case_kind: str = "default"
    policy: str = ""
    messages: list[dict[str, Any]] = Field(default_factory=list)
    calls: list[ToolCallRecord] = Field(default_factory=list)
    submission: dict[str, Any] | None = None
    invalid_calls: int = 0
    num_turns: int = 0
    terminated: bool = False
    truncated: bool = False
    completion_tokens: int = 0
    token_turns: list[TokenTurn] = Field(default_factory=list)
    reward: float | None = None
    components: dict[str, float] = Field(default_factory=dict)
    weighted: dict[str, float] = Field(default_factory=dict)
    reward_notes: list[str] = Field(default_factory=list)
    timings: dict[str, float] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)


class Group(BaseModel):
    """The trajectories of one case (a GRPO group), with the case's address.

    Attributes:
        case_id: The case all trajectories share.
        trajectories: The episodes.
        policy_version: Version of the policy that sampled them (async training).
    """

    case_id: str
    trajectories: list[Trajectory] = Field(default_factory=list)
    policy_version: int = 0

    @property
    def rewards(self) -> list[float]:
        """Total rewards of the trajectories (unscored ones count as 0.0)."""
        return [t.reward if t.reward is not None else 0.0 for t in self.trajectories]

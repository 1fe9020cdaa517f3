"""OpenEnv's Action, Observation, State, Environment and client, typed for a twin.

Imported only through :mod:`integrations.openenv_server` (its ``TwinAction`` ... names, or
:func:`integrations.openenv_server.build_app`), after it has checked that openenv-core is
installed: this module imports openenv-core at its top.
"""

from __future__ import annotations

import uuid
from typing import Any

import openenv.core as core
from openenv.core.client_types import StepResult
from pydantic import Field

from integrations._episode import EpisodeBook, ToolCallEpisode
from twin.core import Twin
from twin.tools import thaw

__all__ = [
    "TwinAction",
    "TwinEnvClient",
    "TwinEnvironment",
    "TwinObservation",
    "TwinState",
    "state_of",
]


class TwinAction(core.Action):  # type: ignore[misc, name-defined]
    """One tool call of the twin's agent."""

    tool: str = Field(description="The tool's name, as in the observation's `tools`.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="The tool's arguments.")


class TwinObservation(core.Observation):  # type: ignore[misc, name-defined]
    """What the agent sees: the opening messages after reset, a tool's result after step."""

    episode_id: str | None = Field(default=None, description="The episode (name it in HTTP /step).")
    messages: list[dict[str, Any]] = Field(
        default_factory=list, description="Opening messages (reset)."
    )
    tools: list[dict[str, Any]] = Field(default_factory=list, description="Tool schemas (reset).")
    text: str = Field(default="", description="The tool's result, or what was wrong (step).")
    error: bool = Field(default=False, description="Whether the call failed.")
    reward_components: dict[str, float] | None = Field(
        default=None,
        description="Once done: each reward term's weighted share of `reward` (OpenEnv drops "
        "`metadata` on the wire, so they travel here too).",
    )


class TwinState(core.State):  # type: ignore[misc, name-defined]
    """The episode's status; reward, submission and outcome only once it has ended."""

    status: str = "not_started"
    twin: str | None = None
    split: str | None = None
    index: int | None = None
    case_id: str | None = None
    turns: int = 0
    invalid_calls: int = 0
    submission: Any = None
    reward: dict[str, Any] | None = None
    outcome: Any = None


class TwinEnvironment(core.Environment):  # type: ignore[misc, name-defined]
    """A twin's episode behind OpenEnv's ``reset`` / ``step`` / ``state``.

    Args:
        twin: The twin (shared read-only by every session).
        book: Where HTTP episodes are kept between requests (None: WebSocket sessions only).
    """

    # Each instance holds its own TwinEnv; the twin's world is shared read-only.
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, twin: Twin, book: EpisodeBook | None = None) -> None:
        super().__init__()
        self.twin = twin
        self._book = book
        # made by reset: HTTP builds one environment per request, most never reset
        self._episode: ToolCallEpisode | None = None
        self._episode_id: str | None = None

    def reset(  # type: ignore[override]
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        split: str = "train",
        index: int | None = None,
        **unknown: Any,
    ) -> TwinObservation:
        """Start case ``(split, index)`` (``index=None``: drawn from ``seed``)."""
        if unknown:
            raise ValueError(
                f"unknown reset option(s) {', '.join(sorted(unknown))}; the options are seed, "
                "episode_id, split and index"
            )
        episode = ToolCallEpisode(self.twin)
        messages = episode.reset(split, index, seed)
        self._episode = episode
        self._episode_id = str(episode_id) if episode_id else uuid.uuid4().hex
        if self._book is not None:
            self._book.put(self._episode_id, episode)
        return TwinObservation(
            episode_id=self._episode_id,
            messages=thaw(messages),
            tools=thaw(self.twin.frozen_tool_schemas),
            text=str(messages[-1].get("content", "")) if messages else "",
        )

    def step(  # type: ignore[override]
        self, action: TwinAction, timeout_s: float | None = None, episode_id: str | None = None
    ) -> TwinObservation:
        """Run ``action`` as one assistant turn; ``episode_id`` picks an HTTP episode."""
        episode = self._episode
        if episode_id and self._book is not None:
            episode = self._book.get(episode_id)
        if episode is None or not episode.started:
            raise ValueError(
                "reset() the episode before a step (over HTTP each request gets a fresh "
                "environment: send the reset's episode_id with the step, "
                '{"action": ..., "episode_id": ...})'
            )
        if episode.done:
            return TwinObservation(
                episode_id=episode_id or self._episode_id,
                text="Error: the episode has ended; reset to start another.",
                error=True,
                done=True,
                reward=episode.final_reward(),
            )
        text, failed = episode.call(action.tool, action.arguments)
        done = episode.done
        terms = episode.final_terms() if done else None
        return TwinObservation(
            episode_id=episode_id or self._episode_id,
            text=text,
            error=failed,
            done=done,
            reward=episode.final_reward() if done else None,
            reward_components=terms,
            metadata={"reward_components": terms} if terms else {},
        )

    @property
    def state(self) -> TwinState:
        """This session's episode status (see :func:`state_of`)."""
        if self._episode is None:
            return TwinState()
        return state_of(self._episode, self._episode_id)

    def get_metadata(self) -> Any:
        from openenv.core.env_server.types import EnvironmentMetadata

        return EnvironmentMetadata(
            name=f"twinrl/{self.twin.name}",
            description=f"The {self.twin.name} twin: its tools, controlled cases and reward.",
        )


def state_of(episode: ToolCallEpisode, episode_id: str | None) -> TwinState:
    """An episode's :class:`TwinState` (reward, submission and outcome once it has ended)."""
    report = episode.report()
    return TwinState(episode_id=episode_id, step_count=int(report.get("turns") or 0), **report)


class TwinEnvClient(core.EnvClient):  # type: ignore[misc, name-defined]
    """OpenEnv's WebSocket client, typed for a twin."""

    def _step_payload(self, action: TwinAction) -> dict[str, Any]:
        return {"tool": action.tool, "arguments": action.arguments}

    def _parse_result(self, payload: dict[str, Any]) -> Any:
        obs = TwinObservation(
            **payload.get("observation", {}),
            reward=payload.get("reward"),
            done=bool(payload.get("done", False)),
        )
        return StepResult(observation=obs, reward=payload.get("reward"), done=obs.done)

    def _parse_state(self, payload: dict[str, Any]) -> TwinState:
        return TwinState(**payload)

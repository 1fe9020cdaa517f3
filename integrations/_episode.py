"""One twin episode driven one tool call at a time: what every bridge in this package shares.

TRL, MCP and OpenEnv hand a bridge one tool call at a time (a method call, a ``tools/call``
request, a step), not an assistant turn of text. :class:`ToolCallEpisode` feeds each call to a
:class:`twin.env.TwinEnv` as an assistant turn holding exactly that call, so the episode is the
twin's own: the same argument validation, hidden-argument injection (``world``, ``state``,
``task``; never the truth), error messages, turn budget (``config.max_turns``: one call is one
turn here), terminal tool and reward. The case's truth reaches no return value of
:meth:`ToolCallEpisode.call`; only :meth:`ToolCallEpisode.report` (for the harness, never the
agent) carries the reward and the outcome, and only once the episode has ended.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import OrderedDict
from typing import Any

from twin.core import Twin
from twin.env import TwinEnv
from twin.errors import CaseError
from twin.registry import make_twin
from twin.tools import thaw, to_jsonable
from twin.trajectory import Trajectory

__all__ = [
    "EpisodeBook",
    "EpisodeNotFoundError",
    "EpisodeReport",
    "ToolCallEpisode",
    "resolve_twin",
]

#: What :meth:`ToolCallEpisode.report` returns (a plain JSON-able dict).
EpisodeReport = dict[str, Any]


def resolve_twin(twin: Twin | str, **config: Any) -> Twin:
    """``twin`` itself, or the registered twin called ``twin`` (e.g. ``"Returns"``) built with
    ``config``."""
    if isinstance(twin, Twin):
        if config:
            raise TypeError("pass config options only with a twin name, not with a Twin instance")
        return twin
    if isinstance(twin, str):
        return make_twin(twin, **config)
    raise TypeError(f"twin must be a Twin or a registered twin name, got {type(twin).__name__}")


class ToolCallEpisode:
    """A :class:`TwinEnv` episode played one tool call at a time.

    Args:
        twin: The twin (its world is shared with every other episode of the same config).
    """

    def __init__(self, twin: Twin) -> None:
        self.twin = twin
        self.env = TwinEnv(twin)
        self._ids = itertools.count()
        self._started = False
        self._reward: float | None = None
        self._info: dict[str, Any] = {}

    # -- episode --------------------------------------------------------------------------------
    def reset(
        self, split: str = "train", index: int | None = None, seed: int | None = None
    ) -> list[dict[str, Any]]:
        """Start the episode on case ``(split, index)`` (``index=None``: drawn from ``seed``).

        Returns:
            The case's opening messages (system + user).

        Raises:
            CaseError: an unknown split or an index out of range; the message says what is allowed.
        """
        if index is not None:
            index = _case_index(index)
        options: dict[str, Any] = {"split": split}
        if index is not None:
            options["index"] = index
        messages, _ = self.env.reset(seed=seed, options=options)
        self._started = True
        self._reward = None
        self._info = {}
        return messages

    @property
    def started(self) -> bool:
        """True once :meth:`reset` has run."""
        return self._started

    @property
    def done(self) -> bool:
        """True once a terminal tool succeeded or the turn budget ran out."""
        return self._reward is not None

    @property
    def trajectory(self) -> Trajectory | None:
        """The episode so far (None before :meth:`reset`)."""
        return self.env.trajectory

    def call(self, name: str, arguments: dict[str, Any] | str | None) -> tuple[str, bool]:
        """Run one tool call as one assistant turn of the twin.

        Returns:
            The text the agent sees (the tool's result, or what was wrong and what is allowed),
            and whether the call failed.
        """
        if not self._started:
            raise RuntimeError("reset() the episode before calling a tool")
        call_id = f"call_{next(self._ids)}"
        args = arguments if isinstance(arguments, str) else _json(arguments or {})
        turn = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            ],
        }
        obs, reward, terminated, truncated, info = self.env.step(turn)
        if (terminated or truncated) and self._reward is None and "reward" in info:
            self._reward = float(reward)
            self._info = {
                "reward": info["reward"],
                "outcome": info.get("outcome"),
                "terminated": terminated,
                "truncated": truncated,
            }
        text = "\n".join(str(m.get("content", "")) for m in obs)
        return text, bool(info.get("errors"))

    def record_text(self, text: str) -> None:
        """Play a turn in which the model wrote ``text`` and no structured call (a harness such as
        TRL ends the rollout there without telling the episode). It counts as the twin counts
        any text turn: calls written as text are parsed and run, a turn without one is an
        invalid turn, and the turn budget applies. Nothing happens once the episode has ended."""
        if not self._started:
            raise RuntimeError("reset() the episode before recording a turn")
        if self.done:
            return
        _, reward, terminated, truncated, info = self.env.step(
            {"role": "assistant", "content": text}
        )
        if (terminated or truncated) and "reward" in info:
            self._reward = float(reward)
            self._info = {
                "reward": info["reward"],
                "outcome": info.get("outcome"),
                "terminated": terminated,
                "truncated": truncated,
            }

    def final_terms(self) -> dict[str, float]:
        """Each reward term's weighted contribution to :meth:`final_reward` (penalties negative;
        the raw components when the reward weights nothing), scored as :meth:`final_reward` is."""
        traj = self.env.trajectory
        case = self.env.case
        if traj is None or case is None:
            raise RuntimeError("reset() the episode before asking for its reward")
        if not self.done:
            traj = traj.model_copy(update={"truncated": True})
        result = self.twin.score(traj, case)
        return {k: float(v) for k, v in (dict(result.weighted) or dict(result.components)).items()}

    def final_reward(self) -> float:
        """The twin's reward of this episode.

        An episode that has not ended (the harness stopped before a terminal call or the turn
        budget) is scored as the twin scores a truncated one: ``twin.score`` of the trajectory
        marked ``truncated``. The env itself is left as it is.
        """
        if self._reward is not None:
            return self._reward
        traj = self.env.trajectory
        case = self.env.case
        if traj is None or case is None:
            raise RuntimeError("reset() the episode before asking for its reward")
        cut = traj.model_copy(update={"truncated": True})
        return float(self.twin.score(cut, case).total)

    def report(self) -> EpisodeReport:
        """Status, and at the end the reward (total, components) and outcome: for the harness only.

        Before the episode ends, ``reward`` and ``outcome`` are None: nothing derived from the
        case's truth is shown while the agent can still act on it.
        """
        traj = self.env.trajectory
        if traj is None:
            return {"status": "not_started", "reward": None, "outcome": None}
        status = "running"
        if self.done:
            status = "terminated" if self._info.get("terminated") else "truncated"
        return {
            "status": status,
            "twin": self.twin.name,
            "split": traj.split,
            "index": traj.index,
            "case_id": traj.case_id,
            "turns": traj.num_turns,
            "invalid_calls": traj.invalid_calls,
            "submission": thaw(traj.submission) if self.done else None,
            "reward": self._info.get("reward") if self.done else None,
            "outcome": thaw(self._info.get("outcome")) if self.done else None,
        }


def _case_index(value: Any) -> int:
    """A case index from a wire value: an int, a whole float (``3.0``) or a string of digits.

    Raises:
        CaseError: anything else (``1.5``, ``True``, ``"x"``): never silently rounded.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    raise CaseError(f"index must be a whole number (a case index), got {value!r}")


def _json(value: Any) -> str:
    return json.dumps(to_jsonable(value), ensure_ascii=False)


class EpisodeNotFoundError(LookupError):
    """An HTTP step or state for an episode id the server does not hold (never reset, or
    dropped)."""


class EpisodeBook:
    """Episodes by id, oldest dropped past ``limit``; shared by the request threads (the
    OpenEnv server's HTTP episodes, which live across requests)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_id: OrderedDict[str, ToolCallEpisode] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, episode_id: str, episode: ToolCallEpisode) -> None:
        with self._lock:
            self._by_id[episode_id] = episode
            self._by_id.move_to_end(episode_id)
            while len(self._by_id) > self.limit:
                self._by_id.popitem(last=False)

    def get(self, episode_id: str) -> ToolCallEpisode:
        with self._lock:
            episode = self._by_id.get(episode_id)
        if episode is None:
            raise EpisodeNotFoundError(
                f"no episode {episode_id!r} on this server; reset with it first (the server keeps "
                f"the last {self.limit} HTTP episodes)"
            )
        return episode

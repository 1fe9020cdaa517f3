"""twinrl twins as verifiers (v1) environments, for ``vf-eval`` and prime-rl.

::

    from integrations.verifiers_env import load_environment

    env = load_environment("catalog", split="test")      # a verifiers.v1 Env

or from the command line, with the taskset named by this module's import path::

    vf-eval --env.taskset.id integrations.verifiers_env --env.taskset.twin returns \\
        --env.agent.runtime.type subprocess --model MODEL --client.base-url URL -n 20

The pieces (this module exports one of each, which is how verifiers finds them):

- :class:`TwinTaskset`: one task per controlled case of a split; a task's data is the case's
  reference (twin, split, index), its opening messages and the tool schemas. The hidden truth
  never leaves the twin.
- :class:`TwinHarness`: the agent loop, in process. It plays one :class:`twin.env.TwinEnv`
  episode: each model turn goes through verifiers' interception endpoint (so the trace records
  every call, tokens included for training) and is handed to ``TwinEnv.step``, which runs the
  tool calls with their hidden arguments (``world``, ``state``, ``task``) injected, exactly as
  ``twin eval`` does. The assistant turns are kept in ``trace.info["twin"]["actions"]``.
- :class:`TwinTask`: the rubric. Scoring replays the recorded turns in a fresh episode of the
  same case (twins are deterministic) and records each reward term under its own name with its
  weight in the twin's reward, plus ``adjustment`` (weight 1: gates, penalties, bonuses and the
  clip) so that ``trace.reward`` equals the twin's total; every component is also a metric.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import httpx
import verifiers.v1 as vf
from pydantic import Field

from twin.env import TwinEnv
from twin.registry import make_twin
from twin.tools import thaw

__all__ = ["TwinHarness", "TwinTask", "TwinTaskset", "load_environment"]

#: The id verifiers imports the taskset (and its harness) by: the top-level `twinrl_verifiers`.
TASKSET_ID = "twinrl-verifiers"


class TwinTasksetConfig(vf.TasksetConfig):
    """Which twin, built with which options, and which of its controlled cases."""

    twin: str = Field("catalog", description="Twin name or id, e.g. 'catalog', 'returns', 'toy'.")
    split: str = Field("train", description="The split whose cases become tasks.")
    num_cases: int | None = Field(
        None, ge=1, description="The first N cases of the split (default: all of them)."
    )
    max_turns: int | None = Field(
        None, ge=1, description="Twin option: assistant turns per episode."
    )
    prompt_style: str | None = Field(None, description="Twin option: 'full' or 'compact'.")
    seed: int | None = Field(None, description="Twin option: seed of the world and the cases.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Any other twin options (twin show NAME lists them)."
    )

    def twin_config(self) -> dict[str, Any]:
        """The options the twin is built with: ``options`` plus the named ones that are set."""
        named = {"max_turns": self.max_turns, "prompt_style": self.prompt_style, "seed": self.seed}
        return {**self.options, **{k: v for k, v in named.items() if v is not None}}


class TwinTaskData(vf.TaskData):
    """One controlled case, by reference: the truth stays in the twin."""

    twin: str
    split: str
    index: int
    case_id: str
    tools: list[dict[str, Any]] = Field(default_factory=list)
    twin_config: dict[str, Any] = Field(default_factory=dict)


class TwinTask(vf.Task[TwinTaskData, vf.State, vf.TaskConfig]):
    """A twin's case; scoring is the twin's own reward of the recorded episode."""

    async def score(self, trace: vf.Trace, runtime: Any = None) -> None:
        """Record each term with its weight, the adjustment, and every component as a metric."""
        await super().score(trace, runtime)  # judges or metrics plugged in through the config
        if self.scoring_deferred:
            return
        result = replay_reward(self.data, recorded_actions(trace))
        weighted = 0.0
        for name, weight in reward_weights(self.data.twin, self.data.twin_config).items():
            value = float(result.components.get(name, 0.0))
            trace.record_reward(name, value, weight)
            weighted += value * weight
        # gates, penalties, bonuses and the clip: what turns the weighted sum into the total
        trace.record_reward("adjustment", result.total - weighted, 1.0)
        trace.record_metrics({f"twin/{k}": float(v) for k, v in result.components.items()})
        trace.record_metric("twin/total", float(result.total))


class TwinTaskset(vf.Taskset[TwinTask, TwinTasksetConfig]):
    """The controlled cases of one split of one twin, in index order."""

    def load(self) -> Iterable[TwinTask]:
        twin = make_twin(self.config.twin, **self.config.twin_config())
        n = twin.splits.get(self.config.split)
        if n is None:
            raise ValueError(
                f"twin {twin.name!r} has no split {self.config.split!r}; "
                f"allowed: {', '.join(twin.splits)}"
            )
        if self.config.num_cases is not None:
            n = min(n, self.config.num_cases)
        env = TwinEnv(twin)
        for index in range(n):
            messages, info = env.reset(options={"split": self.config.split, "index": index})
            data = TwinTaskData(
                id=str(info["case_id"]),
                name=str(info["case_id"]),
                prompt=[dict(m) for m in messages],
                twin=self.config.twin,
                split=self.config.split,
                index=index,
                case_id=str(info["case_id"]),
                tools=thaw(info["tools"]),
                twin_config=self.config.twin_config(),
            )
            yield TwinTask(data, self.config.task)


class TwinHarnessConfig(vf.HarnessConfig):
    """The in-process twin agent loop."""

    request_timeout: float = Field(600.0, gt=0, description="Seconds per model call.")


class TwinHarness(vf.Harness[TwinHarnessConfig]):
    """Plays one TwinEnv episode per rollout; every model call goes through ``endpoint``."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = False
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: Any,
        trace: vf.Trace,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TwinTaskData,
        tool_interception_url: str | None = None,
    ) -> Any:
        """Run the episode to its end; returns a synthetic successful program result."""
        from verifiers.v1.runtimes import ProgramResult

        env = TwinEnv(make_twin(data.twin, **data.twin_config))
        env.reset(options={"split": data.split, "index": data.index})
        actions: list[dict[str, Any]] = []
        record: dict[str, Any] = {"case_id": data.case_id, "actions": actions}
        trace.info["twin"] = record
        url = endpoint.rstrip("/") + "/chat/completions"
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(timeout=self.config.request_timeout) as client:
            done = False
            while not done:
                body = {"model": ctx.model, "messages": _wire(env.messages), "tools": data.tools}
                response = await client.post(url, json=body, headers=headers)
                response.raise_for_status()
                message = response.json()["choices"][0]["message"]
                action = {
                    k: message.get(k) for k in ("role", "content", "tool_calls") if k in message
                }
                action["role"] = "assistant"
                if not action.get("tool_calls"):
                    action.pop("tool_calls", None)
                actions.append(action)
                _, _, terminated, truncated, info = env.step(action)
                done = terminated or truncated
        record["total"] = float(info["reward"]["total"])
        return ProgramResult(exit_code=0, stdout="", stderr="")


def _wire(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [thaw(m) for m in messages]


def recorded_actions(trace: vf.Trace) -> list[dict[str, Any]]:
    """The assistant turns :class:`TwinHarness` recorded on ``trace``."""
    return list((trace.info.get("twin") or {}).get("actions") or [])


def replay_reward(data: TwinTaskData, actions: list[dict[str, Any]]) -> Any:
    """The twin's :class:`rewards.RewardResult` of ``actions`` played on the case of ``data``."""
    env = TwinEnv(make_twin(data.twin, **data.twin_config))
    env.reset(options={"split": data.split, "index": data.index})
    info: dict[str, Any] = {}
    for action in actions:
        _, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            break
    if "reward" not in info:
        raise vf.TaskError(
            f"case {data.case_id}: the recorded {len(actions)} turns did not end the episode"
        )
    from rewards import RewardResult

    return RewardResult.model_validate(thaw(info["reward"]))


def reward_weights(twin_name: str, config: Mapping[str, Any] | None = None) -> dict[str, float]:
    """``{term name: weight}`` of a twin's reward."""
    reward = make_twin(twin_name, **dict(config or {})).reward
    return {k: float(v) for k, v in reward.weights.items() if math.isfinite(v)}


def load_environment(
    twin: str = "catalog",
    *,
    split: str = "train",
    num_cases: int | None = None,
    env_config: Mapping[str, Any] | None = None,
    taskset_id: str = TASKSET_ID,
    **twin_options: Any,
) -> Any:
    """A verifiers.v1 environment of one twin: its cases, the twin harness, its reward.

    Args:
        twin: Twin name or id (``twin list``).
        split: The split whose cases are the tasks (``train`` by default: an environment is for
            training; evaluate on ``test``).
        num_cases: Use only the first N cases.
        env_config: Further ``EnvConfig`` fields (``timeout``, ``max_concurrent_agents``, ...).
        taskset_id: The module verifiers loads the taskset and harness from (a package made by
            ``twin package`` passes its own).
        **twin_options: Twin options, every one passed to the twin (``max_turns``,
            ``prompt_style``, ``seed``, and the twin's own, e.g. ``case_mix``).
    """
    named = {
        k: twin_options.pop(k) for k in ("max_turns", "prompt_style", "seed") if k in twin_options
    }
    config = vf.resolve_env_config(
        {
            "taskset": {
                "id": taskset_id,
                "twin": twin,
                "split": split,
                "num_cases": num_cases,
                "options": twin_options,
                **named,
            },
            "agent": {"harness": {"id": taskset_id}, "runtime": {"type": "subprocess"}},
            **dict(env_config or {}),
        }
    )
    return vf.load_environment(config)

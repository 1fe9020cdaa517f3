"""The ``Twin`` base class: a world, tools, controlled cases, a prompt and a default reward.

A twin is a simulated business process. Subclasses set the class attributes under
"Set these in ALL subclasses" and implement :meth:`Twin.build_world`, :meth:`Twin.make_case` and
:meth:`Twin.prompt`; tools are methods marked with :func:`twin.tools.tool`::

    class ReturnsTwin(Twin):
        name = "Returns"
        version = 0
        description = "A returns desk: look up an order, check the policy, decide."
        reward = returns_reward          # any callable (trajectory, case) -> RewardResult

        def build_world(self) -> World: ...
        def make_case(self, rng, split, index) -> tuple[str, dict, dict]: ...
        def prompt(self, case) -> list[dict]: ...

        @tool
        def lookup_order(self, order_id: str, world: World) -> dict:
            \"\"\"Look up an order.\"\"\"

The world is built once per process for each distinct config and shared read-only by every
episode; twins whose world is costly also cache it on disk under :meth:`Twin.cache_dir`.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from twin.cases import DEFAULT_SPLITS, Case, case_rng
from twin.errors import CaseError, ConfigError
from twin.protocols import Policy
from twin.tools import Tool, freeze, tools_of
from twin.trajectory import Trajectory

__all__ = ["RewardFn", "RewardResultLike", "Twin", "TwinConfig", "as_policy"]


@runtime_checkable
class RewardResultLike(Protocol):
    """What a reward returns (``rewards.RewardResult`` satisfies it)."""

    total: float
    components: dict[str, float]
    weighted: dict[str, float]
    notes: list[str]


class RewardFn(Protocol):
    """A reward: ``reward(trajectory, case) -> RewardResult``."""

    def __call__(self, trajectory: Trajectory, case: Case) -> RewardResultLike: ...


class TwinConfig(BaseModel):
    """Options every twin takes; twins extend it with their own fields.

    Attributes:
        seed: Seed of the world and of every case.
        max_turns: Assistant turns before the episode is truncated.
        max_action_chars: Longest assistant turn accepted; longer ones are rejected with a message.
        max_result_chars: Tool results longer than this are cut (with a note) before the agent
            sees them.
        max_calls_per_turn: Most tool calls run in one assistant turn; the calls after them are
            not run, each answered with a message and counted as an invalid call.
        prompt_style: ``"full"`` (the default) or ``"compact"``: a shorter system prompt and
            tool descriptions for small models, with the same tools and cases; a twin lists the
            styles it has in :attr:`Twin.prompt_styles`.
    """

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    max_turns: int = Field(8, ge=1)
    max_action_chars: int = Field(16_000, ge=1)
    max_result_chars: int = Field(8_000, ge=100)
    max_calls_per_turn: int = Field(8, ge=1)
    prompt_style: Literal["full", "compact"] = "full"


_setattr = object.__setattr__  # sets a field of a frozen pydantic model
_WORLDS: dict[tuple[type, str], Any] = {}
_WORLDS_LOCK = threading.Lock()


class Twin:
    """Base class of every twin. Subclasses set the attributes below and the abstract methods."""

    # Set these in ALL subclasses
    name: ClassVar[str]
    version: ClassVar[int] = 0
    description: ClassVar[str] = ""
    config_model: ClassVar[type[TwinConfig]] = TwinConfig
    splits: ClassVar[dict[str, int]] = DEFAULT_SPLITS
    #: True when tools block (disk, network): runners then call ``step`` in a thread pool.
    blocking_tools: ClassVar[bool] = False
    #: The values of ``TwinConfig.prompt_style`` this twin's prompt and tool schemas implement.
    prompt_styles: ClassVar[tuple[str, ...]] = ("full",)
    reward: RewardFn

    def __init__(self, **config: Any) -> None:
        """Validate ``config`` against :attr:`config_model`.

        Raises:
            ConfigError: an unknown option or a bad value; the message lists the valid options.
        """
        try:
            self.config = self.config_model(**config)
        except ValidationError as exc:
            fields = ", ".join(self.config_model.model_fields)
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
            )
            raise ConfigError(
                f"{type(self).__name__} config: {problems}. Options: {fields}"
            ) from None
        style = self.config.prompt_style
        if style not in self.prompt_styles:
            raise ConfigError(
                f"{type(self).__name__} config: prompt_style {style!r} is not implemented by this "
                f"twin; it has: {', '.join(self.prompt_styles)}"
            )
        self.tools: list[Tool] = tools_of(self)
        self._tools_by_name = {t.name: t for t in self.tools}
        self._cases: dict[tuple[str, int], Case] = {}

    # -- world ---------------------------------------------------------------------------------
    def build_world(self) -> Any:
        """Build the static data every episode shares (read-only). Override."""
        return None

    def world_key(self) -> str:
        """The part of the config that determines the world (default: the whole config but the
        prompt style, which changes only what the agent is told)."""
        return json.dumps(
            self.config.model_dump(mode="json", exclude={"prompt_style"}), sort_keys=True
        )

    @property
    def world(self) -> Any:
        """The world for this config, built on first use and shared within the process."""
        key = (type(self), self.world_key())
        world = _WORLDS.get(key)
        if world is None:
            with _WORLDS_LOCK:
                world = _WORLDS.get(key)
                if world is None:
                    world = self.build_world()
                    _WORLDS[key] = world
        return world

    def cache_dir(self) -> Path:
        """Folder for this twin's on-disk cache: ``$TWINRL_CACHE`` or ``~/.cache/twinrl``."""
        root = Path(os.environ.get("TWINRL_CACHE") or Path.home() / ".cache" / "twinrl")
        digest = hashlib.sha256(self.world_key().encode()).hexdigest()[:16]
        path = root / f"{self.name}-v{self.version}" / digest
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- cases ---------------------------------------------------------------------------------
    def make_case(
        self, rng: random.Random, split: str, index: int
    ) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """Build one case from ``rng``; return ``(kind, task, truth)``. Override."""
        raise NotImplementedError

    def num_cases(self, split: str) -> int:
        """How many cases ``split`` has."""
        self._check_split(split)
        return self.splits[split]

    def case(self, split: str, index: int) -> Case:
        """The controlled case ``(split, index)``: the same bytes on every machine.

        Raises:
            CaseError: unknown split or index out of range.
        """
        self._check_split(split)
        if (
            not isinstance(index, int)
            or isinstance(index, bool)
            or not 0 <= index < self.splits[split]
        ):
            raise CaseError(
                f"{self.name}: index must be an integer in [0, {self.splits[split]}) for split "
                f"{split!r}, got {index!r}"
            )
        key = (split, index)
        cached = self._cases.get(key)
        if cached is None:
            rng = case_rng(self.name, self.config.seed, split, index)
            kind, task, truth = self.make_case(rng, split, index)
            cached = Case(
                twin=self.name, split=split, index=index, kind=kind, task=task, truth=truth
            )
            # The case is memoised and shared by every episode (tools get ``task``, the terminal
            # info the truth): read-only, so no episode can change another's case.
            _setattr(cached, "task", freeze(cached.task))
            _setattr(cached, "truth", freeze(cached.truth))
            if len(self._cases) < 50_000:  # cases are cheap to rebuild; bound the memo
                self._cases[key] = cached
        return cached

    def _check_split(self, split: str) -> None:
        if split not in self.splits:
            raise CaseError(
                f"{self.name}: unknown split {split!r}; splits: {', '.join(self.splits)}"
            )

    # -- episode -------------------------------------------------------------------------------
    def prompt(self, case: Case) -> list[dict[str, Any]]:
        """The opening messages (system + user) for ``case``. Must not reveal ``case.truth``."""
        raise NotImplementedError

    def new_state(self, case: Case) -> dict[str, Any]:
        """Fresh per-episode mutable state, injected into tools as ``state`` (keep it tiny)."""
        return {}

    def outcome(self, trajectory: Trajectory, case: Case) -> dict[str, Any]:
        """What the terminal ``info`` reveals after the episode (default: the truth)."""
        return {"truth": case.truth, "kind": case.kind}

    def _reward_callable(self) -> RewardFn:
        # A plain function stored as a class attribute would bind as a method; call it unbound.
        # Instance attributes (set in __init__) win, as with normal attribute look-up.
        reward = self.__dict__.get("reward")
        if reward is None:
            reward = type(self).__dict__.get("_reward_fn_cache")
            if reward is None:
                reward = inspect.getattr_static(type(self), "reward", None)
                if reward is None:
                    raise NotImplementedError(f"{type(self).__name__} sets no `reward`")
                if isinstance(reward, staticmethod):
                    reward = reward.__func__
                type.__setattr__(type(self), "_reward_fn_cache", reward)
        return reward  # type: ignore[no-any-return]

    def score(
        self, trajectory: Trajectory, case: Case, *, defer_group: bool = False
    ) -> RewardResultLike:
        """Score an episode with the twin's reward.

        Args:
            trajectory: The episode.
            case: Its case.
            defer_group: When the reward :attr:`needs_group`, leave its group terms for
                :meth:`score_groups` instead of failing (what an episode's end does).
        """
        reward = self._reward_callable()
        if defer_group and self.needs_group:
            return reward(trajectory, case, defer_group=True)  # type: ignore[call-arg]
        return reward(trajectory, case)

    @property
    def needs_group(self) -> bool:
        """True when the reward scores episodes against their group (it has a true
        ``needs_group``, as ``rewards.Reward`` with a RULER-style judge term does): an episode's
        end scores it provisionally and :meth:`score_groups` scores it with its group."""
        try:
            reward = self._reward_callable()
        except NotImplementedError:  # no reward: scoring says so when an episode ends
            return False
        return bool(getattr(reward, "needs_group", False))

    def score_groups(
        self, groups: Sequence[Sequence[tuple[Trajectory, Case]]], *, new_step: bool = False
    ) -> None:
        """Score each group's ended episodes together and store the results in the trajectories.

        For a reward that :attr:`needs_group` (through its ``score_groups(groups, new_step=)``):
        ``reward``, ``components``, ``weighted`` and ``reward_notes`` are replaced (notes added
        after the end scoring, e.g. a trainer's cut note, are kept) and ``info["deferred"]`` is
        removed. Other rewards score nothing here: their episode's end was final.

        Args:
            groups: Each group's ``(trajectory, case)`` pairs.
            new_step: Start the reward's next judge budget step first (once per training step).
        """
        reward = self._reward_callable()
        if not self.needs_group:
            return
        results = reward.score_groups(groups, new_step=new_step)  # type: ignore[attr-defined]
        for group, scored in zip(groups, results):
            for (traj, _), result in zip(group, scored):
                pending = traj.info.pop("deferred", None) or {}
                extra = traj.reward_notes[
                    int(pending.get("reward_notes", len(traj.reward_notes))) :
                ]
                traj.reward = float(result.total)
                traj.components = dict(result.components)
                traj.weighted = dict(result.weighted)
                traj.reward_notes = list(result.notes) + extra

    # -- doctor hooks (``twin check``, :func:`twin.doctor.doctor`) ------------------------------
    #: Thresholds of ``twin check`` this twin holds itself to (names: see
    #: :data:`twin.doctor.report.DEFAULT_THRESHOLDS`); say in a comment why one differs.
    check_thresholds: ClassVar[dict[str, float]] = {}

    def kind_of(self, split: str, index: int) -> str | None:
        """The kind of case ``(split, index)`` without building the case, or None (the default)
        when the twin has no cheaper way than :meth:`case`. :meth:`case_kind` reads it."""
        return None

    def case_kind(self, split: str, index: int) -> str:
        """The kind of case ``(split, index)``: :meth:`kind_of` when it answers, else the built
        case's kind."""
        kind = self.kind_of(split, index)
        if kind is not None:
            return str(kind)
        return self.case(split, index).kind

    def case_label(self, case: Case) -> str:
        """The answer class of ``case`` the shortcut audit tries to predict from the prompt and
        the first tool output (default: its kind; better: the terminal answer, e.g. a verdict)."""
        return case.kind

    def extra_checks(self, cases: int) -> list[dict[str, Any]]:
        """The twin's own ``twin check`` rows, each a dict of
        :meth:`twin.doctor.report.Report.add` arguments (``check``, ``name``, ``status``, ...);
        ``cases`` is the check's per-kind case count. Default: none."""
        return []

    # -- evaluation hooks ----------------------------------------------------------------------
    def baselines(self) -> dict[str, Any]:
        """Named policies of this twin, ``{name: factory(twin) -> policy}`` (or a policy):
        ``--policy NAME`` picks one, ``oracle`` is :meth:`oracle_policy`, the others other
        than ``random`` are :meth:`reference_policies`. Default: none."""
        return {}

    def success(self, trajectory: Trajectory) -> bool | None:
        """Whether a scored episode succeeded by the twin's own rule, or None (the default) when
        success is reaching the reward's maximum (:func:`twin.rollout.success_fn`)."""
        return None

    def reference_policies(self) -> dict[str, Any]:
        """The twin's best policies that do not read the truth: ``{name: policy}``.

        ``twin check`` measures every degenerate policy against the best of them. Default: the
        :meth:`baselines` other than ``oracle`` and ``random``, made for this twin.
        """
        return {
            name: as_policy(self, factory)
            for name, factory in _baselines_of(self).items()
            if name not in ("oracle", "random")
        }

    def oracle_policy(self) -> Any | None:
        """A policy that reaches the maximum reward on every case (it may read the truth); used
        only to prove every case is solvable. Default: the ``oracle`` baseline, or None."""
        factory = _baselines_of(self).get("oracle")
        return None if factory is None else as_policy(self, factory)

    def degenerate_policies(self) -> dict[str, Any]:
        """Twin-specific shortcut policies ``twin check`` holds against the references, e.g. one
        that submits the first search hit. The generic ones (every constant answer of the
        terminal tool, no tool calls, random) are built by the doctor. Default: none."""
        return {}

    def world_entities(self, split: str, limit: int | None = None) -> dict[str, set[str]] | None:
        """Entities (kind -> names, e.g. ``{"brands": {...}, "sellers": {...}}``) the first
        ``limit`` cases of ``split`` use (all when None), for the train/test overlap check.
        None (the default): not implemented; ``{}``: the twin has no world entities."""
        return None

    def truth_fields(self, case: Case) -> list[str] | None:
        """Strings of ``case``'s truth no prompt, non-terminal tool output or info may carry.

        None (the default): the doctor takes the truth's string values (and the kind) that
        several cases share, i.e. answer classes, not case-specific facts a tool may rightly
        find (a category id), and leaves out the ones the task itself shows."""
        return None

    # -- tools ---------------------------------------------------------------------------------
    def tool(self, name: str) -> Tool | None:
        """The tool called ``name``, or None."""
        return self._tools_by_name.get(name)

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of every tool, in declaration order."""
        return [t.schema for t in self.tools]

    @property
    def frozen_tool_schemas(self) -> list[dict[str, Any]]:
        """:attr:`tool_schemas`, read-only (:func:`twin.tools.freeze`), made once per twin: every
        env of this twin hands the same schemas to its callers."""
        frozen = self.__dict__.get("_frozen_tool_schemas")
        if frozen is None:
            frozen = self.__dict__["_frozen_tool_schemas"] = freeze(self.tool_schemas)
        return frozen  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} twin/{self.name}-v{self.version} seed={self.config.seed}>"


def _baselines_of(twin: Twin) -> dict[str, Any]:
    return dict(twin.baselines() or {})


def as_policy(twin: Twin, policy_or_factory: Any) -> Policy:
    """A hook's value as a policy: a policy (has ``act``) as it is; a factory
    ``f(twin) -> policy`` called with ``twin``."""
    if hasattr(policy_or_factory, "act") and not isinstance(policy_or_factory, type):
        return policy_or_factory
    return policy_or_factory(twin)

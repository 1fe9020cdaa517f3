"""Evaluate a policy on a twin's cases and record the run: the workflow behind ``twin eval``.

::

    from twin.evaluation import evaluate
    from twin.policies import make_policy
    from twin.registry import make_twin
    from twin.store import RunStore

    twin = make_twin("returns")
    result = evaluate(twin, make_policy("random", twin), [("test", i) for i in range(20)],
                      store=RunStore())
    result.summary["reward_mean"], result.summary["errors"], result.run_id

Every finished group is written to the store as it completes (one transaction), failed episodes
included, each with its reason (``info["error"]``, ``error_type``, ``error_turn``, and
``error_hint`` when the policy said what to change) and its partial trajectory. The run is
finished with the summary when every episode has ended, however many failed; it is marked
``interrupted`` on Ctrl-C and ``failed`` when the evaluation itself breaks.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from twin.core import Twin
from twin.protocols import Policy
from twin.rollout import CaseRef, OnGroup, arun_episodes, success_fn, summarize
from twin.store import RunStore
from twin.trajectory import Group

if TYPE_CHECKING:
    from twin.policies import PolicySettings

__all__ = [
    "BACKENDS",
    "Backend",
    "EvalInterrupted",
    "EvalJob",
    "EvalResult",
    "evaluate",
    "plan_evaluation",
    "score_group",
]

#: Where the episodes run: this process, or a Ray cluster.
Backend = Literal["local", "ray"]
BACKENDS: tuple[str, ...] = ("local", "ray")


@dataclass
class EvalResult:
    """What :func:`evaluate` returns.

    Attributes:
        summary: :func:`twin.rollout.summarize`'s figures plus ``twin``, ``policy``, ``split``,
            ``run_id``, ``store`` (the store URL, when stored) and ``usage`` (when the policy
            counts requests and tokens).
        groups: One group per case, in case order.
        run_id: The stored run, or None without a store.
    """

    summary: dict[str, Any]
    groups: list[Group] = field(default_factory=list)
    run_id: int | None = None

    @property
    def failed_episodes(self) -> int:
        """Episodes that ended with an error (stored, with their reason)."""
        return int(self.summary.get("errors", 0))


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`evaluate`; the run is stored as ``interrupted`` with what finished.

    Attributes:
        run_id: The run (None without a store).
        kept: Episodes the store holds for it.
    """

    def __init__(self, run_id: int | None, kept: int) -> None:
        super().__init__(f"evaluation interrupted; run {run_id} keeps {kept} episodes")
        self.run_id = run_id
        self.kept = kept


def evaluate(
    twin: Twin,
    policy: Policy,
    cases: Sequence[CaseRef],
    *,
    group_size: int = 1,
    concurrency: int = 64,
    store: RunStore | None = None,
    policy_spec: str | None = None,
    config: dict[str, Any] | None = None,
    progress: bool = True,
    backend: Backend = "local",
    ray_address: str | None = None,
) -> EvalResult:
    """Run ``group_size`` episodes of ``policy`` on each case, store them, summarize them.

    Args:
        twin: The twin.
        policy: A :class:`twin.policies.Policy`; its ``aclose()`` (if any) is awaited at the end.
        cases: ``(split, index)`` pairs.
        group_size: Episodes per case.
        concurrency: Most episodes in flight.
        store: Where to record the run (kind ``eval``); None records nothing.
        policy_spec: The policy as the run records it (default ``policy.name``).
        config: The run's configuration, stored with it (must not hold secrets).
        progress: Progress bar on stderr.
        backend: ``"local"`` (this process, asyncio) or ``"ray"`` (chunks of groups as Ray tasks
            on a cluster, :mod:`twin.evaluation.ray_eval`; the same groups, stored the same way).
        ray_address: The Ray cluster to join (default ``$RAY_ADDRESS``, else a local one).

    Returns:
        The summary, the groups and the run id.

    Raises:
        EvalInterrupted: Ctrl-C; the run is stored as ``interrupted``.
        CaseError: a case that does not exist (before any episode starts; nothing stored).
        ConfigError: an unknown backend, or ``"ray"`` without Ray installed.
    """
    if backend not in BACKENDS:
        from twin.errors import ConfigError

        raise ConfigError(f"unknown eval backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    for split, index in cases:
        twin.case(split, index)  # fail before a run is recorded

    def run_all(store_group: OnGroup | None) -> tuple[list[Group], Any]:
        """The groups, and the request usage the policy (or the Ray workers') counted."""
        on_group = _scoring(twin, store_group, backend)
        groups, ray_usage = asyncio.run(
            _run_groups(twin, policy, cases, on_group, group_size=group_size,
                        concurrency=concurrency, progress=progress, backend=backend,
                        ray_address=ray_address)
        )  # fmt: skip
        return groups, ray_usage if backend == "ray" else getattr(policy, "usage", None)

    if store is None:
        try:
            groups, usage = run_all(None)
        except KeyboardInterrupt:
            raise EvalInterrupted(None, 0) from None
        return EvalResult(_summary(twin, policy, cases, groups, None, usage), groups, None)

    spec = policy_spec or policy.name
    with store.track_run("eval", twin.name, spec, config) as run:
        try:
            groups, usage = run_all(lambda group: run.add_episodes(group.trajectories))
        except KeyboardInterrupt:
            raise EvalInterrupted(run.id, run.count_episodes()) from None
        summary = _summary(twin, policy, cases, groups, run.id, usage)
        run.metrics = summary
    summary["store"] = store.url
    return EvalResult(summary, groups, run.id)


def _scoring(twin: Twin, store_group: OnGroup | None, backend: Backend) -> OnGroup | None:
    """What to call with each finished group: store it, after scoring it together when the
    twin's reward ranks episodes within their group (``twin.needs_group``)."""
    if not twin.needs_group:
        return store_group
    if backend == "ray":

        def on_group(group: Group) -> None:
            score_group(twin, group)
            if store_group is not None:
                store_group(group)

        return on_group

    async def on_group_async(group: Group) -> None:
        await asyncio.to_thread(score_group, twin, group)  # the judge may take seconds
        if store_group is not None:
            store_group(group)

    return on_group_async


async def _run_groups(
    twin: Twin,
    policy: Policy,
    cases: Sequence[CaseRef],
    on_group: OnGroup | None,
    *,
    group_size: int,
    concurrency: int,
    progress: bool,
    backend: Backend,
    ray_address: str | None,
) -> tuple[list[Group], dict[str, Any] | None]:
    """The groups, and the usage the Ray workers' policies counted (None on the local backend);
    the policy's ``aclose()`` (if any) is awaited however the run ends."""
    try:
        if backend == "ray":
            from twin.evaluation.ray_eval import run_on_ray  # Ray is imported only on this path

            return run_on_ray(
                twin, policy, cases, group_size=group_size, concurrency=concurrency,
                progress=progress, on_group=on_group, address=ray_address,
            )  # fmt: skip
        groups = await arun_episodes(
            twin,
            policy,
            cases,
            group_size=group_size,
            concurrency=concurrency,
            progress=progress,
            on_group=on_group,
        )
        return groups, None
    finally:
        closer = getattr(policy, "aclose", None)
        if closer is not None:
            await closer()


def _summary(
    twin: Twin,
    policy: Policy,
    cases: Sequence[CaseRef],
    groups: list[Group],
    run_id: int | None,
    usage: Any,
) -> dict[str, Any]:
    """:func:`twin.rollout.summarize`'s figures with the run's names, id and request usage."""
    summary = summarize(groups, success=success_fn(twin))
    summary.update(
        {
            "twin": twin.name,
            "policy": policy.name,
            "split": cases[0][0] if cases else "",
            "run_id": run_id,
        }
    )
    if isinstance(usage, dict):
        summary["usage"] = dict(usage)
    return summary


def score_group(twin: Twin, group: Group) -> None:
    """Score a finished group's episodes together, for a twin whose reward ranks episodes within
    their group (``twin.needs_group``): :meth:`twin.core.Twin.score_groups` on the episodes that
    ended without an error. A judge that fails marks those episodes failed (reward None, the
    reason in ``info["error"]``) instead of ending the evaluation."""
    done = [t for t in group.trajectories if t.reward is not None and "error" not in t.info]
    if not done:
        return
    try:
        twin.score_groups([[(t, twin.case(t.split, t.index)) for t in done]])
    except Exception as exc:  # noqa: BLE001 - one group's judge failure must not end the run
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        for t in done:
            t.reward = None
            t.info["error"] = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
            t.info["error_type"] = type(exc).__name__
            t.info["error_turn"] = t.num_turns


#: Episodes in flight when neither the caller nor the policy file says.
DEFAULT_CONCURRENCY = 64


@dataclass
class EvalJob:
    """An evaluation ready to run (what ``twin eval`` runs): :func:`plan_evaluation` makes it.

    Attributes:
        twin: The twin.
        policy: The policy, made from ``policy_spec``.
        policy_spec: The policy as the run records it, e.g. ``"random"`` or ``"openai:MODEL"``.
        cases: ``(split, index)`` pairs, each run ``group_size`` times.
        group_size: Episodes per case.
        concurrency: Most episodes in flight.
        backend: Where the episodes run.
        config: The run's configuration as stored (never the API key).
    """

    twin: Twin
    policy: Policy
    policy_spec: str
    cases: list[CaseRef]
    group_size: int
    concurrency: int
    backend: Backend
    config: dict[str, Any]

    def describe(self) -> str:
        """One line: the twin, the episodes and the policy, e.g. for a log before the run."""
        n = len(self.cases)
        split = self.cases[0][0] if self.cases else ""
        return (
            f"{self.twin.name}: {n} cases x {self.group_size} = {n * self.group_size} "
            f"episodes of {self.policy.name} on split {split!r}"
        )

    def run(self, store: RunStore | None = None, *, progress: bool = True) -> EvalResult:
        """:func:`evaluate` this job, recording it in ``store`` (None: not recorded)."""
        return evaluate(
            self.twin,
            self.policy,
            self.cases,
            group_size=self.group_size,
            concurrency=self.concurrency,
            store=store,
            policy_spec=self.policy_spec,
            config=self.config,
            progress=progress,
            backend=self.backend,
        )


def plan_evaluation(
    twin: Twin,
    settings: PolicySettings,
    *,
    episodes: int,
    split: str = "test",
    start: int = 0,
    group_size: int = 1,
    seed: int = 0,
    backend: Backend = "local",
    twin_config: dict[str, Any] | None = None,
    policy_file: str | None = None,
) -> EvalJob:
    """Make the policy and pick the cases of an evaluation; check that they fit the split.

    Args:
        twin: The twin.
        settings: The policy and its request settings (``random`` when it names none; the
            concurrency, when set, bounds the episodes in flight, default 64).
        episodes: Episodes in all: ``ceil(episodes / group_size)`` cases, each run
            ``group_size`` times.
        split: Case split.
        start: First case index.
        group_size: Episodes per case.
        seed: Seed of the random policy.
        backend: ``"local"`` or ``"ray"`` (checked when the job runs).
        twin_config: The twin's config, recorded with the run.
        policy_file: The policy file ``settings`` came from, recorded with the run.

    Returns:
        The job; ``job.run(store)`` evaluates it.

    Raises:
        ConfigError: the cases do not fit the split, or the policy spec is unknown.
    """
    from twin.errors import ConfigError
    from twin.policies import make_policy

    spec = settings.policy or "random"
    in_flight = settings.concurrency or DEFAULT_CONCURRENCY
    is_openai = spec.startswith("openai:")
    options = settings.request_options() if is_openai else {}
    policy = make_policy(
        spec, twin, seed=seed, base_url=settings.base_url, api_key=settings.api_key, **options
    )
    n_cases = math.ceil(episodes / group_size)
    if n_cases > twin.num_cases(split) - start:
        raise ConfigError(
            f"{twin.name} split {split!r} has {twin.num_cases(split)} cases; {n_cases} "
            f"from index {start} do not fit: lower --episodes, raise --group-size or pick "
            "another --split"
        )
    config: dict[str, Any] = {
        "twin_config": dict(twin_config or {}),
        "split": split,
        "start": start,
        "episodes": n_cases * group_size,
        "cases": n_cases,
        "group_size": group_size,
        "concurrency": in_flight,
        "backend": backend,
        "seed": seed,
        "base_url": settings.base_url,
        "temperature": settings.temperature if settings.temperature is not None else 0.0,
        "policy_file": policy_file,
    }
    if is_openai:  # the key is a secret: never in the store
        config["request"] = {k: v for k, v in options.items() if k != "api_key"}
    return EvalJob(
        twin=twin,
        policy=policy,
        policy_spec=spec,
        cases=[(split, start + i) for i in range(n_cases)],
        group_size=group_size,
        concurrency=in_flight,
        backend=backend,
        config=config,
    )

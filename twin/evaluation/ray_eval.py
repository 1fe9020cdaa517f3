"""``evaluate(..., backend="ray")``: the episodes of an evaluation fanned out over a Ray cluster.

The twin and the policy are pickled once (``ray.put``) and built once per Ray worker process (a
process-wide cache keyed by the object's id), not once per task. The cases are cut into chunks of
whole groups; each chunk is one Ray task that runs :func:`twin.rollout.arun_episodes` on its cases,
exactly as the local backend runs all of them, and returns its groups. The driver writes each
group to the run store as its chunk comes back, so the store holds the same rows as a local run:
same cases, same episode keys (``"<case id>#<k>"``), same rewards for a deterministic policy.

Ray is imported here only, and this module only from :func:`twin.evaluation.evaluate`'s ray branch:
``import twin`` never needs Ray. ``pip install 'twinrl[ray]'`` installs it.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from twin.core import Twin
from twin.errors import ConfigError
from twin.protocols import Policy
from twin.rollout import CaseRef, arun_episodes, progress_bar
from twin.trajectory import Group

__all__ = ["RAY_ADDRESS_ENV", "ensure_ray", "run_on_ray"]

#: The cluster to join (``ray start --head`` prints it); unset: a running local cluster, else a
#: new one.
RAY_ADDRESS_ENV = "RAY_ADDRESS"
#: Chunks per CPU of the cluster: a few per CPU keep every worker busy to the end of the run.
CHUNKS_PER_CPU = 4

# One (twin, policy) per Ray worker process and evaluation: building a twin can take seconds.
_BUILT: dict[str, tuple[Any, Any]] = {}


def ensure_ray(address: str | None = None, *, num_cpus: int | None = None) -> Any:
    """Import Ray and connect to (or start) a cluster; return the ``ray`` module.

    Args:
        address: ``ray://...`` / ``HOST:PORT`` / ``auto``; None: ``$RAY_ADDRESS``, else a running
            local cluster, else a new local one.
        num_cpus: CPUs of a new local cluster (ignored when joining one).

    Raises:
        ConfigError: Ray is not installed.
    """
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "backend 'ray' needs Ray: pip install 'twinrl[ray]' (or choose backend 'local')"
        ) from None
    if not ray.is_initialized():
        options: dict[str, Any] = {"ignore_reinit_error": True, "log_to_driver": False}
        target = address or os.environ.get(RAY_ADDRESS_ENV)
        if target:
            options["address"] = target
        else:
            options["include_dashboard"] = False
            if num_cpus is not None:
                options["num_cpus"] = num_cpus
        ray.init(**options)
    return ray


def _chunks(n_cases: int, cpus: int, size: int | None) -> list[range]:
    if size is None:
        size = max(1, math.ceil(n_cases / max(1, cpus * CHUNKS_PER_CPU)))
    return [range(i, min(i + size, n_cases)) for i in range(0, n_cases, size)]


def _run_chunk(
    key: str, packed: list[Any], cases: list[CaseRef], group_size: int, concurrency: int
) -> tuple[list[Group], dict[str, Any] | None]:
    """One Ray task: the groups of ``cases``, and what the policy's usage counters grew by."""
    built = _BUILT.get(key)
    if built is None:
        import ray

        # the reference comes wrapped in a list so that Ray does not resolve it for every task
        built = _BUILT[key] = ray.get(packed[0])
    twin, policy = built
    before = _usage(policy)
    groups = asyncio.run(
        arun_episodes(
            twin, policy, cases, group_size=group_size, concurrency=concurrency, progress=False
        )
    )
    after = _usage(policy)
    grown = None
    if after is not None:
        grown = {
            k: v - (before or {}).get(k, 0) if isinstance(v, int | float) else v
            for k, v in after.items()
        }
    return groups, grown


def _usage(policy: Policy) -> dict[str, Any] | None:
    usage = getattr(policy, "usage", None)
    return dict(usage) if isinstance(usage, dict) else None


def run_on_ray(
    twin: Twin,
    policy: Policy,
    cases: Sequence[CaseRef],
    *,
    group_size: int,
    concurrency: int,
    progress: bool,
    on_group: Callable[[Group], Any] | None,
    address: str | None = None,
    chunk_size: int | None = None,
) -> tuple[list[Group], dict[str, Any] | None]:
    """Run the episodes of ``cases`` as Ray tasks; call ``on_group`` on the driver as groups arrive.

    Args:
        twin: The twin (pickled once, built once per Ray worker process).
        policy: The policy (pickled with the twin; it must survive pickling, as the built-in and
            ``openai:`` policies do).
        cases: ``(split, index)`` pairs.
        group_size: Episodes per case.
        concurrency: Most episodes in flight in each task.
        progress: Progress bar on stderr (episodes done, on the driver).
        on_group: Called on the driver with each finished group (e.g. to store it).
        address: The cluster (see :func:`ensure_ray`).
        chunk_size: Cases per task (default: about ``CHUNKS_PER_CPU`` tasks per cluster CPU).

    Returns:
        The groups in case order, and the policy's usage summed over the tasks (None when the
        policy does not count).
    """
    ray = ensure_ray(address)
    import uuid

    try:
        packed = ray.put((twin, policy))
    except Exception as exc:  # noqa: BLE001 - say which object could not travel
        raise ConfigError(
            f"backend 'ray' sends the twin and the policy to the cluster, and {twin.name} x "
            f"{policy.name} does not pickle ({type(exc).__name__}: {exc}); use backend 'local'"
        ) from exc
    key = uuid.uuid4().hex
    cases = [(str(s), int(i)) for s, i in cases]
    cpus = int(ray.cluster_resources().get("CPU", 1))
    remote = ray.remote(num_cpus=1)(_run_chunk)
    pending = {
        remote.remote(key, [packed], [cases[i] for i in chunk], group_size, concurrency): chunk
        for chunk in _chunks(len(cases), cpus, chunk_size)
    }
    results: list[Group | None] = [None] * len(cases)
    usage: dict[str, Any] | None = None
    bar = progress_bar(
        len(cases) * group_size, enabled=progress, desc=f"{twin.name} x {policy.name} (ray)"
    )
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            chunk = pending.pop(done[0])
            groups, grown = ray.get(done[0])
            for i, group in zip(chunk, groups, strict=True):
                results[i] = group
                if on_group is not None:
                    on_group(group)
            if grown is not None:
                usage = usage or {}
                for k, v in grown.items():
                    usage[k] = usage.get(k, 0) + v if isinstance(v, int | float) else v
            if bar is not None:
                bar.update(len(chunk) * group_size)
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return [g for g in results if g is not None], usage

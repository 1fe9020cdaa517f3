"""``twin plan --nodes N --gpus-per-node G``: how many sampler engines one learner can use on a Ray
cluster.

From the measured seconds per step of each side (``twin bench trainer --json``, or given), the
overlapped loop's throughput, the side that bounds it, and where each part runs. The memory plan of
one machine is :mod:`trainer.plan`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twin.errors import ConfigError

__all__ = ["ClusterPlan", "plan_cluster", "print_cluster", "sides_from_bench"]


# -- a Ray cluster: how many engines for one learner, and which side bounds throughput -------------
@dataclass(frozen=True)
class ClusterPlan:
    """Where ``backend: ray`` puts rollout and learner on ``nodes x gpus_per_node`` GPUs.

    Attributes:
        nodes: Nodes of the cluster.
        gpus_per_node: GPUs per node.
        learner_gpus: GPUs of the learner (one: the learner is one process, on the head node).
        engines: Sampler engines proposed (one GPU each); more would idle behind the learner.
        spare_gpus: GPUs left unused (the learner bounds throughput before they would help).
        rollout_workers: Rollout worker actors proposed (two per engine: one samples while the
            other runs its envs and renders).
        rollout_s: Seconds of one lot on one engine (measured).
        learner_s: Seconds of one update on the learner (measured).
        steps_per_s: Expected learner steps per second (k >= 1, sides overlapped).
        bound: ``"learner"`` or ``"rollout"``: the side that sets ``steps_per_s``.
        placement: One line per node: what runs there.
    """

    nodes: int
    gpus_per_node: int
    learner_gpus: int
    engines: int
    spare_gpus: int
    rollout_workers: int
    rollout_s: float
    learner_s: float
    steps_per_s: float
    bound: str
    placement: list[str] = field(default_factory=list)


def sides_from_bench(path: str | Path) -> tuple[float, float]:
    """``(rollout_s, learner_s)`` per step from ``twin bench trainer --json FILE``: the synchronous
    pinned run's rollout side (the learner's wait for a lot) and learner side (the rest of the
    step).

    Raises:
        ConfigError: the file is missing or is not a bench report.
    """
    try:
        report = json.loads(Path(path).read_text())
        run = report["runs"].get("k0_pinned") or report["runs"][report["baseline"]]
        rollout_s = float(run["learner_wait_s"])
        learner_s = float(run["step_s"]) - rollout_s
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"--bench {path}: not a `twin bench trainer --json` report ({type(exc).__name__}: "
            f"{exc}); write one with `twin bench trainer --json bench.json`, or give --rollout-s "
            "and --learner-s"
        ) from None
    return rollout_s, learner_s


def plan_cluster(nodes: int, gpus_per_node: int, rollout_s: float, learner_s: float) -> ClusterPlan:
    """Engines and workers for one learner GPU, from the measured seconds per step of each side.

    With ``E`` engines each sampling a lot in ``rollout_s`` and the learner taking ``learner_s`` per
    update, the overlapped loop (``max_staleness >= 1``) makes ``min(E / rollout_s, 1 / learner_s)``
    steps per second: engines beyond ``ceil(rollout_s / learner_s)`` would wait for the learner.

    Raises:
        ConfigError: fewer than 2 GPUs in all, or a side's time that is not positive.
    """
    total = nodes * gpus_per_node
    if nodes < 1 or gpus_per_node < 1 or total < 2:
        raise ConfigError(
            f"a cluster plan needs >= 2 GPUs in all (one learner, >= 1 engine); got {nodes} "
            f"node(s) x {gpus_per_node} GPU(s)"
        )
    if not (rollout_s > 0 and learner_s > 0):
        raise ConfigError(
            f"per-step seconds must be > 0, got rollout {rollout_s} and learner {learner_s}"
        )
    wanted = max(1, math.ceil(rollout_s / learner_s - 1e-9))
    engines = min(total - 1, wanted)
    rollout_rate, learner_rate = engines / rollout_s, 1.0 / learner_s
    bound = "learner" if learner_rate <= rollout_rate else "rollout"
    placement: list[str] = []
    left = engines
    for node in range(nodes):
        here = gpus_per_node - (1 if node == 0 else 0)
        used = min(here, left)
        left -= used
        parts = (["learner (driver, 1 GPU)"] if node == 0 else []) + (
            [f"{used} engine(s)"] if used else []
        )
        parts.append(f"{gpus_per_node - used - (1 if node == 0 else 0)} GPU(s) free")
        placement.append(f"node {node}: " + ", ".join(parts))
    return ClusterPlan(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        learner_gpus=1,
        engines=engines,
        spare_gpus=total - 1 - engines,
        rollout_workers=2 * engines,
        rollout_s=rollout_s,
        learner_s=learner_s,
        steps_per_s=min(rollout_rate, learner_rate),
        bound=bound,
        placement=placement,
    )


def print_cluster(console: Any, plan: ClusterPlan) -> None:
    """Print ``plan`` (the placement, the bound side and the recipe lines) to a rich console."""
    console.print(
        f"[bold]cluster[/]: {plan.nodes} node(s) x {plan.gpus_per_node} GPU(s); measured per step: "
        f"rollout {plan.rollout_s:.2f} s on one engine, learner {plan.learner_s:.2f} s",
        soft_wrap=True,
    )
    for line in plan.placement:
        console.print(f"  {line}", soft_wrap=True)
    other = "rollout" if plan.bound == "learner" else "learner"
    console.print(
        f"  {plan.engines} engine(s), {plan.rollout_workers} rollout worker(s): "
        f"~{plan.steps_per_s:.3f} steps/s; "
        f"the [bold]{plan.bound}[/] bounds throughput"
        + (
            f" ({plan.spare_gpus} GPU(s) would idle as engines: the {other} side already outpaces "
            "it)"
            if plan.spare_gpus
            else ""
        ),
        soft_wrap=True,
    )
    console.print(
        f"  recipe: backend: ray; ray: {{engines: {plan.engines}, rollout_workers: "
        f"{plan.rollout_workers}}}; "
        "async: {max_staleness: 1}",
        soft_wrap=True,
        markup=False,
    )

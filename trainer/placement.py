"""CPU placement of the trainer's processes (``devices.cpu_affinity``, Linux).

With rollout and learner both on CPU, the learner splits the cores it may use in two
(:func:`plan_cpu_placement`), pins itself to one half (:func:`place_learner`) and exports the other
half as ``$TWINRL_ROLLOUT_CPUS`` to the processes it starts afterwards; the rollout worker
(:mod:`trainer.workers`) and ``twin serve`` pin themselves to it at start-up
(:func:`place_rollout_process`). On two cores the sampling side and the learner then each own one
core instead of pre-empting each other, which is what lets ``k = 1`` approach 2x the synchronous
loop. Every such process runs ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` threads (1 by default) with
``OMP_WAIT_POLICY=PASSIVE``, so idle OpenMP threads sleep instead of spinning on a shared core.

This module imports nothing heavy at import time (torch is loaded inside the functions that need
it), so a rollout-side process can place itself before torch reads its thread settings.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twin.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import Recipe

__all__ = [
    "ROLLOUT_CPUS_ENV",
    "CpuPlacement",
    "format_cpus",
    "parse_cpus",
    "pin_process",
    "place_learner",
    "place_rollout_process",
    "plan_cpu_placement",
    "thread_env",
]

log = logging.getLogger("twinrl.placement")

#: The rollout side's cores, as the learner exports them to the processes it starts (``0,2-3``).
ROLLOUT_CPUS_ENV = "TWINRL_ROLLOUT_CPUS"


@dataclass(frozen=True)
class CpuPlacement:
    """Disjoint CPU sets for the rollout side (sampler server + rollout worker) and the learner."""

    rollout: tuple[int, ...]
    learner: tuple[int, ...]


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"0,2-3"`` -> ``(0, 2, 3)`` (the ``taskset -c`` / cpuset list syntax).

    Raises:
        ConfigError: the text is not a list of core numbers and ranges.
    """
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ConfigError(
                f"expected a CPU list like '0' or '0,2-3' (taskset -c syntax), got {text[:80]!r}"
            ) from None
        if first < 0 or last > MAX_CPU:  # before the range is built: 0-99999999 is no set to make
            raise ConfigError(
                f"core numbers must be in 0-{MAX_CPU} (Linux's most cores), got {part!r} in "
                f"{text[:80]!r}"
            )
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ConfigError(f"expected a non-empty list of core numbers >= 0, got {text[:80]!r}")
    return tuple(sorted(cpus))


#: The largest core number a CPU list may name (Linux's CONFIG_NR_CPUS is at most 8192).
MAX_CPU = 8191


def format_cpus(cpus: Iterable[int]) -> str:
    """``(0, 2, 3)`` -> ``"0,2,3"`` (readable by :func:`parse_cpus` and ``taskset -c``)."""
    return ",".join(str(c) for c in sorted(set(cpus)))


def thread_env(threads: int) -> dict[str, str]:
    """Environment of a process that must use ``threads`` CPU threads and never spin while idle."""
    n = str(max(1, int(threads)))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OMP_WAIT_POLICY": "PASSIVE"}


def _allowed_cpus() -> tuple[int, ...] | None:
    if not hasattr(os, "sched_getaffinity"):  # macOS, Windows: the OS places threads
        return None
    return tuple(sorted(os.sched_getaffinity(0)))


def plan_cpu_placement(devices: Any, cpus: Sequence[int] | None = None) -> CpuPlacement | None:
    """The rollout / learner split of ``devices.cpu_affinity: auto``, or None when nothing is
    pinned.

    Nothing is pinned when ``cpu_affinity`` is ``off``, when either side runs on a GPU, when the OS
    has no ``sched_setaffinity`` (not Linux) or when fewer than two cores are allowed. Otherwise
    the rollout side gets the first half of the allowed cores (the larger half when their number
    is odd: on CPU, sampling is the slower side) and the learner the rest.

    Args:
        devices: The recipe's ``devices`` section (``rollout``, ``learner``, ``cpu_affinity``).
        cpus: The cores to split (default: those this process may run on).
    """
    if getattr(devices, "cpu_affinity", "off") != "auto":
        return None
    if str(devices.rollout) != "cpu" or str(devices.learner) != "cpu":
        return None
    allowed = _allowed_cpus() if cpus is None else tuple(sorted(set(cpus)))
    if allowed is None or len(allowed) < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    half = (len(allowed) + 1) // 2
    return CpuPlacement(rollout=allowed[:half], learner=allowed[half:])


def pin_process(cpus: Iterable[int]) -> bool:
    """Pin every thread of this process (and the threads and children it starts later) to ``cpus``.

    ``sched_setaffinity(0)`` only moves the calling thread, so each thread in ``/proc/self/task``
    is moved. Returns False (and logs why) when the OS refused: placement is an optimisation, never
    a reason to stop a run.
    """
    chosen = set(cpus)
    if not hasattr(os, "sched_setaffinity") or not chosen:
        return False
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            try:
                os.sched_setaffinity(tid, chosen)
            except ProcessLookupError:  # the thread ended meanwhile
                continue
        os.sched_setaffinity(0, chosen)
    except OSError as exc:
        log.warning(
            "could not pin process %d to cores %s: %s", os.getpid(), format_cpus(chosen), exc
        )
        return False
    return True


def place_learner(cfg: Recipe) -> CpuPlacement | None:
    """Threads and (``devices.cpu_affinity: auto``) cores of the learner: call first in the trainer.

    Sets ``torch``'s threads to ``devices.cpu_threads`` (default with pinning: one per learner
    core). With a placement it pins this process to the learner's cores and exports the rollout
    cores as ``$TWINRL_ROLLOUT_CPUS``, so the sampler server and the rollout worker started after
    it pin themselves there (:func:`place_rollout_process`); without one it removes that variable.

    Args:
        cfg: The recipe (its ``devices`` section is read).

    Returns:
        The placement applied, or None.
    """
    import torch

    devices = cfg.devices
    placement = plan_cpu_placement(devices)
    if placement is None:
        os.environ.pop(ROLLOUT_CPUS_ENV, None)
        if devices.cpu_threads:
            torch.set_num_threads(devices.cpu_threads)
        return None
    pin_process(placement.learner)
    os.environ[ROLLOUT_CPUS_ENV] = format_cpus(placement.rollout)
    torch.set_num_threads(devices.cpu_threads or len(placement.learner))
    log.info(
        "cpu placement: rollout (sampler + worker) on cores %s, learner on cores %s, %d thread(s) "
        "each",
        format_cpus(placement.rollout),
        format_cpus(placement.learner),
        torch.get_num_threads(),
    )
    return placement


def place_rollout_process(
    threads: int | None = None, cpus: str | None = None
) -> tuple[int, ...] | None:
    """Cores and threads of a rollout-side process (the rollout worker, ``twin serve``).

    Pins this process to ``cpus`` (default: ``$TWINRL_ROLLOUT_CPUS``, exported by
    :func:`place_learner`; nothing when neither is set) and gives it ``threads`` threads (default:
    one per pinned core; torch's default when unpinned) through the ``OMP_*`` / ``MKL_*``
    variables, and ``torch.set_num_threads`` when torch is already loaded. Call it before
    importing torch where possible (OpenMP reads ``OMP_WAIT_POLICY`` once, when torch loads).

    Returns:
        The cores pinned to, or None.
    """
    spec = cpus if cpus is not None else os.environ.get(ROLLOUT_CPUS_ENV)
    chosen = parse_cpus(spec) if spec else None
    cores = os.cpu_count()
    if chosen is not None and cores is not None and max(chosen) >= cores:
        # one thread per named core: --cpus 0-99999 once started 100,000 threads
        missing = [c for c in chosen if c >= cores]
        raise ConfigError(
            f"cores {format_cpus(missing[:8])}{'...' if len(missing) > 8 else ''} are not on this "
            f"machine; it has {cores} (0-{cores - 1})"
        )
    if chosen is not None and not pin_process(chosen):
        chosen = None
    count = threads or (len(chosen) if chosen else None)
    if count:
        os.environ.update(thread_env(count))  # read by torch when it loads
        if "torch" in sys.modules:
            import torch

            torch.set_num_threads(count)
    return chosen

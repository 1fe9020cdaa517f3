"""torch's CPU thread count when a recipe or the environment does not set one.

torch starts one thread per core. When other processes keep those cores busy (another stage of
a chain, an evaluation beside training, other users) its threads pre-empt each other: on a
loaded 2-core machine two threads made a SmolLM2 step 1.5-3x slower than one. The default here
is the cores left idle: ``cores - round(load average)``, at least one, at most ``cores``; an
explicit ``devices.cpu_threads`` or ``OMP_NUM_THREADS`` wins.
"""

from __future__ import annotations

import os

import torch

__all__ = ["default_cpu_threads", "place_cpu_threads"]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_cpu_threads(cores: int | None = None, load: float | None = None) -> int:
    """Threads for a process that shares ``cores`` with a ``load`` (1-minute load average) of
    others.

    Args:
        cores: Cores this process may run on (default: its affinity mask).
        load: Runnable processes on the machine (default: ``os.getloadavg()[0]``).
    """
    cores = _cores() if cores is None else max(1, int(cores))
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    return max(1, min(cores, cores - round(load)))


def place_cpu_threads(requested: int | None) -> int:
    """Set torch's intra-op threads: ``requested``, else ``OMP_NUM_THREADS``, else the default."""
    if requested:
        threads = int(requested)
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = default_cpu_threads()
    torch.set_num_threads(threads)
    return threads

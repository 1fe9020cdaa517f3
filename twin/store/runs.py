"""What the store says about a run: its kinds and statuses, :class:`RunInfo` (a ``runs`` row
read back) and whether the run's writer still lives."""

from __future__ import annotations

import datetime as dt
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from twin.errors import TwinError
from twin.store.schema import RunTable

__all__ = [
    "HEARTBEAT_S",
    "HOST",
    "RUN_KINDS",
    "RUN_STATUSES",
    "RunInfo",
    "RunNotFoundError",
    "STALE_AFTER_S",
    "pid_alive",
    "run_info",
    "writer_gone",
]

#: The kinds of run the store records.
RUN_KINDS = ("eval", "train", "demo", "bench")
#: Statuses a run reads back with (``interrupted``: ``running`` but its process is gone).
RUN_STATUSES = ("running", "finished", "failed", "interrupted")
#: Seconds between heartbeats of a running run.
HEARTBEAT_S = 20.0
#: A running run whose heartbeat is older than this reads back as ``interrupted``.
STALE_AFTER_S = 120.0
#: This host's name, as runs record their writer's.
HOST = socket.gethostname()


class RunNotFoundError(TwinError, KeyError):
    """A run id that the store does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class RunInfo:
    """One row of the ``runs`` table, with its episode count and mean reward.

    Attributes:
        id: Run id.
        kind: ``eval``, ``train``, ``demo`` or ``bench``.
        twin: Twin name.
        policy: Policy spec or name.
        config: The run's configuration (CLI options, recipe).
        status: ``running``, ``finished``, ``failed`` or ``interrupted`` (stored as
            ``running`` but its process is gone or its heartbeat is stale; or ended by Ctrl-C).
        started_at: Start time (timezone-aware, UTC).
        finished_at: End time (timezone-aware, UTC), None while running.
        metrics: The summary written by :meth:`RunStore.finish_run`.
        episodes: Episodes stored for the run.
        reward_mean: Mean reward over the stored, scored episodes (None when there are none).
        pid: Process id of the run's writer (None in stores older than liveness).
        host: Host name of the run's writer.
        heartbeat_at: Time of the writer's last sign of life (timezone-aware, UTC).
    """

    id: int
    kind: str
    twin: str
    policy: str
    config: dict[str, Any] = field(default_factory=dict)
    status: str = "running"
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    metrics: dict[str, Any] | None = None
    episodes: int = 0
    reward_mean: float | None = None
    pid: int | None = None
    host: str | None = None
    heartbeat_at: dt.datetime | None = None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0 checks without sending)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return True
    return True


def writer_gone(pid: int | None, host: str | None) -> bool:
    """Whether a run's recorded writer is a process of this host that no longer exists."""
    return pid is not None and host == HOST and not pid_alive(pid)


def run_info(row: RunTable, count: int, mean: float | None) -> RunInfo:
    """A ``runs`` row as :class:`RunInfo` (its status as stored)."""
    return RunInfo(
        id=row.id,
        kind=row.kind,
        twin=row.twin,
        policy=row.policy,
        config=dict(row.config or {}),
        status=row.status,
        started_at=row.started_at,
        finished_at=row.finished_at,
        metrics=row.metrics,
        episodes=int(count),
        reward_mean=None if mean is None else float(mean),
        pid=row.pid,
        host=row.host,
        heartbeat_at=row.heartbeat_at,
    )

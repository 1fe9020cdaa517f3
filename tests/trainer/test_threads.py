"""Default torch threads: the cores the machine's load leaves idle (trainer/threads.py)."""

from __future__ import annotations

import pytest
import torch

from trainer.threads import default_cpu_threads, place_cpu_threads


@pytest.mark.parametrize(
    ("cores", "load", "threads"),
    [(2, 0.0, 2), (2, 0.7, 1), (2, 1.2, 1), (2, 7.8, 1), (16, 3.9, 12), (1, 0.0, 1)],
)
def test_one_thread_per_idle_core_and_at_least_one(cores: int, load: float, threads: int) -> None:
    assert default_cpu_threads(cores, load) == threads


def test_an_explicit_count_then_the_environment_win(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert place_cpu_threads(2) == 2 and torch.get_num_threads() == 2
        assert place_cpu_threads(None) == 3 and torch.get_num_threads() == 3
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
        idle = default_cpu_threads()
        monkeypatch.setattr("os.getloadavg", lambda: (50.0, 0.0, 0.0))
        assert place_cpu_threads(None) == 1 == torch.get_num_threads() <= idle
    finally:
        torch.set_num_threads(before)

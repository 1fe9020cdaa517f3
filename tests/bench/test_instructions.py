"""bench/instructions.py: instructions per operation from callgrind's totals."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench import instructions


def test_per_operation_takes_the_reset_out_of_each_step_episode():
    counts = {"env.reset": 2_000, "env.step (text)": 2_800, "env.step (message)": 3_200}
    figures = instructions.per_operation(counts, n=10)
    assert figures == {"env.reset": 200.0, "env.step (text)": 20.0, "env.step (message)": 30.0}
    with pytest.raises(ValueError, match="n must be at least 1"):
        instructions.per_operation(counts, n=0)


def test_count_says_what_is_missing_without_valgrind(monkeypatch):
    monkeypatch.setattr(instructions.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="valgrind is not installed"):
        instructions.count(Path("."), "reset", 1)


def test_count_quotes_the_run_when_callgrind_prints_no_total(monkeypatch):
    monkeypatch.setattr(instructions.shutil, "which", lambda name: "/usr/bin/valgrind")
    failed = subprocess.CompletedProcess([], 1, "", "valgrind: no such tool\n")
    monkeypatch.setattr(instructions.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RuntimeError, match="exit code 1:\nvalgrind: no such tool"):
        instructions.count(Path("."), "reset", 1)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_a_count_repeats_within_a_tenth_of_a_percent_and_grows_with_the_episodes():
    # Two processes differ by a few hundred instructions in 400k (memory addresses feed a few
    # hashes), so a count repeats closely, not bit for bit. The three runs go side by side: each
    # is mostly the interpreter's start under valgrind, and a count does not depend on the clock.
    tree = Path(instructions.__file__).resolve().parents[1]
    with ThreadPoolExecutor(max_workers=3) as pool:
        one, again, ten = pool.map(lambda n: instructions.count(tree, "reset", n), (5, 5, 10))
    assert again == pytest.approx(one, rel=1e-3)
    assert ten > one * 1.5

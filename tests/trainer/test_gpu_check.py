"""``bench/gpu_check.py``: the GPU check's own logic, run as its CPU dry run (``--cpu``).

The script is meant for a machine with a GPU; this runs the same code with both sides on CPU, so a
broken script is found here and not on the first GPU it meets.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_cpu_dry_run_prints_its_figures(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu", "--model", "tiny", "--steps", "3",
         "--compare", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "CPU dry run; model tiny" in out
    for k in (0, 1):
        line = re.search(rf"k={k}: ([\d.]+) steps/s, (\d+) sampled tokens/s", out)
        assert line and float(line.group(1)) > 0 and int(line.group(2)) > 0, out
    mismatches = [float(m) for m in re.findall(r"logprob mismatch max ([\d.e+-]+|nan)", out)]
    assert len(mismatches) == 2 and all(m < 1e-3 for m in mismatches), out  # a number, not NaN
    assert re.search(r"throughput ratio k=1 / k=0: [\d.]+x", out), out

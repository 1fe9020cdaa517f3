"""Every command that needs torch, on an install without the training extra: exit 2 and one line
naming the install command (docs/cli.md), never a ModuleNotFoundError traceback.

"Without the extra" is made faithfully and cheaply: one fresh interpreter whose import system
refuses torch and the libraries that come with it (a meta-path finder installed by
``sitecustomize``, the way a venv without them would refuse), running each command in turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "data" / "recipes"

#: Every command that needs torch (train extra), as typed after `twin`.
NEEDS_TORCH = [
    ["train", str(RECIPES / "toy-cpu.yaml")],
    ["sft", str(RECIPES / "returns-sft-cpu.yaml")],
    ["plan", str(RECIPES / "toy-cpu.yaml")],
    ["serve", "tiny"],
    ["bench", "trl"],
    ["bench", "trainer"],
    ["eval", "Toy", "--policy", "hf:tiny", "-n", "1", "--no-store", "--no-progress"],
    ["collect", "Toy", "--policy", "hf:tiny", "--episodes", "1", "--out", "collected"],
]

_BLOCKER = """
import importlib.abc, sys
BLOCKED = {"torch", "transformers", "peft", "tokenizers", "gguf", "accelerate", "trl", "vllm"}

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
"""

_RUN_ALL = """
import contextlib, io, json, sys
from twinrl_cli import main

results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # noqa: BLE001 - a traceback is what the test catches
            code, err = -1, io.StringIO(f"{type(exc).__name__}: {exc}")
    results.append({"argv": argv, "code": code, "stderr": err.getvalue(),
                    "torch_loaded": "torch" in sys.modules})
print(json.dumps(results))
"""


def test_every_command_that_needs_torch_exits_2_with_the_install_command(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
        TWINRL_CACHE=str(tmp_path / "cache"),
        TWINRL_STORE=str(tmp_path / "runs.db"),
        COLUMNS="200",
    )
    out = subprocess.run(
        [sys.executable, "-c", _RUN_ALL, json.dumps(NEEDS_TORCH)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["argv"] for r in results] == NEEDS_TORCH
    for r in results:
        lines = [line for line in r["stderr"].splitlines() if line.startswith("error:")]
        assert r["code"] == 2, r
        assert "Traceback" not in r["stderr"] and len(lines) == 1, r
        assert "pip install 'twinrl[train]'" in lines[0] and "torch" in lines[0], r
        assert not r["torch_loaded"]

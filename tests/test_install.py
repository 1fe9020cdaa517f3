"""The env-only install: twins, rewards and evaluation without torch (the ``train`` extra)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PACKAGES = ("torch", "transformers", "tokenizers", "peft", "gguf")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_twins_rewards_and_eval_import_no_training_package():
    code = f"""
import sys
import twin, rewards
from twin.evaluation import evaluate
from twin.policies import make_policy
import twinrl_cli
for name in ("catalog", "returns", "toy"):
    t = twin.make_twin(name)
    t.case("test" if "test" in t.splits else next(iter(t.splits)), 0)
    make_policy("random", t)
loaded = sorted(m for m in {TRAIN_PACKAGES!r} if m in sys.modules)
print("LOADED", loaded)
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED []" in proc.stdout, proc.stdout


def test_hf_policy_without_torch_says_to_install_the_train_extra():
    # sys.modules[name] = None makes `import name` fail as if it were not installed
    code = """
import sys
sys.modules["torch"] = None
import twin
from twin.errors import ConfigError
from twin.policies import make_policy
try:
    make_policy("hf:smollm2", twin.make_twin("toy"))
except ConfigError as exc:
    print("ERROR", exc)
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert line.startswith("ERROR policy 'hf:smollm2'"), line
    assert "torch" in line and "pip install 'twinrl[train]'" in line


def _pip_reaches_an_index(python: Path, into: Path) -> str | None:
    """None when pip can find packages (an index, or find-links); else why not."""
    proc = subprocess.run(
        [str(python), "-m", "pip", "download", "--no-deps", "-q", "-d", str(into), "typer"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]


@pytest.mark.slow
def test_fresh_venv_without_extras_lists_evaluates_checks_and_serves_mcp_without_torch(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    why = _pip_reaches_an_index(python, tmp_path / "probe")
    if why is not None:
        pytest.skip(f"no package index or find-links reachable for the fresh venv: {why}")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    twin_cmd = env_dir / "bin" / "twin"
    run_env = {**os.environ, "TWINRL_STORE": str(tmp_path / "runs.db")}
    listed = subprocess.run(
        [str(twin_cmd), "list"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=run_env,
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "catalog" in listed.stdout.lower()
    evaluated = subprocess.run(
        [str(twin_cmd), "eval", "catalog", "--policy", "heuristic", "--episodes", "5"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=run_env,
    )
    assert evaluated.returncode == 0, evaluated.stdout[-2000:] + evaluated.stderr[-2000:]
    checked = subprocess.run(
        [str(twin_cmd), "check", "catalog", "--cases", "2"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=run_env,
    )
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-2000:]
    # `twin mcp` serves over stdio: the fresh venv's own MCP client lists the twin's tools
    client = textwrap.dedent(f"""
        import anyio, sys
        from mcp.client import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client

        async def main():
            params = StdioServerParameters(command={str(twin_cmd)!r}, args=["mcp", "returns"])
            async with Client(stdio_client(params)) as client:
                print(sorted(t.name for t in (await client.list_tools()).tools))

        anyio.run(main)
    """)
    served = subprocess.run(
        [str(python), "-c", client],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=run_env,
    )
    assert served.returncode == 0, served.stderr[-3000:]
    assert "'decide'" in served.stdout and "'lookup_order'" in served.stdout, served.stdout
    probe = subprocess.run(
        [
            str(python),
            "-c",
            f"import importlib.util as u; print([m for m in {TRAIN_PACKAGES!r} if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stdout.strip() == "[]", probe.stdout + probe.stderr

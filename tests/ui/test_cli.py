"""`twin ui` and `twin demo`'s pointer to it, on the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from twinrl_cli import app

runner = CliRunner()


def test_demo_ends_with_the_command_that_opens_its_runs(tmp_path: Path) -> None:
    store = tmp_path / "demo store.db"
    proc = subprocess.run(
        [
            sys.executable, "-m", "twinrl_cli", "demo", "--episodes", "1", "--group-size", "1",
            "--policies", "random", "--no-progress", "--store", str(store),
            "--out", str(tmp_path / "report"),
        ],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"look at these runs in a browser: twin ui --store '{store}'"
    assert store.exists()


def test_ui_on_a_missing_store_is_one_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["ui", "--store", str(tmp_path / "none.db"), "--port", "0"])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: no run store at")
    assert len(result.output.strip().splitlines()) == 1


def test_ui_help_names_its_options() -> None:
    result = runner.invoke(app, ["ui", "--help"])
    assert result.exit_code == 0
    for option in ("--store", "--port", "--host"):
        assert option in result.output

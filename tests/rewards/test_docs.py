"""The guide's examples run."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from rewards.testing import RolloutFile

DOC = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.DOTALL)


def test_python_example_runs(capsys):
    (code,) = blocks("python")
    exec(compile(code, str(DOC), "exec"), {})
    assert "decision" in capsys.readouterr().out


def test_yaml_example_is_a_valid_rollout_file():
    (text,) = blocks("yaml")
    spec = RolloutFile.model_validate(yaml.safe_load(text))
    assert len(spec.cases) == 4 and spec.cases[3].turns

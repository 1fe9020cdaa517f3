"""The guides' examples run: docs/rewards.md, and the reward tests of
docs/define_your_own_twin.md."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rewards.testing import RolloutFile

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "rewards.md"
OWN_TWIN = ROOT / "docs" / "define_your_own_twin.md"


def blocks(lang: str, doc: Path = DOC) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", doc.read_text(), re.DOTALL)


def _printed_dict(out: str, start: str) -> dict:
    """The dict a guide's example printed on the line starting with ``start``, as values (its
    numbers compared as numbers, not as their repr)."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith(start)]
    return ast.literal_eval(line)


def test_python_examples_run(capsys):
    compose, properties = blocks("python")
    exec(compile(compose, str(DOC), "exec"), {})
    assert "decision" in capsys.readouterr().out
    scope: dict = {}
    exec(compile(properties, str(DOC), "exec"), scope)
    assert scope["report"].examples == 20
    assert scope["report"].ratios[
        ("verdict_counterfeit_as_ok", "verdict_ok_as_counterfeit")
    ] == pytest.approx(7.0)
    printed = _printed_dict(capsys.readouterr().out, "{('verdict_counterfeit_as_ok'")
    assert printed[("verdict_counterfeit_as_ok", "verdict_ok_as_counterfeit")] == pytest.approx(7.0)


def test_yaml_example_is_a_valid_rollout_file():
    (text,) = blocks("yaml")
    spec = RolloutFile.model_validate(yaml.safe_load(text))
    assert len(spec.cases) == 4 and spec.cases[3].turns


def test_own_twin_reward_examples_check_a_twin_the_kit_knows_only_through_the_registry(tmp_path):
    # The guide's twin (registered with twin.register, in a fresh process so the registry stays
    # clean), then its property check and its rollout file, run as the guide says.
    define, _check, properties = blocks("python", OWN_TWIN)
    (rollouts,) = blocks("yaml", OWN_TWIN)
    path = tmp_path / "mini.rollouts.yaml"
    path.write_text(rollouts)
    code = "\n".join(
        [
            define,
            properties,
            "from rewards.testing import run_rollout_file",
            f"outcomes = run_rollout_file({str(path)!r})",
            "print('rollouts', [o.passed for o in outcomes], [o.error for o in outcomes])",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    losses = _printed_dict(done.stdout, "{'wrong_decision'")
    assert set(losses) == {"wrong_decision", "invalid_call", "no_decision"}
    assert losses["wrong_decision"] == losses["no_decision"] == [1.0]
    assert losses["invalid_call"] == [pytest.approx(0.02)]
    assert "rollouts [True, True, True] [None, None, None]" in done.stdout

"""`twin train` and `twin plan` on bad input: one `error:` line and exit 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from twinrl_cli import app

runner = CliRunner()
TOY = (
    "twin: {{name: {twin}, config: {config}}}\ntrain: {{output_dir: {out}, store: false}}\n{extra}"
)


def _recipe(
    tmp_path: Path,
    *,
    twin: str = "Toy",
    config: str = "{}",
    out: str | None = None,
    extra: str = "",
) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        TOY.format(twin=twin, config=config, out=out or str(tmp_path / "run"), extra=extra)
    )
    return str(path)


def _one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _binary(tmp_path: Path) -> str:
    path = tmp_path / "weights.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    return str(path)


@pytest.mark.parametrize("command", ["plan", "train"])
def test_binary_recipe(tmp_path: Path, command: str) -> None:
    _one_line_error(runner.invoke(app, [command, _binary(tmp_path)]), "weights.yaml", "not UTF-8")


@pytest.mark.parametrize("command", ["plan", "train"])
def test_output_dir_that_is_a_file(tmp_path: Path, command: str) -> None:
    (tmp_path / "taken").write_text("a file")
    path = _recipe(tmp_path, out=str(tmp_path / "taken"))
    _one_line_error(runner.invoke(app, [command, path]), "train.output_dir", "is a file")


@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_gpu_this_machine_lacks(
    tmp_path: Path, command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    path = _recipe(tmp_path, extra="devices: {learner: 'cuda:9', rollout: cpu}\n")
    _one_line_error(
        runner.invoke(app, [command, path]), "devices.learner 'cuda:9'", "1 CUDA device"
    )


def test_plan_without_gpus_checks_devices_against_the_planned_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    path = _recipe(tmp_path, extra="devices: {learner: 'cuda:9', rollout: cpu}\n")
    _one_line_error(
        runner.invoke(app, ["plan", path]), "devices.learner 'cuda:9'", "2 GPU(s)", "--gpus"
    )
    _one_line_error(runner.invoke(app, ["plan", path, "--gpus", "0"]), "--gpus 0")
    result = runner.invoke(app, ["plan", path, "--gpus", "10"])
    assert result.exit_code in (0, 1), result.output  # a plan (fits or not), not an error
    assert "cuda:9" in result.output and "peak" in result.output


def test_train_on_a_cpu_machine_refuses_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = _recipe(tmp_path, extra="devices: {learner: 'cuda:0', rollout: cpu}\n")
    _one_line_error(
        runner.invoke(app, ["train", path]), "devices.learner 'cuda:0'", "no CUDA device"
    )


def test_plan_unknown_twin_and_bad_twin_config(tmp_path: Path) -> None:
    _one_line_error(
        runner.invoke(app, ["plan", _recipe(tmp_path, twin="NoSuchTwin")]), "NoSuchTwin"
    )
    _one_line_error(
        runner.invoke(app, ["plan", _recipe(tmp_path, config="{max_turns: -3}")]), "max_turns"
    )
    _one_line_error(runner.invoke(app, ["plan", _recipe(tmp_path, config="{bogus: 1}")]), "bogus")


def test_plan_of_a_good_recipe_still_exits_0(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plan", _recipe(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "FITS" in result.output


def test_train_refuses_to_start_over_checkpoints(tmp_path: Path) -> None:
    state = tmp_path / "run" / "checkpoints" / "step-000003" / "trainer_state.pt"
    state.parent.mkdir(parents=True)
    state.write_bytes(b"an earlier run")
    path = _recipe(tmp_path, extra="model: {path: tiny}\n")
    _one_line_error(runner.invoke(app, ["train", path]), "already holds checkpoints", "--overwrite")
    assert state.read_bytes() == b"an earlier run"
    _one_line_error(runner.invoke(app, ["train", path, "--resume", "--overwrite"]), "not both")


def test_train_overwrite_starts_over(tmp_path: Path) -> None:
    old = tmp_path / "run" / "checkpoints" / "step-000009"
    old.mkdir(parents=True)
    (old / "trainer_state.pt").write_bytes(b"an earlier run")
    path = _recipe(
        tmp_path,
        config="{max_turns: 1}",
        extra="model: {path: tiny}\nsampler: {max_new_tokens: 2, max_episode_tokens: 512}\n"
        "algorithm: {group_size: 2, groups_per_step: 1}\n",
    )
    result = runner.invoke(app, ["train", path, "--set", "train.steps=1", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert not old.exists() and (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()

"""The ``twin`` command line: help, list, show, play, eval (+ run store), runs, and the wrappers."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import twin as twin_pkg
from twin.cli import _passthrough, app, parse_overrides
from twin.errors import ConfigError
from twin.store import RunStore

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


@pytest.fixture()
def cli_twin(monkeypatch, key_twin_cls):
    class CliKeyTwin(key_twin_cls):
        """Ten cases; case i asks for key k<i>, whose value is v<i>."""

        name = "CliKey"
        splits = {"test": 10}
        world_size = 10

        def value_of(self, i: int) -> str:
            return f"v{i}"

        def key_for(self, rng, index: int) -> str:
            return f"k{index}"

    spec = twin_pkg.register(CliKeyTwin)
    # pytest imports this file under a generated module name: point the spec at the class itself
    monkeypatch.setattr(spec, "load", lambda: CliKeyTwin)
    yield spec
    from twin.registry import registry

    registry.pop(spec.id, None)


@pytest.fixture(autouse=True)
def isolated_store(tmp_path, monkeypatch):
    """Never write the repository's runs/ folder."""
    monkeypatch.setenv("TWINRL_STORE", str(tmp_path / "default.db"))
    return tmp_path / "default.db"


def test_help_in_process_and_as_module():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in (
        "list",
        "show",
        "play",
        "eval",
        "runs",
        "demo",
        "bench",
        "reward",
        "train",
        "serve",
        "plan",
    ):
        assert command in result.output
    proc = subprocess.run(
        [sys.executable, "-m", "twin", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0 and "eval" in proc.stdout
    script = Path(sys.executable).with_name("twin")  # the console script of an install
    if script.exists():
        proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "eval" in proc.stdout


def test_list_shows_registered_twins_and_tools(cli_twin):
    result = runner.invoke(app, ["list", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in json.loads(result.stdout)}
    assert rows["twin/CliKey-v0"]["tools"] == ["lookup(key: string)", "submit(value: string)"]
    assert rows["twin/CliKey-v0"]["description"].startswith("Find the value")
    assert "twin/Returns-v0" in rows and rows["twin/Returns-v0"]["error"] is None
    table = runner.invoke(app, ["list"])
    assert (
        table.exit_code == 0
        and "twin/CliKey-v0" in table.output
        and "lookup(key: string)" in table.output
    )


def test_show_hides_the_truth_unless_asked(cli_twin):
    result = runner.invoke(app, ["show", "clikey", "--index", "3", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["case_id"] == "CliKey/test/3" and "truth" not in data
    assert data["messages"][1]["content"] == "Find the value of key k3 and submit it."
    assert [t["function"]["name"] for t in data["tools"]] == ["lookup", "submit"]
    assert "v3" not in result.stdout
    shown = runner.invoke(app, ["show", "clikey", "--index", "3", "--truth", "--json"])
    assert json.loads(shown.stdout)["truth"] == {"value": "v3"}
    table = runner.invoke(app, ["show", "clikey", "--index", "3"])
    assert table.exit_code == 0 and "k3" in table.output and "v3" not in table.output


def test_show_unknown_twin_and_bad_set(cli_twin):
    result = runner.invoke(app, ["show", "clikee"])
    assert (
        result.exit_code == 2 and "no twin 'clikee'" in result.output and "CliKey" in result.output
    )
    bad = runner.invoke(app, ["show", "clikey", "--set", "max_turns=0"])
    assert bad.exit_code == 2 and "max_turns" in bad.output
    unknown = runner.invoke(app, ["show", "clikey", "--set", "colour=red"])
    assert unknown.exit_code == 2 and "colour" in unknown.output


def test_play_with_piped_stdin(cli_twin):
    typed = (
        "\n".join(['lookup {"key": "k2"}', "nosuch {}", ":tools", 'submit {"value": "v2"}']) + "\n"
    )
    result = runner.invoke(app, ["play", "clikey", "--index", "2"], input=typed)
    assert result.exit_code == 0, result.output
    assert '"value": "v2"' in result.output or "v2" in result.output
    assert "nosuch" in result.output  # the error message for the unknown tool names it
    assert "reward 1.0000" in result.output and "checked" in result.output


def test_play_end_of_input_and_raw_text(cli_twin):
    typed = '<tool_call>{"name": "lookup", "arguments": {"key": "k1"}}</tool_call>\n'
    result = runner.invoke(
        app, ["play", "clikey", "--index", "1", "--set", "max_turns=3"], input=typed
    )
    assert result.exit_code == 0, result.output
    assert "v1" in result.output and "end of input" in result.output


def test_eval_writes_the_store(cli_twin, tmp_path):
    db = tmp_path / "runs.db"
    result = runner.invoke(
        app,
        [
            "eval",
            "clikey",
            "--policy",
            "random",
            "--episodes",
            "20",
            "--group-size",
            "2",
            "--store",
            str(db),
            "--json",
            "--no-progress",
            "--set",
            "max_turns=3",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["episodes"] == 20 and summary["groups"] == 10 and summary["group_size"] == 2
    assert set(summary["pass@k"]) == {"1", "2"} and "correct" in summary["components"]
    store = RunStore(db)
    run = store.run(summary["run_id"])
    assert (
        run.status == "finished"
        and run.episodes == 20
        and run.kind == "eval"
        and run.twin == "CliKey"
    )
    assert run.config["group_size"] == 2 and run.config["twin_config"] == {"max_turns": 3}
    assert run.metrics["reward_mean"] == summary["reward_mean"]
    trajs = store.episodes(run.id)
    assert {t.case_id for t in trajs} == {f"CliKey/test/{i}" for i in range(10)}
    assert all(t.policy == "random" and t.num_turns <= 3 for t in trajs)


def test_eval_errors(cli_twin, tmp_path):
    too_many = runner.invoke(app, ["eval", "clikey", "--episodes", "11", "--no-store"])
    assert too_many.exit_code == 2 and "has 10 cases" in too_many.output
    bad_policy = runner.invoke(app, ["eval", "clikey", "--policy", "gpt9", "--no-store"])
    assert bad_policy.exit_code == 2 and "openai:MODEL" in bad_policy.output


def test_eval_returns_random_50_and_runs_listing(tmp_path):
    """The acceptance check: `twin eval returns --policy random --episodes 50` fills the store."""
    db = tmp_path / "returns.db"
    result = runner.invoke(
        app,
        [
            "eval",
            "returns",
            "--policy",
            "random",
            "--episodes",
            "50",
            "--store",
            str(db),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "pass@k" in result.output and "by case kind" in result.output
    (run,) = RunStore(db).runs()
    assert run.episodes == 50 and run.status == "finished" and run.twin == "Returns"
    listing = runner.invoke(app, ["runs", "--store", str(db), "--json"])
    assert listing.exit_code == 0 and json.loads(listing.stdout)[0]["episodes"] == 50
    table = runner.invoke(app, ["runs", "--store", str(db)])
    assert table.exit_code == 0 and "Returns" in table.output and "finished" in table.output
    shown = runner.invoke(app, ["runs", "show", str(run.id), "--store", str(db), "--episodes", "3"])
    assert (
        shown.exit_code == 0
        and "Returns/test/0" in shown.output
        and "episodes (3 of 50)" in shown.output
    )
    missing = runner.invoke(app, ["runs", "show", "999", "--store", str(db)])
    assert missing.exit_code == 2 and "no run with id 999" in missing.output


def test_eval_default_store_is_env_var(cli_twin, isolated_store):
    result = runner.invoke(app, ["eval", "clikey", "--episodes", "2", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert RunStore(isolated_store).runs()[0].episodes == 2


def test_overrides_parsing():
    assert parse_overrides(["max_turns=4", "name=x", "flag=true", "path=a/b.yaml", "empty="]) == {
        "max_turns": 4,
        "name": "x",
        "flag": True,
        "path": "a/b.yaml",
        "empty": "",
    }
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["oops"])
    assert _passthrough(
        ["--episodes", "3", "--quick", "--out=r/x", "--no-plots", "--n-jobs", "2"]
    ) == {"episodes": 3, "quick": True, "out": "r/x", "plots": False, "n_jobs": 2}
    with pytest.raises(ConfigError):
        _passthrough(["stray"])


# -- wrappers ----------------------------------------------------------------------------------
def _fake(monkeypatch, name: str, **functions: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, fn in functions.items():
        setattr(module, key, fn)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_wrappers_call_their_targets(monkeypatch):
    calls: list[tuple] = []

    def demo_main(episodes: int = 10, quick: bool = False) -> None:
        calls.append(("demo", episodes, quick))

    def train(recipe, overrides, resume):
        calls.append(("train", recipe, overrides, resume))

    def serve_main(model, host, port):
        calls.append(("serve", model, host, port))

    _fake(monkeypatch, "envs.catalog.demo", main=demo_main)
    _fake(monkeypatch, "trainer.cli", train=train)
    _fake(monkeypatch, "trainer.server", main=serve_main)
    _fake(monkeypatch, "trainer.plan", main=lambda recipe: calls.append(("plan", recipe)))
    _fake(monkeypatch, "envs.catalog.bench", main=lambda **kw: calls.append(("bench catalog", kw)))
    _fake(monkeypatch, "trainer.bench", main=lambda **kw: calls.append(("bench trainer", kw)))
    _fake(
        monkeypatch, "rewards.testing", cli_main=lambda files: calls.append(("reward", files)) or 1
    )

    assert runner.invoke(app, ["demo", "--episodes", "3", "--quick"]).exit_code == 0
    assert (
        runner.invoke(
            app, ["train", "r.yaml", "--set", "optim.lr=1e-4", "--set", "train.steps=2", "--resume"]
        ).exit_code
        == 0
    )
    assert runner.invoke(app, ["serve", "tiny", "--port", "9000"]).exit_code == 0
    assert runner.invoke(app, ["plan", "r.yaml"]).exit_code == 0
    assert runner.invoke(app, ["bench", "catalog", "--quick"]).exit_code == 0
    assert runner.invoke(app, ["bench", "trainer"]).exit_code == 0
    assert (
        runner.invoke(app, ["reward", "test", "a.rollouts.yaml", "b.rollouts.yaml"]).exit_code == 1
    )
    assert calls == [
        ("demo", 3, True),
        ("train", "r.yaml", ["optim.lr=1e-4", "train.steps=2"], True),
        ("serve", "tiny", "127.0.0.1", 9000),
        ("plan", "r.yaml"),
        ("bench catalog", {"quick": True}),
        ("bench trainer", {}),
        ("reward", ["a.rollouts.yaml", "b.rollouts.yaml"]),
    ]
    bad = runner.invoke(app, ["demo", "--bogus", "1"])
    assert bad.exit_code == 2 and "bogus" in bad.output


def test_wrappers_exit_2_when_the_target_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "trainer.plan", None)  # import fails: ModuleNotFoundError
    result = runner.invoke(app, ["plan", "r.yaml"])
    assert result.exit_code == 2
    assert (
        "twin plan" in result.output
        and "trainer.plan" in result.output
        and "not available" in result.output
    )
    _fake(monkeypatch, "trainer.cli")  # the module is there, the function is not
    result = runner.invoke(app, ["train", "r.yaml"])
    assert result.exit_code == 2 and "no function 'train'" in result.output

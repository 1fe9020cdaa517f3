"""The typed options of ``twin demo``, ``twin bench ...``, ``twin plan`` and ``twin serve``.

Each command parses its options with typer and calls its target function with them: the
options must be the function's (same names, same defaults), reach it with the parsed values,
and a bad value must be one ``error:`` line that says what is allowed.
"""

from __future__ import annotations

import enum
import importlib
import inspect
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from twin.errors import ConfigError
from twinrl_cli import app

runner = CliRunner()

#: command -> (target "module:function", options the command adds that the target does not
#: take, target parameters the command sets itself).
COMMANDS: dict[tuple[str, ...], tuple[str, set[str], set[str]]] = {
    ("demo",): ("envs.catalog.demo:main", {"no_store"}, set()),
    ("bench", "catalog"): ("bench.catalog:main", set(), set()),
    ("bench", "trainer"): ("bench.trainers:main", set(), set()),
    ("bench", "trl"): ("bench.trl_ratio:main", set(), set()),
    ("bench", "openenv"): ("bench.openenv_latency:step_latency", set(), {"out"}),
    ("plan",): ("trainer.plan:main", set(), set()),
}


def _command(path: tuple[str, ...]) -> Any:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _options(path: tuple[str, ...]) -> dict[str, Any]:
    """``{target parameter name: default}`` of a command's options, named by their flag."""
    out = {}
    for param in _command(path).params:
        if not param.opts[0].startswith("--"):
            continue  # an argument (the recipe of `twin plan`)
        default = param.default.value if isinstance(param.default, enum.Enum) else param.default
        out[param.opts[0][2:].replace("-", "_")] = default
    return out


def _target(spec: str) -> inspect.Signature:
    module, _, name = spec.partition(":")
    return inspect.signature(getattr(importlib.import_module(module), name))


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_options_are_the_target_functions_parameters_with_its_defaults(path):
    spec, extra, set_by_command = COMMANDS[path]
    options = _options(path)
    params = {
        name: p.default
        for name, p in _target(spec).parameters.items()
        if p.kind is not p.VAR_KEYWORD and p.default is not p.empty and name not in set_by_command
    }
    assert set(options) - extra == set(params), f"twin {' '.join(path)} vs {spec}"
    for name, default in params.items():
        if name == "transports":  # the function takes a tuple, the option the same comma-separated
            default = ",".join(default)
        assert options[name] == default, (name, options[name], default)


def test_serve_options_are_the_servers_parameters_and_limits():
    from trainer.serving.api import ServeLimits

    options = _options(("serve",))
    params = {
        name: p.default
        for name, p in _target("trainer.serving.cli:serve").parameters.items()
        if p.kind is not p.VAR_KEYWORD and p.default is not p.empty
    }
    limits = set(ServeLimits.model_fields)
    assert set(options) == set(params) | limits
    for name, default in params.items():
        assert options[name] == default, name
    # a limit left out is not passed: the server's ServeLimits keeps the only defaults
    assert all(options[name] is None for name in limits)


# -- options reach the target ------------------------------------------------------------------
def _record(monkeypatch, spec: str, result: Any = 0) -> list[dict[str, Any]]:
    module, _, name = spec.partition(":")
    calls: list[dict[str, Any]] = []

    def fake(*args: Any, **kwargs: Any) -> Any:
        calls.append({"args": args, **kwargs})
        return result

    monkeypatch.setattr(importlib.import_module(module), name, fake)
    return calls


def test_bench_trainer_options_reach_the_function(monkeypatch, tmp_path):
    calls = _record(monkeypatch, "bench.trainers:main")
    out = tmp_path / "b.json"
    args = [
        "bench",
        "trainer",
        "--steps",
        "3",
        "--set",
        "a.b=1",
        "--set",
        "c=2",
        "--k0-threads",
        "1",
        "--backend",
        "ray",
        "--json",
        str(out),
        "--epochs",
        "2",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert calls == [
        {
            "args": (),
            "steps": 3,
            "warmup": 4,
            "set": ["a.b=1", "c=2"],
            "json": str(out),
            "output_dir": None,
            "epochs": 2,
            "k0_threads": "1",
            "backend": "ray",
        }
    ]


def test_bench_trl_and_catalog_options_reach_their_functions(monkeypatch):
    trl = _record(monkeypatch, "bench.trl_ratio:main")
    catalog = _record(monkeypatch, "bench.catalog:main")
    assert (
        runner.invoke(
            app, ["bench", "trl", "--lr", "0.01", "--rounds", "2", "--group", "4"]
        ).exit_code
        == 0
    )
    assert (
        runner.invoke(
            app, ["bench", "catalog", "--no-cold", "--n", "50", "--version", "0"]
        ).exit_code
        == 0
    )
    assert (trl[0]["lr"], trl[0]["rounds"], trl[0]["group"], trl[0]["steps"]) == (0.01, 2, 4, 5)
    assert (catalog[0]["cold"], catalog[0]["warm"], catalog[0]["n"], catalog[0]["version"]) == (
        False,
        True,
        50,
        0,
    )


def test_bench_openenv_parses_transports_and_arguments(monkeypatch):
    calls = _record(monkeypatch, "bench.openenv_latency:step_latency", result={"ws": {}})
    args = [
        "bench",
        "openenv",
        "--transports",
        "ws",
        "--arguments",
        '{"query": "boxes", "limit": 2}',
        "--steps",
        "7",
        "--twin",
        "Returns",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert calls[0]["transports"] == ("ws",)
    assert calls[0]["arguments"] == {"query": "boxes", "limit": 2}
    assert (calls[0]["steps"], calls[0]["twin"], calls[0]["tool"]) == (
        7,
        "Returns",
        "search_taxonomy",
    )
    assert runner.invoke(app, ["bench", "openenv"]).exit_code == 0
    assert calls[1]["transports"] == ("ws", "http") and calls[1]["arguments"] is None


def test_demo_options_reach_the_function_and_its_status_is_the_exit_status(monkeypatch):
    calls = _record(monkeypatch, "envs.catalog.demo:main", result=2)
    args = ["demo", "--episodes", "3", "--no-store", "--policies", "random,oracle", "--no-progress"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert (
        calls[0]["episodes"],
        calls[0]["store"],
        calls[0]["policies"],
        calls[0]["progress"],
    ) == (
        3,
        False,
        "random,oracle",
        False,
    )
    runner.invoke(app, ["demo", "--store", "x.db"])
    assert (
        calls[1]["store"] == "x.db" and calls[1]["episodes"] is None and calls[1]["group_size"] == 4
    )


def test_a_twinrl_error_in_the_target_is_one_line(monkeypatch):
    import bench.trainers

    def broken(**_: Any) -> int:
        raise ConfigError("--set expects KEY=VALUE, got 'oops'")

    monkeypatch.setattr(bench.trainers, "main", broken)
    result = runner.invoke(app, ["bench", "trainer", "--set", "oops"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --set expects KEY=VALUE, got 'oops'"


# -- bad values: one line, what is allowed --------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "allowed"),
    [
        (["bench", "trainer", "--k0-threads", "3"], ["'best'", "'1'", "'all'"]),
        (["bench", "trainer", "--backend", "slurm"], ["'local'", "'ray'"]),
        (["bench", "openenv", "--transports", "ws,udp"], ["ws, http"]),
        (["bench", "openenv", "--arguments", "[1, 2]"], ["JSON object"]),
        (["bench", "trl", "--steps", "many"], ["--steps", "integer"]),
        (["bench", "catalog", "--version", "2"], ["--version", "less than or equal to 1"]),
        (["demo", "--episodes", "0"], ["--episodes", "greater than or equal to 1"]),
        (["serve", "tiny", "--logprobs-mode", "sampled"], ["processed_logprobs", "raw_logprobs"]),
        (["bench", "trl", "--bogus"], ["No such option: --bogus"]),
    ],
)
def test_a_bad_option_value_is_one_line_saying_what_is_allowed(monkeypatch, args, allowed):
    for spec in (
        "bench.trainers:main",
        "bench.trl_ratio:main",
        "bench.catalog:main",
        "bench.openenv_latency:step_latency",
        "envs.catalog.demo:main",
    ):
        _record(monkeypatch, spec)  # nothing may run: the value is refused while parsing
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for word in allowed:
        assert word in lines[0], (word, lines[0])

"""The ``twin`` command line: help, list, show, play, eval (+ run store), runs, and the wrappers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import twin as twin_pkg
from twin.errors import ConfigError
from twin.store import RunStore
from twinrl_cli import app, parse_overrides

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
        [sys.executable, "-m", "twinrl_cli", "--help"],
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


# -- wrappers ----------------------------------------------------------------------------------
def _fake(monkeypatch, name: str, **functions: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, fn in functions.items():
        setattr(module, key, fn)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_wrappers_call_their_targets(monkeypatch):
    calls: list[tuple] = []

    def train(recipe, overrides, resume, overwrite=False):
        calls.append(("train", recipe, overrides, resume))

    _fake(monkeypatch, "trainer.cli", train=train)
    _fake(monkeypatch, "trainer.serving.cli", serve=lambda model, host, port, **kw: calls.append(
        ("serve", model, host, port, kw["max_loras"], kw.get("max_n"))))  # fmt: skip
    _fake(
        monkeypatch,
        "trainer.plan",
        main=lambda recipe, **kw: calls.append(("plan", recipe, kw["gpus"])),
    )
    _fake(
        monkeypatch,
        "rewards.testing",
        cli_main=lambda files, allow_import=False: calls.append(("reward", files)) or 1,
    )

    assert (
        runner.invoke(
            app, ["train", "r.yaml", "--set", "optim.lr=1e-4", "--set", "train.steps=2", "--resume"]
        ).exit_code
        == 0
    )
    assert runner.invoke(app, ["serve", "tiny", "--port", "9000", "--max-n", "8"]).exit_code == 0
    assert runner.invoke(app, ["plan", "r.yaml", "--gpus", "4"]).exit_code == 0
    assert (
        runner.invoke(app, ["reward", "test", "a.rollouts.yaml", "b.rollouts.yaml"]).exit_code == 1
    )
    assert calls == [
        ("train", "r.yaml", ["optim.lr=1e-4", "train.steps=2"], True),
        ("serve", "tiny", "127.0.0.1", 9000, 4, 8),
        ("plan", "r.yaml", 4),
        ("reward", ["a.rollouts.yaml", "b.rollouts.yaml"]),
    ]
    bad = runner.invoke(app, ["demo", "--bogus", "1"])
    assert bad.exit_code == 2 and "--bogus" in bad.output
    assert [line for line in bad.output.splitlines() if line.strip()] == [bad.output.strip()]


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


def test_a_missing_optional_library_is_a_one_line_install_hint(monkeypatch):
    for name in ("mcp", "mcp_types", "integrations.mcp_server"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "mcp", None)  # as if the MCP SDK had gone missing
    monkeypatch.setitem(sys.modules, "mcp_types", None)
    result = runner.invoke(app, ["mcp", "returns"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert "Traceback" not in result.output and len(lines) == 1, result.output
    assert "pip install 'mcp>=2,<3'" in lines[0]
    # a target module that imports a missing library at its top: the hint names the library's extra
    import builtins

    real_import = builtins.__import__

    def import_without_torch(name, *args, **kwargs):
        if name == "trainer.plan":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", import_without_torch)
    result = runner.invoke(app, ["plan", "r.yaml"])
    assert result.exit_code == 2, result.output
    assert "needs the package 'torch'" in result.output and "twinrl[train]" in result.output


# -- twin eval against an OpenAI-compatible server on loopback -------------------------------
class _FakeServer(BaseHTTPRequestHandler):
    """/v1/chat/completions by model name: ``slow`` sleeps past any test timeout, ``locked``
    answers 401, ``solver`` looks the key up and submits its value (tool calls)."""

    requests: list[tuple[dict, str]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((body, self.headers.get("Authorization", "")))
        if body["model"] == "slow":
            time.sleep(2.0)
            self._send(200, {"choices": [{"message": {"role": "assistant", "content": "late"}}]})
            return
        if body["model"] == "locked":
            self._send(401, {"error": {"message": "Incorrect API key provided"}})
            return
        messages = body["messages"]
        if messages[-1]["role"] == "tool":
            name, args = "submit", {"value": json.loads(messages[-1]["content"])["value"]}
        else:
            name, args = "lookup", {"key": messages[1]["content"].split("key ")[1].split(" ")[0]}
        function = {"name": name, "arguments": json.dumps(args)}
        call = {"id": "c1", "type": "function", "function": function}
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        usage = {"prompt_tokens": 20, "completion_tokens": 7}
        self._send(200, {"choices": [{"message": message}], "usage": usage})

    def _send(self, code: int, data: dict) -> None:
        raw = json.dumps(data).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        except OSError:  # the client gave up (the timeout test)
            pass

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    server.daemon_threads = True
    _FakeServer.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _eval(server: str, model: str, db: Path, *extra: str) -> Any:
    return runner.invoke(
        app,
        ["eval", "clikey", "--policy", f"openai:{model}", "--base-url", server, "--episodes", "4",
         "--store", str(db), "--no-progress", *extra],
    )  # fmt: skip


def test_eval_timeouts_are_explained_and_failed_episodes_stored(cli_twin, fake_server, tmp_path):
    db = tmp_path / "t.db"
    result = _eval(fake_server, "slow", db, "--timeout", "0.2")
    assert result.exit_code == 3, result.output  # some episodes failed; the command did not
    out = " ".join(result.output.split())
    assert "failed episodes: reasons" in out and "PolicyError (ReadTimeout)" in out
    assert "hint: raise --timeout" in out
    store = RunStore(db)
    (run,) = store.runs()
    assert run.status == "finished" and run.episodes == 4
    assert run.config["request"]["timeout"] == 0.2
    for t in store.episodes(run.id):
        assert t.info["error_type"] == "PolicyError" and t.info["error_cause"] == "ReadTimeout"
        assert t.info["error_turn"] == 1 and t.messages  # the partial trajectory: the prompt
        assert "no reply within 0.2 s (ReadTimeout)" in t.info["error"]
    shown = runner.invoke(app, ["runs", "show", str(run.id), "--store", str(db)])
    assert shown.exit_code == 0 and "no reply within" in " ".join(shown.output.split())
    store.close()


def test_eval_401_suggests_the_api_key_and_json_lists_reasons(cli_twin, fake_server, tmp_path):
    result = _eval(fake_server, "locked", tmp_path / "k.db", "--json")
    assert result.exit_code == 3, result.output
    summary = json.loads(result.stdout)
    (reason,) = summary["error_reasons"]
    assert reason["type"] == "PolicyError (HTTP 401)" and reason["count"] == 4
    assert reason["turns"] == [1] and "--api-key" in reason["hint"]


def test_eval_request_settings_reach_the_server(cli_twin, fake_server, tmp_path, monkeypatch):
    db = tmp_path / "ok.db"
    spec = tmp_path / "policy.yaml"
    spec.write_text(
        f"policy: openai:solver\nbase_url: {fake_server}\nmax_tokens: 999\nretries: 1\n"
    )
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    result = runner.invoke(
        app,
        ["eval", "clikey", "--policy-file", str(spec), "--episodes", "3", "--max-tokens", "128",
         "--top-p", "0.9", "--temperature", "0.3", "--timeout", "30", "--concurrency", "2",
         "--extra-body", '{"chat_template_kwargs": {"enable_thinking": false}}',
         "--store", str(db), "--no-progress"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    body, auth = _FakeServer.requests[0]
    assert body["max_tokens"] == 128 and body["top_p"] == 0.9 and body["temperature"] == 0.3
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert auth == "Bearer sk-secret" and len(_FakeServer.requests) == 6  # 3 x (lookup, submit)
    store = RunStore(db)
    (run,) = store.runs()
    assert run.policy == "openai:solver" and run.config["concurrency"] == 2
    assert run.config["request"]["retries"] == 1 and "sk-secret" not in json.dumps(run.config)
    trajs = store.episodes(run.id)
    assert all(t.reward == 1.0 and [c.name for c in t.calls] == ["lookup", "submit"] for t in trajs)
    store.close()


def test_eval_bad_request_settings_are_one_line_errors(cli_twin, tmp_path):
    for extra, words in (
        (["--extra-body", "{nope"], "--extra-body must be a JSON object"),
        (["--extra-body", "[1]"], "must be a JSON object, got list"),
        (["--policy-file", str(tmp_path / "none.yaml")], "not found"),
    ):
        args = ["eval", "clikey", "--policy", "openai:m", "--no-store", *extra]
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and words in result.output, result.output
        assert result.output.count("error:") == 1


def test_runs_shows_killed_runs_as_interrupted_and_rejects_a_non_database(tmp_path):
    db = tmp_path / "r.db"
    store = RunStore(db)
    store.start_run("eval", "Returns", "random")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    from sqlalchemy import update

    from twin.store import RunTable

    with store.engine.begin() as conn:
        conn.execute(update(RunTable).values(pid=int(dead.stdout)))
    listing = runner.invoke(app, ["runs", "--store", str(db)])
    assert listing.exit_code == 0 and "interrupted" in listing.output
    assert (
        json.loads(runner.invoke(app, ["runs", "--store", str(db), "--json"]).stdout)[0]["status"]
        == "interrupted"
    )
    store.close()
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n" * 40)
    bad = runner.invoke(app, ["runs", "--store", str(text)])
    assert bad.exit_code == 2 and "not a database" in bad.output
    assert len(bad.output.strip().splitlines()) == 1

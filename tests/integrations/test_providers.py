"""`twin eval` against local fakes of hosted model APIs (127.0.0.1 only): an OpenAI reasoning
model (refuses max_tokens and temperature 0), Anthropic's Messages API and OpenAI's Responses API.
Each fake checks the request as the real API does (alternating roles, every tool call answered
by its id), so an eval that completes with no policy error has round-tripped the tool calls."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import pairwise
from typing import Any, ClassVar

import pytest
from typer.testing import CliRunner

from twinrl_cli import app

runner = CliRunner()


class _Fake(BaseHTTPRequestHandler):
    """A model API: ``path`` answered by ``reply(body) -> (status, json)``; requests kept."""

    path_expected = ""
    requests: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        type(self).requests.append(
            {
                "path": self.path,
                "body": body,
                "headers": {k.lower(): v for k, v in self.headers.items()},
            }
        )
        if self.path != self.path_expected:
            return self._send(404, {"error": {"message": f"no route {self.path}"}})
        status, data = self.reply(body)
        self._send(status, data)

    def reply(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:  # pragma: no cover
        raise NotImplementedError

    def _send(self, code: int, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


def _first_call(tools: list[dict[str, Any]], schema_key: str) -> tuple[str, dict[str, Any]]:
    """The first listed tool, with a string for each required argument."""
    tool = tools[0]
    schema = tool.get(schema_key) or {}
    args = {name: "X-1" for name in schema.get("required", [])}
    return tool["name"], args


class _Anthropic(_Fake):
    path_expected = "/v1/messages"

    def reply(self, body):
        msgs = body["messages"]
        if body.get("max_tokens") is None or "system" not in body:
            return 400, {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": "max_tokens and system expected",
                },
            }
        for a, b in pairwise(msgs):
            if a["role"] == b["role"]:
                return 400, {
                    "type": "error",
                    "error": {"type": "invalid_request_error", "message": "roles must alternate"},
                }
        for i, m in enumerate(msgs):
            uses = [
                c["id"]
                for c in m["content"]
                if m["role"] == "assistant" and c["type"] == "tool_use"
            ]
            if uses:
                answered = (
                    [c.get("tool_use_id") for c in msgs[i + 1]["content"]]
                    if i + 1 < len(msgs)
                    else []
                )
                if not set(uses) <= set(answered):
                    return 400, {
                        "type": "error",
                        "error": {
                            "type": "invalid_request_error",
                            "message": "tool_use without tool_result",
                        },
                    }
        turn = sum(m["role"] == "assistant" for m in msgs)
        if turn == 0:
            name, args = _first_call(body["tools"], "input_schema")
            content = [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": name, "input": args},
            ]
        else:
            content = [{"type": "text", "text": "I cannot decide."}]
        return 200, {
            "id": f"msg_{turn}",
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 10, "output_tokens": 5},
        }


class _Reasoning(_Fake):
    """OpenAI chat completions as its reasoning models answer it."""

    path_expected = "/v1/chat/completions"

    def reply(self, body):
        if "max_tokens" in body:
            return 400, {
                "error": {
                    "message": "Unsupported parameter: 'max_tokens' is not supported "
                    "with this model. Use 'max_completion_tokens' instead.",
                    "type": "invalid_request_error",
                    "param": "max_tokens",
                    "code": "unsupported_parameter",
                }
            }
        if body.get("temperature", 1) != 1:
            return 400, {
                "error": {
                    "message": "Unsupported value: 'temperature' does not support 0 "
                    "with this model. Only the default (1) value is supported.",
                    "type": "invalid_request_error",
                    "param": "temperature",
                    "code": "unsupported_value",
                }
            }
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        message: dict[str, Any] = {"role": "assistant", "content": "I cannot decide."}
        if turn == 0:
            name, args = _first_call([t["function"] for t in body["tools"]], "parameters")
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                ],
            }
        return 200, {
            "id": "c",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5},
        }


class _Responses(_Fake):
    path_expected = "/v1/responses"

    def reply(self, body):
        items = body["input"]
        calls = {i["call_id"] for i in items if i.get("type") == "function_call"}
        outputs = {i["call_id"] for i in items if i.get("type") == "function_call_output"}
        if calls != outputs or "max_output_tokens" not in body:
            return 400, {
                "error": {
                    "message": "every function_call needs its output",
                    "type": "invalid_request_error",
                }
            }
        if not calls:
            name, args = _first_call(body["tools"], "parameters")
            output = [
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": name,
                    "arguments": json.dumps(args),
                    "status": "completed",
                },
            ]
        else:
            output = [
                {
                    "type": "message",
                    "id": "m_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": "I cannot decide.", "annotations": []}
                    ],
                }
            ]
        return 200, {
            "id": "resp_1",
            "object": "response",
            "created_at": 0,
            "model": body["model"],
            "status": "completed",
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": 10,
                "output_tokens": 5,
                "total_tokens": 15,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }


def _serve(handler: type[_Fake]) -> Iterator[str]:
    handler.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch, tmp_path):
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TWINRL_CACHE", str(tmp_path / "cache"))


def _eval(policy: str, base_url: str, *extra: str) -> dict[str, Any]:
    result = runner.invoke(
        app,
        [
            "eval",
            "Returns",
            "--policy",
            policy,
            "--base-url",
            base_url,
            "--episodes",
            "2",
            "--set",
            "max_turns=2",
            "--no-store",
            "--no-progress",
            "--json",
            "--retries",
            "0",
            *extra,
        ],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("handler", [_Reasoning])
def test_eval_completes_against_a_reasoning_model_endpoint(handler):
    for base in _serve(handler):
        summary = _eval("openai:o-test", base + "/v1", "--max-tokens", "64")
    assert summary["errors"] == 0 and summary["episodes"] == 2 and summary["mean_turns"] == 2
    last = handler.requests[-1]["body"]
    assert (
        last["max_completion_tokens"] == 64
        and "max_tokens" not in last
        and "temperature" not in last
    )


def test_eval_completes_against_an_anthropic_messages_api():
    pytest.importorskip("anthropic", reason="the providers extra: pip install 'twinrl[providers]'")
    for base in _serve(_Anthropic):
        summary = _eval("anthropic:claude-test", base, "--api-key", "sk-ant-test")
    assert summary["errors"] == 0 and summary["episodes"] == 2 and summary["mean_turns"] == 2
    first = _Anthropic.requests[0]
    headers = first["headers"]  # the key, in the header this SDK version sends it in
    assert "sk-ant-test" in (headers.get("x-api-key"), headers.get("authorization", "")[7:])
    assert first["body"]["tools"][0]["input_schema"]["type"] == "object"
    second = next(r["body"] for r in _Anthropic.requests if len(r["body"]["messages"]) > 1)
    assert second["messages"][1]["content"][-1]["type"] == "tool_use"
    assert second["messages"][2]["content"][0]["type"] == "tool_result"


def test_eval_completes_against_an_openai_responses_api():
    pytest.importorskip("openai", reason="the providers extra: pip install 'twinrl[providers]'")
    for base in _serve(_Responses):
        summary = _eval("openai-responses:gpt-test", base + "/v1")
    assert summary["errors"] == 0 and summary["episodes"] == 2 and summary["mean_turns"] == 2
    second = next(
        r["body"]
        for r in _Responses.requests
        if any(i.get("type") == "function_call_output" for i in r["body"]["input"])
    )
    assert second["input"][-1]["call_id"] == "call_1"


def test_provider_errors_say_what_to_change():
    pytest.importorskip("anthropic", reason="the providers extra: pip install 'twinrl[providers]'")

    class _Denied(_Fake):
        path_expected = "/v1/messages"

        def reply(self, body):
            return 401, {
                "type": "error",
                "error": {"type": "authentication_error", "message": "invalid x-api-key"},
            }

    for base in _serve(_Denied):
        result = runner.invoke(
            app,
            [
                "eval",
                "Returns",
                "--policy",
                "anthropic:claude-test",
                "--base-url",
                base,
                "--episodes",
                "1",
                "--no-store",
                "--no-progress",
                "--retries",
                "0",
                "--json",
            ],
        )
    assert result.exit_code == 3, result.output
    (reason,) = json.loads(result.stdout)["error_reasons"]
    assert "ANTHROPIC_API_KEY" in reason["hint"] and "invalid x-api-key" in reason["message"]
    assert reason["type"] == "PolicyError (HTTP 401)"

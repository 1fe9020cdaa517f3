"""Policies: replay, random, OpenAI-compatible chat (mock transport and a real loopback server)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.errors import ConfigError
from twin.policies import (
    OpenAIChatPolicy,
    Policy,
    PolicyError,
    RandomPolicy,
    ReplayPolicy,
    make_policy,
)
from twin.rollout import run_episodes, summarize
from twin.tools import tool

PROMPT = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Find the value of key k12 and submit it."},
]


@pytest.fixture(scope="module")
def twin(key_twin_cls):
    class KeyPolicyTwin(key_twin_cls):
        """100 keys; submit takes an optional confidence; one baseline."""

        name = "KeyPolicyTest"
        splits = {"test": 100}
        world_size = 100

        def kind_for(self, index: int) -> str:
            return "default"

        @tool(terminal=True)
        def submit(self, value: str, confidence: int = 3) -> str:
            """Submit the value.

            Args:
                value: The value found.
                confidence: 1 to 5.
            """
            return "submitted"

        def baselines(self):
            return {
                "always-k0": lambda twin: ReplayPolicy(
                    [{"name": "submit", "arguments": {"value": "v0"}}], name="always-k0"
                )
            }

    return KeyPolicyTwin(max_turns=4)


# -- replay ------------------------------------------------------------------------------------
def test_replay_turn_forms_and_end():
    policy = ReplayPolicy(
        [
            '<tool_call>{"name": "lookup", "arguments": {"key": "k1"}}</tool_call>',
            {"name": "lookup", "arguments": {"key": "k2"}},
            {
                "calls": [
                    {"name": "lookup", "arguments": {"key": "k3"}},
                    {"name": "submit", "arguments": {"value": "x"}},
                ],
                "content": "two calls",
            },
            {"role": "assistant", "content": "plain", "tool_calls": []},
        ]
    )
    assert isinstance(policy, Policy)
    chat = list(PROMPT)
    got = []
    for _ in range(5):
        msg = asyncio.run(policy.act(chat, []))
        got.append(msg)
        chat = chat + [msg, {"role": "tool", "content": "{}"}]
    assert got[0] == {
        "role": "assistant",
        "content": '<tool_call>{"name": "lookup", "arguments": {"key": "k1"}}</tool_call>',
    }
    assert got[1]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"key": "k2"}'}
    assert [c["function"]["name"] for c in got[2]["tool_calls"]] == ["lookup", "submit"]
    assert got[2]["content"] == "two calls"
    assert got[3]["content"] == "plain"
    assert got[4] == {
        "role": "assistant",
        "content": "(replay finished: the script has 4 turns and no more)",
    }


def test_replay_returns_copies():
    policy = ReplayPolicy([{"name": "lookup", "arguments": {"key": "k2"}}])
    msg = asyncio.run(policy.act(list(PROMPT), []))
    msg["tool_calls"].clear()
    assert asyncio.run(policy.act(list(PROMPT), []))["tool_calls"]


def test_replay_from_yaml_and_json(tmp_path):
    y = tmp_path / "turns.yaml"
    y.write_text(
        "turns:\n  - name: lookup\n    arguments: {key: k12}\n  - name: submit\n    arguments: "
        "{value: v84}\n"
    )
    j = tmp_path / "turns.json"
    j.write_text(json.dumps([{"name": "lookup", "arguments": {"key": "k12"}}]))
    assert len(ReplayPolicy.from_file(y).turns) == 2
    assert ReplayPolicy.from_file(j).name == "replay:turns.json"
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\n")
    with pytest.raises(ConfigError, match="must hold a list"):
        ReplayPolicy.from_file(bad)
    with pytest.raises(ConfigError, match="not found"):
        ReplayPolicy.from_file(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="replay turn 0"):
        ReplayPolicy([42])
    with pytest.raises(ConfigError, match="got keys"):
        ReplayPolicy([{"arguments": {}}])


def test_replay_solves_a_case(twin):
    case = twin.case("test", 0)
    value = twin.world[case.task["key"]]
    policy = ReplayPolicy(
        [
            {"name": "lookup", "arguments": {"key": case.task["key"]}},
            {"name": "submit", "arguments": {"value": value}},
        ]
    )
    (group,) = run_episodes(twin, policy, [("test", 0)], progress=False)
    assert group.trajectories[0].reward == 1.0 and group.trajectories[0].policy == "replay"


# -- random ------------------------------------------------------------------------------------
SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "pick",
            "parameters": {
                "type": "object",
                "properties": {
                    "color": {"enum": ["red", "green"]},
                    "n": {"type": "integer", "minimum": 2, "maximum": 5},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                    "attrs": {"type": "object", "additionalProperties": {"type": "string"}},
                    "flag": {"type": "boolean"},
                    "maybe": {
                        "anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]
                    },
                    "ref": {"$ref": "#/$defs/Kind"},
                },
                "required": ["color", "n", "ref"],
                "$defs": {"Kind": {"enum": ["a", "b"]}},
            },
        },
    },
]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_random_arguments_follow_the_schema(seed):
    msg = RandomPolicy(seed=seed, junk_rate=0.0).turn(PROMPT, SCHEMAS)
    (call,) = msg["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "pick"
    assert args["color"] in ("red", "green") and 2 <= args["n"] <= 5 and args["ref"] in ("a", "b")
    assert len(args.get("tags", [])) <= 2
    assert all(isinstance(v, str) for v in args.get("attrs", {}).values())
    if args.get("maybe") is not None:
        assert 0 <= args["maybe"] <= 1


def test_random_is_deterministic_per_seed_and_episode():
    a, b, c = RandomPolicy(seed=1), RandomPolicy(seed=1), RandomPolicy(seed=2)
    turns = lambda p: [p.turn(PROMPT + [{"role": "assistant"}] * i, SCHEMAS) for i in range(6)]  # noqa: E731
    assert turns(a) == turns(b)
    assert turns(a) != turns(c)
    assert turns(a.for_episode("x#0")) == turns(b.for_episode("x#0"))
    assert turns(a.for_episode("x#0")) != turns(a.for_episode("x#1"))


def test_random_uses_words_from_the_chat_and_makes_junk():
    policy = RandomPolicy(seed=0, junk_rate=0.0)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {
                    "type": "object",
                    "properties": {"key": {"type": "string"}},
                    "required": ["key"],
                },
            },
        }
    ]
    keys = {
        json.loads(
            policy.for_episode(str(i)).turn(PROMPT, tools)["tool_calls"][0]["function"]["arguments"]
        )["key"]
        for i in range(200)
    }
    assert "k12" in keys and keys <= {
        "Find",
        "the",
        "value",
        "of",
        "key",
        "k12",
        "and",
        "submit",
        "it",
    }
    junk = [RandomPolicy(seed=s, junk_rate=1.0).turn(PROMPT, tools) for s in range(40)]
    kinds = set()
    for msg in junk:
        if not msg.get("tool_calls"):
            kinds.add("text")
        else:
            fn = msg["tool_calls"][0]["function"]
            kinds.add(
                "unknown"
                if fn["name"] != "lookup"
                else "badjson"
                if fn["arguments"].endswith(": ")
                else "badargs"
            )
    assert kinds == {"text", "unknown", "badjson", "badargs"}
    with pytest.raises(ConfigError):
        RandomPolicy(junk_rate=2.0)


def test_random_episodes_never_crash_and_sometimes_succeed(twin):
    groups = run_episodes(
        twin, RandomPolicy(seed=0), [("test", i) for i in range(50)], group_size=2, progress=False
    )
    s = summarize(groups)
    assert s["errors"] == 0 and s["episodes"] == 100
    assert s["invalid_calls_total"] > 0


# -- OpenAI-compatible chat over httpx.MockTransport -----------------------------------------------
def _completion(message: dict, usage: dict | None = None) -> dict:
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": usage or {"prompt_tokens": 10, "completion_tokens": 3},
    }


CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_9",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"key": "k12"}'},
        }
    ],
}


def test_openai_request_and_response():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=_completion(CALL))

    policy = OpenAIChatPolicy(
        "http://model.test/v1/",
        "m1",
        api_key="sk-1",
        temperature=0.5,
        max_tokens=77,
        transport=httpx.MockTransport(handler),
        extra_body={"top_p": 0.9},
    )
    chat = PROMPT + [
        CALL,
        {"role": "tool", "tool_call_id": "call_9", "name": "lookup", "content": "{}", "extra": 1},
        {"role": "assistant", "content": '<tool_call>{"name": "lookup"}</tool_call>'},
        {"role": "tool", "tool_call_id": "call_1_0", "name": "lookup", "content": "{}"},
    ]
    msg = asyncio.run(policy.act(chat, SCHEMAS))
    assert msg == CALL
    (req,) = seen
    assert str(req.url) == "http://model.test/v1/chat/completions"
    assert req.headers["authorization"] == "Bearer sk-1"
    body = json.loads(req.content)
    assert (
        body["model"] == "m1"
        and body["temperature"] == 0.5
        and body["max_tokens"] == 77
        and body["top_p"] == 0.9
    )
    assert body["tools"] == SCHEMAS
    # standard keys only; a tool result with no matching tool_calls id goes back as user text
    assert body["messages"][2:] == [
        CALL,
        {"role": "tool", "tool_call_id": "call_9", "content": "{}"},
        {"role": "assistant", "content": '<tool_call>{"name": "lookup"}</tool_call>'},
        {"role": "user", "content": "[lookup result] {}"},
    ]
    assert policy.usage == {
        "requests": 1,
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "retries": 0,
    }
    assert policy.name == "openai:m1"


def test_openai_env_defaults(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://env.test/v1")
    policy = OpenAIChatPolicy(model="m")
    assert policy.url == "http://env.test/v1/chat/completions" and policy.api_key == "sk-env"
    monkeypatch.delenv("OPENAI_API_KEY")
    monkeypatch.delenv("OPENAI_BASE_URL")
    policy = OpenAIChatPolicy(model="m")
    assert policy.url == "https://api.openai.com/v1/chat/completions" and policy.api_key is None


def test_openai_retries_then_succeeds(monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    codes = iter([503, 429, 200])

    def handler(request):
        code = next(codes)
        if code != 200:
            return httpx.Response(code, text="busy", headers={"retry-after": "0"})
        return httpx.Response(200, json=_completion({"role": "assistant", "content": "hi"}))

    policy = OpenAIChatPolicy(
        "http://m.test/v1", "m", transport=httpx.MockTransport(handler), retries=2
    )
    assert asyncio.run(policy.act(PROMPT, [])) == {"role": "assistant", "content": "hi"}
    assert policy.usage["retries"] == 2


async def _no_sleep(_delay: float) -> None:
    return None


def test_openai_http_error_is_clear(monkeypatch):
    def handler(request):
        return httpx.Response(401, json={"error": {"message": "Incorrect API key provided"}})

    policy = OpenAIChatPolicy(
        "http://m.test/v1", "m", api_key="bad", transport=httpx.MockTransport(handler)
    )
    with pytest.raises(PolicyError) as err:
        asyncio.run(policy.act(PROMPT, []))
    text = str(err.value)
    assert "HTTP 401" in text and "http://m.test/v1/chat/completions" in text
    assert "Incorrect API key provided" in text and "OPENAI_API_KEY" in text


def test_openai_gives_up_after_retries(monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    calls = 0

    def handler(request):
        nonlocal calls
        calls += 1
        if calls % 2:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(500, text="<html>oops</html>")

    policy = OpenAIChatPolicy(
        "http://m.test/v1", "m", transport=httpx.MockTransport(handler), retries=3
    )
    with pytest.raises(PolicyError, match=r"HTTP 500: '<html>oops</html>'"):
        asyncio.run(policy.act(PROMPT, []))
    assert calls == 4
    policy = OpenAIChatPolicy(
        "http://m.test/v1", "m", transport=httpx.MockTransport(handler), retries=0
    )
    calls = 0
    with pytest.raises(PolicyError, match="failed after 1 attempts: ConnectError"):
        asyncio.run(policy.act(PROMPT, []))


def test_openai_bad_reply_shape():
    policy = OpenAIChatPolicy(
        "http://m.test/v1",
        "m",
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json={"choices": []})),
    )
    with pytest.raises(PolicyError, match=r"expected a chat completion with choices\[0\].message"):
        asyncio.run(policy.act(PROMPT, []))


def test_openai_client_survives_several_event_loops(twin):
    def handler(request):
        return httpx.Response(200, json=_completion({"role": "assistant", "content": "no idea"}))

    policy = OpenAIChatPolicy("http://m.test/v1", "m", transport=httpx.MockTransport(handler))
    for _ in range(2):  # each run_episodes is a fresh asyncio.run
        groups = run_episodes(twin, policy, [("test", 0), ("test", 1)], progress=False)
        assert all(t.truncated and "error" not in t.info for g in groups for t in g.trajectories)


# -- a real OpenAI-compatible server on loopback ---------------------------------------------------
class _FakeChat(BaseHTTPRequestHandler):
    """Serves /v1/chat/completions: lookup the key in the prompt, then submit the looked-up
    value."""

    requests: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        messages = body["messages"]
        last = messages[-1]
        if last["role"] == "tool":
            value = json.loads(last["content"])["value"]
            name, args = "submit", {"value": value}
        else:
            key = messages[1]["content"].split("key ")[1].split(" ")[0]
            name, args = "lookup", {"key": key}
        n = sum(m["role"] == "assistant" for m in messages)
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{n}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
            ],
        }
        self._send(200, _completion(message))

    def _send(self, code: int, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def loopback_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeChat)
    _FakeChat.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_policy_against_loopback_server(twin, loopback_server):
    policy = make_policy("openai:fake-model", twin, base_url=loopback_server, api_key="sk-test")
    groups = run_episodes(
        twin, policy, [("test", i) for i in range(6)], group_size=2, concurrency=4, progress=False
    )
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 12
    assert all(
        t.reward == 1.0 and t.num_turns == 2 and t.policy == "openai:fake-model" for t in trajs
    ), [t.info for t in trajs]
    assert len(_FakeChat.requests) == 24
    first = _FakeChat.requests[0]
    assert first["model"] == "fake-model"
    assert [t["function"]["name"] for t in first["tools"]] == ["lookup", "submit"]
    # the second turn carries the tool call and its result back to the server
    second = next(r for r in _FakeChat.requests if len(r["messages"]) > 2)
    assert second["messages"][2]["tool_calls"][0]["function"]["name"] == "lookup"
    assert second["messages"][3]["role"] == "tool"


def test_openai_policy_404_from_loopback(loopback_server):
    policy = OpenAIChatPolicy(loopback_server.removesuffix("/v1"), "m")
    with pytest.raises(PolicyError, match="HTTP 404.*no route /chat/completions.*ends in /v1"):
        asyncio.run(policy.act(PROMPT, []))


# -- specs -------------------------------------------------------------------------------------
def test_make_policy_specs(twin, tmp_path, monkeypatch):
    assert isinstance(make_policy("random", twin, seed=5), RandomPolicy)
    assert make_policy("random", twin, seed=5).seed == 5
    assert make_policy("random:9", twin).seed == 9
    f = tmp_path / "t.yaml"
    f.write_text("- hello\n")
    assert isinstance(make_policy(f"replay:{f}", twin), ReplayPolicy)
    p = make_policy("openai:gpt-x", twin, base_url="http://h:1/v1", temperature=0.7)
    assert isinstance(p, OpenAIChatPolicy) and p.model == "gpt-x" and p.temperature == 0.7
    assert make_policy("always-k0", twin).name == "always-k0"

    made = []
    fake = types.ModuleType("trainer.hf_policy")

    class HFPolicy:
        @classmethod
        def from_spec(cls, spec, twin_):
            made.append((spec, twin_))
            return "hf-policy"

    fake.HFPolicy = HFPolicy
    monkeypatch.setitem(sys.modules, "trainer.hf_policy", fake)
    assert make_policy("hf:smollm2", twin) == "hf-policy" and made == [("hf:smollm2", twin)]


def test_policy_kinds_are_entry_point_plugins(twin, monkeypatch):
    from importlib.metadata import EntryPoint

    import twin.policies.specs as policies

    assert (
        policies.policy_kinds()["hf"].value == "trainer.hf_policy:HFPolicy.from_spec"
    )  # ours, a plugin too
    plugin = types.ModuleType("my_policies")
    plugin.make = lambda spec, twin_: ("made", spec, twin_)
    monkeypatch.setitem(sys.modules, "my_policies", plugin)
    kinds = {
        "echo": EntryPoint(
            name="echo", value="my_policies:make", group=policies.POLICY_ENTRY_POINT_GROUP
        )
    }
    monkeypatch.setattr(policies, "policy_kinds", lambda: kinds)
    assert make_policy("echo:x", twin) == ("made", "echo:x", twin)
    with pytest.raises(ConfigError, match=r"echo:\.\.\. \(plugin my_policies:make\)"):
        make_policy("nope:x", twin)
    kinds["broken"] = EntryPoint(
        name="broken", value="no_such_module_xyz:make", group="twin.policies"
    )
    with pytest.raises(ConfigError, match="could not be imported"):
        make_policy("broken:x", twin)


def test_make_policy_unknown_lists_forms(twin):
    with pytest.raises(ConfigError) as err:
        make_policy("gpt4", twin)
    text = str(err.value)
    for form in ("random", "replay:FILE", "openai:MODEL", "hf:PATH", "always-k0"):
        assert form in text
    with pytest.raises(ConfigError, match="integer"):
        make_policy("random:x", twin)
    with pytest.raises(ConfigError):
        make_policy("openai:", twin)


# -- request settings, hints and progress ---------------------------------------------------------
def test_openai_timeout_is_explained_not_retried():
    calls = 0

    def handler(request):
        nonlocal calls
        calls += 1
        raise httpx.ReadTimeout("", request=request)

    policy = OpenAIChatPolicy(
        "http://m.test/v1", "m", transport=httpx.MockTransport(handler), timeout=1.5, max_tokens=64
    )
    with pytest.raises(PolicyError) as err:
        asyncio.run(policy.act(PROMPT, []))
    assert calls == 1  # a slow server is not asked again
    assert "no reply within 1.5 s (ReadTimeout)" in str(err.value) and "max_tokens=64" in str(
        err.value
    )
    assert "--timeout" in err.value.hint and isinstance(err.value.__cause__, httpx.ReadTimeout)
    assert policy.in_flight == 0


@pytest.mark.parametrize(
    ("status", "text", "flag"),
    [
        (401, '{"error": {"message": "Incorrect API key provided"}}', "--api-key"),
        (400, "This model's maximum context length is 2048 tokens.", "--max-tokens"),
        (404, "no such model", "--base-url"),
    ],
)
def test_openai_http_errors_carry_the_flag_that_fixes_them(status, text, flag):
    policy = OpenAIChatPolicy(
        "http://m.test/v1",
        "m",
        transport=httpx.MockTransport(lambda r: httpx.Response(status, text=text)),
    )
    with pytest.raises(PolicyError) as err:
        asyncio.run(policy.act(PROMPT, []))
    assert flag in err.value.hint and err.value.cause == f"HTTP {status}"


def test_openai_top_p_progress_and_bad_settings(monkeypatch):
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    bodies: list[dict] = []
    codes = iter([503, 200])

    def handler(request):
        bodies.append(json.loads(request.content))
        if next(codes) == 503:
            return httpx.Response(503, text="busy")
        return httpx.Response(200, json=_completion({"role": "assistant", "content": "hi"}))

    policy = OpenAIChatPolicy(
        "http://m.test/v1", "m", transport=httpx.MockTransport(handler), top_p=0.5
    )
    assert policy.progress() == {"in_flight": 0, "tokens": 0}
    asyncio.run(policy.act(PROMPT, []))
    assert bodies[-1]["top_p"] == 0.5
    assert "top_p" not in OpenAIChatPolicy("http://m.test/v1", "m").request_body(PROMPT, [])
    assert policy.progress() == {
        "in_flight": 0,
        "tokens": 3,
        "retries": 1,
        "last_retry": "HTTP 503",
    }
    with pytest.raises(ConfigError, match="timeout > 0"):
        OpenAIChatPolicy("http://m.test/v1", "m", timeout=0)


def test_policy_file_settings_and_errors(tmp_path):
    from twin.policies import PolicySettings, load_policy_file

    spec = tmp_path / "p.yaml"
    spec.write_text(
        "policy: openai:smollm2\nbase_url: http://h/v1\ntimeout: 600\nmax_tokens: 128\n"
        "extra_body: {chat_template_kwargs: {enable_thinking: false}}\n"
    )
    settings = load_policy_file(spec).merged(max_tokens=64, top_p=None)
    assert settings.policy == "openai:smollm2" and settings.max_tokens == 64  # the flag wins
    assert settings.request_options() == {
        "timeout": 600.0,
        "max_tokens": 64,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    assert PolicySettings().request_options() == {}
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: openai:x\ntimeot: 5\nmax_tokens: 0\n")
    with pytest.raises(ConfigError) as err:
        load_policy_file(bad)
    text = str(err.value)
    assert "timeot" in text and "max_tokens" in text and "allowed fields" in text
    assert "\n" not in text
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_policy_file(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_policy_file(tmp_path / "missing.yaml")


# -- deadlines and reasoning-model endpoints ---------------------------------------------------
class _Dripping(BaseHTTPRequestHandler):
    """Answers 200 at once, then sends its body one byte every 0.2 s (bounded: 200 bytes)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b" " * 200
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                threading.Event().wait(0.2)
        except OSError:  # the client gave up: expected
            pass

    def log_message(self, *args: Any) -> None:
        pass


def _serve(handler: type) -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def test_the_timeout_is_a_deadline_for_the_whole_request():
    """Issue 24: a server dripping a byte at a time kept each read under the timeout, so a
    request under --timeout 5 took 101 s and counted as no error."""
    server, url = _serve(_Dripping)
    try:
        policy = OpenAIChatPolicy(url, "m", timeout=1.0, retries=0)
        loop = asyncio.new_event_loop()
        start = loop.time()
        with pytest.raises(PolicyError) as err:
            loop.run_until_complete(policy.act(PROMPT, []))
        elapsed = loop.time() - start
        loop.close()
    finally:
        server.shutdown()
        server.server_close()
    assert "no reply within 1 s" in str(err.value) and err.value.cause == "ReadTimeout"
    assert elapsed < 20  # the drip takes 40 s; this bounds the test, it is not a timing claim


class _ReasoningModel(BaseHTTPRequestHandler):
    """Like OpenAI's reasoning models: refuses max_tokens and a temperature other than 1."""

    bodies: list[dict] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        type(self).bodies.append(body)
        if "max_tokens" in body:
            return self._send(
                400,
                {
                    "error": {
                        "message": "Unsupported parameter: 'max_tokens' is not supported with "
                        "this model. Use 'max_completion_tokens' instead.",
                        "type": "invalid_request_error",
                        "param": "max_tokens",
                        "code": "unsupported_parameter",
                    }
                },
            )
        if body.get("temperature", 1) != 1:
            return self._send(
                400,
                {
                    "error": {
                        "message": "Unsupported value: 'temperature' does not support 0 with "
                        "this model. Only the default (1) value is supported.",
                        "type": "invalid_request_error",
                        "param": "temperature",
                        "code": "unsupported_value",
                    }
                },
            )
        n = sum(m["role"] == "assistant" for m in body["messages"])
        call = ("lookup", {"key": "k12"}) if n == 0 else ("submit", {"value": "v12"})
        self._send(
            200,
            _completion(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"c{n}",
                            "type": "function",
                            "function": {"name": call[0], "arguments": json.dumps(call[1])},
                        }
                    ],
                }
            ),
        )

    def _send(self, code: int, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_reasoning_model_endpoint_gets_max_completion_tokens_and_its_default_temperature():
    _ReasoningModel.bodies = []
    server, url = _serve(_ReasoningModel)
    try:
        policy = OpenAIChatPolicy(url, "o-mini", max_tokens=77, retries=0)
        first = asyncio.run(policy.act(PROMPT, []))
        second = asyncio.run(policy.act(PROMPT, []))
    finally:
        server.shutdown()
        server.server_close()
    assert first["tool_calls"][0]["function"]["name"] == "lookup" and second == first
    assert policy.token_field == "max_completion_tokens" and policy.dropped == {"temperature"}
    sent = _ReasoningModel.bodies[-1]
    assert (
        sent["max_completion_tokens"] == 77
        and "max_tokens" not in sent
        and "temperature" not in sent
    )
    assert len(_ReasoningModel.bodies) == 4  # 2 refusals on the first turn, none after
    assert policy.usage["retries"] == 0


def test_a_refused_parameter_is_not_mistaken_for_a_context_overflow():
    text = json.dumps(
        {
            "error": {
                "message": "Unsupported parameter: 'logit_bias' is not supported with this model.",
                "param": "logit_bias",
                "code": "unsupported_parameter",
            }
        }
    )
    policy = OpenAIChatPolicy(
        "http://m.test/v1",
        "m",
        extra_body={"logit_bias": {}},
        transport=httpx.MockTransport(lambda r: httpx.Response(400, text=text)),
    )
    with pytest.raises(PolicyError) as err:
        asyncio.run(policy.act(PROMPT, []))
    assert "logit_bias" in err.value.hint and "--max-tokens" not in err.value.hint

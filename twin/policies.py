"""Policies: whatever writes the assistant's turns.

A policy is any object with a ``name`` and an async ``act(messages, tools)`` that returns an
assistant message dict (OpenAI format; ``tool_calls`` or text the env parses)::

    class Policy(Protocol):
        name: str
        async def act(self, messages: list[dict], tools: list[dict]) -> dict: ...

Policies must not mutate ``messages``. A policy that needs per-episode randomness may define
``for_episode(key: str) -> Policy``; the runner then calls it once per episode with a stable key
(``"<case id>#<k>"``) and acts through the returned object.

Shipped here:

- :class:`ReplayPolicy`: hand-written assistant turns, e.g. for reward tests and demos.
- :class:`RandomPolicy`: random tool calls with arguments built from the tool schemas.
- :class:`OpenAIChatPolicy`: any OpenAI-compatible ``/chat/completions`` server, over httpx.
- ``anthropic:`` and ``openai-responses:`` (:mod:`twin.providers`): Anthropic's Messages API and
  OpenAI's Responses API through the providers' SDKs.
- :func:`make_policy`: a policy from a command-line spec (``random``, ``openai:gpt-4o-mini``, ...).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from twin.cases import stable_seed
from twin.chat_wire import Message, PolicyError, wire_messages
from twin.errors import ConfigError
from twin.http import tls_context

__all__ = [
    "OpenAIChatPolicy",
    "Policy",
    "PolicyError",
    "PolicySettings",
    "RandomPolicy",
    "ReplayPolicy",
    "load_policy_file",
    "make_policy",
    "policy_for_episode",
    "policy_kinds",
    "tool_call",
]


@runtime_checkable
class Policy(Protocol):
    """What the runner drives: a name and an async ``act``."""

    name: str

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """Return the next assistant message for the chat ``messages`` (do not mutate it)."""
        ...


def policy_for_episode(policy: Policy, key: str) -> Policy:
    """``policy.for_episode(key)`` when the policy defines it, else the policy itself."""
    fork = getattr(policy, "for_episode", None)
    return fork(key) if callable(fork) else policy


def tool_call(name: str, arguments: Any, call_id: str) -> dict[str, Any]:
    """An OpenAI tool-call dict; ``arguments`` is JSON-encoded unless it already is a string."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _assistant_turns(messages: Sequence[Message]) -> int:
    return sum(1 for m in messages if m.get("role") == "assistant")


# -- replay ------------------------------------------------------------------------------------
class ReplayPolicy:
    """Plays hand-written assistant turns, one per call, in order.

    Each turn is either a string (raw model text, e.g. ``<tool_call>{...}</tool_call>``, parsed
    by the env) or a dict: a full assistant message (``{"role": "assistant", "content": ...,
    "tool_calls": [...]}``), a shorthand call ``{"name": "submit", "arguments": {...}}``, or
    ``{"calls": [{"name": ..., "arguments": ...}, ...], "content": "..."}`` for several calls.
    The position is the number of assistant messages already in the chat, so one policy serves
    any number of concurrent episodes. After the last turn it answers in text that the script
    has ended (the env counts that as a turn without a tool call).

    Args:
        turns: The turns.
        name: Name recorded in trajectories.

    Raises:
        ConfigError: a turn that is neither a string nor one of the dict forms.
    """

    def __init__(self, turns: Sequence[str | dict[str, Any]], name: str = "replay") -> None:
        self.name = name
        self.turns = [self._normalise(t, i) for i, t in enumerate(turns)]

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ReplayPolicy:
        """Load turns from a YAML or JSON file: a list of turns, or ``{"turns": [...]}``.

        Raises:
            ConfigError: the file is missing or does not hold a list of turns.
        """
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"replay file {str(p)!r} not found; give a YAML or JSON list of turns"
            )
        from twin.yamlsafe import load_yaml_file

        data = load_yaml_file(p, what="replay file")  # YAML is a superset of JSON; bounded size
        if isinstance(data, dict) and "turns" in data:
            data = data["turns"]
        if not isinstance(data, list):
            raise ConfigError(
                f"replay file {str(p)!r} must hold a list of assistant turns "
                "(or {turns: [...]}), "
                f"got {type(data).__name__}"
            )
        return cls(data, name=f"replay:{p.name}")

    @staticmethod
    def _normalise(turn: Any, i: int) -> Message:
        if isinstance(turn, str):
            return {"role": "assistant", "content": turn}
        if not isinstance(turn, dict):
            raise ConfigError(
                f"replay turn {i}: expected a string or a dict, got {type(turn).__name__}: {turn!r}"
            )
        if "role" in turn or "tool_calls" in turn:
            msg = {"role": "assistant", "content": turn.get("content"), **turn}
            msg["role"] = "assistant"
            return msg
        if "name" in turn:
            calls = [turn]
        elif "calls" in turn:
            calls = list(turn["calls"])
        else:
            raise ConfigError(
                f"replay turn {i}: a dict turn needs 'role'/'tool_calls' (a message), 'name' and "
                f"'arguments' (one call) or 'calls' (several); got keys {sorted(turn)}"
            )
        tool_calls = []
        for j, call in enumerate(calls):
            if not isinstance(call, dict) or "name" not in call:
                raise ConfigError(
                    f"replay turn {i}, call {j}: expected {{name, arguments}}, got {call!r}"
                )
            tool_calls.append(tool_call(call["name"], call.get("arguments", {}), f"call_{i}_{j}"))
        return {"role": "assistant", "content": turn.get("content"), "tool_calls": tool_calls}

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """The next scripted turn (a copy), or a text turn saying the script has ended."""
        i = _assistant_turns(messages)
        if i < len(self.turns):
            return json.loads(json.dumps(self.turns[i]))  # a copy: envs may annotate messages
        return {
            "role": "assistant",
            "content": f"(replay finished: the script has {len(self.turns)} turns and no more)",
        }

    def __repr__(self) -> str:
        return f"ReplayPolicy({len(self.turns)} turns, name={self.name!r})"


# -- random ------------------------------------------------------------------------------------
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-./]{0,39}")


class RandomPolicy:
    """Random tool calls with arguments built from the tool schemas; sometimes junk.

    String arguments are drawn from the words and values already in the chat (ids in the
    prompt, names in tool results), so a random agent sometimes hits a real record; enums,
    numbers, booleans, arrays and objects follow the schema. With probability ``junk_rate`` a
    turn is junk instead: plain text, an unknown tool, malformed JSON or wrongly typed arguments.

    Deterministic: the turn depends only on ``seed``, the episode key (see ``for_episode``; by
    default the opening messages) and the turn number, never on scheduling.

    Args:
        seed: Seed.
        junk_rate: Probability of a junk turn.
        name: Name recorded in trajectories.
    """

    def __init__(
        self, seed: int = 0, junk_rate: float = 0.1, name: str = "random", _key: str | None = None
    ) -> None:
        if not 0.0 <= junk_rate <= 1.0:
            raise ConfigError(f"junk_rate must be in [0, 1], got {junk_rate}")
        self.seed = seed
        self.junk_rate = junk_rate
        self.name = name
        self._key = _key

    def for_episode(self, key: str) -> RandomPolicy:
        """A copy whose randomness is keyed by ``key`` (distinct episodes of one case differ)."""
        return RandomPolicy(self.seed, self.junk_rate, self.name, _key=key)

    def _rng(self, messages: Sequence[Message]) -> random.Random:
        key = self._key
        if key is None:
            key = json.dumps(
                [m.get("content") for m in messages[:2]],
                sort_keys=True,
                ensure_ascii=False,
                default=str,
            )
        return random.Random(
            stable_seed("RandomPolicy", self.seed, key, _assistant_turns(messages))
        )

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """A random tool call (or, rarely, junk)."""
        return self.turn(messages, tools)

    def turn(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]) -> Message:
        """The synchronous body of :meth:`act`."""
        rng = self._rng(messages)
        turn = _assistant_turns(messages)
        call_id = f"call_{turn}_0"
        if not tools:
            return {"role": "assistant", "content": "I have no tools to call."}
        words = _candidate_words(messages)
        if rng.random() < self.junk_rate:
            return _junk(rng, tools, words, call_id)
        fn = rng.choice(list(tools))["function"]
        params = fn.get("parameters") or {}
        args = _sample_object(rng, params, params.get("$defs", {}), words, depth=0)
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call(fn["name"], args, call_id)],
        }

    def __repr__(self) -> str:
        return f"RandomPolicy(seed={self.seed}, junk_rate={self.junk_rate})"


class _Words:
    """Strings an argument may take: values from tool results (ids, names) and prompt words."""

    def __init__(self, values: list[str], words: _Words) -> None:
        self.values = values
        self.words = words or values or ["x"]

    def pick(self, rng: random.Random) -> str:
        # Half the time a value a tool returned: ids found by search are the plausible ones.
        if self.values and rng.random() < 0.5:
            return rng.choice(self.values)
        return rng.choice(self.words)


def _candidate_words(messages: Sequence[Message]) -> _Words:
    """Strings seen in the chat: tool-result values; prompt words and keys. In order, unique."""
    values: dict[str, None] = {}
    words: dict[str, None] = {}

    def add_json(value: Any) -> None:
        if isinstance(value, str):
            if 0 < len(value) <= 60:
                values.setdefault(value, None)
        elif isinstance(value, dict):
            for k, v in value.items():
                words.setdefault(str(k), None)
                add_json(v)
        elif isinstance(value, list):
            for v in value:
                add_json(v)

    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            continue
        if m.get("role") == "tool":
            try:
                add_json(json.loads(content))
                continue
            except (json.JSONDecodeError, ValueError):
                pass
        if m.get("role") in ("user", "tool"):
            for w in _WORD.findall(content):
                words.setdefault(w.rstrip(".,"), None)
        if len(values) + len(words) > 400:
            break
    return _Words(list(values), list(words))


def _sample_value(
    rng: random.Random, schema: dict[str, Any], defs: dict[str, Any], words: _Words, depth: int
) -> Any:
    if "$ref" in schema:
        target = defs.get(schema["$ref"].rsplit("/", 1)[-1], {})
        return _sample_value(rng, target, defs, words, depth + 1)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    for union in ("anyOf", "oneOf"):
        if union in schema:
            options = [s for s in schema[union] if s.get("type") != "null"] or schema[union]
            return _sample_value(rng, rng.choice(options), defs, words, depth + 1)
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = rng.choice([k for k in kind if k != "null"] or kind)
    if kind == "string":
        return words.pick(rng)
    if kind == "integer":
        low = int(schema.get("minimum", schema.get("exclusiveMinimum", -1) + 1))
        high = int(schema.get("maximum", schema.get("exclusiveMaximum", low + 11) - 1))
        return rng.randint(low, max(low, high))
    if kind == "number":
        low = float(schema.get("minimum", 0.0))
        high = float(schema.get("maximum", low + 100.0))
        return round(rng.uniform(low, high), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        if depth > 4:
            return []
        n = rng.randint(int(schema.get("minItems", 0)), int(schema.get("maxItems", 3)))
        return [
            _sample_value(rng, schema.get("items", {}), defs, words, depth + 1) for _ in range(n)
        ]
    if kind == "object":
        return _sample_object(rng, schema, defs, words, depth + 1)
    return words.pick(rng)


def _sample_object(
    rng: random.Random, schema: dict[str, Any], defs: dict[str, Any], words: _Words, depth: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if depth > 4:
        return out
    required = set(schema.get("required", []))
    for pname, prop in (schema.get("properties") or {}).items():
        if pname in required or rng.random() < 0.5:
            out[pname] = _sample_value(rng, prop, defs, words, depth)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict) and not schema.get("properties"):
        for _ in range(rng.randint(0, 3)):
            out[words.pick(rng)] = _sample_value(rng, extra, defs, words, depth)
    return out


def _junk(
    rng: random.Random, tools: Sequence[dict[str, Any]], words: _Words, call_id: str
) -> Message:
    name = rng.choice(list(tools))["function"]["name"]
    kind = rng.randrange(4)
    if kind == 0:
        return {"role": "assistant", "content": f"I think the answer is {words.pick(rng)}."}
    if kind == 1:
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call(name + "_x", {}, call_id)],
        }
    if kind == 2:
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [tool_call(name, '{"oops": ', call_id)],
        }
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [tool_call(name, {"_": [1, 2]}, call_id)],
    }


# -- OpenAI-compatible chat ----------------------------------------------------------------------
_RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class OpenAIChatPolicy:
    """Any OpenAI-compatible ``/chat/completions`` server (OpenAI, vLLM, llama.cpp, ...).

    One ``httpx.AsyncClient`` carries every concurrent episode. Retries connection errors, 429
    and 5xx with exponential backoff (honouring ``Retry-After``); other errors raise
    :class:`PolicyError` with the status, the URL, the start of the body and a ``hint`` naming
    the ``twin eval`` flag that fixes the common ones. A request that gets no reply within
    ``timeout`` is not retried: the server is up but slower than the timeout, and asking again
    only adds to its queue.

    Args:
        base_url: Server root including ``/v1`` (default ``$OPENAI_BASE_URL``, else OpenAI's).
        model: Model name the server knows.
        api_key: Bearer token (default ``$OPENAI_API_KEY``; none is sent when neither is set).
        temperature: Sampling temperature.
        max_tokens: Most tokens per turn.
        transport: An httpx transport, e.g. ``httpx.MockTransport(handler)`` in tests.
        timeout: Seconds per request.
        retries: Extra attempts after a retryable failure.
        extra_body: Merged into each request body (e.g. ``{"chat_template_kwargs": {...}}``).
        name: Name recorded in trajectories (default ``openai:<model>``).
        top_p: Nucleus sampling threshold (not sent when None: the server's default).
    """

    def __init__(
        self,
        base_url: str | None = None,
        model: str = "gpt-4o-mini",
        api_key: str | None = None,
        *,
        temperature: float = 0.0,
        max_tokens: int = 1024,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout: float = 120.0,
        retries: int = 3,
        extra_body: dict[str, Any] | None = None,
        name: str | None = None,
        top_p: float | None = None,
    ) -> None:
        if timeout <= 0 or max_tokens < 1 or retries < 0:
            raise ConfigError(
                f"openai policy: need timeout > 0, max_tokens >= 1 and retries >= 0; got "
                f"timeout={timeout}, max_tokens={max_tokens}, retries={retries}"
            )
        self.base_url = (
            base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
        ).rstrip("/")
        self.url = f"{self.base_url}/chat/completions"
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.transport = transport
        self.timeout = timeout
        self.retries = retries
        self.extra_body = dict(extra_body or {})
        self.name = name or f"openai:{model}"
        self.usage = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "retries": 0}
        self.in_flight = 0
        self.last_retry: str | None = None
        #: How the server wants the turn's token budget sent: ``max_tokens``, or
        #: ``max_completion_tokens`` once the server refused the first (OpenAI reasoning models).
        self.token_field = "max_tokens"
        #: Sampling parameters the server refused (``temperature``, ``top_p``): no longer sent.
        self.dropped: set[str] = set()
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> httpx.AsyncClient:
        # An AsyncClient's connection pool belongs to the event loop that opened it, and each
        # `run_episodes` call runs its own loop: keep the client of the current loop only.
        # Holding the loop object (not its id) rules out a new loop reusing a stale client.
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._http = httpx.AsyncClient(
                transport=self.transport,
                timeout=self.timeout,
                headers=headers,
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
                verify=tls_context(),
            )
            self._loop = loop
        return self._http

    def request_body(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]
    ) -> dict[str, Any]:
        """The JSON body sent for one turn."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": wire_messages(messages),
            "temperature": self.temperature,
            self.token_field: self.max_tokens,
        }
        if self.top_p is not None:
            body["top_p"] = self.top_p
        for name in self.dropped:
            body.pop(name, None)
        if tools:
            body["tools"] = list(tools)
        body.update(self.extra_body)
        return body

    def _adapt(self, body: dict[str, Any], response: httpx.Response) -> bool:
        """Follow a 400 that refuses one of our own parameters: send ``max_completion_tokens``
        instead of ``max_tokens``, or leave out a refused ``temperature`` / ``top_p`` (reasoning
        models take only their defaults). True when ``body`` was changed and should be re-sent."""
        param = _unsupported_parameter(response)
        if param is None or param in self.extra_body:  # the user's own extra_body: theirs to fix
            return False
        if param == "max_tokens" and "max_tokens" in body:
            self.token_field = "max_completion_tokens"
            body["max_completion_tokens"] = body.pop("max_tokens")
            return True
        if param in ("temperature", "top_p") and param in body:
            self.dropped.add(param)
            body.pop(param)
            return True
        return False

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """POST the chat and return the assistant message (``tool_calls`` kept).

        Raises:
            PolicyError: an HTTP error, an unreachable server after the retries, or a reply
                without ``choices[0].message``.
        """
        body = self.request_body(messages, tools)
        self.in_flight += 1
        try:
            response = await self._post(body)
        finally:
            self.in_flight -= 1
        try:
            data = response.json()
            message = data["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise PolicyError(
                f"POST {self.url}: expected a chat completion with choices[0].message, got "
                f"{_excerpt(response.text)}",
                cause="bad reply",
            ) from None
        usage = data.get("usage") or {}
        self.usage["requests"] += 1
        self.usage["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        self.usage["completion_tokens"] += int(usage.get("completion_tokens") or 0)
        out: Message = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "id": c.get("id") or f"call_{i}",
                    "type": c.get("type", "function"),
                    "function": dict(c.get("function") or {}),
                }
                for i, c in enumerate(message["tool_calls"])
            ]
        return out

    def progress(self) -> dict[str, Any]:
        """Live figures for a progress bar: requests in flight, completion tokens received,
        retries so far (and why the last one happened)."""
        figures: dict[str, Any] = {
            "in_flight": self.in_flight,
            "tokens": self.usage["completion_tokens"],
        }
        if self.usage["retries"]:
            figures["retries"] = self.usage["retries"]
            figures["last_retry"] = self.last_retry
        return figures

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        client = self._client()
        delay = 0.5
        adaptations = 3  # at most: max_tokens, temperature, top_p
        attempt = 0
        while True:
            last = attempt >= self.retries
            try:
                # httpx's timeout restarts with every byte read: a server that drips its reply
                # would never hit it. The whole request (headers and body) gets `timeout` seconds.
                response = await asyncio.wait_for(
                    client.post(self.url, json=body), timeout=self.timeout
                )
            except (TimeoutError, httpx.ReadTimeout, httpx.WriteTimeout) as exc:
                # The deadline and httpx's read timeout are the same length: whichever fires, the
                # reply did not arrive in time, and it is reported the same way.
                cause = "WriteTimeout" if isinstance(exc, httpx.WriteTimeout) else "ReadTimeout"
                raise PolicyError(
                    f"POST {self.url}: no reply within {self.timeout:g} s "
                    f"({cause}); the server may be slow or generating up to "
                    f"max_tokens={self.max_tokens} tokens",
                    hint="raise --timeout (seconds per request) or lower --max-tokens",
                    cause=cause,
                ) from exc
            except httpx.TransportError as exc:
                if last:
                    raise PolicyError(
                        f"POST {self.url} failed after {self.retries + 1} attempts: "
                        f"{type(exc).__name__}: {exc}. Is the server running? (base URL: "
                        f"--base-url or $OPENAI_BASE_URL)",
                        hint="check --base-url and that the server is running",
                    ) from exc
                self.last_retry = type(exc).__name__
            else:
                if response.status_code < 400:
                    return response
                if response.status_code == 400 and adaptations and self._adapt(body, response):
                    adaptations -= 1
                    continue  # the same request in the form the server asked for: no retry used
                if last or response.status_code not in _RETRY_STATUS:
                    raise PolicyError(
                        _http_message(self.url, response, self.model),
                        hint=_http_hint(response),
                        cause=f"HTTP {response.status_code}",
                    )
                self.last_retry = f"HTTP {response.status_code}"
                retry_after = response.headers.get("retry-after", "")
                if retry_after.replace(".", "", 1).isdigit():
                    delay = min(float(retry_after), 30.0)
            self.usage["retries"] += 1
            attempt += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    async def aclose(self) -> None:
        """Close the HTTP client (call from the loop that used it)."""
        if self._http is not None:
            await self._http.aclose()
        self._http, self._loop = None, None

    def __repr__(self) -> str:
        return f"OpenAIChatPolicy(base_url={self.base_url!r}, model={self.model!r})"


def _excerpt(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _http_message(url: str, response: httpx.Response, model: str) -> str:
    hint = {
        401: "check the API key ($OPENAI_API_KEY)",
        403: "the key is not allowed to use this model",
        404: f"check the base URL (it usually ends in /v1) and that the server has model {model!r}",
        400: "the server rejected the request; see its message",
    }.get(response.status_code, "see the server's message")
    return f"POST {url} -> HTTP {response.status_code}: {_excerpt(response.text)}; {hint}"


_CONTEXT_OVERFLOW = re.compile(
    r"context length|context window|maximum context|too many tokens|prompt is too long|"
    r"max_tokens|max_completion_tokens|exceeds? the model",
    re.IGNORECASE,
)


_UNSUPPORTED = re.compile(r"unsupported (?:parameter|value):? *'(\w+)'", re.IGNORECASE)


def _unsupported_parameter(response: httpx.Response) -> str | None:
    """The request parameter a 400 says the model does not take (OpenAI's ``error.param`` with
    code ``unsupported_parameter`` / ``unsupported_value``, or its message), else None."""
    try:
        error = response.json().get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    if isinstance(error, dict) and error.get("code") in (
        "unsupported_parameter",
        "unsupported_value",
    ):
        if isinstance(error.get("param"), str):
            return error["param"]
    found = _UNSUPPORTED.search(response.text)
    return found.group(1) if found else None


def _http_hint(response: httpx.Response) -> str | None:
    """The ``twin eval`` flag that fixes a failed request, when one does."""
    code = response.status_code
    refused = _unsupported_parameter(response) if code == 400 else None
    if refused:
        return (
            f"the model does not take {refused!r}: leave it out of --extra-body / the policy file"
            if refused not in ("max_tokens", "max_completion_tokens", "temperature", "top_p")
            else f"the server refused {refused!r} in every form twinrl sends; see its message"
        )
    if code == 401:
        return "pass --api-key (or set $OPENAI_API_KEY)"
    if code == 404:
        return "check --base-url (it usually ends in /v1) and the model name after openai:"
    if code in (400, 413, 422) and _CONTEXT_OVERFLOW.search(response.text):
        return (
            "lower --max-tokens (prompt + completion must fit the model's context), or give the "
            "server a longer context or the twin fewer turns (--set max_turns=N)"
        )
    if code in _RETRY_STATUS:
        return "the server is overloaded or failing: lower --concurrency or raise --retries"
    return None


# -- settings ----------------------------------------------------------------------------------
class PolicySettings(BaseModel):
    """A policy and its request settings, as a policy spec file holds them (YAML or JSON)::

        policy: openai:smollm2
        base_url: http://127.0.0.1:18000/v1
        timeout: 600          # seconds per request
        max_tokens: 128       # per turn
        temperature: 0.0
        top_p: 0.95
        retries: 3
        concurrency: 4        # episodes in flight
        extra_body: {chat_template_kwargs: {enable_thinking: false}}

    Every field but ``policy`` is optional (None: the command line's or the default value).
    ``api_key`` is accepted but better left to ``$OPENAI_API_KEY``; it is never stored.
    """

    model_config = ConfigDict(extra="forbid")

    policy: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    timeout: float | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    retries: int | None = Field(default=None, ge=0)
    concurrency: int | None = Field(default=None, ge=1)
    extra_body: dict[str, Any] | None = None

    def merged(self, **overrides: Any) -> PolicySettings:
        """These settings with every non-None override on top (the command line wins)."""
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return PolicySettings.model_validate(data)

    def request_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`OpenAIChatPolicy` that are set (base URL and key apart)."""
        keys = ("timeout", "max_tokens", "temperature", "top_p", "retries", "extra_body")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


def load_policy_file(path: str | os.PathLike[str]) -> PolicySettings:
    """Read a policy spec file (see :class:`PolicySettings`).

    Raises:
        ConfigError: the file is missing, not YAML/JSON, not a mapping, or has unknown or
            invalid fields (the message names them and lists the allowed ones).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"policy file {str(p)!r} not found; give a YAML or JSON mapping")
    from twin.yamlsafe import load_yaml_file

    data = load_yaml_file(p, what="policy file")  # YAML is a superset of JSON; bounded size
    if not isinstance(data, dict):
        raise ConfigError(
            f"policy file {str(p)!r} must hold a mapping (policy: openai:MODEL, timeout: ...), "
            f"got {type(data).__name__}"
        )
    try:
        return PolicySettings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(file)'}: {e['msg']}" for e in exc.errors()
        )
        allowed = ", ".join(PolicySettings.model_fields)
        raise ConfigError(
            f"policy file {str(p)!r}: {problems} (allowed fields: {allowed})"
        ) from None


# -- specs -------------------------------------------------------------------------------------
POLICY_FORMS = (
    "random[:SEED]",
    "replay:FILE (YAML/JSON list of turns)",
    "openai:MODEL (base URL from --base-url or $OPENAI_BASE_URL, key from $OPENAI_API_KEY)",
    "anthropic:MODEL (Anthropic's Messages API; key from $ANTHROPIC_API_KEY; twinrl[providers])",
    "openai-responses:MODEL (OpenAI's Responses API; key from $OPENAI_API_KEY; twinrl[providers])",
    "hf:PATH|smollm2 (a local model through the trainer)",
)


# What the ``train`` extra installs: the ``hf:`` policy (the trainer's model) needs them.
_TRAIN_PACKAGES = frozenset({"torch", "transformers", "tokenizers", "peft", "gguf"})

#: Entry-point group of policy kinds: ``NAME = "module:factory"`` makes ``NAME:ARG`` a policy spec,
#: built by ``factory(spec, twin)``. twinrl's own ``hf:`` is one (``trainer.hf_policy``), so the core
#: never imports the trainer.
POLICY_ENTRY_POINT_GROUP = "twin.policies"


def policy_kinds() -> dict[str, Any]:
    """The policy kinds installed as plugins: ``{name: importlib.metadata.EntryPoint}``."""
    return {ep.name: ep for ep in entry_points(group=POLICY_ENTRY_POINT_GROUP)}


def make_policy(
    spec: str,
    twin: Any = None,
    *,
    seed: int = 0,
    base_url: str | None = None,
    api_key: str | None = None,
    **options: Any,
) -> Policy:
    """A policy from a command-line spec.

    Specs: ``random`` / ``random:SEED``, ``replay:FILE``, ``openai:MODEL``, a baseline of the
    twin (``Twin.baselines() -> {name: factory(twin) -> policy}``, e.g. ``heuristic``, ``oracle``)
    and the kinds registered in the entry-point group ``twin.policies``, e.g. ``hf:PATH`` /
    ``hf:smollm2`` (twinrl's ``trainer.hf_policy.HFPolicy.from_spec(spec, twin)``).

    Args:
        spec: The spec.
        twin: The twin the policy will act in (baselines and ``hf:`` need it).
        seed: Seed of ``random``.
        base_url: Base URL of ``openai:`` (default ``$OPENAI_BASE_URL``).
        api_key: API key of ``openai:`` (default ``$OPENAI_API_KEY``).
        **options: Passed to :class:`OpenAIChatPolicy` (``temperature``, ``max_tokens``, ...).

    Raises:
        ConfigError: an unknown spec; the message lists every allowed form.
    """
    kind, _, arg = spec.partition(":")
    baselines = _baselines(twin)
    if spec in baselines:
        return baselines[spec](twin)
    if kind == "random":
        try:
            return RandomPolicy(seed=int(arg) if arg else seed, name=spec)
        except ValueError:
            raise ConfigError(
                f"policy {spec!r}: the seed after 'random:' must be an integer"
            ) from None
    if kind == "replay" and arg:
        return ReplayPolicy.from_file(arg)
    if kind == "openai" and arg:
        return OpenAIChatPolicy(base_url=base_url, model=arg, api_key=api_key, **options)
    if kind in ("anthropic", "openai-responses") and arg:
        from twin.providers import make_provider_policy

        return make_provider_policy(kind, arg, base_url=base_url, api_key=api_key, **options)
    plugins = policy_kinds()
    if kind in plugins and arg:
        try:  # the plugin may import its libraries when loaded or only when it builds
            return plugins[kind].load()(spec, twin)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] not in _TRAIN_PACKAGES:
                raise ConfigError(
                    f"policy {spec!r} needs {plugins[kind].value} (entry point {kind!r} of "
                    f"{POLICY_ENTRY_POINT_GROUP!r}), which could not be imported ({exc})"
                ) from None
            raise ConfigError(
                f"policy {spec!r} runs a local model and needs {exc.name}, which is not "
                "installed; install the training extra: pip install 'twinrl[train]'"
            ) from None
    forms = list(POLICY_FORMS) + [f"{name} (a baseline of this twin)" for name in baselines]
    forms += [
        f"{name}:... (plugin {ep.value})" for name, ep in sorted(plugins.items()) if name != "hf"
    ]
    raise ConfigError(f"unknown policy spec {spec!r}; allowed: " + "; ".join(forms))


def _baselines(twin: Any) -> dict[str, Any]:
    if twin is None:  # make_policy without a twin: only the generic forms
        return {}
    return dict(twin.baselines() or {})

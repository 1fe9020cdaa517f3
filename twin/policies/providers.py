"""Hosted-model providers through their own client libraries: Anthropic's Messages API and
OpenAI's Responses API.

::

    twin eval returns --policy anthropic:claude-sonnet-4-5          # $ANTHROPIC_API_KEY
    twin eval returns --policy openai-responses:gpt-5-mini          # $OPENAI_API_KEY

Each is a :class:`twin.policies.Policy` built on the provider's official SDK (``anthropic``,
``openai``; ``pip install 'twinrl[providers]'``): the SDK owns the wire format, retries with
backoff (honouring ``Retry-After``) and connection handling. What twinrl adds is the translation
between the chat the twin keeps (OpenAI chat messages with ``tool_calls``) and the provider's
form, a deadline for each whole request (``timeout``), and :class:`twin.policies.PolicyError`
with the ``twin eval`` flag that fixes a failure. Any OpenAI-compatible chat server (vLLM,
llama.cpp, ``twin serve``, OpenAI's chat completions) stays on ``openai:`` (plain httpx: no SDK
needed, so ``pip install twinrl`` alone evaluates against a local server).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from typing import Any

from twin.errors import ConfigError, MissingDependencyError
from twin.policies.chat_wire import PolicyError, wire_messages
from twin.protocols import Message

__all__ = ["PROVIDER_KINDS", "AnthropicPolicy", "OpenAIResponsesPolicy"]

#: Policy-spec kinds served here: ``KIND:MODEL``.
PROVIDER_KINDS = ("anthropic", "openai-responses")
_INSTALL = "pip install 'twinrl[providers]'"


def _sdk(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        raise MissingDependencyError(
            f"the {name}: policy uses the {name} SDK, which is not installed: {_INSTALL}"
        ) from None


class _SDKPolicy:
    """What the SDK-backed policies share: settings, usage figures, deadline, error mapping."""

    kind = ""
    key_env = ""

    def __init__(
        self,
        model: str,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 1024,
        timeout: float = 120.0,
        retries: int = 3,
        extra_body: dict[str, Any] | None = None,
        top_p: float | None = None,
        name: str | None = None,
    ) -> None:
        if timeout <= 0 or max_tokens < 1 or retries < 0:
            raise ConfigError(
                f"{self.kind} policy: need timeout > 0, max_tokens >= 1 and retries >= 0; got "
                f"timeout={timeout}, max_tokens={max_tokens}, retries={retries}"
            )
        self.model = model
        self.base_url = base_url
        self.api_key = api_key if api_key is not None else os.environ.get(self.key_env)
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.retries = retries
        self.extra_body = dict(extra_body or {})
        self.name = name or f"{self.kind}:{model}"
        self.usage = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "retries": 0}
        self.in_flight = 0
        self.dropped: set[str] = set()
        self._client_obj: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> Any:
        # An SDK client's connection pool belongs to the loop that opened it (see OpenAIChatPolicy).
        loop = asyncio.get_running_loop()
        if self._client_obj is None or self._loop is not loop:
            self._client_obj = self._make_client()
            self._loop = loop
        return self._client_obj

    def _make_client(self) -> Any:  # pragma: no cover - each provider's own
        raise NotImplementedError

    async def _request(self, call: Any, kwargs: dict[str, Any]) -> Any:
        """``await call(**kwargs)`` within the deadline; a refused temperature/top_p is left out
        once and the request sent again (reasoning models take only their defaults)."""
        sdk = _sdk(self.sdk_name)
        self.in_flight += 1
        try:
            for _ in range(3):
                try:
                    return await asyncio.wait_for(call(**kwargs), timeout=self.timeout)
                except sdk.BadRequestError as exc:
                    sampling = kwargs.get("extra_body") or {}
                    refused = next(
                        (
                            p
                            for p in ("temperature", "top_p")
                            if (p in kwargs or p in sampling) and p in str(exc.message)
                        ),
                        None,
                    )
                    if refused is None or refused in self.extra_body:
                        raise self._error(exc) from exc
                    self.dropped.add(refused)
                    kwargs.pop(refused, None)
                    sampling.pop(refused, None)
                except (asyncio.TimeoutError, sdk.APITimeoutError) as exc:
                    raise PolicyError(
                        f"{self.name}: no reply within {self.timeout:g} s; the model may be slow "
                        f"or writing up to max_tokens={self.max_tokens} tokens",
                        hint="raise --timeout (seconds per request) or lower --max-tokens",
                        cause="ReadTimeout",
                    ) from exc
                except sdk.APIError as exc:
                    raise self._error(exc) from exc
            raise PolicyError(f"{self.name}: the server refused every form of the request")
        finally:
            self.in_flight -= 1

    def _error(self, exc: Any) -> PolicyError:
        status = getattr(exc, "status_code", None)
        where = self.base_url or "the provider's API"
        if status is None:  # connection errors (after the SDK's retries)
            return PolicyError(
                f"{self.name}: cannot reach {where}: {type(exc).__name__}: {exc}",
                hint="check --base-url and the network",
            )
        hint = {
            401: f"pass --api-key (or set ${self.key_env})",
            403: "the key is not allowed to use this model",
            404: f"check the model name after {self.kind}: and --base-url",
            429: "rate limited: lower --concurrency or raise --retries",
        }.get(status)
        if hint is None and status >= 500:
            hint = "the provider is overloaded or failing: lower --concurrency or raise --retries"
        body = " ".join(_server_words(exc).split())[:500]
        return PolicyError(
            f"{self.name} at {where} -> HTTP {status}: {body}", hint=hint, cause=f"HTTP {status}"
        )

    def _count(self, prompt_tokens: Any, completion_tokens: Any) -> None:
        self.usage["requests"] += 1
        self.usage["prompt_tokens"] += int(prompt_tokens or 0)
        self.usage["completion_tokens"] += int(completion_tokens or 0)

    def progress(self) -> dict[str, Any]:
        """Live figures for a progress bar: requests in flight and completion tokens received."""
        return {"in_flight": self.in_flight, "tokens": self.usage["completion_tokens"]}

    async def aclose(self) -> None:
        """Close the SDK client (call from the loop that used it)."""
        if self._client_obj is not None:
            await self._client_obj.close()
        self._client_obj, self._loop = None, None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model={self.model!r}, base_url={self.base_url!r})"


def _server_words(exc: Any) -> str:
    """The server's own error message from an SDK exception (its JSON ``error.message``)."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
    return str(getattr(exc, "message", exc))


# -- Anthropic Messages API ---------------------------------------------------------------------
class AnthropicPolicy(_SDKPolicy):
    """Claude through Anthropic's Messages API (the ``anthropic`` SDK).

    Args:
        model: The model, e.g. ``claude-sonnet-4-5``.
        base_url: API root (default ``$ANTHROPIC_BASE_URL``, else Anthropic's); a trailing
            ``/v1`` is allowed.
        api_key: The key (default ``$ANTHROPIC_API_KEY``).
        temperature, max_tokens, timeout, retries, top_p: As :class:`twin.policies.OpenAIChatPolicy`
            (``timeout`` is a deadline per request; ``retries`` are the SDK's).
        extra_body: Merged into each request body.
        name: Name recorded in trajectories (default ``anthropic:<model>``).
    """

    kind = "anthropic"
    key_env = "ANTHROPIC_API_KEY"
    sdk_name = "anthropic"

    def _make_client(self) -> Any:
        sdk = _sdk("anthropic")
        base = self.base_url or os.environ.get("ANTHROPIC_BASE_URL")
        if base:
            base = base.rstrip("/").removesuffix("/v1")
        return sdk.AsyncAnthropic(
            api_key=self.api_key or "unset",
            base_url=base,
            timeout=self.timeout,
            max_retries=self.retries,
        )

    def request(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]
    ) -> dict[str, Any]:
        """The keyword arguments of ``messages.create`` for one turn."""
        system, chat = anthropic_messages(messages)
        kwargs: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "messages": chat,
        }
        if system:
            kwargs["system"] = system
        # The SDK no longer types sampling parameters (newer models fix them); the API still
        # takes them where a model allows, and a refusal leaves them out (see _request).
        sampling: dict[str, Any] = {"temperature": self.temperature}
        if self.top_p is not None:
            sampling["top_p"] = self.top_p
        if tools:
            kwargs["tools"] = [
                {
                    "name": t["function"]["name"],
                    "description": t["function"].get("description", ""),
                    "input_schema": t["function"].get("parameters") or {"type": "object"},
                }
                for t in tools
            ]
        for name in self.dropped:
            sampling.pop(name, None)
        kwargs["extra_body"] = {**sampling, **self.extra_body}
        return kwargs

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """One Messages API call; ``tool_use`` blocks become ``tool_calls``."""
        client = self._client()
        reply = await self._request(client.messages.create, self.request(messages, tools))
        usage = getattr(reply, "usage", None)
        self._count(getattr(usage, "input_tokens", 0), getattr(usage, "output_tokens", 0))
        texts, calls = [], []
        for block in reply.content:
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "tool_use":
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {
                            "name": block.name,
                            "arguments": json.dumps(block.input, ensure_ascii=False),
                        },
                    }
                )
        out: Message = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            out["tool_calls"] = calls
        return out


def anthropic_messages(messages: Sequence[Message]) -> tuple[str, list[dict[str, Any]]]:
    """The chat as the Messages API takes it: the system text apart, ``tool_calls`` as
    ``tool_use`` blocks, tool results as ``tool_result`` blocks in the next user turn, and
    consecutive turns of one role merged (the API wants user and assistant to alternate)."""
    system: list[str] = []
    out: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for m in wire_messages(messages):
        role, content = m.get("role"), m.get("content")
        if role == "system":
            system.append(str(content or ""))
        elif role == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError):
                    args = {"_unparsed": fn.get("arguments")}
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call.get("id"),
                        "name": fn.get("name"),
                        "input": args if isinstance(args, dict) else {"value": args},
                    }
                )
            add("assistant", blocks or [{"type": "text", "text": "(no text)"}])
        elif role == "tool":
            add(
                "user",
                [
                    {
                        "type": "tool_result",
                        "tool_use_id": m.get("tool_call_id"),
                        "content": str(content or ""),
                    }
                ],
            )
        else:
            add("user", [{"type": "text", "text": str(content or "")}])
    return "\n\n".join(system), out


# -- OpenAI Responses API -----------------------------------------------------------------------
class OpenAIResponsesPolicy(_SDKPolicy):
    """OpenAI's Responses API (the ``openai`` SDK): the API OpenAI's reasoning models are built
    for. Arguments as :class:`AnthropicPolicy`; the key defaults to ``$OPENAI_API_KEY``, the base
    URL to ``$OPENAI_BASE_URL`` (else OpenAI's); ``max_tokens`` is sent as ``max_output_tokens``.
    """

    kind = "openai-responses"
    key_env = "OPENAI_API_KEY"
    sdk_name = "openai"

    def _make_client(self) -> Any:
        sdk = _sdk("openai")
        return sdk.AsyncOpenAI(
            api_key=self.api_key or "unset",
            base_url=self.base_url or os.environ.get("OPENAI_BASE_URL"),
            timeout=self.timeout,
            max_retries=self.retries,
        )

    def request(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]
    ) -> dict[str, Any]:
        """The keyword arguments of ``responses.create`` for one turn."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "input": responses_input(messages),
            "max_output_tokens": self.max_tokens,
            "temperature": self.temperature,
            "store": False,
        }
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if tools:
            kwargs["tools"] = [
                {
                    "type": "function",
                    "name": t["function"]["name"],
                    "description": t["function"].get("description", ""),
                    "parameters": t["function"].get("parameters") or {"type": "object"},
                }
                for t in tools
            ]
        for name in self.dropped:
            kwargs.pop(name, None)
        if self.extra_body:
            kwargs["extra_body"] = dict(self.extra_body)
        return kwargs

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """One Responses API call; ``function_call`` items become ``tool_calls``."""
        client = self._client()
        reply = await self._request(client.responses.create, self.request(messages, tools))
        usage = getattr(reply, "usage", None)
        self._count(getattr(usage, "input_tokens", 0), getattr(usage, "output_tokens", 0))
        texts, calls = [], []
        for item in reply.output or []:
            if item.type == "message":
                texts.extend(
                    c.text for c in item.content if getattr(c, "type", "") == "output_text"
                )
            elif item.type == "function_call":
                calls.append(
                    {
                        "id": item.call_id,
                        "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments},
                    }
                )
        out: Message = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            out["tool_calls"] = calls
        return out


def responses_input(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The chat as Responses API input items (``function_call`` / ``function_call_output``)."""
    items: list[dict[str, Any]] = []
    for m in wire_messages(messages):
        role, content = m.get("role"), m.get("content")
        if role == "assistant":
            if content:
                items.append({"role": "assistant", "content": str(content)})
            for call in m.get("tool_calls") or []:
                fn = call.get("function") or {}
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call.get("id"),
                        "name": fn.get("name"),
                        "arguments": fn.get("arguments") or "{}",
                    }
                )
        elif role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": m.get("tool_call_id"),
                    "output": str(content or ""),
                }
            )
        else:
            items.append(
                {
                    "role": role if role in ("system", "user") else "user",
                    "content": str(content or ""),
                }
            )
    return items


def make_provider_policy(kind: str, model: str, **options: Any) -> _SDKPolicy:
    """The policy of spec ``KIND:MODEL`` for a kind in :data:`PROVIDER_KINDS`."""
    cls = {"anthropic": AnthropicPolicy, "openai-responses": OpenAIResponsesPolicy}[kind]
    _sdk(cls.sdk_name)  # a missing SDK fails here, before any episode starts
    return cls(model, **options)

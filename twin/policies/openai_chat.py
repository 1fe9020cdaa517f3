"""``openai:MODEL``: :class:`OpenAIChatPolicy`, any OpenAI-compatible ``/chat/completions``
server over httpx, with retries and errors that name the ``twin eval`` flag that fixes them."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Sequence
from typing import Any

import httpx

from twin.errors import ConfigError
from twin.policies.chat_wire import PolicyError, wire_messages
from twin.policies.http import tls_context
from twin.protocols import Message

__all__ = ["OpenAIChatPolicy"]


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
            except (asyncio.TimeoutError, httpx.ReadTimeout, httpx.WriteTimeout) as exc:
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

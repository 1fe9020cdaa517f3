"""A judge: a model asked for a verdict, behind a content-hash cache and a per-step budget.

The judge is any policy spec the project understands (``openai:MODEL`` against any
OpenAI-compatible server, ``hf:smollm2`` locally, a plugin kind), made by
:func:`twin.policies.make_policy` on first use and asked with plain chat messages (no tools)::

    judge = Judge("openai:gpt-4o-mini", base_url="http://127.0.0.1:8000/v1",
                  max_calls_per_step=256, max_tokens_per_step=200_000)
    answers = judge.ask_many([[{"role": "user", "content": "Rate 1-5: ..."}], ...])

- **Cache.** Every answer is kept in memory and on disk (``cache_dir``, default
  ``$TWINRL_CACHE/judge`` or ``~/.cache/twinrl/judge``; None: memory only), keyed by the SHA-256
  of the judge's identity and the request. Asking again costs no call.
- **Budget.** ``max_calls_per_step`` and ``max_tokens_per_step`` bound the calls a step may
  issue (tokens = the request's estimated prompt tokens + ``max_tokens``, counted before the
  call, so a step never spends past its budget). A request past the budget raises
  :class:`JudgeBudgetError` before anything is sent; the answers already received stay cached,
  and the caller's episodes are untouched, so scoring again after :meth:`Judge.new_step` (or
  with a larger budget) finishes the work at the cost of the missing calls only.
- **Concurrency.** :meth:`Judge.ask_many` sends the uncached requests together (at most
  ``concurrency`` in flight) on the judge's own event loop, in a background thread, so a
  synchronous reward term can use it from any thread, inside or outside an event loop.
- **Failures.** A request that gets no answer within ``timeout`` seconds is asked again, and an
  answer the caller's parser rejects is followed up (the judge sees its answer and what was
  wrong with it), up to ``retries`` times; then :class:`JudgeError` says what the judge said.
  Nothing is scored as 0 silently. The answer is cached under the original request.

Tests and the rollout kit swap the judge for a recorded one with :func:`judge_override`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from twin.errors import ConfigError, TwinError

__all__ = [
    "Judge",
    "JudgeAnswer",
    "JudgeBudgetError",
    "JudgeError",
    "JudgeLike",
    "default_cache_dir",
    "estimate_tokens",
    "judge_override",
    "prompt_key",
]

Messages = list[dict[str, Any]]
#: ``parse(text) -> value``; raises ``ValueError`` when the answer is malformed.
Parser = Callable[[str], Any]


class JudgeError(TwinError):
    """The judge gave no usable answer (timeouts, malformed answers, a failing server)."""


class JudgeBudgetError(JudgeError):
    """A step would issue more judge calls or tokens than its budget allows."""


@dataclass(frozen=True)
class JudgeAnswer:
    """One answer of the judge.

    Attributes:
        key: The cache key (SHA-256 of the judge's identity and the request).
        prompt_key: SHA-256 of the request's messages only (what a recorded judge matches).
        text: What the judge wrote.
        cached: True when it came from the cache (no call was issued).
        judge: The judge's spec.
    """

    key: str
    prompt_key: str
    text: str
    cached: bool
    judge: str

    def record(self, limit: int = 2000) -> dict[str, Any]:
        """A JSON-able record of the answer to store with the episode."""
        text = self.text if len(self.text) <= limit else self.text[:limit] + "..."
        return {
            "judge": self.judge,
            "key": self.key,
            "prompt_key": self.prompt_key,
            "answer": text,
            "cached": self.cached,
        }


class JudgeLike(Protocol):
    """What judge terms call: a judge, or a stand-in (a recorded judge in tests)."""

    spec: str

    def ask_many(
        self, requests: Sequence[Messages], parse: Parser | Sequence[Parser | None] | None = None
    ) -> list[JudgeAnswer]:
        """Answer every request, in order."""
        ...


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def prompt_key(messages: Messages) -> str:
    """SHA-256 of a request's messages (role and content only): the same on every machine."""
    plain = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
    return hashlib.sha256(_canonical(plain).encode()).hexdigest()


def estimate_tokens(messages: Messages) -> int:
    """A cheap, conservative token count of a request: one token per 3 characters, plus 4 per
    message (the budget is checked before the call, when no tokenizer count exists)."""
    return sum(len(str(m.get("content") or "")) // 3 + 4 for m in messages)


def default_cache_dir() -> Path:
    """``$TWINRL_CACHE/judge`` or ``~/.cache/twinrl/judge``."""
    root = Path(os.environ.get("TWINRL_CACHE") or Path.home() / ".cache" / "twinrl")
    return root / "judge"


# A recorded judge (tests, the rollout kit) replaces every judge while the context is active.
_OVERRIDE: contextvars.ContextVar[JudgeLike | None] = contextvars.ContextVar(
    "judge_override", default=None
)


@contextlib.contextmanager
def judge_override(judge: JudgeLike) -> Iterator[JudgeLike]:
    """Within the block, every judge term of this thread asks ``judge`` instead of its own."""
    token = _OVERRIDE.set(judge)
    try:
        yield judge
    finally:
        _OVERRIDE.reset(token)


def active_judge(own: JudgeLike) -> JudgeLike:
    """The judge a term asks: the override when one is active, else its own."""
    return _OVERRIDE.get() or own


class _LoopThread:
    """One event loop in a daemon thread: sync callers submit coroutines to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="judge-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


@dataclass
class _Usage:
    step: int = 0
    calls: int = 0
    tokens: int = 0
    total_calls: int = 0
    cache_hits: int = 0


@dataclass
class Judge:
    """A judge model with a cache, a budget and bounded retries (see the module docstring).

    Args:
        spec: Policy spec of the judge, e.g. ``openai:gpt-4o-mini`` or ``hf:smollm2,temperature=0``.
        base_url: Server root of ``openai:`` specs (default ``$OPENAI_BASE_URL``).
        api_key: Key of ``openai:`` specs (default ``$OPENAI_API_KEY``).
        max_tokens: Most tokens per answer.
        temperature: Sampling temperature (``openai:`` specs; ``hf:`` takes it in the spec).
        timeout: Seconds to wait for one answer.
        retries: Extra attempts after a timeout or a malformed answer (bounded).
        concurrency: Most requests in flight at once.
        max_calls_per_step: Most calls one step may issue (None: unbounded).
        max_tokens_per_step: Most estimated tokens (prompt + ``max_tokens``) one step may
            spend (None: unbounded).
        cache_dir: Folder of the disk cache (default :func:`default_cache_dir`; None: memory only).
        policy: A ready policy (anything with async ``act(messages, tools)``) instead of
            making one from ``spec``; tests use it.
    """

    spec: str
    base_url: str | None = None
    api_key: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    timeout: float = 60.0
    retries: int = 1
    concurrency: int = 8
    max_calls_per_step: int | None = None
    max_tokens_per_step: int | None = None
    cache_dir: Path | str | None = field(default_factory=default_cache_dir)
    policy: Any = None
    usage: _Usage = field(default_factory=_Usage, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, str) or ":" not in self.spec and self.policy is None:
            raise ConfigError(
                "judge spec must be a policy spec such as 'openai:MODEL' or 'hf:smollm2', got "
                f"{self.spec!r}"
            )
        if self.timeout <= 0 or self.max_tokens < 1 or self.retries < 0 or self.concurrency < 1:
            raise ConfigError(
                "judge: need timeout > 0, max_tokens >= 1, retries >= 0 and concurrency >= 1; got "
                f"timeout={self.timeout}, max_tokens={self.max_tokens}, retries={self.retries}, "
                f"concurrency={self.concurrency}"
            )
        for name in ("max_calls_per_step", "max_tokens_per_step"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(
                    f"judge: {name} must be a positive integer or None, got {value!r}"
                )
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir)
        self._memory: dict[str, str] = {}
        self._lock = threading.Lock()
        self._loop: _LoopThread | None = None

    # -- identity and cache ------------------------------------------------------------------
    @property
    def identity(self) -> dict[str, Any]:
        """What, besides the request, decides the answer (part of every cache key)."""
        return {
            "spec": self.spec,
            "base_url": self.base_url or os.environ.get("OPENAI_BASE_URL"),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }

    def key(self, messages: Messages) -> str:
        """The cache key of a request."""
        return hashlib.sha256(
            _canonical([self.identity, prompt_key(messages)]).encode()
        ).hexdigest()

    def _cache_path(self, key: str) -> Path | None:
        return None if self.cache_dir is None else Path(self.cache_dir) / key[:2] / f"{key}.json"

    def cached(self, messages: Messages) -> str | None:
        """The cached answer of a request, or None."""
        key = self.key(messages)
        with self._lock:
            if key in self._memory:
                return self._memory[key]
        path = self._cache_path(key)
        if path is not None and path.is_file():
            try:
                text = json.loads(path.read_text(encoding="utf-8"))["answer"]
            except (OSError, ValueError, KeyError, TypeError):
                return None  # a torn or foreign file: ask again and overwrite it
            if isinstance(text, str):
                with self._lock:
                    self._memory[key] = text
                return text
        return None

    def _store(self, messages: Messages, text: str) -> None:
        key = self.key(messages)
        with self._lock:
            self._memory[key] = text
        path = self._cache_path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        record = {
            "judge": self.identity,
            "prompt_key": prompt_key(messages),
            "messages": messages,
            "answer": text,
        }
        tmp.write_text(_canonical(record), encoding="utf-8")
        os.replace(tmp, path)  # atomic: concurrent writers of one key leave one whole file

    # -- budget ------------------------------------------------------------------------------
    def new_step(self) -> None:
        """Start a new step: the per-step call and token counts go back to 0."""
        with self._lock:
            self.usage.step += 1
            self.usage.calls = 0
            self.usage.tokens = 0

    def _reserve(self, messages: Messages, pending: int) -> None:
        cost = estimate_tokens(messages) + self.max_tokens
        with self._lock:
            u = self.usage
            over = []
            if self.max_calls_per_step is not None and u.calls + 1 > self.max_calls_per_step:
                over.append(
                    f"call {u.calls + 1} (of a batch of {pending}) > "
                    f"max_calls_per_step={self.max_calls_per_step}"
                )
            if self.max_tokens_per_step is not None and u.tokens + cost > self.max_tokens_per_step:
                over.append(
                    f"{u.tokens} + {cost} estimated tokens > "
                    f"max_tokens_per_step={self.max_tokens_per_step}"
                )
            if over:
                raise JudgeBudgetError(
                    f"judge {self.spec!r} is over its budget for step {u.step}: {'; '.join(over)}. "
                    f"Nothing past the budget was sent; the {u.calls} answers of this step are "
                    "cached and the episodes are unchanged: raise the budget (max_calls_per_step, "
                    "max_tokens_per_step) or call judge.new_step(), then score again"
                )
            u.calls += 1
            u.tokens += cost
            u.total_calls += 1

    # -- asking ------------------------------------------------------------------------------
    def _policy(self) -> Any:
        if self.policy is None:
            from twin.policies import make_policy  # the project's spec resolution

            options: dict[str, Any] = {}
            if self.spec.startswith("openai:"):
                options = {
                    "max_tokens": self.max_tokens,
                    "temperature": self.temperature,
                    "timeout": self.timeout,
                    "retries": 0,
                }
            self.policy = make_policy(
                self.spec, None, base_url=self.base_url, api_key=self.api_key, **options
            )
        return self.policy

    async def _ask_one(
        self, messages: Messages, parse: Parser | None, gate: asyncio.Semaphore, pending: int
    ) -> str:
        problems: list[str] = []
        asked = list(messages)
        for _attempt in range(self.retries + 1):
            self._reserve(asked, pending)
            async with gate:
                try:
                    reply = await asyncio.wait_for(
                        self._policy().act(list(asked), []), self.timeout
                    )
                except asyncio.TimeoutError:
                    problems.append(f"no answer within {self.timeout:g} s")
                    continue
                except JudgeError:
                    raise
                except TwinError as exc:
                    problems.append(f"{type(exc).__name__}: {exc}")
                    continue
            text = reply.get("content") if isinstance(reply, dict) else None
            if not isinstance(text, str):
                problems.append(f"an answer without text ({str(reply)[:200]!r})")
                continue
            if parse is not None:
                try:
                    parse(text)
                except ValueError as exc:
                    problems.append(f"a malformed answer {text[:200]!r} ({exc})")
                    # ask again with the judge's own answer and what was wrong with it: at
                    # temperature 0 the same request would only get the same answer
                    asked = [
                        *messages,
                        {"role": "assistant", "content": text[:2000]},
                        {
                            "role": "user",
                            "content": f"That answer could not be read: {exc}. "
                            "Answer again in the required format.",
                        },
                    ]
                    continue
            self._store(messages, text)
            return text
        raise JudgeError(
            f"judge {self.spec!r} gave no usable answer after {self.retries + 1} attempt(s): "
            + "; ".join(problems)
            + ". Check the judge server, raise `timeout`/`retries`, or make the rubric's answer "
            "format clearer"
        )

    async def _ask_all(
        self, requests: Sequence[Messages], parsers: Sequence[Parser | None]
    ) -> list[str]:
        gate = asyncio.Semaphore(self.concurrency)
        tasks = [
            asyncio.ensure_future(self._ask_one(m, p, gate, len(requests)))
            for m, p in zip(requests, parsers)
        ]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [d for d in done if isinstance(d, BaseException)]
        if errors:  # the answers that did come are cached; report the first failure
            budget = [e for e in errors if isinstance(e, JudgeBudgetError)]
            raise (budget or errors)[0]
        return list(done)  # type: ignore[arg-type]

    def ask_many(
        self, requests: Sequence[Messages], parse: Parser | Sequence[Parser | None] | None = None
    ) -> list[JudgeAnswer]:
        """Answer every request, in order: cached ones at no cost, the others concurrently.

        Args:
            requests: Chat requests (lists of ``{"role", "content"}`` messages).
            parse: Checks an answer (one for all requests, or one per request); a ``ValueError``
                makes it malformed (asked again, bounded).

        Raises:
            JudgeBudgetError: the uncached requests do not fit the step's budget (nothing past
                it was sent; the answers received are cached).
            JudgeError: a request got no usable answer after the retries.
        """
        requests = [list(m) for m in requests]
        parsers = list(parse) if isinstance(parse, (list, tuple)) else [parse] * len(requests)
        if len(parsers) != len(requests):
            raise ConfigError(f"judge: {len(parsers)} parsers for {len(requests)} requests")
        texts: list[str | None] = [self.cached(m) for m in requests]
        hits = sum(t is not None for t in texts)
        with self._lock:
            self.usage.cache_hits += hits
        todo: dict[str, int] = {}  # identical uncached requests are asked once
        for i, (m, t) in enumerate(zip(requests, texts)):
            if t is None:
                todo.setdefault(self.key(m), i)
        if todo:
            if self._loop is None:
                with self._lock:
                    if self._loop is None:
                        self._loop = _LoopThread()
            asked = [requests[i] for i in todo.values()]
            answers = self._loop.run(self._ask_all(asked, [parsers[i] for i in todo.values()]))
            by_key = dict(zip(todo, answers))
            texts = [t if t is not None else by_key[self.key(m)] for m, t in zip(requests, texts)]
        fresh = set(todo)
        out = []
        for m, t in zip(requests, texts):
            key = self.key(m)
            out.append(
                JudgeAnswer(
                    key=key,
                    prompt_key=prompt_key(m),
                    text=str(t),
                    cached=key not in fresh,
                    judge=self.spec,
                )
            )
            fresh.discard(key)  # a duplicate of an asked request is served from the cache
        return out

    def ask(self, messages: Messages, parse: Parser | None = None) -> JudgeAnswer:
        """Answer one request (see :meth:`ask_many`)."""
        return self.ask_many([messages], parse)[0]

"""The completions server of ``twin serve``: requests in, batches to the engine, vLLM's answers out.

It speaks the part of vLLM's API the trainer uses (see ``docs/serving.md``), with the same request
and response shapes and the same status codes, so a run can switch between this server (CPU, tests)
and ``vllm serve`` (GPU) by changing a URL:

- ``POST /v1/completions``: ``prompt`` as token ids (``[ids]`` or ``[[ids], ...]``) or text;
  ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``n``, ``logprobs``, ``prompt_logprobs``,
  ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``, ``return_tokens_as_token_ids``,
  ``model`` (the base name or a loaded adapter's name).
- ``GET /v1/models``: the base model and every loaded adapter.
- ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}`` and
  ``POST /v1/unload_lora_adapter {"lora_name"}``: an existing name is 400 unless ``load_inplace``,
  a path without an adapter is 404, an unknown adapter in a request is 404
  (``trainer/serving/lora.py``).
- ``GET /health``.

Every body is validated against :class:`~trainer.serving.api.ServeLimits` (400 with the field and
what is allowed); the HTTP layer and the optional API key are in ``trainer/serving/http.py``.

One worker thread owns the model: it takes up to ``max_batch_rows`` rows of the oldest request
plus the queued requests of the same adapter that fit (a larger request goes back to the end of
the queue with the rows it has left), sets that adapter and samples the batch with the engine
(``trainer/serving/engine.py``: per-row temperature, top-p, length and seed; logprobs of the
sampled tokens from the same logits it sampled from).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.serving.api import (
    LogprobsMode,
    ServeLimits,
    ServerError,
    completion_request_model,
    validate,
)
from trainer.serving.engine import Engine, Row
from trainer.serving.lora import Adapter, AdapterSlots
from twin.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["CompletionServer"]

log = logging.getLogger("twinrl.serve")


@dataclass(eq=False)
class _Request:
    """One ``/v1/completions`` call, expanded into rows (prompt x n) for the worker.

    The worker samples it in chunks of at most ``max_batch_rows`` rows: ``next_row`` is the first
    row not yet given to a batch, ``rows_done`` counts the rows sampled.
    """

    adapter: Adapter | None
    prompts: list[list[int]]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_ids: frozenset[int]
    logprobs: int | None
    prompt_logprobs: int | None
    done: threading.Event = field(default_factory=threading.Event)
    result: list[Row | None] | None = None
    error: BaseException | None = None
    next_row: int = 0
    rows_done: int = 0

    @property
    def rows(self) -> int:
        """Sequences to sample: prompts x n."""
        return len(self.prompts) * self.n


class CompletionServer:
    """The model, its adapters and the batching worker; HTTP-free so tests can call it directly.

    Args:
        model: A transformers causal LM (``PreTrainedModel``); peft adapters are added to it.
        tokenizer: Its tokenizer (text prompts, ``text`` in responses, eos id).
        model_name: The name requests use for the base model (vLLM's ``--served-model-name``).
        max_loras: Adapters kept resident in the model at once; others reload from disk on use.
        max_batch_rows: Most sequences sampled together in one batch.
        max_model_len: Longest prompt + completion accepted (defaults to the model config's
            ``max_position_embeddings``).
        logprobs_mode: ``processed_logprobs`` (after temperature/top-p) or ``raw_logprobs``.
        seed: Seed of the generator used by requests that give no ``seed``.
        limits: What one request may ask for (default :class:`ServeLimits` ()).
        adapter_root: Only adapters under this folder load (symlinks and ``..`` resolved first);
            None: any folder the process can read.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_name: str = "base",
        max_loras: int = 4,
        max_batch_rows: int = 64,
        max_model_len: int | None = None,
        logprobs_mode: LogprobsMode = "processed_logprobs",
        seed: int = 0,
        limits: ServeLimits | None = None,
        adapter_root: str | Path | None = None,
    ) -> None:
        if max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {max_loras}")
        if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ConfigError(
                f"logprobs_mode must be processed_logprobs or raw_logprobs, got {logprobs_mode!r}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_batch_rows = max_batch_rows
        self.logprobs_mode = logprobs_mode
        self.limits = limits or ServeLimits()
        self._request_model = completion_request_model(self.limits)
        cfg = getattr(model, "config", None)
        self.max_model_len = max_model_len or int(
            getattr(cfg, "max_position_embeddings", 0) or 1 << 30
        )
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or len(tokenizer))
        self.eos_ids = self._eos_ids()
        pad = getattr(tokenizer, "pad_token_id", None)
        pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self.engine = Engine(model, pad_id=pad_id, logprobs_mode=logprobs_mode, seed=seed)
        self.created = int(time.time())
        self._lock = threading.Lock()  # guards the adapter tables and the queue's grouping
        self._model_lock = threading.Lock()  # held while the model runs or its adapters change
        self.slots = AdapterSlots(
            model,
            model_name=model_name,
            max_loras=max_loras,
            adapter_root=Path(adapter_root).resolve() if adapter_root is not None else None,
            lock=self._lock,
            model_lock=self._model_lock,
        )
        self._queue: collections.deque[_Request] = collections.deque()
        self._wakeup = threading.Condition(self._lock)
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="twin-serve-worker", daemon=True)
        self._worker.start()

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (
            getattr(self.model, "generation_config", None),
            getattr(self.model, "config", None),
        ):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def close(self) -> None:
        """Stop the worker thread (queued requests fail)."""
        with self._lock:
            self._closed = True
            self._wakeup.notify_all()
        self._worker.join(timeout=10)

    # -- routes ----------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        """The ``GET /v1/models`` body: the base model, then the adapters in load order."""
        card = {"object": "model", "owned_by": "twinrl", "max_model_len": self.max_model_len}
        data = [
            {
                "id": self.model_name,
                "created": self.created,
                "root": self.model_name,
                "parent": None,
                **card,
            }
        ]
        for a in self.slots.listing():
            # root is the name, not the path: clients need not learn the server's folders
            data.append(
                {
                    "id": a.name,
                    "created": a.created,
                    "root": a.name,
                    "parent": self.model_name,
                    **card,
                }
            )
        return {"object": "list", "data": data}

    def load_lora_adapter(self, body: dict[str, Any]) -> str:
        """Handle ``POST /v1/load_lora_adapter`` (see :meth:`AdapterSlots.load`)."""
        return self.slots.load(body)

    def unload_lora_adapter(self, body: dict[str, Any]) -> str:
        """Handle ``POST /v1/unload_lora_adapter`` (see :meth:`AdapterSlots.unload`)."""
        return self.slots.unload(body)

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """Handle ``POST /v1/completions`` (blocking until the batch that holds it is done).

        Raises:
            ServerError: 400 for a malformed request, 404 for an unknown model name.
        """
        request, name, req = self._parse(body)
        with self._lock:
            if self._closed:
                raise ServerError("the server is shutting down", 503)
            if request.adapter is not None:
                request.adapter.pending += 1
            self._queue.append(request)
            self._wakeup.notify()
        request.done.wait()
        if request.error is not None:
            if isinstance(request.error, ServerError):
                raise request.error
            raise ServerError(
                f"generation failed: {type(request.error).__name__}: {request.error}", 500
            )
        return self._response(req, request, name)

    def _parse(self, body: dict[str, Any]) -> tuple[_Request, str, Any]:
        """Validate a completions body against the limits; the queued
        request, model name and body."""
        req = validate(self._request_model, body, "completions request")
        name = req.model or self.model_name
        adapter = self.slots.resolve(name)
        prompts = self._prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        stops = frozenset(req.stop_token_ids or ()) | (
            frozenset() if req.ignore_eos else self.eos_ids
        )
        for ids in prompts:
            if len(ids) + max_tokens > self.max_model_len:
                raise ServerError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, "
                    f"you requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                    f"{max_tokens} for the completion). Please reduce the length of the prompt or "
                    "max_tokens.",
                    400,
                )
        request = _Request(
            adapter=adapter,
            prompts=prompts,
            n=req.n or 1,
            max_tokens=max_tokens,
            temperature=_temperature(req.temperature),
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop_ids=stops,
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
        )
        return request, name, req

    def _prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Token ids of validated prompts (text is tokenized), checked against the vocabulary."""
        out = []
        for prompt in prompts:
            ids = (
                list(self.tokenizer(prompt)["input_ids"])
                if isinstance(prompt, str)
                else list(prompt)
            )
            if not ids:
                raise ServerError("a prompt is empty; give at least one token", 400)
            if len(ids) > self.limits.max_prompt_tokens:
                raise ServerError(
                    f"a prompt has {len(ids)} tokens; at most {self.limits.max_prompt_tokens} are "
                    "allowed",
                    400,
                )
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise ServerError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", 400)
            out.append(ids)
        return out

    def _response(self, req: Any, request: _Request, name: str) -> dict[str, Any]:
        as_ids, with_ids, skip_special = (
            req.return_tokens_as_token_ids,
            req.return_token_ids,
            req.skip_special_tokens,
        )
        choices = []
        prompt_tokens = completion_tokens = 0
        for index, row in enumerate(request.result or []):
            assert row is not None
            prompt = request.prompts[index // request.n]
            if index % request.n == 0:
                prompt_tokens += len(prompt)
            completion_tokens += len(row.ids)
            lp = None
            if request.logprobs is not None:
                tokens = [self._token(t, as_ids) for t in row.ids]
                offsets, pos = [], 0
                for t in tokens:
                    offsets.append(pos)
                    pos += len(t)
                lp = {
                    "text_offset": offsets,
                    "token_logprobs": row.token_logprobs,
                    "tokens": tokens,
                    "top_logprobs": [{self._token(t, as_ids): v for t, v in top} for top in row.top]
                    if request.logprobs > 0
                    else None,
                }
            choices.append(
                {
                    "index": index,
                    "text": self.tokenizer.decode(row.ids, skip_special_tokens=skip_special),
                    "logprobs": lp,
                    "finish_reason": row.finish_reason,
                    "stop_reason": None if row.stop_token in self.eos_ids else row.stop_token,
                    "prompt_logprobs": self._prompt_logprobs(row),
                    "prompt_token_ids": prompt if with_ids else None,
                    "token_ids": row.ids if with_ids else None,
                }
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None,
            },
        }

    def _token(self, token_id: int, as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _prompt_logprobs(self, row: Row) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: None for the first token, then ``{id: {logprob, rank,
        decoded_token}}``."""
        if row.prompt_lps is None:
            return None
        result: list[dict[str, Any] | None] = [None]
        for token, (value, rank, top) in zip(row.prompt[1:], row.prompt_lps, strict=True):
            entry = {
                str(token): {
                    "logprob": value,
                    "rank": rank,
                    "decoded_token": self.tokenizer.decode([token]),
                }
            }
            for r_i, (t, v) in enumerate(top, start=1):
                entry.setdefault(
                    str(t), {"logprob": v, "rank": r_i, "decoded_token": self.tokenizer.decode([t])}
                )
            result.append(entry)
        return result

    # -- the worker ------------------------------------------------------------------------------
    def _next_batch(self) -> list[tuple[_Request, int, int]] | None:
        """Wait for requests; the next batch as ``(request, first row, end row)`` slices.

        The scheduling policy (docs/security.md): the oldest request gives up to
        ``max_batch_rows`` of its rows; queued requests of the same adapter version join whole
        while they fit. A request with rows left goes to the back of the queue, so requests take
        turns in chunks and a small one waits at most one chunk of each request ahead of it.
        """
        with self._lock:
            while True:
                while not self._queue and not self._closed:
                    self._wakeup.wait()
                if self._closed:
                    for r in self._queue:
                        r.error = ServerError("the server is shutting down", 503)
                        self._finish(r)
                    self._queue.clear()
                    return None
                first = self._queue.popleft()
                if first.error is None:
                    break
                self._finish(first)  # an earlier chunk failed: the rest is not worth sampling
            end = min(first.rows, first.next_row + self.max_batch_rows)
            batch, rows = [(first, first.next_row, end)], end - first.next_row
            first.next_row = end
            rest: collections.deque[_Request] = collections.deque()
            while self._queue:
                r = self._queue.popleft()
                size = r.rows - r.next_row
                if (
                    r.adapter is first.adapter
                    and r.error is None
                    and rows + size <= self.max_batch_rows
                ):
                    batch.append((r, r.next_row, r.rows))
                    r.next_row = r.rows
                    rows += size
                else:
                    rest.append(r)
            if first.next_row < first.rows:
                rest.append(first)
            self._queue = rest
            return batch

    def _finish(self, request: _Request) -> None:
        """Release a request's adapter and wake its caller. Holds the lock."""
        if request.adapter is not None:
            request.adapter.pending -= 1
        request.done.set()

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                with self._model_lock:
                    self.slots.activate(batch[0][0].adapter)
                    self._run(batch)
            except BaseException as exc:
                log.exception("generation failed")
                for r, _, _ in batch:
                    r.error = exc
            finally:
                with self._lock:
                    finished = []
                    for r, start, end in batch:
                        r.rows_done += end - start
                        if r.rows_done == r.rows or (r.error is not None and r not in self._queue):
                            finished.append(r)
                    for r in finished:
                        if r.adapter is not None:
                            r.adapter.pending -= 1
                with self._model_lock:
                    self.slots.collect()
                for r in finished:
                    r.done.set()

    def _run(self, batch: list[tuple[_Request, int, int]]) -> None:
        rows: list[Row] = []
        for r, start, end in batch:
            if r.result is None:
                r.result = [None] * r.rows
            for index in range(start, end):
                gen = None
                if r.seed is not None:
                    # Each row gets its own stream: the same request gives the same bytes
                    # whatever else shares its batch (or however it is chunked).
                    gen = torch.Generator(device="cpu").manual_seed(_row_seed(r.seed, index))
                row = Row(
                    prompt=r.prompts[index // r.n],
                    max_tokens=r.max_tokens,
                    temperature=r.temperature,
                    top_p=r.top_p,
                    generator=gen,
                    stop_ids=r.stop_ids,
                    logprobs=r.logprobs,
                    prompt_logprobs=r.prompt_logprobs,
                )
                r.result[index] = row
                rows.append(row)
        self.engine.decode(rows)


def _row_seed(seed: int, row: int) -> int:
    """The seed of one row of a seeded request, kept in the range torch generators take."""
    value = seed + 1_000_003 * row
    return value if value < 1 << 64 else value % (1 << 64)


#: Temperatures below this sample greedily, as in vLLM (``_SAMPLING_EPS``): dividing logits by
#: less overflows float32 to infinity, and the logprobs to NaN.
SAMPLING_EPS = 1e-5


def _temperature(value: float | None) -> float:
    if value is None:
        return 1.0
    return 0.0 if value < SAMPLING_EPS else value

"""``twin serve MODEL``: a small OpenAI-compatible completions server over transformers.

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
  a path without an adapter is 404, an unknown adapter in a request is 404.
- ``GET /health``.

Every body is validated against :class:`ServeLimits` (400 with the field and what is allowed);
the HTTP layer and the optional API key are in ``trainer/serving_http.py``. With an adapter root,
only adapters under it load. See ``docs/security.md``.

Adapters are peft LoRA adapters on one copy of the base model. One worker thread owns the model:
it takes up to ``max_batch_rows`` rows of the oldest request plus the queued requests of the same
adapter that fit (a larger request goes back to the end of the queue with the rows it has left),
sets that adapter, and samples with
its own decoding loop (per-row temperature, top-p, length and seed; logprobs of the sampled tokens
from the same logits it sampled from). An adapter is resolved when its request arrives, so a
request finishes on the adapter it started with even if the name is unloaded or replaced
meanwhile. At most ``max_loras`` adapters stay resident; others are reloaded from disk on use.

Logprobs are ``processed_logprobs`` by default (after temperature and top-p, the distribution that
was sampled from: what the learner recomputes), or ``raw_logprobs`` (before them, vLLM's default).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ValidationError

from trainer.serving_http import (
    API_KEY_ENV,
    LoadAdapterRequest,
    ServeLimits,
    ServerError,
    UnloadAdapterRequest,
    completion_request_model,
    exposure_warnings,
    make_http_server,
    validation_message,
)
from twin.errors import ConfigError, TwinError
from twin.http import tls_context

__all__ = [
    "CompletionServer",
    "ManagedServer",
    "ServerError",
    "ServerProcess",
    "ServeLimits",
    "free_port",
    "main",
    "make_http_server",
]

log = logging.getLogger("twinrl.serve")

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


# -- adapters -------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Adapter:
    """One loaded adapter version. ``key`` is the peft adapter name inside the model, unique per load."""

    name: str
    path: str
    key: str
    created: int = field(default_factory=lambda: int(time.time()))
    pending: int = 0  # queued or running requests that resolved to this version
    retired: bool = False  # unloaded or replaced; deleted from the model once pending == 0


@dataclass(eq=False)
class _Request:
    """One ``/v1/completions`` call, expanded into rows (prompt x n) for the worker.

    The worker samples it in chunks of at most ``max_batch_rows`` rows: ``next_row`` is the first
    row not yet given to a batch, ``rows_done`` counts the rows sampled.
    """

    adapter: _Adapter | None
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
    result: list[dict[str, Any]] | None = None
    error: BaseException | None = None
    next_row: int = 0
    rows_done: int = 0

    @property
    def rows(self) -> int:
        """Sequences to sample: prompts x n."""
        return len(self.prompts) * self.n


#: Free adapter slots kept for in-place loads (each holds one adapter's LoRA weights).
_FREE_SLOTS = 2


def _lora_shape(config: Any) -> tuple[Any, ...]:
    """What must match for one LoRA adapter's weights to be copied into another's slot."""
    targets = config.target_modules
    return (
        config.r, config.lora_alpha, tuple(sorted(targets)) if isinstance(targets, (list, set)) else targets,
        tuple(sorted(config.modules_to_save or ())), config.use_rslora, config.use_dora, config.bias,
        config.fan_in_fan_out, str(config.layers_to_transform), str(sorted((config.rank_pattern or {}).items())),
        str(sorted((config.alpha_pattern or {}).items())), str(config.lora_dropout),
    )  # fmt: skip


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
        model: Any,
        tokenizer: Any,
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
        self.max_loras = max_loras
        self.max_batch_rows = max_batch_rows
        self.logprobs_mode = logprobs_mode
        self.limits = limits or ServeLimits()
        self._request_model = completion_request_model(self.limits)
        self.adapter_root = Path(adapter_root).resolve() if adapter_root is not None else None
        cfg = getattr(model, "config", None)
        self.max_model_len = max_model_len or int(
            getattr(cfg, "max_position_embeddings", 0) or 1 << 30
        )
        self.vocab_size = int(getattr(cfg, "vocab_size", 0) or len(tokenizer))
        self.eos_ids = self._eos_ids()
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)
        self.device = next(model.parameters()).device
        # transformers renamed `past_key_values` to `cache` (5.2x); pass whichever this model takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.created = int(time.time())
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self._adapters: dict[str, _Adapter] = {}  # public name -> current version
        self._resident: collections.OrderedDict[str, _Adapter] = (
            collections.OrderedDict()
        )  # key -> version (LRU)
        self._loaded_keys = 0
        self._peft: Any = None  # peft.PeftModel around self.model, made on the first adapter load
        # peft adapter slots no version owns any more, kept to load the next adapter of the same
        # shape into in place: peft's load_adapter builds LoRA modules in every target layer
        self._free: list[str] = []
        self._lock = threading.Lock()  # guards the adapter tables and the queue's grouping
        self._model_lock = threading.Lock()  # held while the model runs or its adapters change
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

    # -- adapter management ----------------------------------------------------------------------
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
        with self._lock:
            for a in self._adapters.values():
                data.append(
                    {
                        "id": a.name,
                        "created": a.created,
                        "root": a.name,  # not the path: clients need not learn the server's folders
                        "parent": self.model_name,
                        **card,
                    }
                )
        return {"object": "list", "data": data}

    def load_lora_adapter(self, body: dict[str, Any]) -> str:
        """Handle ``POST /v1/load_lora_adapter``; return vLLM's success text.

        Raises:
            ServerError: 400 missing fields or an existing name without ``load_inplace``;
                404 the path holds no ``adapter_config.json``; 500 peft failed to load it.
        """
        request = self._validate(LoadAdapterRequest, body, "load_lora_adapter request")
        name, inplace = request.lora_name, request.load_inplace
        if name == self.model_name:
            raise ServerError(
                f"The lora adapter name '{name}' is the base model's name; choose another.", 400
            )
        with self._lock:
            if name in self._adapters and not inplace:
                raise ServerError(
                    f"The lora adapter '{name}' has already been loaded. "
                    'Pass "load_inplace": true to replace it, or load it under a new name.',
                    400,
                )
        path = self._adapter_path(request.lora_path)
        if not (path / "adapter_config.json").is_file():
            raise ServerError(f"Loading lora {name} failed: No adapter found for {request.lora_path}", 404)
        with self._lock:
            self._loaded_keys += 1
            version = _Adapter(name=name, path=str(path), key=f"lora{self._loaded_keys}")
        # Load eagerly so a broken adapter is an error now, not in the first request.
        with self._model_lock:
            try:
                self._make_resident(version)
            except Exception as exc:
                raise ServerError(
                    f"Loading lora {name} from {request.lora_path} failed: {type(exc).__name__}: {exc}", 500
                ) from exc
            with self._lock:
                old = self._adapters.get(name)
                if old is not None:
                    old.retired = True
                self._adapters[name] = version
            self._collect()
        log.info("loaded adapter %s from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, body: dict[str, Any]) -> str:
        """Handle ``POST /v1/unload_lora_adapter``; requests already queued on it still finish.

        Raises:
            ServerError: 400 no ``lora_name``; 404 no adapter of that name is loaded.
        """
        name = self._validate(UnloadAdapterRequest, body, "unload_lora_adapter request").lora_name
        with self._lock:
            version = self._adapters.pop(name, None)
            if version is None:
                raise ServerError(f"The lora adapter '{name}' cannot be found.", 404)
            version.retired = True
        with self._model_lock:
            self._collect()
        log.info("unloaded adapter %s", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    @staticmethod
    def _validate(model: type[BaseModel], body: dict[str, Any], what: str) -> Any:
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            raise ServerError(validation_message(exc, what), 400) from None

    def _adapter_path(self, lora_path: str) -> Path:
        """The folder to load ``lora_path`` from; with an adapter root, its resolved form under it.

        Raises:
            ServerError: 403 the resolved path is outside the adapter root (checked before its
                existence, so a client learns nothing about folders outside the root).
        """
        path = Path(lora_path)
        if self.adapter_root is None:
            return path
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop
            raise ServerError(f"lora_path {lora_path!r} cannot be resolved: {exc}", 400) from None
        if not resolved.is_relative_to(self.adapter_root):
            raise ServerError(
                f"lora_path {lora_path!r} is outside this server's adapter root (twin serve --adapter-root); "
                "only adapters under it load",
                403,
            )
        return resolved  # load what was checked, not a path whose links may change

    def _make_resident(self, version: _Adapter) -> None:
        """Load ``version`` into the model if it is not (evicting the least recently used). Holds the model lock."""
        if version.key in self._resident:
            self._resident.move_to_end(version.key)
            return
        from peft import PeftModel

        if self._peft is None:
            # Wraps (and injects LoRA layers into) self.model in place; generation keeps calling
            # self.model, whose LoRA layers follow the PeftModel's active adapter.
            try:
                self._peft = PeftModel.from_pretrained(
                    self.model, version.path, adapter_name=version.key
                )
            except BaseException:
                _strip_lora_layers(self.model)
                raise
        elif not self._load_into_free_slot(version):
            try:
                self._peft.load_adapter(version.path, adapter_name=version.key)
            except BaseException:
                self._drop_partial_adapter(version.key)
                raise
        self._resident[version.key] = version
        while len(self._resident) > self.max_loras:
            self._delete(next(iter(self._resident)))

    def _drop_partial_adapter(self, key: str) -> None:
        """Remove what a failed ``load_adapter`` added (peft builds the LoRA modules, then loads weights)."""
        if key not in self._peft.peft_config:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self._peft.delete_adapter(key)
        # delete_adapter may make what it left active; the served adapters are set per batch anyway
        self._peft.base_model.disable_adapter_layers()

    def _load_into_free_slot(self, version: _Adapter) -> bool:
        """Copy ``version``'s weights into a free slot of the same LoRA shape; False when none fits.

        The trainer loads a new adapter of one shape every step and unloads an old one; copying
        the weights in place skips building LoRA modules in every target layer (on the tiny
        model a load fell from ~0.04 s to ~0.014 s).
        """
        from peft import LoraConfig
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        if not self._free:
            return False
        config = LoraConfig.from_pretrained(version.path)
        shape = _lora_shape(config)
        slot = next((k for k in self._free if _lora_shape(self._peft.peft_config[k]) == shape), None)
        if slot is None:
            return False
        weights = load_peft_weights(version.path, device=str(self.device))
        result = set_peft_model_state_dict(self._peft, weights, adapter_name=slot)
        missing = [k for k in getattr(result, "missing_keys", []) if f".{slot}." in k]
        if missing:  # a partial copy would mix two adapters: load it the ordinary way instead
            log.warning("adapter %s does not fill slot %s (%d missing keys); loading it anew", version.name, slot,
                        len(missing))  # fmt: skip
            return False
        self._free.remove(slot)
        version.key = slot
        return True

    def _delete(self, key: str) -> None:
        # peft keeps at least one adapter; the last one stays (unreachable by name) until replaced.
        if len(self._resident) > 1:
            assert self._peft is not None
            version = self._resident.pop(key)
            # A version evicted while still served is reloaded later under a new key: its old
            # key's slot may hold another adapter's weights by then.
            with self._lock:  # load_lora_adapter numbers keys on an HTTP thread
                self._loaded_keys += 1
                version.key = f"lora{self._loaded_keys}"
            if len(self._free) < _FREE_SLOTS:
                self._free.append(key)
                return
            with warnings.catch_warnings():  # "adapter X was active which is now deleted": expected
                warnings.simplefilter("ignore", UserWarning)
                self._peft.delete_adapter(key)

    def _collect(self) -> None:
        """Delete retired versions that no request still needs. Holds the model lock."""
        with self._lock:
            dead = [k for k, v in self._resident.items() if v.retired and v.pending == 0]
        for key in dead:
            self._delete(key)

    # -- completions -----------------------------------------------------------------------------
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
        """Validate a completions body against the limits; the queued request, model name and body."""
        req = self._validate(self._request_model, body, "completions request")
        name = req.model or self.model_name
        adapter = None
        if name != self.model_name:
            with self._lock:
                adapter = self._adapters.get(name)
            if adapter is None:
                raise ServerError(f"The model `{name}` does not exist.", 404)
        prompts = self._prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        stops = frozenset(req.stop_token_ids or ()) | (frozenset() if req.ignore_eos else self.eos_ids)
        for ids in prompts:
            if len(ids) + max_tokens > self.max_model_len:
                raise ServerError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                    f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                    "for the completion). Please reduce the length of the prompt or max_tokens.",
                    400,
                )
        request = _Request(
            adapter=adapter,
            prompts=prompts,
            n=req.n or 1,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
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
            ids = list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise ServerError("a prompt is empty; give at least one token", 400)
            if len(ids) > self.limits.max_prompt_tokens:
                raise ServerError(
                    f"a prompt has {len(ids)} tokens; at most {self.limits.max_prompt_tokens} are allowed", 400
                )
            bad = [i for i in ids if not 0 <= i < self.vocab_size]
            if bad:
                raise ServerError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", 400)
            out.append(ids)
        return out

    def _response(self, req: Any, request: _Request, name: str) -> dict[str, Any]:
        as_ids, with_ids, skip_special = req.return_tokens_as_token_ids, req.return_token_ids, req.skip_special_tokens
        choices = []
        prompt_tokens = completion_tokens = 0
        for index, row in enumerate(request.result or []):
            prompt = request.prompts[index // request.n]
            if index % request.n == 0:
                prompt_tokens += len(prompt)
            completion_tokens += len(row["ids"])
            lp = None
            if request.logprobs is not None:
                tokens = [self._token(t, as_ids) for t in row["ids"]]
                offsets, pos = [], 0
                for t in tokens:
                    offsets.append(pos)
                    pos += len(t)
                lp = {
                    "text_offset": offsets,
                    "token_logprobs": row["logprobs"],
                    "tokens": tokens,
                    "top_logprobs": [
                        {self._token(t, as_ids): v for t, v in top} for top in row["top"]
                    ]
                    if request.logprobs > 0
                    else None,
                }
            choices.append(
                {
                    "index": index,
                    "text": self.tokenizer.decode(row["ids"], skip_special_tokens=skip_special),
                    "logprobs": lp,
                    "finish_reason": row["finish_reason"],
                    "stop_reason": row["stop_reason"],
                    "prompt_logprobs": row.get("prompt_logprobs"),
                    "prompt_token_ids": prompt if with_ids else None,
                    "token_ids": row["ids"] if with_ids else None,
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
                if r.adapter is first.adapter and r.error is None and rows + size <= self.max_batch_rows:
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
                    self._activate(batch[0][0].adapter)
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
                    self._collect()
                for r in finished:
                    r.done.set()

    def _activate(self, adapter: _Adapter | None) -> None:
        if adapter is None:
            if self._peft is not None:
                self._peft.base_model.disable_adapter_layers()
            return
        self._make_resident(adapter)
        self._peft.base_model.enable_adapter_layers()
        self._peft.set_adapter(adapter.key)

    @torch.inference_mode()
    def _run(self, batch: list[tuple[_Request, int, int]]) -> None:
        rows: list[dict[str, Any]] = []
        for r, start, end in batch:
            if r.result is None:
                r.result = [{} for _ in range(r.rows)]
            for index in range(start, end):
                prompt = r.prompts[index // r.n]
                gen = None
                if r.seed is not None:
                    # Each row gets its own stream: the same request gives the same bytes
                    # whatever else shares its batch (or however it is chunked).
                    gen = torch.Generator(device="cpu").manual_seed(_row_seed(r.seed, index))
                row = {
                    "request": r,
                    "prompt": prompt,
                    "gen": gen or self._generator,
                    "ids": [],
                    "logprobs": [],
                    "top": [],
                    "finish_reason": None,
                    "stop_reason": None,
                }
                r.result[index] = row
                rows.append(row)
        self._decode(rows)
        for row in rows:
            for key in ("request", "prompt", "gen"):
                row.pop(key)

    def _decode(self, rows: list[dict[str, Any]]) -> None:
        """Sample every row to its stop; prompts are left-padded so all rows decode in step."""
        from transformers import DynamicCache

        width = max(len(row["prompt"]) for row in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row["prompt"]) :] = torch.tensor(row["prompt"])
            mask[i, width - len(row["prompt"]) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want_prompt_lp = [row["request"].prompt_logprobs for row in rows]
        need_full = any(v is not None for v in want_prompt_lp)
        # A GRPO group sends its prompt G times: prefill each distinct (left-padded) prompt once and
        # index its keys/values out to the rows (not with prompt logprobs, which need every row's).
        index: dict[tuple[int, ...], int] = {}
        unit = [index.setdefault(tuple(row["prompt"]), len(index)) for row in rows]
        shared = not need_full and len(index) < len(unit)
        if shared:
            first = torch.tensor([unit.index(u) for u in range(len(index))], device=self.device)
            spread = torch.tensor(unit, device=self.device)
        out = self.model(
            input_ids=ids[first] if shared else ids,
            attention_mask=mask[first] if shared else mask,
            position_ids=positions[first] if shared else positions,
            use_cache=True,
            **{self._cache_kw: DynamicCache()},
            **({} if need_full else {"logits_to_keep": 1}),
        )
        if need_full:
            for i, (row, k) in enumerate(zip(rows, want_prompt_lp, strict=True)):
                if k is not None:
                    start = width - len(row["prompt"])
                    row["prompt_logprobs"] = self._prompt_logprobs(
                        out.logits[i, start:].float(), row["prompt"], k
                    )
        logits = out.logits[:, -1].float()
        cache = getattr(out, self._cache_kw)
        if shared:
            cache.batch_select_indices(spread)
            logits = logits[spread]
        active = [row["request"].max_tokens > 0 for row in rows]
        for i, row in enumerate(rows):
            if not active[i]:
                row["finish_reason"] = "length"
        while any(active):
            live = [i for i, a in enumerate(active) if a]
            tokens = self._sample_step([rows[i] for i in live], logits[live])
            next_ids = torch.full((len(rows),), self.pad_id, dtype=torch.long)
            for i, token in zip(live, tokens, strict=True):
                next_ids[i] = token
                row = rows[i]
                r = row["request"]
                if token in r.stop_ids:
                    row["finish_reason"] = "stop"
                    row["stop_reason"] = None if token in self.eos_ids else token
                    active[i] = False
                elif len(row["ids"]) >= r.max_tokens:
                    row["finish_reason"] = "length"
                    active[i] = False
            if not any(active):
                break
            mask = torch.cat(
                [mask, torch.ones((len(rows), 1), dtype=torch.long, device=self.device)], dim=1
            )
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=next_ids[:, None].to(self.device),
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kw: cache},
            )
            cache = getattr(out, self._cache_kw)
            logits = out.logits[:, -1].float()

    def _sample_step(self, rows: list[dict[str, Any]], logits: torch.Tensor) -> list[int]:
        """Sample one token for each row (batched), append it and its logprob to the row."""
        requests: list[_Request] = [row["request"] for row in rows]
        logits = logits.cpu()
        raw = torch.log_softmax(logits, dim=-1)
        temps = torch.tensor([r.temperature or 1.0 for r in requests]).unsqueeze(1)
        scaled = logits / temps
        top_p = torch.tensor([r.top_p for r in requests]).unsqueeze(1)
        if bool((top_p < 1.0).any()):
            scaled = torch.where(top_p < 1.0, _top_p_filter(scaled, top_p), scaled)
        processed = torch.log_softmax(scaled, dim=-1)
        # Inverse-CDF sampling with one uniform per row from the row's own generator: a seeded
        # request draws the same numbers whatever else shares its batch.
        cdf = processed.exp().cumsum(dim=-1)
        u = torch.stack([torch.rand((), generator=row["gen"]) for row in rows])
        sampled = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        sampled = sampled.clamp(max=logits.shape[-1] - 1)
        greedy = torch.tensor([r.temperature == 0.0 for r in requests])
        tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
        processed = torch.where(greedy.unsqueeze(1), raw, processed)
        table = raw if self.logprobs_mode == "raw_logprobs" else processed
        table = table.clamp(min=-9999.0)  # vLLM's floor: -inf (a token top-p removed) is not JSON
        chosen = table.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        token_list = tokens.tolist()
        for j, (row, r) in enumerate(zip(rows, requests, strict=True)):
            token = token_list[j]
            row["ids"].append(token)
            row["logprobs"].append(chosen[j])
            if r.logprobs:
                values, indices = torch.topk(table[j], min(r.logprobs, table.shape[-1]))
                top = list(zip(indices.tolist(), values.tolist(), strict=True))
                if token not in {t for t, _ in top}:
                    top.insert(0, (token, chosen[j]))
                row["top"].append(top)
        return token_list

    def _prompt_logprobs(
        self, logits: torch.Tensor, prompt: list[int], k: int
    ) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: None for the first token, then ``{id: {logprob, rank, decoded_token}}``."""
        lps = torch.log_softmax(logits[:-1], dim=-1)
        result: list[dict[str, Any] | None] = [None]
        for pos, token in enumerate(prompt[1:]):
            row = lps[pos]
            entry: dict[str, Any] = {}
            value = float(row[token])
            rank = int((row > row[token]).sum()) + 1
            entry[str(token)] = {
                "logprob": value,
                "rank": rank,
                "decoded_token": self.tokenizer.decode([token]),
            }
            if k > 0:
                values, indices = torch.topk(row, k)
                for r_i, (t, v) in enumerate(
                    zip(indices.tolist(), values.tolist(), strict=True), start=1
                ):
                    entry.setdefault(
                        str(t),
                        {"logprob": v, "rank": r_i, "decoded_token": self.tokenizer.decode([t])},
                    )
            result.append(entry)
        return result


def _row_seed(seed: int, row: int) -> int:
    """The seed of one row of a seeded request, kept in the range torch generators take."""
    value = seed + 1_000_003 * row
    return value if value < 1 << 64 else value % (1 << 64)


def _strip_lora_layers(model: Any) -> None:
    """Put back every layer peft wrapped in ``model`` (a failed first load leaves them active)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if name and isinstance(module, BaseTunerLayer):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.get_base_layer())
    if "peft_config" in vars(model):
        del model.peft_config


def _top_p_filter(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches ``top_p`` (at least one).

    Works on the last dimension; ``top_p`` may be a tensor that broadcasts against ``[..., 1]``.
    """
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _load(model: str, dtype: str, device: str) -> tuple[Any, Any]:
    """Load ``tiny``, ``smollm2`` or a local HF dir with the trainer's loader."""
    from trainer.models import load_model

    return load_model(model, dtype, device)


def main(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "float32",
    max_loras: int = 4,
    *,
    served_model_name: str | None = None,
    device: str = "cpu",
    logprobs_mode: LogprobsMode = "processed_logprobs",
    max_batch_rows: int = 64,
    seed: int = 0,
    threads: int | None = None,
    cpus: str | None = None,
    api_key: str | None = None,
    adapter_root: str | None = None,
    **limits: Any,
) -> None:
    """Serve ``model`` until interrupted (``twin serve MODEL``).

    Args:
        model: ``tiny``, ``smollm2`` or a local HF model dir.
        host: Interface to bind (loopback by default; see ``docs/security.md`` before exposing it).
        port: TCP port.
        dtype: ``float32`` (CPU default), ``bfloat16`` or ``float16``.
        max_loras: Adapters resident at once.
        served_model_name: The base model's name in requests (default: ``model``).
        device: ``cpu`` or ``cuda:N``.
        logprobs_mode: ``processed_logprobs`` (after temperature/top-p) or ``raw_logprobs``.
        max_batch_rows: Most sequences sampled together.
        seed: Seed for requests without their own ``seed``.
        threads: CPU threads (default: one per core of ``cpus`` when pinned, else torch's
            default). Idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE`` when started by
            :class:`ServerProcess`).
        cpus: Cores to pin the server to, ``taskset -c`` syntax (``0`` or ``0,2-3``); default
            ``$TWINRL_ROLLOUT_CPUS``, which the async trainer exports with
            ``devices.cpu_affinity: auto``.
        api_key: Required as ``Authorization: Bearer`` on every route but ``/health``
            (default ``$TWINRL_API_KEY``; prefer the variable: arguments show in ``ps``).
        adapter_root: Only adapters under this folder load.
        limits: :class:`ServeLimits` fields (``max_n``, ``max_tokens``, ``read_timeout``, ...).

    Raises:
        ConfigError: a limit is not a valid value.
    """
    unknown = sorted(set(limits) - set(ServeLimits.model_fields))
    if unknown:
        options = ", ".join("--" + name.replace("_", "-") for name in ServeLimits.model_fields)
        raise ConfigError(f"unknown twin serve option(s) {', '.join(unknown)}; the limits are {options}")
    try:
        serve_limits = ServeLimits(**limits)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, "twin serve option")) from None
    from trainer.placement import place_rollout_process

    pinned = place_rollout_process(threads, cpus)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
    # str(): `twin serve --api-key 123` arrives as an int through the CLI's YAML values
    api_key = str(api_key) if api_key is not None else os.environ.get(API_KEY_ENV) or None
    for warning in exposure_warnings(host, api_key, adapter_root):
        log.warning("%s", warning)
    if pinned:
        log.info("pinned to cores %s with %d thread(s)", ",".join(map(str, pinned)), torch.get_num_threads())
    net, tokenizer = _load(model, dtype, device)
    core = CompletionServer(
        net,
        tokenizer,
        model_name=served_model_name or model,
        max_loras=max_loras,
        max_batch_rows=max_batch_rows,
        logprobs_mode=logprobs_mode,
        seed=seed,
        limits=serve_limits,
        adapter_root=adapter_root,
    )
    httpd = make_http_server(core, host, port, api_key=api_key)
    print(
        f"twin serve: {served_model_name or model} on http://{host}:{httpd.server_address[1]}/v1"
        + (" (API key required)" if api_key else ""),
        flush=True,
    )
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        core.close()


# -- subprocess helper -----------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ManagedServer:
    """A server in a child process: start, wait for ``/health``, stop; the log goes to a file.

    Subclasses give :meth:`command` and :meth:`environment`.
    """

    name = "server"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 120.0,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        """``http://host:port`` (no path)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ``http://host:port/v1``."""
        return f"{self.url}/v1"

    def command(self) -> list[str]:
        """The argv to run. Override."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The child's environment. Override to add variables."""
        return dict(os.environ)

    def start(self) -> ManagedServer:
        """Start the child and wait until ``/health`` answers 200.

        Raises:
            TwinError: the child exited or did not become healthy within ``startup_timeout``;
                the message holds the command and the tail of its log.
        """
        if self.process is not None and self.process.poll() is None:
            return self
        if self.log_path is None:
            import tempfile

            self.log_path = Path(tempfile.mkstemp(prefix=f"twin-{self.name}-", suffix=".log")[1])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        self.wait_healthy(self.startup_timeout)
        return self

    def healthy(self) -> bool:
        """True when ``GET /health`` answers 200 now."""
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=2.0, verify=tls_context()).status_code == 200
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        """True while the child process runs."""
        return self.process is not None and self.process.poll() is None

    def wait_healthy(self, timeout: float) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            TwinError: the child died or ``timeout`` passed; the log tail is in the message.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise TwinError(
                    f"{self.name} exited with code {self.process.returncode} before it became healthy.\n"
                    f"command: {' '.join(self.command())}\nlog {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.2)
        tail = self.log_tail()
        self.stop()
        raise TwinError(
            f"{self.name} did not answer {self.url}/health within {timeout:.0f} s; raise the startup "
            f"timeout or read its log.\ncommand: {' '.join(self.command())}\nlog {self.log_path}:\n{tail}"
        )

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the child's log."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_bytes()[-20_000:].decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the child (SIGTERM, then SIGKILL after ``timeout``)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess(ManagedServer):
    """``twin serve`` in a child process on a free loopback port (for the trainer and tests).

    Example::

        with ServerProcess("tiny") as server:
            ServerSampler(server.base_url, "tiny")

    Args:
        model: ``tiny``, ``smollm2`` or a local HF dir.
        dtype: Weights dtype.
        max_loras: Adapters resident at once.
        served_model_name: Base model name in requests (default ``model``).
        device: ``cpu`` or ``cuda:N``.
        logprobs_mode: See :class:`CompletionServer`.
        python: Interpreter to run (default: this one).
        threads: CPU threads of the child (default: torch's choice, or one per pinned core); set,
            it also gets ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` and ``OMP_WAIT_POLICY=PASSIVE``
            (idle threads sleep instead of spinning on cores the learner needs).
        cpus: Cores to pin the child to (``taskset -c`` syntax); default ``$TWINRL_ROLLOUT_CPUS``.
        api_key: The child's API key, handed over in ``$TWINRL_API_KEY`` (not on its command
            line); None: the child inherits this process's ``$TWINRL_API_KEY``, if any.
        adapter_root: Only adapters under this folder load (``--adapter-root``).
        host, port, log_path, startup_timeout: See :class:`ManagedServer`.
    """

    name = "twin serve"

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "float32",
        max_loras: int = 4,
        served_model_name: str | None = None,
        device: str = "cpu",
        logprobs_mode: LogprobsMode = "processed_logprobs",
        python: str | None = None,
        threads: int | None = None,
        seed: int = 0,
        cpus: str | None = None,
        api_key: str | None = None,
        adapter_root: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.api_key = api_key
        self.adapter_root = Path(adapter_root).resolve() if adapter_root is not None else None
        self.model = model
        self.dtype = dtype
        self.max_loras = max_loras
        self.served_model_name = served_model_name or model
        self.device = device
        self.logprobs_mode = logprobs_mode
        self.python = python or sys.executable
        self.threads = threads
        self.seed = seed
        self.cpus = cpus

    def command(self) -> list[str]:
        """``python -m trainer.server MODEL --host .. --port .. ...``."""
        return [
            self.python,
            "-m",
            "trainer.server",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-loras",
            str(self.max_loras),
            "--served-model-name",
            self.served_model_name,
            "--device",
            self.device,
            "--logprobs-mode",
            self.logprobs_mode,
            "--seed",
            str(self.seed),
            *(["--threads", str(self.threads)] if self.threads else []),
            *(["--cpus", self.cpus] if self.cpus else []),
            *(["--adapter-root", str(self.adapter_root)] if self.adapter_root else []),
        ]

    def environment(self) -> dict[str, str]:
        """This process's environment, offline, with the repository importable."""
        env = dict(os.environ)
        env["HF_HUB_OFFLINE"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key
        if self.threads:
            from trainer.placement import thread_env

            env.update(thread_env(self.threads))
        elif self.cpus or env.get("TWINRL_ROLLOUT_CPUS"):
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # OpenMP reads it once, as torch loads
        return env


def _cli(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.server", description=__doc__.split("\n")[0]
    )
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--logprobs-mode",
        default="processed_logprobs",
        choices=["processed_logprobs", "raw_logprobs"],
    )
    parser.add_argument("--max-batch-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpus", default=None, help="cores to pin to, e.g. 0 or 0,2-3")
    parser.add_argument("--api-key", default=None, help=f"bearer key required on /v1 routes (default ${API_KEY_ENV})")
    parser.add_argument("--adapter-root", default=None, help="only adapters under this folder load")
    for name, info in ServeLimits.model_fields.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=info.annotation, default=info.default,
            help=f"{info.description} (default {info.default})",
        )  # fmt: skip
    args = vars(parser.parse_args(argv))
    main(**args)


if __name__ == "__main__":
    _cli()

"""Samplers: continue token-id prompts, return the sampled ids and their logprobs.

One interface, two implementations:

- :class:`HFSampler`: batched decoding on the in-process model (with whatever LoRA adapter is
  active), CPU by default, through the same engine as ``twin serve``
  (``trainer/serving/engine.py``).
- :class:`ServerSampler`: the same over an OpenAI-compatible ``/v1/completions`` endpoint that
  takes token-id prompts (vLLM, or ``twin serve``).

Logprobs are those of the distribution sampled from: ``log_softmax`` of the logits at temperature
``T`` after top-p (vLLM's ``processed_logprobs``; the trainer requires ``top_p`` 1, where this is
what the learner recomputes). Both samplers are deterministic given ``seed``.

Every request states each sampling field the learner's logprobs depend on (:data:`NEUTRAL_SAMPLING`
plus ``temperature``, ``top_p`` and ``top_k``): a field left out is filled by vLLM from the model's
``generation_config.json`` unless the server runs with ``--generation-config vllm``, and Qwen3's
sets ``top_k: 20``, which would sample from the top 20 tokens while the learner scores the full
softmax. ``top_k`` -1 and 0 both mean "no top-k" (the whole vocabulary); requests send -1, which
every vLLM release reads that way.

``max_new_tokens`` is one number for every prompt or one per prompt: a multi-turn rollout gives
each episode what its context has left, so a request never asks a server (vLLM answers HTTP 400)
for more tokens than fit.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import httpx
import torch

from twin.cases import stable_seed
from twin.errors import ConfigError, TwinError
from twin.policies.http import tls_context

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_CONCURRENCY",
    "NEUTRAL_SAMPLING",
    "HFSampler",
    "Sample",
    "Sampler",
    "SamplerError",
    "ServerSampler",
    "connection_limits",
    "per_prompt_budgets",
    "top_k_field",
    "turn_stop_ids",
]

#: Most new tokens: one number for all prompts, or one per prompt.
Budget = int | Sequence[int]

#: Requests a :class:`ServerSampler` keeps in flight at once by default: enough that vLLM batches a
#: 512-episode lot in two waves rather than eight (it schedules up to 256 sequences a step).
DEFAULT_CONCURRENCY = 256

#: Sampling fields every request sets to their neutral value, so that nothing the server reads
#: from the model's generation config changes the distribution sampled from.
NEUTRAL_SAMPLING: dict[str, float | int] = {
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
}


def connection_limits(concurrency: int) -> httpx.Limits:
    """An httpx pool that holds ``concurrency`` connections (httpx's default stops at 100, which
    would quietly cap the requests in flight below :data:`DEFAULT_CONCURRENCY`)."""
    return httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)


def turn_stop_ids(
    tokenizer: PreTrainedTokenizerBase, model_dir: str | os.PathLike[str] | None = None
) -> list[int]:
    """Ids that end an assistant turn: the tokenizer's eos and every eos id of the model's
    ``generation_config.json`` (vLLM stops on both: 151643 ``<|endoftext|>`` besides
    ``<|im_end|>`` for Qwen3, 128008 ``<|eom_id|>`` and 128009 for Llama 3.1).

    Args:
        tokenizer: The model's tokenizer.
        model_dir: The model's folder; None or a folder without a generation config: the
            tokenizer's eos only.

    Raises:
        ConfigError: neither holds an eos id, or the generation config is not JSON.
    """
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    path = None if model_dir is None else Path(model_dir) / "generation_config.json"
    if path is not None and path.is_file():
        import json

        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as exc:
            raise ConfigError(f"{path} is not a JSON object ({exc}); fix or remove it") from None
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    if not ids:
        raise ConfigError(
            "neither the tokenizer nor generation_config.json names an eos token; the sampler "
            "cannot tell where a turn ends (set tokenizer.eos_token)"
        )
    return ids


def top_k_field(top_k: int | None) -> int:
    """The request's ``top_k``: -1 for "no top-k" (given as None, 0 or -1), else ``top_k``.

    Raises:
        ConfigError: ``top_k`` is below -1.
    """
    if top_k is None or top_k in (0, -1):
        return -1
    if top_k < -1:
        raise ConfigError(f"top_k must be -1 or 0 (no top-k) or a positive count, got {top_k}")
    return int(top_k)


class SamplerError(TwinError):
    """A sampler could not produce completions (server down, bad response)."""


@dataclass
class Sample:
    """One completion.

    Attributes:
        ids: Sampled token ids, cut after the first stop id (the stop id is kept).
        logprobs: Logprob of each sampled id under the sampling distribution, ``len == len(ids)``.
        finish_reason: ``"stop"`` (a stop id was sampled) or ``"length"`` (max_new_tokens).
    """

    ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


@runtime_checkable
class Sampler(Protocol):
    """Anything that continues token-id prompts."""

    def sample(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: Budget,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """Sample one completion per prompt, in order (``max_new_tokens``: one or per prompt)."""
        ...


def per_prompt_budgets(max_new_tokens: Budget, n: int) -> list[int]:
    """``max_new_tokens`` as one limit per prompt.

    Args:
        max_new_tokens: One limit for all prompts, or one per prompt.
        n: Number of prompts.

    Returns:
        ``n`` limits.

    Raises:
        ConfigError: A list of another length, or a negative limit.
    """
    if isinstance(max_new_tokens, int):
        budgets = [int(max_new_tokens)] * n
    else:
        budgets = [int(b) for b in max_new_tokens]
        if len(budgets) != n:
            raise ConfigError(
                f"max_new_tokens has {len(budgets)} limits for {n} prompts; pass one number or one "
                "per prompt"
            )
    for i, b in enumerate(budgets):
        if b < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {b} for prompt {i}")
    return budgets


def _cut(ids: list[int], logprobs: list[float], stop: set[int]) -> Sample:
    for i, tok in enumerate(ids):
        if tok in stop:
            return Sample(ids[: i + 1], logprobs[: i + 1], "stop")
    return Sample(ids, logprobs, "length")


class HFSampler:
    """Batched sampling on an in-process model, with the engine of ``twin serve``.

    The model may be a peft model: sampling uses its active adapter, so a learner sharing the
    model object is always sampled on-policy. Each prompt is one row of
    :meth:`trainer.serving.engine.Engine.decode` with its own seed and length limit.

    Args:
        model: A causal LM (or peft model around one).
        tokenizer: Its tokenizer (needs a pad or eos token).
        max_batch: Most prompts decoded together (larger lists are split).
        prefix_cache: Keep the keys/values of finished rows (``trainer/serving/kvcache.py``) and
            run the model only over tokens not seen before: a multi-turn episode then prefills
            each turn's new messages only. Call :meth:`clear_cache` whenever the weights change
            (e.g. after an optimizer step).
        cache_bytes: Memory bound of the prefix cache.
        autocast: Sample under ``torch.autocast`` to this dtype (``"bfloat16"``: the learner's
            ``model.autocast``, so the sampled logprobs are of the distribution it scores); None:
            the weights' dtype.
    """

    #: Prefill each distinct prompt of a batch once (a GRPO group repeats its prompt G times),
    #: and the batch's common prefix once.
    share_prefill: bool = True

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch: int = 256,
        prefix_cache: bool = False,
        cache_bytes: int = 4 << 30,
        autocast: str | None = None,
    ) -> None:
        from trainer.models import resolve_autocast
        from trainer.scoring import autocast_context
        from trainer.serving.engine import Engine, PrefixStore

        self.model = model
        autocast = resolve_autocast(autocast, self.device)
        autocast_context(autocast, self.device)  # a bad dtype fails here
        self.autocast = autocast
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.store: PrefixStore | None = PrefixStore(cache_bytes) if prefix_cache else None
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        if pad is None:
            raise ConfigError(
                "HFSampler: the tokenizer has neither a pad nor an eos token; set one"
            )
        self.pad_id = int(pad)
        self.engine = Engine(model, pad_id=self.pad_id)

    @property
    def device(self) -> torch.device:
        """Device of the model's parameters."""
        return next(self.model.parameters()).device

    def clear_cache(self) -> None:
        """Forget cached keys/values (they belong to the weights they were computed with)."""
        if self.store is not None:
            self.store.clear()

    def sample(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: Budget,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        seed: int | None = None,
        row_seeds: Sequence[int] | None = None,
    ) -> list[Sample]:
        """Sample one completion per prompt (see :class:`Sampler`).

        Args:
            prompts: Token-id prompts (non-empty lists).
            max_new_tokens: Most tokens to sample, for all prompts or one per prompt.
            temperature: Sampling temperature (0 = greedy).
            top_p: Nucleus threshold.
            stop_ids: Ids that end a completion (default: the tokenizer's eos).
            seed: Seeds the rows' private RNG streams (the global RNG is left unchanged);
                None: the engine's own stream, which each call advances.
            row_seeds: One seed per prompt (default: derived from ``seed`` and the prompt's
                index), so a row's sample does not depend on its batch.

        Returns:
            One :class:`Sample` per prompt, in order.
        """
        from trainer.serving.engine import Row

        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise SamplerError("HFSampler: every prompt needs at least one token")
        if temperature < 0:
            raise ConfigError(
                f"HFSampler: temperature must be >= 0 (0 = greedy), got {temperature}"
            )
        if not 0.0 < top_p <= 1.0:
            raise ConfigError(f"HFSampler: top_p must be in (0, 1], got {top_p}")
        stops = frozenset(int(t) for t in (stop_ids or [self.tokenizer.eos_token_id]))
        budgets = per_prompt_budgets(max_new_tokens, len(prompts))
        if row_seeds is not None and len(row_seeds) != len(prompts):
            raise ConfigError(
                f"HFSampler: {len(row_seeds)} row_seeds for {len(prompts)} prompts; pass one per "
                "prompt"
            )
        if row_seeds is None and seed is not None:
            row_seeds = [stable_seed("hf-sampler-row", seed, i) for i in range(len(prompts))]
        rows = [
            Row(
                prompt=list(p),
                max_tokens=b,
                temperature=float(temperature),
                top_p=float(top_p),
                stop_ids=stops,
                generator=None
                if row_seeds is None
                else torch.Generator().manual_seed(int(row_seeds[i]) % (2**63)),
            )
            for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))
        ]
        from trainer.scoring import autocast_context

        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        try:
            with autocast_context(self.autocast, self.device):  # thread-local: entered here
                for start in range(0, len(rows), self.max_batch):
                    chunk = rows[start : start + self.max_batch]
                    self.engine.decode(chunk, store=self.store, share_prefill=self.share_prefill)
        finally:
            self.model.train(was_training)
        return [Sample(r.ids, r.token_logprobs, r.finish_reason or "length") for r in rows]


class ServerSampler:
    """Sampling over an OpenAI-compatible ``/v1/completions`` endpoint with token-id prompts.

    Speaks vLLM's extensions: ``return_token_ids``, ``return_tokens_as_token_ids``, ``logprobs``
    and ``stop_token_ids``; reads ``choices[i].token_ids`` and
    ``choices[i].logprobs.token_logprobs``. With a ``seed``, each prompt goes as its own request
    with its own derived seed (a batch under one seed would repeat the same sample for the
    identical prompts of a GRPO group); requests run concurrently and the server batches them.

    Args:
        base_url: Server root, e.g. ``http://127.0.0.1:8000`` (``/v1`` is appended when missing).
        model_name: Model or adapter name to request (e.g. ``policy@3``).
        api_key: Bearer token, if the server wants one (default ``$TWINRL_API_KEY``).
        timeout: Seconds per request.
        transport: An httpx transport (tests pass ``httpx.MockTransport``).
        concurrency: Most requests in flight at once (:data:`DEFAULT_CONCURRENCY`).
        top_k: Sample among the ``top_k`` likeliest tokens; None, 0 or -1: the whole vocabulary
            (the only setting under which the learner's full-softmax logprobs are the sampler's).
        per_row_seeds: The server derives a seed per row of a request itself (``twin serve``
            does; vLLM does not): a seeded call with one token limit then goes as ONE request,
            which lets the server batch the whole lot at once (about 1.5x faster on CPU).
    """

    def __init__(
        self,
        base_url: str,
        model_name: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        top_k: int | None = None,
        per_row_seeds: bool = False,
    ) -> None:
        if concurrency < 1:
            raise ConfigError(f"ServerSampler: concurrency must be >= 1, got {concurrency}")
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.model_name = model_name
        self.api_key = api_key if api_key is not None else os.environ.get("TWINRL_API_KEY")
        self.timeout = timeout
        self.transport = transport
        self.concurrency = concurrency
        self.top_k = top_k_field(top_k)
        self.per_row_seeds = per_row_seeds

    def sample(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: Budget,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """Sample one completion per prompt (blocking wrapper of :meth:`asample`)."""
        return asyncio.run(
            self.asample(
                prompts,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                stop_ids=stop_ids,
                seed=seed,
            )
        )

    async def asample(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: Budget,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """Sample one completion per prompt, in order.

        Each request's ``max_tokens`` is its prompt's own limit: seeded prompts go one request
        each (one request in all with ``per_row_seeds`` and a single limit); unseeded prompts go
        as one request per distinct limit.

        Raises:
            SamplerError: the server is unreachable or answered with an error or a malformed body.
        """
        if not prompts:
            return []
        budgets = per_prompt_budgets(max_new_tokens, len(prompts))
        base = self._base_body(temperature, top_p, stop_ids)
        stop_set = set(int(t) for t in stop_ids or ())
        async with self.client() as client:
            limit = asyncio.Semaphore(self.concurrency)
            if seed is not None and self.per_row_seeds and len(set(budgets)) == 1:
                body = {**base, "max_tokens": budgets[0], "prompt": [list(p) for p in prompts],
                        "seed": stable_seed("server-sampler-batch", seed) % (2**31)}  # fmt: skip
                return list(await self._request(client, body, len(prompts), stop_set))
            if seed is None:
                rows: dict[int, list[int]] = {}
                for i, b in enumerate(budgets):
                    rows.setdefault(b, []).append(i)

                async def batch(b: int, index: list[int]) -> list[Sample]:
                    body = {**base, "max_tokens": b, "prompt": [list(prompts[i]) for i in index]}
                    async with limit:
                        return await self._request(client, body, len(index), stop_set)

                parts = await asyncio.gather(*(batch(b, index) for b, index in rows.items()))
                out: list[Sample | None] = [None] * len(prompts)
                for index, samples in zip(rows.values(), parts):
                    for i, sample in zip(index, samples):
                        out[i] = sample
                return [s for s in out if s is not None]

            async def one(i: int, prompt: list[int]) -> Sample:
                body = {
                    **base,
                    "max_tokens": budgets[i],
                    "prompt": [list(prompt)],
                    "seed": stable_seed("server-sampler", seed, i) % (2**31),
                }
                async with limit:
                    return (await self._request(client, body, 1, stop_set))[0]

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    #: Episodes sampled through this sampler may advance one by one (:meth:`asample_one`): each
    #: request is its own, so nothing is gained by waiting for the others. A server that seeds the
    #: rows of one request itself (``per_row_seeds``) batches a whole lot better as one request.
    @property
    def streams_turns(self) -> bool:
        """Whether :func:`trainer.episodes.collect_groups` should advance episodes independently."""
        return not self.per_row_seeds

    def client(self) -> httpx.AsyncClient:
        """An HTTP client for this server (use it as ``async with``), pooled for
        :attr:`concurrency` connections."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.AsyncClient(
            base_url=self.base_url, timeout=self.timeout, transport=self.transport, headers=headers,
            verify=tls_context(), limits=connection_limits(self.concurrency),
        )  # fmt: skip

    def _base_body(
        self, temperature: float, top_p: float, stop_ids: Sequence[int] | None
    ) -> dict[str, Any]:
        base: dict[str, Any] = {
            "model": self.model_name,
            "temperature": float(temperature),
            "top_p": float(top_p),
            "top_k": self.top_k,
            **NEUTRAL_SAMPLING,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if stop_ids:
            base["stop_token_ids"] = [int(t) for t in stop_ids]
        return base

    async def asample_one(
        self,
        client: httpx.AsyncClient,
        prompt: list[int],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> Sample:
        """One completion of one prompt over ``client`` (from :meth:`client`); ``seed`` is the
        request's own. The caller bounds how many run at once.

        Raises:
            SamplerError: as :meth:`asample`.
        """
        if not prompt:
            raise SamplerError("ServerSampler: every prompt needs at least one token")
        body = {**self._base_body(temperature, top_p, stop_ids), "max_tokens": int(max_new_tokens),
                "prompt": [list(prompt)]}  # fmt: skip
        if seed is not None:
            body["seed"] = int(seed) % (2**31)
        return (await self._request(client, body, 1, set(int(t) for t in stop_ids or ())))[0]

    async def _request(
        self, client: httpx.AsyncClient, body: dict[str, Any], n: int, stop_set: set[int]
    ) -> list[Sample]:
        try:
            response = await client.post("/completions", json=body)
        except httpx.HTTPError as exc:
            raise SamplerError(
                f"sampler server {self.base_url} unreachable ({type(exc).__name__}: {exc}); is it "
                "running?"
            ) from exc
        if response.status_code != 200:
            raise SamplerError(
                f"sampler server {self.base_url}/completions answered HTTP {response.status_code} "
                f"for model {self.model_name!r}: {response.text[:500]}"
            )
        try:
            choices = sorted(response.json()["choices"], key=lambda c: c.get("index", 0))
            samples = []
            for choice in choices:
                ids = [int(t) for t in choice["token_ids"]]
                lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                if len(ids) != len(lps):
                    raise ValueError(f"{len(ids)} token_ids but {len(lps)} token_logprobs")
                reason = choice.get("finish_reason") or "length"
                sample = _cut(ids, lps, stop_set) if stop_set else Sample(ids, lps, reason)
                if sample.finish_reason == "length" and reason == "stop":
                    sample.finish_reason = "stop"  # the server stopped on its own eos
                samples.append(sample)
        except (KeyError, TypeError, ValueError) as exc:
            raise SamplerError(
                f"sampler server {self.base_url} sent a completion without token ids/logprobs "
                f"({exc}); it must support return_token_ids and logprobs (vLLM >= 0.10 or twin "
                "serve)"
            ) from None
        if len(samples) != n:
            raise SamplerError(f"sampler server returned {len(samples)} choices for {n} prompts")
        return samples

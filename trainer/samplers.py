"""Samplers: continue token-id prompts, return the sampled ids and their logprobs.

One interface, two implementations:

- :class:`HFSampler`: batched transformers ``generate`` on the in-process model (with whatever
  LoRA adapter is active), CPU by default.
- :class:`ServerSampler`: the same over an OpenAI-compatible ``/v1/completions`` endpoint that
  takes token-id prompts (vLLM, or ``twin serve``).

Logprobs are those of the distribution sampled from at temperature ``T``:
``log_softmax(logits / T)`` of the sampled token (top-p truncation is not folded in, matching what
the learner recomputes). Both samplers are deterministic given ``seed``.

``max_new_tokens`` is one number for every prompt or one per prompt: a multi-turn rollout gives
each episode what its context has left, so a request never asks a server (vLLM answers HTTP 400)
for more tokens than fit.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import httpx
import torch

from twin.cases import stable_seed
from twin.errors import ConfigError, TwinError
from twin.http import tls_context

__all__ = ["HFSampler", "Sample", "Sampler", "SamplerError", "ServerSampler", "per_prompt_budgets"]

#: Most new tokens: one number for all prompts, or one per prompt.
Budget = int | Sequence[int]


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


def _within(samples: list[Sample], budgets: list[int]) -> list[Sample]:
    # Rows sampled under a larger shared limit, cut to their own (a cut row did not stop).
    out = []
    for sample, b in zip(samples, budgets):
        if len(sample.ids) > b:
            sample = Sample(sample.ids[:b], sample.logprobs[:b], "length")
        out.append(sample)
    return out


def _cut(ids: list[int], logprobs: list[float], stop: set[int]) -> Sample:
    for i, tok in enumerate(ids):
        if tok in stop:
            return Sample(ids[: i + 1], logprobs[: i + 1], "stop")
    return Sample(ids, logprobs, "length")


class HFSampler:
    """Batched sampling with transformers ``generate`` on an in-process model.

    The model may be a peft model: sampling uses its active adapter, so a learner sharing the
    model object is always sampled on-policy. Prompts are left-padded into one batch.

    Args:
        model: A causal LM (or peft model around one).
        tokenizer: Its tokenizer (needs a pad or eos token).
        max_batch: Most prompts per ``generate`` call (larger lists are split).
        prefix_cache: Keep the keys/values of finished rows and of each batch's common prefix
            (:mod:`trainer.kvcache`) and run the model only over tokens not seen before: a
            multi-turn episode then prefills each turn's new messages only, and concurrent
            episodes share one prefill of the system prompt. Sampling then runs a plain loop
            instead of ``generate`` (per-row seeds; temperature 0 = greedy). Call
            :meth:`clear_cache` whenever the weights change (e.g. after an optimizer step).
        cache_bytes: Memory bound of the prefix cache.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int = 256,
        prefix_cache: bool = False,
        cache_bytes: int = 4 << 30,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.store: Any = None
        if prefix_cache:
            from trainer.kvcache import PrefixStore

            self.store = PrefixStore(cache_bytes)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ConfigError("HFSampler: the tokenizer has neither a pad nor an eos token; set one")
        self.pad_id = int(pad)

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
            max_new_tokens: Most tokens to sample, for all prompts or one per prompt (the batch
                runs to the largest; each row is cut to its own).
            temperature: Sampling temperature (> 0).
            top_p: Nucleus threshold.
            stop_ids: Ids that end a completion (default: the tokenizer's eos).
            seed: Seeds a private RNG stream for this call (the global RNG is left unchanged).
            row_seeds: With ``prefix_cache``: one seed per prompt (default: derived from
                ``seed`` and the prompt's index), so a row's sample does not depend on its
                batch.

        Returns:
            One :class:`Sample` per prompt, in order.
        """
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise SamplerError("HFSampler: every prompt needs at least one token")
        if temperature < 0 or (temperature == 0 and self.store is None):
            raise ConfigError(
                f"HFSampler: temperature must be > 0 (or 0 = greedy with prefix_cache=True), "
                f"got {temperature}"
            )
        stops = list(stop_ids) if stop_ids else [self.tokenizer.eos_token_id]
        budgets = per_prompt_budgets(max_new_tokens, len(prompts))
        if self.store is not None:
            limit = max(budgets)
            rows = self._sample_cached(prompts, limit, temperature, top_p, stops, seed, row_seeds)
            return _within(rows, budgets)
        out: list[Sample] = []
        for start in range(0, len(prompts), self.max_batch):
            chunk = prompts[start : start + self.max_batch]
            chunk_seed = None if seed is None else stable_seed("hf-sampler", seed, start)
            limit = max(budgets[start : start + self.max_batch])
            out.extend(self._sample_batch(chunk, limit, temperature, top_p, stops, chunk_seed))
        return _within(out, budgets)

    def _sample_cached(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stops: list[int],
        seed: int | None,
        row_seeds: Sequence[int] | None,
    ) -> list[Sample]:
        from trainer.kvcache import sample_with_cache

        if row_seeds is None:
            base = 0 if seed is None else seed
            row_seeds = [stable_seed("hf-sampler-row", base, i) for i in range(len(prompts))]
        elif len(row_seeds) != len(prompts):
            raise ConfigError(
                f"HFSampler: {len(row_seeds)} row_seeds for {len(prompts)} prompts; pass one per prompt"
            )
        was_training = self.model.training
        self.model.eval()
        out: list[Sample] = []
        try:
            for start in range(0, len(prompts), self.max_batch):
                end = start + self.max_batch
                rows = sample_with_cache(
                    self.model,
                    self.store,
                    prompts[start:end],
                    max_new_tokens=max(1, int(max_new_tokens)),
                    temperature=float(temperature),
                    top_p=float(top_p),
                    stops=stops,
                    seeds=list(row_seeds[start:end]),
                )
                out.extend(Sample(ids, lps, reason) for ids, lps, reason in rows)
        finally:
            self.model.train(was_training)
        return out

    @torch.no_grad()
    def _sample_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stops: list[int],
        seed: int | None,
    ) -> list[Sample]:
        from transformers import GenerationConfig

        device = self.device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[row, width - len(p) :] = 1
        # A fresh config: no top_k, repetition penalty or other defaults from the checkpoint
        # may change the distribution we report logprobs for.
        gen_config = GenerationConfig(
            do_sample=True,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=0,
            max_new_tokens=int(max_new_tokens),
            eos_token_id=stops,
            pad_token_id=self.pad_id,
            bos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
        devices = [device] if device.type == "cuda" else []
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        try:
            with torch.random.fork_rng(devices=devices):
                if seed is not None:
                    torch.manual_seed(seed % (2**63))
                result = self.model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention.to(device),
                    generation_config=gen_config,
                    **self._shared_prefill(input_ids.to(device), attention.to(device)),
                )
        finally:
            self.model.train(was_training)
        new = result.sequences[:, width:]
        if new.shape[1] == 0:
            return [Sample([], [], "length") for _ in prompts]
        logits = torch.stack(result.logits, dim=1).float()  # [B, T, V] raw logits
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        chosen = logprobs.gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B, T]
        stop_set = set(stops)
        ids_list = new.tolist()
        lp_list = chosen.tolist()
        return [_cut(ids, lps, stop_set) for ids, lps in zip(ids_list, lp_list)]

    #: Prefill each distinct prompt of a ``generate`` batch once (a GRPO group repeats its prompt
    #: G times) and hand ``generate`` the keys/values indexed out to the rows.
    share_prefill: bool = True

    def _shared_prefill(self, input_ids: torch.Tensor, attention: torch.Tensor) -> dict[str, Any]:
        """``{"cache": ...}`` for ``generate`` when rows repeat a prompt, else ``{}``.

        The cache holds all but each row's last prompt token (``generate`` runs that one, so the
        first sampled token's logits come from it), with ``generate``'s own position ids for
        left-padded rows (``cumsum(mask) - 1``); the prompt is thus prefilled once per distinct
        prompt instead of once per row.
        """
        if not self.share_prefill or input_ids.shape[1] < 2:
            return {}
        index: dict[tuple[int, ...], int] = {}
        unit = [index.setdefault(tuple(row), len(index)) for row in input_ids.tolist()]
        if len(index) == len(unit):
            return {}
        import inspect

        from transformers.generation.utils import GenerationMixin

        # transformers 5 names the cache argument ``cache`` (``past_key_values`` before)
        generation = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
        name = "cache" if "cache" in generation else "past_key_values"
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        params = inspect.signature(base.forward).parameters
        extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}  # the cache is what counts
        first = torch.tensor([unit.index(u) for u in range(len(index))], device=input_ids.device)
        ids, mask = input_ids[first, :-1], attention[first, :-1]
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
        cache = getattr(out, "cache", None) or out.past_key_values
        cache.batch_select_indices(torch.tensor(unit, device=input_ids.device))
        return {name: cache}


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
        concurrency: Most requests in flight at once.
    """

    def __init__(
        self,
        base_url: str,
        model_name: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
        concurrency: int = 64,
    ) -> None:
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.model_name = model_name
        self.api_key = api_key if api_key is not None else os.environ.get("TWINRL_API_KEY")
        self.timeout = timeout
        self.transport = transport
        self.concurrency = concurrency

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
        each; unseeded prompts go as one request per distinct limit.

        Raises:
            SamplerError: the server is unreachable or answered with an error or a malformed body.
        """
        if not prompts:
            return []
        budgets = per_prompt_budgets(max_new_tokens, len(prompts))
        base: dict[str, Any] = {
            "model": self.model_name,
            "temperature": float(temperature),
            "top_p": float(top_p),
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if stop_ids:
            base["stop_token_ids"] = [int(t) for t in stop_ids]
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        stop_set = set(int(t) for t in stop_ids or ())
        async with httpx.AsyncClient(
            base_url=self.base_url, timeout=self.timeout, transport=self.transport, headers=headers,
            verify=tls_context(),
        ) as client:
            limit = asyncio.Semaphore(self.concurrency)
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
                body = {**base, "max_tokens": budgets[i], "prompt": [list(prompt)],
                        "seed": stable_seed("server-sampler", seed, i) % (2**31)}
                async with limit:
                    return (await self._request(client, body, 1, stop_set))[0]

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    async def _request(
        self, client: httpx.AsyncClient, body: dict[str, Any], n: int, stop_set: set[int]
    ) -> list[Sample]:
        try:
            response = await client.post("/completions", json=body)
        except httpx.HTTPError as exc:
            raise SamplerError(
                f"sampler server {self.base_url} unreachable ({type(exc).__name__}: {exc}); is it running?"
            ) from exc
        if response.status_code != 200:
            raise SamplerError(
                f"sampler server {self.base_url}/completions answered HTTP {response.status_code} for "
                f"model {self.model_name!r}: {response.text[:500]}"
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
                f"sampler server {self.base_url} sent a completion without token ids/logprobs ({exc}); "
                f"it must support return_token_ids and logprobs (vLLM >= 0.10 or twin serve)"
            ) from None
        if len(samples) != n:
            raise SamplerError(f"sampler server returned {len(samples)} choices for {n} prompts")
        return samples

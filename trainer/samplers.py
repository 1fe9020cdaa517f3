"""Samplers: continue token-id prompts, return the sampled ids and their logprobs.

One interface, two implementations:

- :class:`HFSampler`: batched transformers ``generate`` on the in-process model (with whatever
  LoRA adapter is active), CPU by default.
- :class:`ServerSampler`: the same over an OpenAI-compatible ``/v1/completions`` endpoint that
  takes token-id prompts (vLLM, or ``twin serve``).

Logprobs are those of the distribution sampled from at temperature ``T``:
``log_softmax(logits / T)`` of the sampled token (top-p truncation is not folded in, matching what
the learner recomputes). Both samplers are deterministic given ``seed``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import httpx
import torch

from twin.cases import stable_seed
from twin.errors import ConfigError, TwinError

__all__ = ["HFSampler", "Sample", "Sampler", "SamplerError", "ServerSampler"]


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
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """Sample one completion per prompt, in order."""
        ...


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
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_batch: int = 256) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ConfigError("HFSampler: the tokenizer has neither a pad nor an eos token; set one")
        self.pad_id = int(pad)

    @property
    def device(self) -> torch.device:
        """Device of the model's parameters."""
        return next(self.model.parameters()).device

    def sample(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """Sample one completion per prompt (see :class:`Sampler`).

        Args:
            prompts: Token-id prompts (non-empty lists).
            max_new_tokens: Most tokens to sample per prompt.
            temperature: Sampling temperature (> 0).
            top_p: Nucleus threshold.
            stop_ids: Ids that end a completion (default: the tokenizer's eos).
            seed: Seeds a private RNG stream for this call (the global RNG is left unchanged).

        Returns:
            One :class:`Sample` per prompt, in order.
        """
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise SamplerError("HFSampler: every prompt needs at least one token")
        if temperature <= 0:
            raise ConfigError(f"HFSampler: temperature must be > 0, got {temperature}")
        stops = list(stop_ids) if stop_ids else [self.tokenizer.eos_token_id]
        out: list[Sample] = []
        for start in range(0, len(prompts), self.max_batch):
            chunk = prompts[start : start + self.max_batch]
            chunk_seed = None if seed is None else stable_seed("hf-sampler", seed, start)
            out.extend(self._sample_batch(chunk, max_new_tokens, temperature, top_p, stops, chunk_seed))
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
        api_key: Bearer token, if the server wants one.
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
        self.api_key = api_key
        self.timeout = timeout
        self.transport = transport
        self.concurrency = concurrency

    def sample(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
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
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ) -> list[Sample]:
        """Sample one completion per prompt, in order.

        Raises:
            SamplerError: the server is unreachable or answered with an error or a malformed body.
        """
        if not prompts:
            return []
        base: dict[str, Any] = {
            "model": self.model_name,
            "max_tokens": int(max_new_tokens),
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
            base_url=self.base_url, timeout=self.timeout, transport=self.transport, headers=headers
        ) as client:
            if seed is None:
                return await self._request(client, {**base, "prompt": [list(p) for p in prompts]}, len(prompts), stop_set)
            limit = asyncio.Semaphore(self.concurrency)

            async def one(i: int, prompt: list[int]) -> Sample:
                body = {**base, "prompt": [list(prompt)], "seed": stable_seed("server-sampler", seed, i) % (2**31)}
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

"""A local model as a twin policy: ``twin eval catalog --policy hf:smollm2``.

:class:`HFPolicy` acts through the trainer's own parts, so an evaluation sees the model exactly as
training does: the :class:`trainer.renderer.Renderer` builds each episode's token sequence from
the chat template with the twin's tool schemas (token-exact across turns: sampled ids are kept,
never re-tokenized), the :class:`trainer.samplers.HFSampler` samples (with the decoding engine
of ``twin serve``, ``trainer/serving/engine.py``), and the completion is decoded into an
assistant message (content + parsed ``tool_calls``).

Concurrent episodes are batched: each ``act`` queues its prompt, and one task hands every queued
prompt to the sampler as one batch in a thread, so the event loop (and the tools) keep running.

Specs: ``hf:MODEL[,key=value...]`` with ``MODEL`` = ``tiny``, ``smollm2``, a local HF folder or a
twinrl checkpoint (``<output_dir>/checkpoints/step-N`` of an SFT or GRPO run, or the run's output
folder for its latest checkpoint: its base model with the adapter merged in, or its full weights,
rendered with the chat template of its recipe), and
options ``temperature`` (0.7), ``top_p`` (1.0), ``max_new_tokens`` (128: a catalog submit call
is under 100 tokens), ``dtype`` (auto),
``device`` (cpu), ``adapter`` (a LoRA adapter folder, e.g. a training checkpoint), ``seed`` (0),
``max_batch`` (32), ``prefix_cache`` (1: reuse keys/values across turns and the shared system
prompt; 0 = prefill the whole conversation every turn), ``autocast`` (``bfloat16``: run the
model under ``torch.autocast``; its linear layers' weights are stored in that dtype once, which
gives the same samples without autocast's copy of every weight on every decoded token; 1.5-2x
faster on a CPU with AMX, see docs/benchmarks.md; ``auto``: bfloat16 where the device computes it
natively, else none), ``threads`` (torch CPU threads; default
``OMP_NUM_THREADS``, else the cores the machine's load leaves idle:
:func:`trainer.threads.default_cpu_threads`). Everything loads offline.
``temperature=0`` samples greedily.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twin.cases import stable_seed
from twin.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from twin.core import Twin

__all__ = ["HFPolicy", "cast_linear_weights", "parse_hf_spec"]

Message = dict[str, Any]


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value not in {"0", "1", "true", "false"}:
        raise ValueError(raw)
    return value in {"1", "true"}


_flag.__name__ = "0 or 1"

_OPTION_TYPES: dict[str, Callable[[str], Any]] = {
    "temperature": float,
    "top_p": float,
    "max_new_tokens": int,
    "dtype": str,
    "device": str,
    "adapter": str,
    "seed": int,
    "max_batch": int,
    "prefix_cache": _flag,
    "autocast": str,
    "threads": int,
}


def parse_hf_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``hf:MODEL,key=value,...`` into the model and typed options.

    Raises:
        ConfigError: not an ``hf:`` spec, an unknown option or a value of the wrong type.
    """
    kind, _, rest = spec.partition(":")
    if kind != "hf" or not rest:
        raise ConfigError(
            f"expected a policy spec like 'hf:smollm2' or 'hf:PATH,temperature=0.2', got {spec!r}"
        )
    model, *parts = rest.split(",")
    options: dict[str, Any] = {}
    for part in parts:
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq or key not in _OPTION_TYPES:
            raise ConfigError(
                f"policy {spec!r}: option {part!r} is not key=value with key one of "
                f"{', '.join(_OPTION_TYPES)}"
            )
        try:
            options[key] = _OPTION_TYPES[key](raw.strip())
        except ValueError:
            raise ConfigError(
                f"policy {spec!r}: {key} must be "
                f"{getattr(_OPTION_TYPES[key], '__name__', 'valid')}, got {raw!r}"
            ) from None
    return model, options


def cast_linear_weights(
    model: torch.nn.Module, dtype_name: str, *, frozen_only: bool = False
) -> int:
    """Store every ``nn.Linear``'s weight and bias in ``dtype_name`` (``"bfloat16"``), once, for a
    model that samples under ``torch.autocast`` to that dtype with fixed weights (an evaluation),
    or, with ``frozen_only``, only the layers whose weight is not trained (a LoRA learner's base
    layers: its adapters keep their dtype and stay trainable).

    Autocast runs a linear layer on its weight rounded to the autocast dtype, and rounds it again
    on every call: at one decoded token per forward pass that copy was 39% of a CPU evaluation's
    time (``docs/benchmarks.md``). Rounded once here, the layers compute the same numbers (same
    sampled ids and logprobs, tested) without the copies. Embeddings and norms keep their dtype; a
    head tied to the embeddings gets its own rounded weight, so the embedding table stays as it
    was. Without ``frozen_only``, do not call it on a model that is being trained.

    Returns:
        How many layers were cast.
    """
    import torch

    from trainer.models import resolve_dtype

    dtype = resolve_dtype(dtype_name)
    cast = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.dtype == dtype:
            continue
        if frozen_only and module.weight.requires_grad:
            continue
        module.weight = torch.nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
        if module.bias is not None:
            module.bias = torch.nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)
        cast += 1
    return cast


# How long the batcher waits for more prompts (seconds): a turn costs seconds on CPU.
_GATHER_TICK_S = 0.02
_GATHER_S = 0.25


@dataclass
class _Pending:
    ids: list[int]
    seed: int
    future: asyncio.Future[Any]


@dataclass
class _Batcher:
    """Collects prompts from concurrent episodes of one event loop; samples them together."""

    policy: HFPolicy
    pending: list[_Pending] = field(default_factory=list)
    running: bool = False

    async def sample(self, ids: list[int], seed: int) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append(_Pending(ids, seed, future))
        if not self.running:
            self.running = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self.pending:
                # Let every episode that is ready queue its prompt before the batch is cut:
                # episodes come back from env.step (in threads) a few ms apart, and a batch
                # cut too early splits the next turn into a small and a large generate.
                for _ in range(3):
                    await asyncio.sleep(0)
                waited = 0.0
                while len(self.pending) < self.policy.max_batch and waited < _GATHER_S:
                    seen = len(self.pending)
                    await asyncio.sleep(_GATHER_TICK_S)
                    waited += _GATHER_TICK_S
                    if len(self.pending) == seen:
                        break
                batch = self.pending[: self.policy.max_batch]
                del self.pending[: len(batch)]
                try:
                    samples = await asyncio.to_thread(
                        self.policy.sample_batch, [p.ids for p in batch], [p.seed for p in batch]
                    )
                except Exception as exc:  # noqa: BLE001 - every waiting episode gets the error
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(exc)
                    continue
                for p, s in zip(batch, samples, strict=True):
                    if not p.future.done():
                        p.future.set_result(s)
        finally:
            self.running = False


class HFPolicy:
    """A local causal LM acting in a twin through the trainer's renderer and sampler.

    Args:
        model: A transformers causal LM (a peft model with an adapter works too).
        tokenizer: Its tokenizer, with a chat template.
        name: The policy's name in runs and reports.
        temperature: Sampling temperature; 0 = greedy.
        top_p: Nucleus threshold.
        max_new_tokens: Most tokens per assistant turn (less when the context is nearly full).
        seed: With the episode key and the turn number, seeds each turn's sample, so an
            episode's samples do not depend on which episodes it was batched with.
        max_batch: Most episodes sampled together.
        prefix_cache: Reuse keys/values across turns and across episodes' common prompt
            prefix (see :class:`trainer.samplers.HFSampler`); only valid while the weights
            stay fixed (an evaluation).
        cache_bytes: Memory bound of that cache.
        chat_template: Render with this template instead of the tokenizer's (a shipped name, a
            ``.jinja`` path or the text; see :func:`trainer.renderer.load_chat_template`).
        template_kwargs: Extra chat template variables on every render.
        autocast: Sample under ``torch.autocast`` to this dtype (``"bfloat16"``; None = the
            weights' dtype).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str = "hf",
        temperature: float = 0.7,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        seed: int = 0,
        max_batch: int = 32,
        prefix_cache: bool = True,
        cache_bytes: int = 4 << 30,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        autocast: str | None = None,
    ) -> None:
        from trainer.models import resolve_autocast
        from trainer.samplers import HFSampler

        if temperature < 0:
            raise ConfigError(f"HFPolicy: temperature must be >= 0 (0 = greedy), got {temperature}")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.seed = seed
        self.max_batch = max_batch
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self.autocast = resolve_autocast(autocast, next(model.parameters()).device)
        self.sampler = HFSampler(
            model,
            tokenizer,
            max_batch=max_batch,
            prefix_cache=prefix_cache,
            cache_bytes=cache_bytes,
            autocast=self.autocast,  # a bad dtype fails here, not in the first turn
        )
        config = getattr(model, "config", None)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self._batches = 0
        self._batchers: dict[int, _Batcher] = {}  # per event loop (each asyncio.run has its own)

    @classmethod
    def from_spec(cls, spec: str, twin: Twin | None = None) -> HFPolicy:
        """Load the model named by ``hf:MODEL[,key=value...]`` (see the module docstring), offline.

        Args:
            spec: The policy spec.
            twin: The twin it will act in (unused: tools come with each ``act``).
        """
        from trainer.checkpoint import checkpoint_model_config, is_checkpoint, load_checkpoint_model
        from trainer.models import load_model

        model_spec, options = parse_hf_spec(spec)
        device = options.pop("device", "cpu")
        threads = options.pop("threads", None)
        if device == "cpu":
            from trainer.threads import place_cpu_threads

            place_cpu_threads(threads)
        if is_checkpoint(
            model_spec
        ):  # an SFT / GRPO checkpoint: its weights, its recipe's template
            model, tokenizer = load_checkpoint_model(
                model_spec, options.pop("dtype", "auto"), device
            )
            model_cfg = checkpoint_model_config(model_spec)
            options.setdefault("chat_template", model_cfg.get("chat_template"))
            options.setdefault("template_kwargs", model_cfg.get("template_kwargs") or {})
        else:
            model, tokenizer = load_model(model_spec, options.pop("dtype", "auto"), device)
        adapter = options.pop("adapter", None)
        if adapter:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter).eval()
        policy = cls(model, tokenizer, name=spec, **options)  # checks the autocast dtype first
        if policy.autocast:
            cast_linear_weights(model, policy.autocast)
        return policy

    # -- sampling ----------------------------------------------------------------------------
    def _stop_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id]

    def sample_batch(self, prompts: list[list[int]], seeds: list[int] | None = None) -> list[Any]:
        """Sample one turn for each prompt (blocking; called in a worker thread).

        Args:
            prompts: Token-id prompts.
            seeds: One seed per prompt (default: derived from the batch number).
        """
        from trainer.samplers import HFSampler

        self._batches += 1
        options: dict[str, Any] = {}
        if seeds is not None and isinstance(self.sampler, HFSampler):
            options["row_seeds"] = seeds
        return self._sample_rows(prompts, options)  # HFSampler enters autocast in this thread

    def _sample_rows(self, prompts: list[list[int]], options: dict[str, Any]) -> list[Any]:
        room = self.max_context - max(len(p) for p in prompts)
        return self.sampler.sample(
            prompts,
            max_new_tokens=max(1, min(self.max_new_tokens, room)),
            temperature=self.temperature,
            top_p=self.top_p,
            stop_ids=self._stop_ids(),
            seed=stable_seed("hf-policy", self.seed, self._batches),
            **options,
        )

    async def _sample(self, ids: list[int], seed: int) -> Any:
        loop = asyncio.get_running_loop()
        batcher = self._batchers.get(id(loop))
        if batcher is None:
            self._batchers = {id(loop): _Batcher(self)}  # drop batchers of finished loops
            batcher = self._batchers[id(loop)]
        return await batcher.sample(ids, seed)

    # -- acting ------------------------------------------------------------------------------
    def renderer(self, tools: Sequence[dict[str, Any]]) -> Any:
        """A fresh :class:`trainer.renderer.Renderer` for this model and ``tools``."""
        from trainer.renderer import Renderer

        return Renderer(
            self.tokenizer,
            list(tools),
            chat_template=self.chat_template,
            template_kwargs=self.template_kwargs,
        )

    def for_episode(self, key: str) -> _EpisodePolicy:
        """An actor that keeps one episode's token sequence across turns (called by the runner)."""
        return _EpisodePolicy(self, key)

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """The next assistant message, rendering the whole conversation afresh."""
        return await _EpisodePolicy(self, "").act(messages, tools)


class _EpisodePolicy:
    """One episode's actor: appends each turn's new messages to the same token sequence."""

    def __init__(self, parent: HFPolicy, key: str) -> None:
        self.parent = parent
        self.key = key
        self.name = parent.name
        self._renderer: Any = None
        self._seen = 0  # messages already in the renderer
        self._turn = 0

    @property
    def token_turns(self) -> list[Any]:
        """The episode's sampled turns as :class:`twin.trajectory.TokenTurn` records."""
        return self._renderer.token_turns() if self._renderer is not None else []

    async def act(self, messages: list[Message], tools: list[dict[str, Any]]) -> Message:
        """Sample the next assistant turn for ``messages`` (not mutated)."""
        if self._renderer is None or len(messages) <= self._seen:
            # First turn, or a conversation that is not ours continued: render it afresh.
            self._renderer = self.parent.renderer(tools)
            self._renderer.start(messages)
        else:
            self._renderer.add_messages(messages[self._seen :])
        seed = stable_seed("hf-policy", self.parent.seed, self.key, self._turn)
        self._turn += 1
        sample = await self.parent._sample(self._renderer.ids, seed)
        message = self._renderer.add_completion(sample.ids, sample.logprobs)
        self._seen = len(messages) + 1
        return dict(message)

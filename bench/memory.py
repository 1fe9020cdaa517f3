"""Measure what a learner step keeps for backward, per token and decoder layer.

``twin plan`` (:mod:`trainer.plan`) budgets the learner's activations from constants per token
and layer; this module measures them, so that the constants can be checked against a real
architecture's shapes on CPU (``tests/trainer/test_memory_plan.py``)::

    python -m bench.memory --model qwen3-8b --layers 2 --tokens 256 --lora-rank 64
    python -m bench.memory --model qwen3-8b --checkpointing

The model is randomly initialised from the published shapes (:data:`trainer.plan.KNOWN_MODELS`)
with a small vocabulary: what a layer keeps per token does not depend on the vocabulary.

Counting: every tensor autograd saves while a decoder layer runs
(:func:`torch.autograd.graph.saved_tensors_hooks`), once per storage, weights excluded; with
activation checkpointing autograd saves nothing inside a layer, and what the checkpoint keeps to
recompute it (the layer's inputs, the KV cache it reads) is counted instead.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import torch

from trainer.saved_tensors import saved_bytes

__all__ = ["Measured", "measure_learner_activations", "measure_logprob_peak", "saved_bytes"]


@dataclass(frozen=True)
class Measured:
    """Saved bytes of one learner forward pass, per token and decoder layer."""

    per_token_layer: float
    tokens: int
    layers: int


def measure_learner_activations(
    model: str = "qwen3-8b",
    *,
    layers: int = 2,
    tokens: int = 256,
    rows: int = 1,
    prompt: int = 0,
    lora_rank: int | None = 64,
    target_modules: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    checkpointing: bool = False,
    vocab: int = 256,
    attn_implementation: str = "sdpa",
) -> Measured:
    """Build a random-init model with ``model``'s layer shapes and count one forward's saved bytes.

    Args:
        model: A name of :data:`trainer.plan.KNOWN_MODELS` (hidden, heads, MLP sizes).
        layers: Decoder layers to build.
        tokens: Tokens per row.
        rows: Rows; with ``prompt > 0`` they share their first ``prompt`` tokens and go through
            the shared-prompt path (the prompt once, its KV cache expanded to the rows).
        prompt: Shared prompt length (0: the padded path).
        lora_rank: LoRA rank (None: full fine-tuning).
        target_modules: LoRA targets (default: all seven projections).
        dtype: Base weights' dtype.
        checkpointing: Activation checkpointing on.
        vocab: Vocabulary of the built model (kept small; it does not change per-layer figures).
        attn_implementation: transformers attention kernel.

    Returns:
        :class:`Measured`: bytes saved inside decoder layers (all but the first, whose input
        needs no gradient under LoRA) / (budget tokens x those layers), where the budget tokens
        are what the learner charges to ``optim.micro_batch_tokens`` for the micro-batch
        (``rows x tokens`` padded; with a shared prompt ``prompt + rows x (suffix + kappa x
        prompt)``).
    """
    from trainer.config import AlgorithmConfig, OptimConfig
    from trainer.learner import Learner, TrainBatch
    from trainer.scoring import decoder_layers

    lm = _random_lm(
        model, layers, vocab, max(4096, tokens), dtype, attn_implementation,
        lora_rank, target_modules,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(5, vocab, (prompt,), generator=g).tolist()
    # the last row one token short: a padded batch, as in training (sdpa then gets a mask)
    lengths = [tokens] * (rows - 1) + [tokens - 1]
    ids = [shared + torch.randint(5, vocab, (n - prompt,), generator=g).tolist() for n in lengths]
    first = max(prompt, 1)
    mask = [[0] * first + [1] * (n - first) for n in lengths]
    batch = TrainBatch(ids, mask, [[0.0] * n for n in lengths], [1.0] * rows)
    learner = Learner(
        lm,
        algorithm=AlgorithmConfig(),
        optim=OptimConfig(
            micro_batch_tokens=10 * rows * tokens, gradient_checkpointing=checkpointing
        ),
        shared_prefix=prompt > 0,
    )
    ((mrows, units),) = list(learner.scorer.plan(list(range(rows)), batch))
    mb = learner.scorer.pad(mrows, batch, units)
    lm.train()
    # The first layer's input (the embeddings) needs no gradient under LoRA: count the others.
    counted_layers = decoder_layers(lm)[1:] if layers > 1 else decoder_layers(lm)
    with saved_bytes(exclude=lm.parameters(), within=counted_layers) as counted:
        logp, _ = learner.scorer.forward(mb)
    del logp
    if prompt:  # what the learner charges to the budget for this micro-batch
        budget = prompt + rows * (
            (tokens - prompt) + learner.scorer.shared_prompt_weight() * prompt
        )
    else:
        budget = rows * tokens
    return Measured(
        counted.total / (budget * len(counted_layers)), int(budget), len(counted_layers)
    )


def _random_lm(
    model: str,
    layers: int,
    vocab: int,
    positions: int,
    dtype: torch.dtype,
    attn_implementation: str,
    lora_rank: int | None,
    target_modules: list[str] | None,
) -> torch.nn.Module:
    """A random-init causal LM with ``model``'s layer shapes, made trainable: LoRA on
    ``target_modules`` (default: all seven projections), or every weight (``lora_rank`` None)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.learner import build_lora_model
    from trainer.plan import KNOWN_MODELS

    dims = replace(KNOWN_MODELS[model], layers=layers, vocab=vocab)
    kind = "qwen3" if dims.qk_norm else ("qwen2" if dims.qkv_bias else "llama")
    config = AutoConfig.for_model(
        kind,
        hidden_size=dims.hidden,
        num_hidden_layers=layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        head_dim=dims.head_dim,
        intermediate_size=dims.intermediate,
        vocab_size=vocab,
        tie_word_embeddings=dims.tied,
        max_position_embeddings=positions,
    )
    config._attn_implementation = attn_implementation
    with torch.device("cpu"):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora_rank is None:
        for p in lm.parameters():
            p.requires_grad_(True)
        return lm
    targets = target_modules or [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    ]  # fmt: skip
    return build_lora_model(
        lm, lora_rank=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets
    )


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def measure_logprob_peak(
    tokens: int,
    vocab: int,
    *,
    hidden: int = 64,
    chunk: int = 512,
    dtype: str = "float32",
    seed: int = 0,
) -> int:
    """Peak resident bytes of one learner logprob path (forward with entropy, then backward).

    Linux only; run it in a fresh process (``python -m bench.memory --logits``): it reads the
    process's resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
    around :func:`trainer.logits.chunked_logprobs` over ``tokens`` positions of a ``hidden ->
    vocab`` output layer without grad (LoRA's), as :class:`trainer.scoring.BatchScorer` calls it.
    torch's CPU allocator returns these large blocks to the OS when they are freed, so the mark is
    the path's peak of live tensors.

    Returns:
        Bytes above the resident set before the path ran.
    """
    from trainer.logits import chunked_logprobs

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    kind = getattr(torch, dtype)
    head = torch.nn.Linear(hidden, vocab, bias=False).requires_grad_(False).to(kind)
    h = torch.randn(tokens, hidden, dtype=kind, requires_grad=True)
    targets = torch.randint(vocab, (tokens,))
    warm, _ = chunked_logprobs(h[:4], head, targets[:4], chunk=2, entropy=True)  # load the kernels
    warm.sum().backward()
    h.grad = None
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident set
    except OSError:
        pass  # the mark then includes start-up's peak, which is below the path's at these sizes
    base = _rss("VmRSS")
    logp, _ = chunked_logprobs(h, head, targets, chunk=chunk, entropy=True)
    logp.sum().backward()
    return _rss("VmHWM") - base


def main(argv: list[str] | None = None) -> int:
    """Print measured and planned KiB per token per layer."""
    from trainer.plan import KNOWN_MODELS, activation_bytes_per_token_layer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(KNOWN_MODELS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--lora-rank", type=int, default=64, help="0: full fine-tuning")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--logits",
        action="store_true",
        help="measure the logprob path's peak instead (--tokens positions, --vocab, --chunk)",
    )
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args(argv)
    if args.logits:
        from trainer.logits import logit_peak_bytes

        peak = measure_logprob_peak(args.tokens, args.vocab, chunk=args.chunk, dtype=args.dtype)
        planned = logit_peak_bytes(args.tokens, args.vocab, args.chunk)
        print(
            f"logprob path, {args.tokens} tok x {args.vocab} vocab, chunk {args.chunk}: measured "
            f"{peak / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB"
        )
        return 0
    dtype = getattr(torch, args.dtype)
    m = measure_learner_activations(
        args.model, layers=args.layers, tokens=args.tokens, lora_rank=args.lora_rank or None,
        dtype=dtype, checkpointing=args.checkpointing,
    )  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    planned = activation_bytes_per_token_layer(
        KNOWN_MODELS[args.model], dtype.itemsize, lora_targets=targets if args.lora_rank else None,
        lora_rank=args.lora_rank, checkpointing=args.checkpointing,
    )  # fmt: skip
    print(
        f"{args.model} x {args.layers} layers, {args.tokens} tok, {args.dtype}, "
        f"{'LoRA r' + str(args.lora_rank) if args.lora_rank else 'full'}, checkpointing "
        f"{args.checkpointing}: "
        f"measured {m.per_token_layer / 1024:.1f} KiB/tok/layer, planned {planned / 1024:.1f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

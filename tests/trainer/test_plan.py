"""`twin plan`: memory figures checked by hand, parameter counts against real models, the 9B recipe
fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trainer.config import load_recipe
from trainer.plan import KNOWN_MODELS, lora_parameters, main, model_dims, plan_recipe
from twin.errors import ConfigError

TOY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "intermediate_size": 16,
    "vocab_size": 32,
    "tie_word_embeddings": False,
}

# The layout of COMMON.md with the workstation's model; used when the shipped recipe is absent.
CATALOG_9B = {
    "seed": 0,
    "twin": {"name": "Catalog", "config": {}, "split": "train"},
    "model": {"path": "Qwen/Qwen3-8B", "dtype": "bfloat16"},
    "lora": {
        "enabled": True,
        "rank": 64,
        "alpha": 128,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    },
    "sampler": {
        "kind": "vllm",
        "temperature": 1.0,
        "max_new_tokens": 512,
        "max_episode_tokens": 8192,
    },
    "algorithm": {"group_size": 8, "groups_per_step": 16},
    "optim": {"lr": 1e-5, "micro_batch_tokens": 4096},
    "train": {"steps": 200, "output_dir": "runs/catalog-9b"},
    "devices": {"rollout": "cuda:0", "learner": "cuda:1"},
    "async": {"max_staleness": 1, "queue_size": 4},
}


def _toy_recipe(tmp_path: Path, **devices: str) -> object:
    (tmp_path / "config.json").write_text(json.dumps(TOY_CONFIG))
    return load_recipe(
        {
            "twin": {"name": "Toy"},
            "model": {"path": str(tmp_path), "dtype": "float32"},
            "lora": {"rank": 2, "target_modules": ["q_proj", "v_proj"]},
            "sampler": {"kind": "hf", "max_episode_tokens": 16},
            "algorithm": {"group_size": 2, "groups_per_step": 1},
            "optim": {"micro_batch_tokens": 16},
            "devices": devices or {"rollout": "cpu", "learner": "cpu"},
        }
    )


def test_toy_figures_computed_by_hand(tmp_path: Path) -> None:
    recipe = _toy_recipe(tmp_path)
    dims = model_dims(str(tmp_path))
    # embed 32x8 twice (untied) + 2 layers x (q 64 + k 32 + v 32 + o 64 + mlp 3x8x16 + norms 16) +
    # norm 8
    assert dims.parameters == 512 + 2 * 592 + 8 == 1704
    # rank 2: q (8 in + 8 out), v (8 in + 4 out), per layer
    assert lora_parameters(dims, 2, ["q_proj", "v_proj"]) == 2 * (2 * 16 + 2 * 12) == 112
    (cpu,) = plan_recipe(recipe)
    assert cpu.roles == ["rollout", "learner"]
    parts = {c.name: c.bytes for c in cpu.components}
    assert parts == {
        "sampler KV cache": 2
        * 16
        * (2 * 1 * 4 * 2 * 4),  # seqs x tokens x (layers x kv x hd x 2 x fp32)
        "learner weights": 1704 * 4,
        "learner LoRA weights": 112 * 4,
        "learner gradients": 112 * 4,
        "learner AdamW state": 112 * 8,
        # per token and layer: (4 hidden + q + 2 kv + 2 q + 4 intermediate) x 4 B = 512 B
        # per token and layer: 2 norms' fp32 inputs 2x8x4 + sdpa q, k/v repeated, out 4x8x4
        # + MLP 3x16x4 + LoRA q and v: (8 in + rank 2) x 4 each = 464 bytes
        "learner activations": 16 * 2 * 464,
        # min(tokens 16, optim.logit_chunk_tokens 1024) x vocab x 8 B (trainer/logits.py)
        "learner logits": 16 * 32 * 8,
    }
    assert cpu.total == 10656 + 16 * 2 * 464 + 16 * 32 * 8  # weights, LoRA, KV, ... + the two above
    assert cpu.fits


def test_checkpointing_keeps_layer_inputs_and_one_layer(tmp_path: Path) -> None:
    recipe = _toy_recipe(tmp_path)
    (cpu,) = plan_recipe(recipe, gradient_checkpointing=True)
    parts = {c.name: c.bytes for c in cpu.components}
    assert parts["learner activations"] == 16 * (2 * 8 * 4 + 464)  # 2 layer inputs + 1 layer


def test_two_devices_get_two_tables_with_runtime(tmp_path: Path) -> None:
    recipe = _toy_recipe(tmp_path, rollout="cuda:0", learner="cuda:1")
    rollout, learner = plan_recipe(recipe, gpu_memory_gb=1)
    assert (rollout.device, learner.device) == ("cuda:0", "cuda:1")
    names = [c.name for c in rollout.components]
    assert names[0] == "weights" and "KV cache" in names and "runtime" in names
    assert "AdamW state" in [c.name for c in learner.components]
    assert rollout.capacity == 1e9


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_parameter_count_matches_transformers(tmp_path: Path, model_type: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "vocab_size": 100,
        "tie_word_embeddings": model_type != "llama",
    }
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    config = AutoConfig.for_model(model_type, **kwargs)
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    assert model_dims(str(tmp_path)).parameters == sum(p.numel() for p in model.parameters())


def test_known_models_match_published_sizes() -> None:
    assert KNOWN_MODELS["smollm2-135m"].parameters == 134_515_008  # SmolLM2-135M model card
    assert round(KNOWN_MODELS["qwen3-8b"].parameters / 1e9, 2) == 8.19  # "8.2B", 8.19B total
    assert round(KNOWN_MODELS["qwen2.5-7b"].parameters / 1e9, 2) == 7.62
    assert round(KNOWN_MODELS["llama-3.1-8b"].parameters / 1e9, 2) == 8.03
    assert round(KNOWN_MODELS["gemma-2-9b"].parameters / 1e9, 2) == 9.24
    assert model_dims("Qwen/Qwen3-8B-Instruct").name == "Qwen3-8B"
    assert model_dims("/models/llama-3.1-8b-instruct").name == "Llama-3.1-8B"
    assert model_dims("smollm2").name == "SmolLM2-135M"
    with pytest.raises(ConfigError, match="Qwen3-8B"):
        model_dims("/nowhere/mystery-model")


def test_unknown_lora_target_is_an_error() -> None:
    with pytest.raises(ConfigError, match="q_proj"):
        lora_parameters(KNOWN_MODELS["tiny"], 8, ["query"])
    assert lora_parameters(KNOWN_MODELS["tiny"], 1, ["all-linear"]) > lora_parameters(
        KNOWN_MODELS["tiny"], 1, ["q_proj"]
    )


def _catalog_9b(tmp_path: Path) -> Path:
    shipped = Path(__file__).resolve().parents[2] / "data" / "recipes" / "catalog-9b-2x96gb.yaml"
    if shipped.exists():
        return shipped
    path = tmp_path / "catalog-9b-2x96gb.yaml"
    path.write_text(yaml.safe_dump(CATALOG_9B))
    return path


def test_catalog_9b_recipe_fits_two_96gb_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _catalog_9b(tmp_path)
    plans = plan_recipe(load_recipe(path), gpu_memory_gb=96)
    assert [p.device for p in plans] == ["cuda:0", "cuda:1"]
    for p in plans:
        assert (
            p.total > 20 * 1024**3
        )  # an 8-9 B model in bf16 and its KV cache / optimizer: not trivial
        assert p.fits, [(c.name, round(c.bytes / 1024**3, 2)) for c in p.components]
    assert main(str(path), gpu_memory_gb=96) == 0
    out = capsys.readouterr().out
    assert out.count("FITS") == 2 and "DOES NOT FIT" not in out


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_the_rollout_plan_charges_the_adapters_the_sampler_server_holds(
    tmp_path: Path, staleness: int
) -> None:
    recipe = load_recipe(_catalog_9b(tmp_path), [f"async.max_staleness={staleness}"])
    rollout = plan_recipe(recipe, gpu_memory_gb=96)[0]
    (adapters,) = [c for c in rollout.components if c.name == "LoRA adapters"]
    assert adapters.note.startswith(f"{staleness + 2} resident x ")  # as max_loras = staleness + 2


def test_a_recipe_that_does_not_fit_exits_1_and_suggests_a_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = {**CATALOG_9B, "optim": {"micro_batch_tokens": 65536}}
    assert main(data, gpu_memory_gb=96) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "micro_batch_tokens <=" in out


def test_an_unknown_twin_split_is_refused_as_twin_train_refuses_it(tmp_path: Path) -> None:
    from trainer.plan import check_runnable
    from twin.errors import CaseError

    recipe = load_recipe("toy-cpu", [f"train.output_dir={tmp_path}", "twin.split=trian"])
    with pytest.raises(CaseError, match=r"unknown split 'trian'; splits: train"):
        check_runnable(recipe)
    check_runnable(load_recipe("toy-cpu", [f"train.output_dir={tmp_path}", "twin.split=dev"]))

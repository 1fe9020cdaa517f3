"""The async trainer's sync probe scores the twin's opening as the episodes render it: with the
recipe's ``model.chat_template`` and ``model.template_kwargs``, not the tokenizer's own template."""

from __future__ import annotations

from pathlib import Path


def test_probe_sequence_uses_the_recipes_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from trainer.config import load_recipe
    from trainer.probe import PROBE_MAX_TOKENS, probe_sequence
    from trainer.renderer import Renderer
    from trainer.tiny import build_tiny
    from twin.env import TwinEnv
    from twin.registry import make_twin

    cfg = load_recipe("toy-lora-cpu", [
        "model.chat_template=qwen3", "model.template_kwargs={enable_thinking: false}",
        f"train.output_dir={tmp_path / 'run'}", "train.store=false",
    ])  # fmt: skip
    twin = make_twin(cfg.twin.name, **cfg.twin.config)
    tokenizer = AutoTokenizer.from_pretrained(build_tiny(), local_files_only=True)
    probe = probe_sequence(twin, tokenizer, cfg)
    obs, info = TwinEnv(twin).reset(options={"split": cfg.twin.split, "index": 0})
    episode = Renderer(tokenizer, info["tools"], chat_template="qwen3",
                       template_kwargs={"enable_thinking": False}).start(obs)  # fmt: skip
    assert probe == list(episode)[:PROBE_MAX_TOKENS]
    text = tokenizer.decode(probe)
    assert text.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )  # qwen3 with thinking off

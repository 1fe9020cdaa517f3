"""The tiny model: offline loading, determinism, cache, cheap tool-call syntax, chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from trainer.tiny import CALL_TOKENS, CALL_WORDS, TINY_WORDS, WHOLE_CALL_TOKENS, build_tiny
from twin.errors import ConfigError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit the answer.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
            },
        },
    }
]


def chat(tok, messages) -> str:
    """The template's text with TOOLS and the generation prompt."""
    return tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def tok(tiny_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


def _digests(d: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())}


def test_loads_offline_with_auto_classes(tiny_dir: Path, tok, monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    assert model.config.vocab_size == len(tok) <= 1024
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    ids = torch.tensor([tok.encode("the answer is red", add_special_tokens=False)])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()


def test_same_seed_same_bytes_other_seed_other_weights(tiny_dir: Path, tmp_path: Path) -> None:
    again = build_tiny(tmp_path / "again")
    other = build_tiny(tmp_path / "other", seed=1)
    assert _digests(again) == _digests(tiny_dir)
    d_other = _digests(other)
    assert d_other["model.safetensors"] != _digests(tiny_dir)["model.safetensors"]
    assert d_other["tokenizer.json"] == _digests(tiny_dir)["tokenizer.json"]


def test_build_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny(tmp_path / "m", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_cache_under_twinrl_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TWINRL_CACHE", str(tmp_path))
    first = build_tiny(extra_corpus=["zebra zebra zebra"])
    assert first.parent == tmp_path and first.name.startswith("tiny-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny(extra_corpus=["zebra zebra zebra"]) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert build_tiny() != first  # another corpus, another key


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not a tiny-model build"):
        build_tiny(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_tool_call_is_cheap_in_tokens(tok) -> None:
    text = '<tool_call>\n{"name": "submit", "arguments": {"answer": "red"}}\n</tool_call><|im_end|>'
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    # The toy's answer words: the whole submit call is one token (WHOLE_CALL_TOKENS).
    assert pieces == [WHOLE_CALL_TOKENS[CALL_WORDS.index("red")], "<|im_end|>"]
    assert tok.decode(ids) == text
    # Any other answer: the fixed prefix, the word and the fixed suffix (CALL_TOKENS).
    other_answer = text.replace("red", "apple")
    assert [tok.decode([i]) for i in tok.encode(other_answer, add_special_tokens=False)] == [
        CALL_TOKENS[0],
        "apple",
        CALL_TOKENS[1],
        "<|im_end|>",
    ]
    assert tok.decode(tok.encode(other_answer, add_special_tokens=False)) == other_answer
    # Any other call uses the boilerplate pieces the pre-tokenizer keeps together (and the suffix).
    other = '<tool_call>\n{"name": "lookup", "arguments": {"key": "red"}}\n</tool_call>'
    assert [tok.decode([i]) for i in tok.encode(other, add_special_tokens=False)] == [
        "<tool_call>",
        '\n{"name": "',
        "lookup",
        '", "arguments": {"key": "',
        "red",
        CALL_TOKENS[1],
    ]


def test_call_tokens_parse_as_a_submit_call(tok) -> None:
    from twin.parsing import parse_tool_calls

    for word in ("red", "fish", "apple"):
        text = tok.decode(
            tok.encode(CALL_TOKENS[0] + word + CALL_TOKENS[1], add_special_tokens=False)
        )
        calls = parse_tool_calls(text).calls
        assert [(c.name, c.arguments) for c in calls] == [("submit", {"answer": word})]


def test_words_are_single_tokens_with_the_same_id_everywhere(tok) -> None:
    for word in ("red", "cat", "apple", "seven"):
        (wid,) = tok.encode(word, add_special_tokens=False)
        prompt = tok.encode(f"The answer is {word}.", add_special_tokens=False)
        call = tok.encode(f'{{"answer": "{word}"}}', add_special_tokens=False)
        assert wid in prompt and wid in call
    singles = sum(len(tok.encode(w, add_special_tokens=False)) == 1 for w in TINY_WORDS)
    assert singles == len(TINY_WORDS)


def test_chat_template_renders_tools_calls_and_results(tok) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say red."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "submit", "arguments": json.dumps({"answer": "red"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'},
    ]
    text = chat(tok, messages)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text
    assert text.endswith(
        "<|im_start|>user\nSay red.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "submit", "arguments": {"answer": "red"}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"ok": true}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    # dict arguments (HF style) render the same as OpenAI's JSON strings
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"answer": "red"}
    same = chat(tok, messages)
    assert same == text
    # no tools: a plain ChatML system turn
    plain = tok.apply_chat_template(messages[:2], tokenize=False)
    assert plain == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay red.<|im_end|>\n"
    )

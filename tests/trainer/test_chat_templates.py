"""Shipped chat templates (trainer/templates/) through the Renderer: Qwen3 (original rules and the
append-only variant), Llama 3.x, Mistral-style, ChatML; token-exact multi-turn tool episodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.episodes import RolloutSettings, collect_groups
from trainer.renderer import Renderer, load_chat_template, shipped_templates
from trainer.tiny import build_tiny
from twin.errors import ConfigError
from twin.registry import make_twin

TOOLS = [
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
THINK = "<think>\nThe key is color.\n</think>\n\n"


def family_tokenizer(special: list[str], eos: str, bos: str | None = None, added=()):
    """The tiny tokenizer with a model family's special tokens (built locally, no download)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny(), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": special})
    if added:
        tok.add_tokens(list(added))
    tok.eos_token = eos
    if bos is not None:
        tok.bos_token = bos
    return tok


@pytest.fixture(scope="module")
def qwen_tok():
    return family_tokenizer([], "<|im_end|>", added=["<think>", "</think>"])


@pytest.fixture(scope="module")
def llama_tok():
    return family_tokenizer(
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
        bos="<|begin_of_text|>",
    )


@pytest.fixture(scope="module")
def mistral_tok():
    return family_tokenizer(
        [
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        "</s>",
        bos="<s>",
    )


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def dec(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def run(tok, template: str, turns, kwargs=None):
    """Play ``turns`` = [(sampled text, stopped?, messages after it or None)]; returns the
    renderer and the list of pieces (prompt, sample, answer, sample, ...)."""
    r = Renderer(tok, TOOLS, chat_template=template, template_kwargs=kwargs)
    pieces = [r.start(OPENING)]
    for text, stop, after in turns:
        ids = enc(tok, text) + ([tok.eos_token_id] if stop else [])
        r.add_completion(ids, [-0.5] * len(ids))
        pieces.append(ids)
        if after is not None:
            pieces.append(r.add_messages(after))
    return r, pieces


TOOL_ANSWER = [{"role": "tool", "content": RESULT}]
NUDGE = [{"role": "user", "content": "Call a tool."}]
QWEN_TOOL_TEXT = (
    "\n<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"

# (name, turns, template kwargs, the text of each answer piece, rewrites under the original)
QWEN_CASES = [
    (
        "finished think block",
        [(THINK + LOOKUP, True, TOOL_ANSWER), (THINK + SUBMIT, True, None)],
        None,
        [QWEN_TOOL_TEXT],
        0,
    ),
    (
        "tool call without reasoning",
        [(LOOKUP, True, TOOL_ANSWER), (SUBMIT, True, None)],
        None,
        [QWEN_TOOL_TEXT],
        1,
    ),
    (
        "turn cut off mid-think",
        [("<think>\nThe key", False, NUDGE), (THINK + SUBMIT, True, None)],
        None,
        ["<|im_end|>\n<|im_start|>user\nCall a tool.<|im_end|>\n<|im_start|>assistant\n"],
        1,
    ),
    (
        "enable_thinking=False",
        [(LOOKUP, True, TOOL_ANSWER), (LOOKUP, True, NUDGE), (SUBMIT, True, None)],
        {"enable_thinking": False},
        [
            QWEN_TOOL_TEXT + EMPTY_THINK,
            "\n<|im_start|>user\nCall a tool.<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK,
        ],
        2,
    ),
]


@pytest.mark.parametrize("case", QWEN_CASES, ids=[c[0] for c in QWEN_CASES])
def test_qwen3_episodes_are_token_exact(qwen_tok, case) -> None:
    _, turns, kwargs, answers, rewrites = case
    original, pieces = run(qwen_tok, "qwen3", turns, kwargs)
    variant, variant_pieces = run(qwen_tok, "qwen3_append_only", turns, kwargs)
    # the original template (which rewrites history) and the append-only variant give the same ids
    assert pieces == variant_pieces
    ep = original.episode()
    assert ep.input_ids == [i for p in pieces for i in p]
    assert [dec(qwen_tok, p) for p in pieces[2::2]] == answers
    start = dec(qwen_tok, pieces[0])
    assert start.endswith("<|im_start|>assistant\n" + (EMPTY_THINK if kwargs else ""))
    assert start == qwen_tok.apply_chat_template(
        OPENING,
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
        chat_template=load_chat_template("qwen3"),
        **(kwargs or {}),
    )
    sampled = [i for i, m in zip(ep.input_ids, ep.loss_mask) if m]
    assert sampled == [i for p in pieces[1::2] for i in p]
    # the whole episode decodes to the variant's rendering of the conversation
    assert variant.check_prefix().ok, variant.check_prefix()
    assert variant.stats["prefix_breaks"] == 0
    assert original.stats["prefix_breaks"] == rewrites


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    turns=st.lists(
        st.tuples(
            st.sampled_from([LOOKUP, THINK + LOOKUP, "<think>\nhm", "No call.", THINK + "Done."]),
            st.booleans(),
            st.sampled_from([TOOL_ANSWER, NUDGE, TOOL_ANSWER + NUDGE, TOOL_ANSWER * 2]),
        ),
        min_size=1,
        max_size=4,
    ),
    thinking=st.sampled_from([None, True, False]),
)
def test_qwen3_original_and_append_only_agree_on_any_episode(qwen_tok, turns, thinking) -> None:
    kwargs = None if thinking is None else {"enable_thinking": thinking}
    turns = [(t, stop, after) for t, stop, after in turns]
    original, pieces = run(qwen_tok, "qwen3", turns, kwargs)
    variant, variant_pieces = run(qwen_tok, "qwen3_append_only", turns, kwargs)
    assert pieces == variant_pieces
    assert original.episode().input_ids == [i for p in pieces for i in p]
    assert variant.check_prefix().ok, variant.check_prefix()


def test_llama3_episode_is_token_exact(llama_tok) -> None:
    call = '{"name": "lookup", "parameters": {"key": "color"}}'
    r, pieces = run(llama_tok, "llama3", [(call, True, TOOL_ANSWER), ("It is red.", True, None)])
    first = dec(llama_tok, pieces[0])
    assert first.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    )
    assert '"name": "lookup"' in first.split("<|start_header_id|>user")[1]  # tools in user turn
    assert r.messages[2]["tool_calls"][0]["function"]["name"] == "lookup"
    assert (
        dec(llama_tok, pieces[2])
        == (  # a string result is JSON-encoded, as Meta's template does
            "<|start_header_id|>ipython<|end_header_id|>\n\n" + json.dumps(RESULT) + "<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
    )
    assert r.episode().input_ids == [i for p in pieces for i in p]
    assert r.check_prefix().ok, r.check_prefix()
    assert r.stats["prefix_breaks"] == 0 and r.stats["refused_turns"] == 0


def test_llama3_two_calls_in_one_turn_are_refused_not_raised(llama_tok) -> None:
    two = LOOKUP + "\n" + LOOKUP
    r = Renderer(llama_tok, TOOLS, chat_template="llama3")
    r.start(OPENING)
    msg = r.add_completion(enc(llama_tok, two) + [llama_tok.eos_token_id])
    assert "single tool-calls" in r.refusal and "nothing was run" in r.refusal
    assert msg == {"role": "assistant", "content": two} and r.stats["refused_turns"] == 1
    obs = r.add_messages([{"role": "user", "content": "One call per turn."}])
    assert dec(llama_tok, obs) == (
        "<|start_header_id|>user<|end_header_id|>\n\nOne call per turn.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    r.add_completion(enc(llama_tok, "ok") + [llama_tok.eos_token_id])
    assert r.refusal is None and r.check_prefix().ok


def test_llama3_refused_turn_is_an_invalid_turn_for_the_agent(llama_tok) -> None:
    two = SUBMIT + "\n" + SUBMIT  # valid calls the env would run: the template forbids two

    class Twice:
        def sample(self, prompts, *, max_new_tokens, **_):
            from trainer.samplers import Sample

            ids = enc(llama_tok, two) + [llama_tok.eos_token_id]
            return [Sample(ids, [-1.0] * len(ids), "stop") for _ in prompts]

    twin = make_twin("Toy", max_turns=2)
    (group,) = collect_groups(
        twin,
        [("train", 2)],
        Twice(),
        lambda tools: Renderer(llama_tok, tools, chat_template="llama3"),
        group_size=1,
        settings=RolloutSettings(max_new_tokens=64, max_episode_tokens=4000),
        seed=0,
    )
    (t,) = group.trajectories
    assert t.calls == [] and t.invalid_calls == 2 and t.truncated and not t.terminated
    assert t.messages[2] == {"role": "assistant", "content": two}
    note = t.messages[3]
    assert note["role"] == "user" and note["content"].startswith(
        "Your last turn had a problem: this model's chat template cannot represent your turn "
        "(This model only supports single tool-calls at once!); nothing was run. Tools: "
    )
    assert t.info["renderer"]["refused_turns"] == 2


def test_mistral_episode_is_token_exact_and_moved_tools_are_appended(mistral_tok) -> None:
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"key": "color"}'},
            }
        ],
    }
    sampled = '[TOOL_CALLS] [{"name": "lookup", "arguments": {"key": "color"}, "id": "c0"}]'
    r = Renderer(mistral_tok, TOOLS, chat_template="mistral")
    prompt = r.start(OPENING)
    tools = "[AVAILABLE_TOOLS] [" + json.dumps(TOOLS[0]) + "][/AVAILABLE_TOOLS]"
    assert dec(mistral_tok, prompt) == "<s>" + tools + "[INST] Be brief.\n\nFind the color.[/INST]"
    c1 = enc(mistral_tok, sampled) + [mistral_tok.eos_token_id]
    r.add_completion(c1, message=call)
    obs1 = r.add_messages([{"role": "tool", "tool_call_id": "c0", "content": RESULT}])
    assert dec(mistral_tok, obs1) == (
        '[TOOL_RESULTS] {"content": "{\\"value\\": \\"red\\"}", "call_id": "c0"}[/TOOL_RESULTS]'
    )
    c2 = enc(mistral_tok, " It is red.") + [mistral_tok.eos_token_id]
    r.add_completion(c2)
    assert r.check_prefix().ok, r.check_prefix()
    # a new user turn moves the tools and the system text to it: history is rewritten, the
    # episode keeps its ids and gets the template's text for the new turn
    obs2 = r.add_messages(NUDGE)
    assert dec(mistral_tok, obs2) == tools + "[INST] Be brief.\n\nCall a tool.[/INST]"
    assert r.stats["prefix_breaks"] == 1
    assert r.episode().input_ids == prompt + c1 + obs1 + c2 + obs2


def test_chatml_by_name_equals_the_tiny_tokenizers_own(qwen_tok) -> None:
    own = Renderer(qwen_tok, TOOLS)
    named = Renderer(qwen_tok, TOOLS, chat_template="chatml_tools")
    assert own.start(OPENING) == named.start(OPENING)
    for r in (own, named):
        r.add_completion(enc(qwen_tok, LOOKUP) + [qwen_tok.eos_token_id])
    assert own.add_messages(TOOL_ANSWER) == named.add_messages(TOOL_ANSWER)
    assert named.check_prefix().ok


def test_template_names_and_paths(tmp_path: Path) -> None:
    assert {"chatml_tools", "qwen3", "qwen3_append_only", "llama3", "mistral"} <= set(
        shipped_templates()
    )
    path = tmp_path / "mine.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    with pytest.raises(ConfigError, match="unknown chat template 'qwen4': use one of .*qwen3"):
        load_chat_template("qwen4")
    with pytest.raises(ConfigError, match="does not exist"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_recipe_fields_reach_the_renderer(tmp_path: Path) -> None:
    from trainer.config import load_recipe
    from trainer.sync_trainer import SyncTrainer

    cfg = load_recipe(
        "toy-cpu",
        [
            "model.chat_template=qwen3_append_only",
            "model.template_kwargs={enable_thinking: false}",
            f"train.output_dir={tmp_path}",
            "train.store=false",
        ],
    )
    recipe = SyncTrainer(cfg)
    recipe.setup()
    r = recipe.renderer_factory(TOOLS)
    assert r.chat_template == load_chat_template("qwen3_append_only")
    assert dec(recipe.tokenizer, r.start(OPENING)).endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    with pytest.raises(ConfigError, match="unknown chat template 'qwen4': use one of"):
        load_recipe("toy-cpu", ["model.chat_template=qwen4"])


def test_llama3_renders_metas_documented_format_exactly(llama_tok) -> None:
    # Meta's Llama 3.1 format, written out by hand: sentences of the instruction with no space
    # between them, tools as 4-space JSON in the first user turn, a call's arguments and a string
    # tool result written with tojson (a dict result is plain JSON)
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    messages = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": "Find the color."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"key": "color"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "red"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": {"key": "shade"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": {"value": "dark"}},
        {"role": "assistant", "content": "Dark red."},
    ]
    tool_json = json.dumps(tool, indent=4)
    expected = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
        "Be brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call with its "
        "proper "
        "arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name '
        "and its "
        "value}.Do not use variables.\n\n" + tool_json + "\n\n"
        "Find the color.<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "lookup", "parameters": {"key": '
        '"color"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"red"<|eot_id|>'
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "lookup", "parameters": {"key": '
        '"shade"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"value": "dark"}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\nDark red.<|eot_id|>"
    )
    r = Renderer(llama_tok, [tool], chat_template="llama3")
    assert r.render(messages, add_generation_prompt=False) == expected
    # tools in the system turn: the same instruction, after Meta's system sentence, no space between
    system = Renderer(
        llama_tok, [tool], chat_template="llama3", template_kwargs={"tools_in_user_message": False}
    )
    text = system.render(messages[:2], add_generation_prompt=True)
    assert (
        "Today Date: 26 Jul 2024\n\nYou have access to the following functions. To call a "
        "function, please "
        'respond with JSON for a function call.Respond in the format {"name": function name, '
        '"parameters": '
        "dictionary of argument name and its value}.Do not use variables.\n\n"
        + tool_json
        + "\n\nBe brief.<|eot_id|>"
    ) in text
    assert text.endswith(
        "Find the color.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )

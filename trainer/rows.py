"""A dataset row (or a trajectory's messages) rendered as the token sequence a learner trains on.

:func:`render_row` is what SFT trains on (``trainer.sft``) and what the choice probe scores
(``trainer.choice_probe``): the prompt, each assistant turn as the ids the chat template writes
for it, the tool results between them, with the loss mask on the assistant turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainer.renderer import EpisodeTokens, Renderer
from twin.errors import ConfigError

__all__ = ["render_row"]

Message = dict[str, Any]


def _end_text(renderer: Renderer) -> str:
    tok = renderer.tokenizer
    end_id = tok.eos_token_id if tok.eos_token_id in renderer.stop_ids else min(renderer.stop_ids)
    return str(tok.decode([end_id], skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _turn_ids(renderer: Renderer, conversation: Sequence[Message], message: Message) -> list[int]:
    """The ids the chat template writes for ``message`` after ``conversation``'s assistant header,
    up to and including its end-of-turn token (what a sampler that wrote it would have returned)."""
    opened = renderer.render(conversation, add_generation_prompt=True)
    closed = renderer.render([*conversation, message], add_generation_prompt=False)
    if not closed.startswith(opened):
        raise ConfigError(
            "render_row: the chat template writes an assistant turn differently from its "
            "generation prompt (it rewrites the last turn, as Qwen3's does with <think>); use a "
            "template that does not, e.g. model.chat_template: qwen3_append_only"
        )
    text = closed[len(opened) :]
    end = _end_text(renderer)
    at = text.rfind(end) if end else -1
    if at < 0:
        raise ConfigError(
            "render_row: the chat template does not end an assistant turn with the end-of-turn "
            f"token {end!r}; pass the Renderer the stop_ids this template ends turns with"
        )
    ids = list(renderer.tokenizer.encode(text[: at + len(end)], add_special_tokens=False))
    if not ids or ids[-1] not in renderer.stop_ids:
        raise ConfigError(
            f"render_row: the end-of-turn text {end!r} does not encode to a stop id "
            f"{sorted(renderer.stop_ids)}"
        )
    return ids


def render_row(renderer: Renderer, messages: Sequence[Message]) -> EpisodeTokens:
    """One dataset row (or a trajectory's messages) as the token sequence GRPO would train on.

    The opening messages go to :meth:`Renderer.start`; each assistant turn is added with
    :meth:`Renderer.add_completion` as the ids the template writes for it (the message itself is
    what the template sees, tool calls included); the messages between turns (tool results) with
    :meth:`Renderer.add_messages`. Messages after the last assistant turn carry no loss and are
    left out. An assistant turn with ``"weight": 0`` (OpenAI's fine-tuning format; 1 is the
    default) stays in the sequence as context with no loss, e.g. a teacher's planted mistake
    whose error message the next turn answers.

    Args:
        renderer: A renderer with the twin's tools (reused: :meth:`Renderer.start` resets it).
        messages: OpenAI chat messages: the prompt, then assistant turns and what came back.

    Returns:
        The episode's ids, with the loss mask on the assistant turns' tokens.

    Raises:
        ConfigError: no assistant turn with weight 1, an assistant ``weight`` other than 0 or 1,
            or a template that cannot be rendered turn by turn.
    """
    msgs = [dict(m) for m in messages]
    first = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), None)
    if first is None:
        raise ConfigError("render_row: the row has no assistant turn (nothing to learn from)")
    weights = [_weight(m, i) for i, m in enumerate(msgs) if m.get("role") == "assistant"]
    if not any(weights):
        raise ConfigError(
            "render_row: every assistant turn has weight 0 (nothing to learn from); a row needs "
            "at least one turn with weight 1 (the default)"
        )
    last = max(i for i, m in enumerate(msgs) if m.get("role") == "assistant")
    renderer.start(msgs[:first])
    pending: list[Message] = []
    for m in msgs[first : last + 1]:
        if m.get("role") != "assistant":
            pending.append(m)
            continue
        if pending:
            renderer.add_messages(pending)
            pending = []
        renderer.add_completion(_turn_ids(renderer, renderer.messages, m), message=m)
    episode = renderer.episode()
    # a weight-0 turn is rendered exactly as a trained one (so the next turn sees the same ids)
    # and only then loses its loss and its span
    for (start, end), weight in zip(list(episode.turn_spans), weights, strict=True):
        if not weight:
            episode.loss_mask[start:end] = [0] * (end - start)
            episode.turn_spans.remove((start, end))
    return episode


def _weight(message: Message, index: int) -> int:
    """An assistant message's loss weight: its ``weight`` (0 or 1), 1 when it has none."""
    weight = message.get("weight", 1)
    if isinstance(weight, bool) or weight not in (0, 1):
        raise ConfigError(
            f"render_row: message {index} has weight {weight!r}; an assistant turn's weight is 0 "
            "(context, no loss) or 1 (trained on, the default)"
        )
    return int(weight)

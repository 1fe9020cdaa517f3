"""A twin inside TRL: an ``environment_factory`` class and the prompt dataset of its cases.

::

    from trl import GRPOConfig, GRPOTrainer
    from integrations.trl import trl_environment, trl_dataset

    trainer = GRPOTrainer(
        model=model,
        train_dataset=trl_dataset("Returns", split="train", n=256),   # prompt, split, index
        environment_factory=trl_environment("Returns"),
        args=GRPOConfig(...),
    )

:func:`trl_environment` builds a class whose public methods are the twin's tools: the same
names, the same typed parameters (hidden ones such as ``world``, ``state`` and ``task`` left
out: the twin injects them), the tool's docstring as the description. TRL calls ``reset(**row)``
for each rollout with the dataset row; the row's ``split`` and ``index`` name the case. Each
method call runs as one assistant turn of a :class:`twin.env.TwinEnv` (validation, error text,
turn budget and terminal tool as in the twin). TRL reads the reward from the environment with
``get_reward()``: the twin's own reward of the episode, logged as ``rewards/<ClassName>/mean``.
An episode the model leaves without a terminal call is scored as a truncated one.

:func:`trl_reward_funcs` gives one weight-0 reward function per reward term (TRL logs each as
``rewards/<term>/mean``) for ``GRPOTrainer(reward_funcs=..., args=GRPOConfig(reward_weights=...))``.
They also hand the rollout's last turn to the episode when the model ended it with text and no
call (TRL stops there without telling the environment), so that turn counts as it does in
``twin eval``; TRL runs them before ``get_reward``. :func:`prepare_tokenizer` sets up TRL's
tool-call parser, for templates TRL does not recognise too.

Nothing here imports TRL at module import; :func:`trl_dataset` imports ``datasets`` (a TRL
dependency) and :func:`prepare_tokenizer` TRL itself, when called.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from integrations._episode import ToolCallEpisode, resolve_twin
from twin.core import Twin
from twin.tools import Tool
from twin.trajectory import Trajectory

__all__ = [
    "TwinTRLEnvironment",
    "prepare_tokenizer",
    "trl_dataset",
    "trl_environment",
    "trl_reward_funcs",
    "trl_rows",
]

#: Names a tool may not take here: TRL treats these methods specially, or they hold the episode.
_RESERVED = frozenset({"reset", "get_reward", "episode", "trajectory", "twin", "done"})


class TwinTRLEnvironment:
    """Base of the classes :func:`trl_environment` builds; one instance plays one rollout at a time.

    TRL pools instances and calls :meth:`reset` before each rollout, then the tool methods, then
    :meth:`get_reward`. Subclasses get one method per twin tool.
    """

    _twin: Twin  # set on each built class

    def __init__(self) -> None:
        self.episode = ToolCallEpisode(self._twin)

    def reset(self, **row: Any) -> str | None:
        """Start the case the dataset row names (``split``, default ``"train"``; ``index``).

        Returns None: the prompt is already in the dataset row (see :func:`trl_dataset`).
        """
        self.episode.reset(split=row.get("split") or "train", index=row.get("index"))
        self._closed = False
        return None

    def _close_rollout(self, completion: Any) -> None:
        """Hand the episode the rollout's final turn when the model wrote text and no call there
        (once per rollout; see :func:`trl_reward_funcs`)."""
        if getattr(self, "_closed", True) or not self.episode.started:
            return
        self._closed = True
        last = completion[-1] if isinstance(completion, list) and completion else completion
        if isinstance(last, dict):
            if last.get("role") != "assistant" or last.get("tool_calls"):
                return
            last = last.get("content")
        if isinstance(last, str) and last.strip():
            self.episode.record_text(last)

    def get_reward(self) -> float:
        """The twin's reward of this rollout's episode (a truncated episode when never finished)."""
        return self.episode.final_reward()

    @property
    def trajectory(self) -> Trajectory | None:
        """The episode so far, as the twin records it."""
        return self.episode.trajectory

    @property
    def twin(self) -> Twin:
        """The twin this environment plays."""
        return self._twin


def _docstring(tool: Tool) -> str:
    """The tool's description plus a Google-style ``Args:`` block (TRL builds the schema from
    it)."""
    params = tool.schema["function"]["parameters"].get("properties", {})
    lines = [tool.description.strip()]
    if params:
        lines += ["", "Args:"]
        for name, prop in params.items():
            desc = " ".join(str(prop.get("description") or name.replace("_", " ")).split())
            lines.append(f"    {name}: {desc}")
    lines += [
        "",
        "Returns:",
        "    The tool's result as JSON text, or what was wrong with the call.",
    ]
    return "\n".join(lines)


def _method(tool: Tool) -> Callable[..., str]:
    """A method named and typed like ``tool`` that runs one call in the instance's episode."""
    name = tool.name

    def method(self: TwinTRLEnvironment, **kwargs: Any) -> str:
        text, _failed = self.episode.call(name, kwargs)
        return text

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    for pname, field in tool.args_model.model_fields.items():
        default = inspect.Parameter.empty if field.is_required() else field.default
        params.append(
            inspect.Parameter(
                pname, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=field.annotation
            )
        )
        annotations[pname] = field.annotation
    annotations["return"] = str
    method.__name__ = method.__qualname__ = name
    method.__doc__ = _docstring(tool)
    method.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    method.__annotations__ = annotations
    return method


def trl_environment(
    twin: Twin | str, *, class_name: str | None = None, **config: Any
) -> type[TwinTRLEnvironment]:
    """A class for ``GRPOTrainer(environment_factory=...)`` that plays ``twin``.

    Args:
        twin: A twin, or a registered twin name (``"Returns"``) built with ``config``.
        class_name: The class's name (TRL logs the reward as ``rewards/<class_name>/mean``);
            default ``<TwinName>Environment``.
        config: Twin options when ``twin`` is a name, e.g. ``max_turns=4``.

    Raises:
        ValueError: a tool whose name TRL or this class reserves (``reset``, ``get_reward``, ...)
            or that starts with ``_``.
    """
    the_twin = resolve_twin(twin, **config)
    namespace: dict[str, Any] = {"_twin": the_twin, "__module__": __name__}
    for tool in the_twin.tools:
        if tool.name in _RESERVED or tool.name.startswith("_"):
            raise ValueError(
                f"tool {tool.name!r} of twin {the_twin.name!r} cannot be a TRL environment method; "
                f"rename it (reserved: {', '.join(sorted(_RESERVED))}, and names starting with '_')"
            )
        namespace[tool.name] = _method(tool)
    name = class_name or f"{the_twin.name}Environment"
    cls = type(name, (TwinTRLEnvironment,), namespace)
    cls.__doc__ = f"The {the_twin.name} twin as a TRL environment: {the_twin.description}".strip()
    return cls


def trl_rows(
    twin: Twin | str,
    split: str = "train",
    n: int | None = None,
    indices: Iterable[int] | None = None,
    **config: Any,
) -> list[dict[str, Any]]:
    """The dataset rows of ``twin``'s cases: ``{"prompt": messages, "split", "index"}``.

    Args:
        twin: A twin or a registered twin name (built with ``config``).
        split: The split the cases come from.
        n: The first ``n`` cases of the split (default: all of them); ignored with ``indices``.
        indices: Exactly these case indices.
    """
    the_twin = resolve_twin(twin, **config)
    if indices is None:
        total = the_twin.num_cases(split)
        indices = range(total if n is None else min(n, total))
    rows = []
    for index in indices:
        case = the_twin.case(split, int(index))
        rows.append(
            {
                "prompt": [dict(m) for m in the_twin.prompt(case)],
                "split": split,
                "index": int(index),
            }
        )
    return rows


def trl_dataset(
    twin: Twin | str,
    split: str = "train",
    n: int | None = None,
    indices: Iterable[int] | None = None,
    **config: Any,
) -> Any:
    """:func:`trl_rows` as a ``datasets.Dataset`` (conversational ``prompt`` column), for TRL."""
    from datasets import Dataset

    return Dataset.from_list(trl_rows(twin, split, n, indices, **config))


def trl_reward_funcs(
    twin: Twin | str, **config: Any
) -> tuple[list[Callable[..., list[float | None]]], list[float]]:
    """One reward function per term of ``twin``'s reward, each with weight 0, for
    ``GRPOTrainer(reward_funcs=funcs, args=GRPOConfig(reward_weights=weights))``.

    TRL passes the rollouts' environments to reward functions; each function returns the term's
    weighted contribution in each rollout's episode (None for an environment of another twin),
    and TRL logs it as ``rewards/<term>/mean``. The total stays the environment's
    ``get_reward`` (weight 1, added by TRL). Each function first hands the episode a final
    text-only turn (:meth:`TwinTRLEnvironment._close_rollout`), so the score matches
    ``twin eval``'s for the same turns.

    Returns:
        ``(funcs, weights)``: the functions, named after the terms, and a 0.0 per function.
    """
    the_twin = resolve_twin(twin, **config)
    terms = _reward_terms(the_twin)

    def make(term: str) -> Callable[..., list[float | None]]:
        def reward(
            prompts: Any = None, completions: Any = None, environments: Any = None, **_: Any
        ) -> list[float | None]:
            out: list[float | None] = []
            for i, env in enumerate(environments or []):
                if not isinstance(env, TwinTRLEnvironment) or env.twin.name != the_twin.name:
                    out.append(None)
                    continue
                env._close_rollout(completions[i] if completions is not None else None)
                out.append(env.episode.final_terms().get(term, 0.0))
            return out

        reward.__name__ = reward.__qualname__ = term
        return reward

    funcs = [make(term) for term in terms]
    return funcs, [0.0] * len(funcs)


def _reward_terms(twin: Twin) -> list[str]:
    """The names of the twin's reward terms (weighted contributions), from scoring one episode."""
    case = twin.case(
        twin.splits[0] if isinstance(twin.splits, (list, tuple)) else next(iter(twin.splits)), 0
    )
    from twin.env import TwinEnv

    env = TwinEnv(twin)
    env.reset(options={"split": case.split, "index": case.index})
    traj = env.trajectory.model_copy(update={"truncated": True})
    result = twin.score(traj, case)
    return sorted(dict(result.weighted) or dict(result.components))


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Give ``tokenizer`` the tool-call parser GRPOTrainer needs, and return it.

    TRL knows the parsers of the chat templates it ships (Qwen, Llama, ...); for any other
    template that writes calls as Hermes ``<tool_call>{...}</tool_call>`` blocks (ChatML models,
    SmolLM2, twinrl's tiny model) TRL's Qwen 3 parser reads them. A tokenizer that already has a
    parser is left as it is.

    Raises:
        ValueError: a template TRL does not know and that does not write ``<tool_call>`` blocks
            (set ``tokenizer.response_template`` yourself).
    """
    from trl import chat_template_utils as ctu

    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
        return tokenizer
    try:
        return ctu.add_response_schema(tokenizer)
    except ValueError:
        template = getattr(tokenizer, "chat_template", None) or ""
        if "<tool_call>" not in str(template):
            raise ValueError(
                "the tokenizer's chat template is neither one TRL knows nor writes <tool_call> "
                "blocks: set tokenizer.response_template to a parser for its tool calls"
            ) from None
    if getattr(ctu, "_SUPPORTS_RESPONSE_TEMPLATE", False):
        tokenizer.response_template = ctu.qwen3_template
    else:
        tokenizer.response_schema = ctu.qwen3_schema
    return tokenizer

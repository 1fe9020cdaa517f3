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

Nothing here imports TRL; :func:`trl_dataset` imports ``datasets`` (a TRL dependency) when called.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from integrations._episode import ToolCallEpisode, resolve_twin
from twin.core import Twin
from twin.tools import Tool
from twin.trajectory import Trajectory

__all__ = ["TwinTRLEnvironment", "trl_dataset", "trl_environment", "trl_rows"]

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
        return None

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
    """The tool's description plus a Google-style ``Args:`` block (TRL builds the schema from it)."""
    params = tool.schema["function"]["parameters"].get("properties", {})
    lines = [tool.description.strip()]
    if params:
        lines += ["", "Args:"]
        for name, prop in params.items():
            desc = " ".join(str(prop.get("description") or name.replace("_", " ")).split())
            lines.append(f"    {name}: {desc}")
    lines += ["", "Returns:", "    The tool's result as JSON text, or what was wrong with the call."]
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
            inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=field.annotation)
        )
        annotations[pname] = field.annotation
    annotations["return"] = str
    method.__name__ = method.__qualname__ = name
    method.__doc__ = _docstring(tool)
    method.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    method.__annotations__ = annotations
    return method


def trl_environment(twin: Twin | str, *, class_name: str | None = None, **config: Any) -> type[TwinTRLEnvironment]:
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


def trl_rows(twin: Twin | str, split: str = "train", n: int | None = None,
             indices: Iterable[int] | None = None, **config: Any) -> list[dict[str, Any]]:
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
        rows.append({"prompt": [dict(m) for m in the_twin.prompt(case)], "split": split, "index": int(index)})
    return rows


def trl_dataset(twin: Twin | str, split: str = "train", n: int | None = None,
                indices: Iterable[int] | None = None, **config: Any) -> Any:
    """:func:`trl_rows` as a ``datasets.Dataset`` (conversational ``prompt`` column), for TRL."""
    from datasets import Dataset

    return Dataset.from_list(trl_rows(twin, split, n, indices, **config))

"""Tools: typed Python functions that an agent can call.

``@tool`` turns a function or method with type hints and a Google-style docstring into a
:class:`Tool`: an OpenAI function schema built by pydantic, and a dispatcher that validates the
arguments before calling the function::

    @tool
    def lookup_order(order_id: str, world: World) -> dict:
        \"\"\"Look up an order by id.

        Args:
            order_id: The order number printed on the receipt, e.g. "A-1001".
        \"\"\"
        if order_id not in world.orders:
            raise ToolError(f"no order {order_id!r}; order ids look like 'A-1001'")
        return world.orders[order_id]

Parameters named ``world``, ``state`` or ``task`` (and ``self``) are *injected* by the twin at
call time and hidden from the schema: ``world`` is the twin's shared read-only world, ``state``
the episode's mutable dict, ``task`` the visible part of the case. The hidden truth of a case is
never injected, so no tool can reach it.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import docstring_parser
import pydantic
from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_json

from twin.errors import ToolArgumentError, ToolError

__all__ = [
    "INJECTED",
    "FrozenDict",
    "FrozenList",
    "Tool",
    "ToolError",
    "ToolArgumentError",
    "freeze",
    "thaw",
    "tool",
    "to_jsonable",
]

#: Parameter names the twin fills in; they never appear in the schema the agent sees.
INJECTED: frozenset[str] = frozenset({"self", "world", "state", "task"})

_TOOL_ATTR = "__twin_tool__"


@dataclass(frozen=True)
class _ToolMeta:
    name: str
    terminal: bool
    mutates: bool
    description: str | None


@dataclass
class Tool:
    """A callable tool with its OpenAI schema and argument model.

    Attributes:
        name: The name the agent calls it by (the function name unless overridden).
        description: What the tool does (the docstring's summary and body).
        fn: The underlying function (bound when it was a method).
        args_model: The pydantic model that validates the agent's arguments.
        injected: Names of parameters the twin fills in at call time.
        terminal: A successful call ends the episode (e.g. ``submit``).
        mutates: The tool changes episode state (informational; used by tests and docs).
    """

    name: str
    description: str
    fn: Callable[..., Any]
    args_model: type[BaseModel]
    injected: tuple[str, ...] = ()
    terminal: bool = False
    mutates: bool = False
    schema: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_function(
        cls,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        terminal: bool = False,
        mutates: bool = False,
        description: str | None = None,
    ) -> Tool:
        """Build a tool from a typed function or bound method."""
        tool_name = name or fn.__name__
        doc = docstring_parser.parse(inspect.getdoc(fn) or "")
        param_docs = {p.arg_name: (p.description or "") for p in doc.params}
        desc = description or "\n\n".join(
            part for part in (doc.short_description, doc.long_description) if part
        )
        if not desc:
            raise TypeError(f"tool {tool_name!r} needs a docstring: the agent reads it to decide")
        try:
            hints = typing.get_type_hints(fn, include_extras=True)
        except Exception as exc:  # unresolved forward references
            raise TypeError(f"tool {tool_name!r}: cannot resolve type hints ({exc})") from exc
        fields: dict[str, Any] = {}
        injected: list[str] = []
        for pname, param in inspect.signature(fn).parameters.items():
            if pname in INJECTED:
                injected.append(pname)
                continue
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(
                    f"tool {tool_name!r}: *args/**kwargs cannot be described to an agent"
                )
            if pname not in hints:
                raise TypeError(f"tool {tool_name!r}: parameter {pname!r} needs a type hint")
            default = ... if param.default is inspect.Parameter.empty else param.default
            fields[pname] = (
                hints[pname],
                Field(default, description=param_docs.get(pname) or None),
            )
        model = pydantic.create_model(  # type: ignore[call-overload]
            f"{tool_name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
        )
        params = model.model_json_schema()
        params.pop("title", None)
        for prop in params.get("properties", {}).values():
            prop.pop("title", None)
        params.setdefault("properties", {})
        params.setdefault("required", [])
        schema = {
            "type": "function",
            "function": {"name": tool_name, "description": desc, "parameters": params},
        }
        return cls(
            name=tool_name,
            description=desc,
            fn=fn,
            args_model=model,
            injected=tuple(injected),
            terminal=terminal,
            mutates=mutates,
            schema=schema,
        )

    # -- calling -------------------------------------------------------------------------------
    def validate(self, arguments: Any) -> dict[str, Any]:
        """Validate the agent's arguments; return them as keyword arguments for the function.

        Raises:
            ToolArgumentError: the message names the tool, each bad argument, what was expected
                and what arrived.
        """
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ToolArgumentError(
                    f"{self.name}: arguments are not valid JSON ({exc.msg} at position {exc.pos}); "
                    f"send a JSON object like {self.example_arguments()}"
                ) from None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise ToolArgumentError(
                f"{self.name}: arguments must be a JSON object, got {type(arguments).__name__}; "
                f"send a JSON object like {self.example_arguments()}"
            )
        try:
            # the model's validator itself: model_validate's wrapper costs ~1 us a call
            validated = self.args_model.__pydantic_validator__.validate_python(arguments)
        except pydantic.ValidationError as exc:
            raise ToolArgumentError(self._explain(exc)) from None
        # extra="forbid": the instance dict holds exactly the declared fields (copy: callers add
        # the injected parameters to it).
        return dict(validated.__dict__)

    def call(self, arguments: Any, **injected: Any) -> Any:
        """Validate ``arguments`` and call the tool; return a JSON-able result.

        ``injected`` supplies the hidden parameters (``world``, ``state``, ``task``); those the
        function does not declare are ignored.

        Raises:
            ToolError: bad arguments or anything the tool itself rejects.
        """
        return to_jsonable(self.run(self.validate(arguments), defaultdict(_none, injected)))

    def run(self, kwargs: dict[str, Any], hidden: Mapping[str, Any]) -> Any:
        """Call the function on validated ``kwargs`` plus the hidden parameters it declares.

        The one place a tool's hidden parameters are filled in (:meth:`call` and
        :class:`twin.env.TwinEnv` both come through here).

        Args:
            kwargs: :meth:`validate`'s result; the hidden parameters are added to it.
            hidden: The hidden parameters' values by name (``world``, ``state``, ``task``);
                read only for those the function declares.

        Returns:
            The function's own result, unconverted.
        """
        for name in self.injected:
            if name != "self":
                kwargs[name] = hidden[name]
        return self.fn(**kwargs)

    # -- describing ----------------------------------------------------------------------------
    def signature_text(self) -> str:
        """A one-line human signature, e.g. ``lookup_brand(name: string, limit?: integer)``."""
        props = self.schema["function"]["parameters"].get("properties", {})
        required = set(self.schema["function"]["parameters"].get("required", []))
        parts = []
        for pname, prop in props.items():
            opt = "" if pname in required else "?"
            parts.append(f"{pname}{opt}: {_type_text(prop)}")
        return f"{self.name}({', '.join(parts)})"

    def example_arguments(self) -> str:
        """A JSON object with the required parameter names, for error messages."""
        params = self.schema["function"]["parameters"]
        example = {
            p: f"<{_type_text(params['properties'][p])}>" for p in params.get("required", [])
        }
        return json.dumps(example)

    def _explain(self, exc: pydantic.ValidationError) -> str:
        props = self.schema["function"]["parameters"].get("properties", {})
        lines = []
        for err in exc.errors(include_url=False):
            # an argument name is the agent's text: echo a bounded piece of it
            loc = _short_name(".".join(str(p) for p in err["loc"])) or "(arguments)"
            top = str(err["loc"][0]) if err["loc"] else ""
            if err["type"] == "missing":
                lines.append(
                    f"missing required argument {loc!r} ({_type_text(props.get(top, {}))})"
                )
            elif err["type"] == "extra_forbidden":
                allowed = ", ".join(props) or "none"
                lines.append(f"unknown argument {loc!r}; allowed: {allowed}")
            else:
                got = _short(err.get("input"))
                expected = _type_text(props.get(top, {}))
                lines.append(f"argument {loc!r}: {err['msg']} (expected {expected}, got {got})")
        return f"{self.name}: " + "; ".join(lines) + f". Usage: {self.signature_text()}"


def _type_text(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    if "anyOf" in prop:
        return " | ".join(_type_text(p) for p in prop["anyOf"])
    if prop.get("type") == "array":
        return f"array of {_type_text(prop.get('items', {}))}"
    if "$ref" in prop:
        return "object"
    return str(prop.get("type", "any"))


def _short_name(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    except Exception:  # noqa: BLE001 - nested too deeply for the encoder, a cycle
        text = f"<{type(value).__name__} nested too deeply>"
    return _short_name(text, limit)


def _none() -> None:
    return None


def to_jsonable(value: Any) -> Any:
    """Turn a tool's return value into plain JSON data (pydantic models are dumped)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    return value


# -- read-only results ---------------------------------------------------------------------------
def _read_only(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise TypeError(
        f"this {type(self).__name__} is read-only: it may be shared by every episode of the "
        "process; take a mutable copy with twin.tools.thaw(value) to change it"
    )


class FrozenDict(dict):  # type: ignore[type-arg]
    """A read-only ``dict`` whose values are frozen too (see :func:`freeze`).

    Twins hand these out for data every episode shares (world records, cached tool results), so
    no episode, trajectory or caller can change what a later episode sees. It is a ``dict``:
    JSON encoders, pydantic and ``==`` treat it as one. Copies are free (it is returned as is);
    ``dict(d)`` or :func:`thaw` give a mutable copy. Its JSON text is computed once
    (:meth:`json_text`): a cached result costs the env no serialisation at all.
    """

    __slots__ = ("_json",)

    def __init__(self, data: Any = (), /, **kwargs: Any) -> None:
        items = dict(data, **kwargs) if kwargs or not isinstance(data, dict) else data
        dict.__init__(self, {k: freeze(v) for k, v in items.items()})

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: Any) -> FrozenDict:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # dict's default pickling refills the dict item by item, which a read-only dict refuses
        return (FrozenDict, (dict(self),))

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"

    def json_text(self) -> str:
        """Compact JSON of the dict (non-ASCII kept), computed on first use and remembered."""
        return _json_text(self)


class FrozenList(list):  # type: ignore[type-arg]
    """A read-only ``list`` whose items are frozen too (see :func:`FrozenDict`)."""

    __slots__ = ("_json",)

    def __init__(self, data: Any = (), /) -> None:
        list.__init__(self, [freeze(v) for v in data])

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = clear = extend = insert = pop = remove = reverse = sort = _read_only

    def __copy__(self) -> FrozenList:
        return self

    def __deepcopy__(self, memo: Any) -> FrozenList:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenList, (list(self),))

    def __repr__(self) -> str:
        return f"FrozenList({list.__repr__(self)})"

    def json_text(self) -> str:
        """Compact JSON of the list (non-ASCII kept), computed on first use and remembered."""
        return _json_text(self)


def _json_text(value: FrozenDict | FrozenList) -> str:
    try:
        return value._json  # type: ignore[no-any-return]
    except AttributeError:
        # a frozen value never changes, so its text never goes stale
        text = to_json(value, fallback=str).decode()
        object.__setattr__(value, "_json", text)
        return text


_FROZEN = (FrozenDict, FrozenList)


def freeze(value: Any) -> Any:
    """A read-only deep copy of JSON-like data: dicts become :class:`FrozenDict`, lists and
    tuples :class:`FrozenList`, pydantic models their JSON dump; frozen parts are reused as is.

    Use it once, when a twin builds data that many episodes share (a world record, a cached
    result); handing the frozen value out afterwards costs nothing.
    """
    kind = type(value)
    if kind is FrozenDict or kind is FrozenList:
        return value
    if isinstance(value, dict):
        return FrozenDict(value)
    if isinstance(value, (list, tuple)):
        return FrozenList(value)
    if isinstance(value, BaseModel):
        return freeze(value.model_dump(mode="json"))
    return value


def thaw(value: Any) -> Any:
    """A plain, mutable deep copy of ``value`` (the inverse of :func:`freeze`)."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    terminal: bool = False,
    mutates: bool = False,
    description: str | None = None,
) -> Any:
    """Mark a function or a twin method as a tool (usable bare or with options).

    Args:
        fn: The function (when used as ``@tool`` without parentheses).
        name: Override the tool name (default: the function name).
        terminal: A successful call ends the episode (``submit``).
        mutates: The tool changes the episode's state.
        description: Override the description taken from the docstring.

    Returns:
        For a plain function, a :class:`Tool`. For a method (first parameter ``self``), the
        function itself, marked so that :class:`twin.core.Twin` builds a bound tool per instance.
    """

    def wrap(f: Callable[..., Any]) -> Any:
        params = list(inspect.signature(f).parameters)
        if params and params[0] == "self":
            setattr(f, _TOOL_ATTR, _ToolMeta(name or f.__name__, terminal, mutates, description))
            return f
        return Tool.from_function(
            f, name=name, terminal=terminal, mutates=mutates, description=description
        )

    return wrap(fn) if fn is not None else wrap


def tools_of(obj: object) -> list[Tool]:
    """The tools declared as ``@tool`` methods on ``obj``'s class, bound to ``obj``, in order."""
    found: list[Tool] = []
    seen: set[str] = set()
    for klass in reversed(type(obj).__mro__):
        for attr, value in vars(klass).items():
            meta = getattr(value, _TOOL_ATTR, None)
            if meta is None:
                continue
            built = Tool.from_function(
                getattr(obj, attr),
                name=meta.name,
                terminal=meta.terminal,
                mutates=meta.mutates,
                description=meta.description,
            )
            if attr in seen:  # overridden in a subclass: keep the original position
                found = [built if t.fn.__name__ == attr else t for t in found]
            else:
                found.append(built)
            seen.add(attr)
    return found

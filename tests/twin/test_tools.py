"""@tool: schemas from signatures and docstrings, hidden injected parameters, validation
messages."""

from __future__ import annotations

import json
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from twin import Tool, ToolArgumentError, ToolError, Twin, tool
from twin.tools import tools_of


class Order(BaseModel):
    order_id: str
    total: float


@tool
def lookup(order_id: str, world: dict, limit: int = 3, tags: list[str] | None = None) -> Order:
    """Look up an order.

    Longer explanation for the agent.

    Args:
        order_id: The order number, e.g. "R-1".
        limit: How many lines to show.
        tags: Optional tags.
    """
    if order_id not in world:
        raise ToolError(f"no order {order_id!r}")
    return Order(order_id=order_id, total=world[order_id])


class Shop(Twin):
    name = "Shop"

    @tool
    def find(self, query: str, state: dict, task: dict) -> list[str]:
        """Find things.

        Args:
            query: Words to look for.
        """
        state["n"] = state.get("n", 0) + 1
        return [query, task["x"]]

    @tool(terminal=True, mutates=True, name="finish")
    def submit(self, verdict: Literal["ok", "bad"], note: str = "") -> dict:
        """Submit the verdict."""
        return {"verdict": verdict}


def test_schema_from_signature_and_docstring():
    assert isinstance(lookup, Tool)
    fn = lookup.schema["function"]
    assert lookup.schema["type"] == "function" and fn["name"] == "lookup"
    assert fn["description"] == "Look up an order.\n\nLonger explanation for the agent."
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["order_id"]
    assert params["properties"]["order_id"] == {
        "type": "string",
        "description": 'The order number, e.g. "R-1".',
    }
    assert params["properties"]["limit"] == {
        "type": "integer",
        "default": 3,
        "description": "How many lines to show.",
    }
    assert params["additionalProperties"] is False


def test_injected_parameters_are_hidden():
    assert "world" not in lookup.schema["function"]["parameters"]["properties"]
    assert lookup.injected == ("world",)
    shop = Shop()
    find = shop.tool("find")
    assert set(find.schema["function"]["parameters"]["properties"]) == {"query"}
    assert set(find.injected) == {"state", "task"}


def test_method_tools_are_bound_and_flagged():
    shop = Shop()
    assert [t.name for t in shop.tools] == ["find", "finish"]
    finish = shop.tool("finish")
    assert finish.terminal and finish.mutates and not shop.tool("find").terminal
    state: dict = {}
    assert shop.tool("find").call({"query": "a"}, state=state, task={"x": "y"}) == ["a", "y"]
    assert state == {"n": 1}
    assert finish.schema["function"]["parameters"]["properties"]["verdict"]["enum"] == ["ok", "bad"]


def test_call_validates_and_dumps_models():
    assert lookup.call({"order_id": "R-1"}, world={"R-1": 9.5}) == {"order_id": "R-1", "total": 9.5}
    assert lookup.call('{"order_id": "R-1"}', world={"R-1": 9.5})["total"] == 9.5
    assert lookup.validate({"order_id": "R-1"}) == {"order_id": "R-1", "limit": 3, "tags": None}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {},
            "lookup: missing required argument 'order_id' (string). Usage: lookup(order_id: "
            "string, limit?: integer, tags?: array of string | null)",
        ),
        (
            {"order_id": 5},
            "lookup: argument 'order_id': Input should be a valid string (expected string, got "
            "5). Usage: lookup(order_id: string, limit?: integer, tags?: array of string | null)",
        ),
        (
            {"order_id": "a", "limit": "many"},
            "lookup: argument 'limit': Input should be a valid integer, unable to parse string as "
            "an integer (expected integer, got 'many'). Usage: lookup(order_id: string, limit?: "
            "integer, tags?: array of string | null)",
        ),
        (
            {"order_id": "a", "colour": 1},
            "lookup: unknown argument 'colour'; allowed: order_id, limit, tags. Usage: "
            "lookup(order_id: string, limit?: integer, tags?: array of string | null)",
        ),
        (
            "{nope",
            "lookup: arguments are not valid JSON (Expecting property name enclosed in double "
            'quotes at position 1); send a JSON object like {"order_id": "<string>"}',
        ),
        (
            [1],
            "lookup: arguments must be a JSON object, got list; send a JSON object like "
            '{"order_id": "<string>"}',
        ),
    ],
)
def test_validation_messages(args, message):
    with pytest.raises(ToolArgumentError) as err:
        lookup.validate(args)
    assert str(err.value) == message


def test_literal_messages_list_the_choices():
    finish = Shop().tool("finish")
    with pytest.raises(
        ToolArgumentError, match="finish: argument 'verdict': Input should be 'ok' or 'bad'"
    ):
        finish.validate({"verdict": "maybe"})


def test_tool_errors_reach_the_caller():
    with pytest.raises(ToolError, match="no order 'R-2'"):
        lookup.call({"order_id": "R-2"}, world={})


def test_tools_need_docstrings_and_hints():
    with pytest.raises(TypeError, match="needs a docstring"):

        @tool
        def nodoc(x: int) -> int:
            return x

    with pytest.raises(TypeError, match="parameter 'x' needs a type hint"):

        @tool
        def nohint(x) -> int:
            """Doc."""
            return x

    with pytest.raises(TypeError, match=r"\*args/\*\*kwargs"):

        @tool
        def star(*xs: int) -> int:
            """Doc."""
            return 0


def test_overriding_a_tool_keeps_its_place():
    class Shop2(Shop):
        name = "Shop2"

        @tool
        def find(self, query: str, state: dict, task: dict) -> list[str]:
            """Find better."""
            return [query]

    tools = tools_of(Shop2())
    assert [t.name for t in tools] == ["find", "finish"]  # the override keeps the original position
    assert Shop2().tool("find").description == "Find better."


# -- read-only results --------------------------------------------------------------------------
def test_frozen_data_refuses_changes_and_behaves_as_json_data():
    import copy
    import pickle

    from pydantic_core import to_json

    from twin.tools import FrozenDict, FrozenList, freeze, thaw
    from twin.trajectory import ToolCallRecord, Trajectory

    data = {"a": [1, {"b": 2}], "t": (1, 2), "s": "x"}
    frozen = freeze(data)
    assert (
        type(frozen) is FrozenDict
        and type(frozen["a"]) is FrozenList
        and type(frozen["a"][1]) is FrozenDict
    )
    assert frozen == {"a": [1, {"b": 2}], "t": [1, 2], "s": "x"}
    for change in (
        lambda: frozen.__setitem__("a", 1),
        lambda: frozen.update(a=1),
        lambda: frozen.pop("a"),
        lambda: frozen["a"].append(3),
        lambda: frozen["a"][1].setdefault("c", 1),
        lambda: frozen["a"].__setitem__(0, 9),
        lambda: frozen["a"].sort(),
    ):
        with pytest.raises(TypeError, match="read-only"):
            change()
    assert frozen == freeze(data) and freeze(frozen) is frozen
    assert copy.deepcopy(frozen) is frozen and pickle.loads(pickle.dumps(frozen)) == frozen
    assert (
        json.loads(json.dumps(frozen))
        == json.loads(frozen.json_text())
        == json.loads(to_json(frozen))
    )
    mutable = thaw(frozen)
    mutable["a"].append(3)
    assert type(mutable) is dict and frozen["a"] == [1, {"b": 2}]
    traj = Trajectory(
        twin="t",
        case_id="t/train/0",
        calls=[ToolCallRecord(id="c", name="n", ok=True, result=frozen)],
    )
    assert Trajectory.model_validate_json(traj.model_dump_json()) == traj


def test_frozen_data_from_a_pydantic_model():
    from twin.tools import FrozenDict, freeze

    class Point(BaseModel):
        x: int
        tags: list[str]

    frozen = freeze({"p": Point(x=1, tags=["a"])})
    assert type(frozen["p"]) is FrozenDict and frozen["p"] == {"x": 1, "tags": ["a"]}


def test_run_fills_only_the_hidden_parameters_the_tool_declares():
    find = Shop().tool("find")
    asked: list[str] = []

    class Hidden(dict):
        def __getitem__(self, name: str) -> Any:
            asked.append(name)
            return {"x": "t"} if name == "task" else {}

    hidden = Hidden()

    assert find.run(find.validate({"query": "q"}), hidden) == ["q", "t"]
    assert sorted(asked) == ["state", "task"]  # never "world", which find does not declare
    asked.clear()
    finish = Shop().tool("finish")
    assert finish.run(finish.validate({"verdict": "ok"}), hidden) == {"verdict": "ok"}
    assert asked == []

"""twinrl's framework: what a twin is and how an agent meets it.

``import twin`` registers the Gymnasium ids ``twin/<Name>-v<N>`` of every known twin.
"""

from twin.cases import Case, case_rng, stable_seed
from twin.contract import check_twin
from twin.core import Twin, TwinConfig
from twin.env import TwinEnv
from twin.errors import (
    CaseError,
    ConfigError,
    ParseError,
    ToolArgumentError,
    ToolError,
    TwinError,
    UnknownTwinError,
)
from twin.parsing import ParsedCall, ParsedTurn, parse_tool_calls
from twin.registry import (
    TwinSpec,
    list_twins,
    make,
    make_twin,
    register,
    registry,
    spec,
)
from twin.spaces import AssistantTurn, ChatMessages
from twin.tools import Tool, tool
from twin.trajectory import Group, TokenTurn, ToolCallRecord, Trajectory

__version__ = "0.1.0"

__all__ = [
    # twins and their parts
    "Case",
    "Tool",
    "Twin",
    "TwinConfig",
    "case_rng",
    "stable_seed",
    "tool",
    # the Gymnasium interface
    "AssistantTurn",
    "ChatMessages",
    "TwinEnv",
    "check_twin",
    # tool calls out of model text
    "ParsedCall",
    "ParsedTurn",
    "parse_tool_calls",
    # registry
    "TwinSpec",
    "list_twins",
    "make",
    "make_twin",
    "register",
    "registry",
    "spec",
    # episodes
    "Group",
    "TokenTurn",
    "ToolCallRecord",
    "Trajectory",
    # errors
    "CaseError",
    "ConfigError",
    "ParseError",
    "ToolArgumentError",
    "ToolError",
    "TwinError",
    "UnknownTwinError",
]

# Register every twin of the entry-point group ``twin.envs`` (ids only; nothing is imported).
from twin.registry import load_plugins as _load_plugins  # noqa: E402

_load_plugins()

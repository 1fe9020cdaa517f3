"""twinrl's framework: what a twin is and how an agent meets it.

``import twin`` registers the Gymnasium ids ``twin/<Name>-v<N>`` of every known twin.
"""

from twin.cases import Case, case_rng
from twin.core import Twin, TwinConfig
from twin.errors import (
    CaseError,
    ConfigError,
    ParseError,
    ToolArgumentError,
    ToolError,
    TwinError,
    UnknownTwinError,
)
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
    "tool",
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

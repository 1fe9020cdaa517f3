"""The twinrl error tree.

All errors that twinrl raises on purpose derive from :class:`TwinError`::

    TwinError
    +-- ToolError                 the agent did something wrong in a tool call (shown to the agent)
    |   +-- ToolArgumentError     arguments failed validation against the tool's schema
    +-- ParseError                no usable tool call could be read from the model's text
    +-- UnknownTwinError          an id or name that the registry does not know (with suggestions)
    +-- CaseError                 a split or index that the twin does not have
    +-- ConfigError               a config, recipe or override that is not valid

Messages say what was expected, what arrived, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "CaseError",
    "ConfigError",
    "MissingDependencyError",
    "ParseError",
    "ToolArgumentError",
    "ToolError",
    "TwinError",
    "UnknownTwinError",
]


class TwinError(Exception):
    """Base class of every error twinrl raises on purpose."""


class ToolError(TwinError):
    """Raised by a tool for anything the agent did wrong; the message is shown to the agent.

    Write the message for the agent: what was wrong and how to fix it, e.g.
    ``ToolError("unknown category id 'aa-99'; ids look like 'aa-1-13', use search_taxonomy")``.
    """


class ToolArgumentError(ToolError):
    """The arguments of a tool call did not validate against the tool's schema."""


class ParseError(TwinError):
    """No usable tool call could be read from the model's output."""


class UnknownTwinError(TwinError, KeyError):
    """A twin id or name that is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class CaseError(TwinError, ValueError):
    """A split name or case index that the twin does not have."""


class ConfigError(TwinError, ValueError):
    """A configuration value, recipe or override that is not valid."""


class MissingDependencyError(TwinError, ImportError):
    """An optional library a feature needs is not installed; the message names the install
    command."""

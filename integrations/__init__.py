"""Bridges that plug a twin into other people's harnesses: TRL, MCP, OpenEnv.

Each module imports its own optional library lazily (``pip install twinrl[integrations]``):
importing this package needs nothing beyond twinrl's core dependencies.

- :mod:`integrations.trl`: a twin as a TRL ``GRPOTrainer(environment_factory=...)`` class, and
  the prompt dataset of its cases.
- :mod:`integrations.mcp_server`: a twin's tools as an MCP server (``twin mcp TWIN``).
- :mod:`integrations.openenv_server`: a twin as an OpenEnv environment (server and client).
"""

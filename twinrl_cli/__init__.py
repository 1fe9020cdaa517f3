"""The ``twin`` command line: the layer on top of every twinrl package (docs/architecture.md).

Nothing of ours imports it. Each command parses its options with typer and calls a library
function (``twin``, ``envs``, ``rewards``, ``trainer``, ``integrations``), importing the package
it needs only when it runs, so that a missing optional library is a one-line install hint.

::

    twin list                                   # registered twins, their tools
    twin show returns --split test --index 0    # a case's prompt and tool schemas
    twin play returns                           # type tool calls yourself
    twin eval returns --policy random --episodes 50
    twin runs                                   # the run store
    twin runs show 3
    twin ui                                     # the run store in a browser
    twin collect returns --policy oracle --split train --episodes 256 --min-reward 0.9
    twin sft recipe.yaml                        # supervised warm start on collected episodes

The commands live by group: ``twins.py`` (list, show, check, play), ``eval.py``, ``runs.py``,
``train.py`` (train, sft, collect, plan), ``bench.py``, ``serve.py`` (serve, mcp), ``reward.py``,
``ui.py`` and ``demo.py``; ``app.py`` holds the typer app, the error handling and the entry point.
"""

from __future__ import annotations

# Importing a command group registers its commands on the app.
from twinrl_cli import bench, demo, eval, openenv, package, reward, runs, serve, train, twins, ui  # noqa: F401, I001  (help order)
from twinrl_cli.app import app, main, parse_overrides

__all__ = ["app", "main", "parse_overrides"]

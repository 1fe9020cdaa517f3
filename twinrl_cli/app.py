"""The ``twin`` typer app, its error handling and what every command group shares.

The command groups (``twinrl_cli/twins.py``, ``eval.py``, ``runs.py``, ``train.py``,
``bench.py``, ``serve.py``, ``reward.py``, ``ui.py``, ``demo.py``) add their commands to
:data:`app` and its sub-apps when ``twinrl_cli`` is imported. Errors a user can fix print one
``error:`` line and exit with status 2: twinrl's own (:class:`twin.errors.TwinError`), a bad
option value or an unknown option (typer's usage errors), and a command whose package or optional
library is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from twin.errors import ConfigError, TwinError

# Before torch loads OpenMP: idle threads sleep instead of spinning. On a shared CPU, spinning
# threads of one process steal the cores another needs (measured: a SmolLM2 decode step 3.3 s
# with spinning threads vs 0.7 s passive while other torch jobs ran).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = [
    "app", "bench_app", "console", "dump", "err_console", "errors", "main", "make_twin", "needs",
    "parse_overrides", "reward_app", "run_target", "runs_app", "twin_config",
]  # fmt: skip

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # error lines stay whole for copy and grep


def _usage_error_line(exc: typer.TyperException) -> str:
    """A usage error (bad value, unknown option, missing argument) as one line."""
    ctx = getattr(exc, "ctx", None)
    where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    return f"[bold red]error:[/] {escape(exc.format_message())}{escape(where)}"


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    try:
        yield
    except typer.TyperException as exc:  # typer's click: every usage error
        if type(exc).__name__ == "NoArgsIsHelpError":  # `twin bench` alone prints the help
            raise
        err_console.print(_usage_error_line(exc))
        raise typer.Exit(exc.exit_code) from None


class _OneLineErrorsGroup(TyperGroup):
    """The top group: a usage error anywhere below it is one ``error:`` line, not a box."""

    def make_context(self, *args: Any, **kwargs: Any) -> typer.Context:  # noqa: D102
        with _one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: typer.Context) -> Any:  # noqa: D102
        with _one_line_usage_errors():
            return super().invoke(ctx)


app = typer.Typer(
    name="twin",
    cls=_OneLineErrorsGroup,
    help="twinrl: digital twins of business processes for training LLM agents with RL.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
runs_app = typer.Typer(help="List the runs in the run store; `twin runs show ID` for one run.")
bench_app = typer.Typer(
    help="Benchmarks: `twin bench catalog`, `twin bench trainer`, `twin bench trl`, "
    "`twin bench openenv`.",
    no_args_is_help=True,
)
reward_app = typer.Typer(help="Reward tools: `twin reward test FILES...`.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")
app.add_typer(bench_app, name="bench")
app.add_typer(reward_app, name="reward")

# -- shared options ----------------------------------------------------------------------------
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set", help="Twin config override KEY=VALUE (repeatable), e.g. --set max_turns=4."
    ),
]
TaxonomyOpt = Annotated[
    str | None,
    typer.Option("--taxonomy", help="Taxonomy folder, passed to the twin as taxonomy_path."),
]
SplitOpt = Annotated[str, typer.Option("--split", help="Case split.")]
StoreOpt = Annotated[
    str | None,
    typer.Option(
        "--store",
        help="Run store: SQLAlchemy URL or SQLite path (default $TWINRL_STORE or runs/twinrl.db).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]


@contextlib.contextmanager
def errors() -> Iterator[None]:
    """Turn twinrl's errors into a one-line message and exit status 2; so is an optional library
    (torch, ...) that a command imports only once it runs and that is not installed."""
    try:
        yield
    except TwinError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        if top not in _INSTALL_OF:
            raise
        err_console.print(
            f"[bold red]error:[/] this command needs the package {top!r}, which is not "
            + escape(f"installed: pip install '{_INSTALL_OF[top]}'")
        )
        raise typer.Exit(2) from None


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["max_turns=4", "name=x"]`` -> ``{"max_turns": 4, "name": "x"}`` (values read as YAML).

    Raises:
        ConfigError: an item without ``=``.
    """
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out[key.strip()] = value
    return out


def twin_config(overrides: list[str] | None, taxonomy: str | None) -> dict[str, Any]:
    """The twin's config from ``--set`` items and ``--taxonomy``."""
    config = parse_overrides(overrides)
    if taxonomy is not None:
        config["taxonomy_path"] = taxonomy
    return config


def make_twin(name: str, config: dict[str, Any]) -> Any:
    """The registered twin ``name`` built with ``config``."""
    from twin.registry import make_twin as registered

    return registered(name, **config)


def dump(data: Any) -> None:
    """JSON on stdout, nothing else (for pipes)."""
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")
    sys.stdout.flush()


# -- commands that run other packages -----------------------------------------------------------
_OUR_PACKAGES = frozenset({"twin", "rewards", "envs", "trainer", "integrations", "twinrl_data"})
#: What installs a library a command needs: an extra of pyproject.toml's optional-dependencies,
#: or the library itself where it is a core dependency that went missing.
_INSTALL_OF = {
    "torch": "twinrl[train]", "transformers": "twinrl[train]", "peft": "twinrl[train]",
    "tokenizers": "twinrl[train]", "gguf": "twinrl[train]",
    "mcp": "mcp>=2,<3", "mcp_types": "mcp>=2,<3",
    "trl": "twinrl[trl]", "verifiers": "twinrl[verifiers]", "wandb": "twinrl[trackers]",
    "trackio": "twinrl[trackers]", "datasets": "twinrl[trl]", "ray": "twinrl[ray]",
    "psycopg": "twinrl[postgres]", "openenv": "twinrl[openenv]", "openai": "twinrl[providers]",
    "anthropic": "twinrl[providers]", "accelerate": "twinrl[train]", "starlette": "starlette>=0.37",
    "uvicorn": "uvicorn>=0.30",
}  # fmt: skip


@contextlib.contextmanager
def needs(command: str, target: str) -> Iterator[None]:
    """Import a command's target inside this block; a missing one exits 2 with one line.

    Args:
        command: The command as typed after ``twin`` (for the message), e.g. ``"bench trl"``.
        target: ``module:function`` the block imports (for the message), e.g.
            ``"bench.trl_ratio:main"``.
    """
    module_name, _, attr = target.partition(":")
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            err_console.print(
                f"[bold red]error:[/] `twin {command}` needs {module_name} ({target}), which is "
                "not available in this installation."
            )
            raise typer.Exit(2) from None
        top = missing.partition(".")[0]
        if top and top not in _OUR_PACKAGES:  # an optional library, not a broken install of ours
            what = _INSTALL_OF.get(top, "twinrl[train,integrations]")
            err_console.print(
                f"[bold red]error:[/] `twin {command}` needs the package {top!r}, which is not "
                + escape(f"installed: pip install '{what}'")
            )
            raise typer.Exit(2) from None
        raise
    except ImportError as exc:
        if exc.name != module_name or f"'{attr}'" not in str(exc):
            raise
        err_console.print(
            f"[bold red]error:[/] `twin {command}` needs {target}, but {module_name} has no "
            f"function {attr!r}."
        )
        raise typer.Exit(2) from None


def run_target(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Call a command's target; twinrl's errors are one line (exit 2), an int result the exit
    status."""
    with errors():
        result = fn(*args, **kwargs)
    if isinstance(result, int) and not isinstance(result, bool) and result != 0:
        raise typer.Exit(result)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``twin`` console script."""
    app(args=argv, prog_name="twin")

"""``twin runs`` and ``twin runs show ID``: the run store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

from twinrl_cli.app import JsonOpt, StoreOpt, console, dump, errors, runs_app
from twinrl_cli.eval import print_summary

__all__ = ["runs", "runs_show"]


# -- runs --------------------------------------------------------------------------------------
@runs_app.callback(invoke_without_command=True)
def runs(
    ctx: typer.Context,
    store: StoreOpt = None,
    limit: Annotated[int, typer.Option("--limit", help="Most runs to list.")] = 30,
    kind: Annotated[
        str | None, typer.Option("--kind", help="Only eval, train, demo or bench runs.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the latest runs in the run store."""
    if ctx.invoked_subcommand is not None:
        return
    from twin.store import RunStore

    with errors(), _readable(store):
        run_store = RunStore(store, create=False)
        rows = run_store.runs(limit, kind=kind)
        run_store.close()
    if as_json:
        dump([r.__dict__ for r in rows])
        return
    table = Table(title=f"runs ({escape(run_store.url)})")
    for col, justify in (
        ("id", "right"),
        ("kind", "left"),
        ("twin", "left"),
        ("policy", "left"),
        ("status", "left"),
        ("started (UTC)", "left"),
        ("episodes", "right"),
        ("reward", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(
            str(r.id),
            r.kind,
            escape(r.twin),
            escape(r.policy),
            _status_text(r.status),
            r.started_at.strftime("%Y-%m-%d %H:%M:%S") if r.started_at else "",
            str(r.episodes),
            "" if r.reward_mean is None else f"{r.reward_mean:.4f}",
        )
    console.print(table)


@runs_app.command("show")
def runs_show(
    run_id: Annotated[int, typer.Argument(help="Run id (from `twin runs`).")],
    store: StoreOpt = None,
    episodes: Annotated[int, typer.Option("--episodes", help="Episodes to list.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Show one run: its config, summary metrics and first episodes."""
    from twin.store import RunStore

    with errors(), _readable(store):
        run_store = RunStore(store, create=False)
        info = run_store.run(run_id)
        trajs = run_store.episodes(run_id, limit=episodes)
        run_store.close()
    if as_json:
        dump({"run": info.__dict__, "episodes": [t.model_dump(mode="json") for t in trajs]})
        return
    console.rule(
        f"[bold]run {info.id}: {info.kind} {escape(info.twin)} x {escape(info.policy)} "
        f"({_status_text(info.status)})"
    )
    console.print(Syntax(json.dumps(info.config, indent=2, default=str), "json", word_wrap=True))
    if info.metrics and "reward_mean" in info.metrics:
        print_summary(info.metrics)
    table = Table(title=f"episodes ({len(trajs)} of {info.episodes})")
    for col in ("case", "kind", "reward", "turns", "invalid", "end"):
        table.add_column(col)
    failed = any("error" in t.info for t in trajs)
    if failed:
        table.add_column("error", overflow="fold")
    for t in trajs:
        end = (
            "error"
            if "error" in t.info
            else ("submit" if t.terminated else "truncated" if t.truncated else "?")
        )
        cells = [
            escape(t.case_id),
            escape(t.case_kind),
            "" if t.reward is None else f"{t.reward:.4f}",
            str(t.num_turns),
            str(t.invalid_calls),
            end,
        ]
        if failed:
            cells.append(escape(_short(str(t.info.get("error", "")), 200)))
        table.add_row(*cells)
    console.print(table)


@contextmanager
def _readable(store: str | None) -> Iterator[None]:
    """A database error while reading (a damaged SQLite file) as a one-line ConfigError."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, DatabaseError

    from twin.errors import ConfigError
    from twin.store import damaged_store_message, resolve_url

    try:
        yield
    except DatabaseError as exc:
        url = resolve_url(store)
        try:
            url = make_url(url).render_as_string(hide_password=True)
        except ArgumentError:
            pass
        raise ConfigError(damaged_store_message(url, exc)) from None


def _status_text(status: str) -> str:
    if status == "interrupted":
        return "[yellow]interrupted[/]"
    return "[red]failed[/]" if status == "failed" else status


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."

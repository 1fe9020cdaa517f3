"""``twin eval``: parse the options, run :func:`twin.evaluation.plan_evaluation`'s job, print
the summary.

Exit status (docs/cli.md): 0 every episode ran; 3 some episodes failed (stored, with their
reasons in the summary); 2 bad input (one line); 1 the command failed (an unexpected error, with a
traceback); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from twinrl_cli.app import (
    JsonOpt,
    SetOpt,
    SplitOpt,
    StoreOpt,
    TaxonomyOpt,
    app,
    console,
    dump,
    err_console,
    errors,
    make_twin,
    twin_config,
)

__all__ = ["eval_", "print_error_reasons", "print_summary"]


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
            f'\'{{"chat_template_kwargs": {{"enable_thinking": false}}}}\'; got {raw!r} ({exc})'
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"--extra-body must be a JSON object, got {type(value).__name__}")
    return value


# long: Typer options are the signature
@app.command("eval")
def eval_(
    name: Annotated[str, typer.Argument(help="Twin name or id.")],
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            "-p",
            help="random[:SEED] | replay:FILE | openai:MODEL | anthropic:MODEL |"
            " openai-responses:MODEL | hf:PATH | a twin baseline (heuristic, oracle)."
            " Default: the policy file's, else random.",
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
        typer.Option("--concurrency", "-c", min=1, help="Episodes in flight at once (default 64)."),
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
        typer.Option(
            "--base-url",
            help="Model server base URL (default $OPENAI_BASE_URL;"
            " anthropic: $ANTHROPIC_BASE_URL).",
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            help="API key of model-server policies (never stored; default: the provider's variable,"
            " $OPENAI_API_KEY or $ANTHROPIC_API_KEY).",
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
    tracker: Annotated[
        str | None,
        typer.Option(
            "--tracker",
            help="Also send the result to wandb or trackio: summary scalars and an episode table"
            " (raw model text, one column per reward term); their own variables apply"
            " (WANDB_PROJECT, WANDB_MODE, TRACKIO_DIR, ...). pip install 'twinrl[trackers]'.",
        ),
    ] = None,
    tracker_project: Annotated[
        str, typer.Option("--tracker-project", help="Project of --tracker (WANDB_PROJECT wins).")
    ] = "twinrl",
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a policy on a twin's cases: reward, components, pass@k, pass^k; store the run.

    Exit status: 0 every episode ran; 3 some episodes failed (stored, reasons in the summary);
    2 bad input; 1 the command failed; 130 interrupted.
    """
    from twin.evaluation import plan_evaluation
    from twin.policies import PolicySettings, load_policy_file
    from twin.store import RunStore

    with errors():
        tracker_lib = _tracker_library(tracker)
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
        config = twin_config(overrides, taxonomy)
        job = plan_evaluation(
            make_twin(name, config), settings, episodes=episodes, split=split, start=start,
            group_size=group_size, seed=seed, backend=backend,  # type: ignore[arg-type]
            twin_config=config, policy_file=policy_file,
        )  # fmt: skip
        run_store = None if no_store else RunStore(store)
        result = _run_job(job, run_store, progress=progress, quiet=as_json)
    _report(result, tracker_lib, tracker_project, as_json=as_json)


def _run_job(job: Any, run_store: Any, *, progress: bool, quiet: bool) -> Any:
    """Run the planned evaluation ``job`` into ``run_store`` (None: not stored); closes it.

    Raises:
        typer.Exit: interrupted (Ctrl-C), after saying how many episodes the run keeps.
    """
    from twin.evaluation import EvalInterrupted

    if not quiet:
        err_console.print(f"[dim]{escape(job.describe())}[/]")
    try:
        return job.run(run_store, progress=progress)
    except EvalInterrupted as stop:
        if stop.run_id is not None:
            err_console.print(
                f"[yellow]interrupted: run {stop.run_id} keeps {stop.kept} episodes[/]"
            )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    finally:
        if run_store is not None:
            run_store.close()


def _report(result: Any, tracker_lib: str | None, project: str, *, as_json: bool) -> None:
    """Send ``result`` to the tracker, print its summary (tables, or JSON with ``as_json``).

    Raises:
        typer.Exit: some episodes failed (EXIT_EPISODES_FAILED).
    """
    summary = result.summary
    if tracker_lib is not None:
        from trainer.metrics import log_evaluation

        episodes = [t for g in result.groups for t in g.trajectories]
        log_evaluation(tracker_lib, summary, episodes, project=project)
    if as_json:
        dump(summary)
    else:
        print_summary(summary)
    if summary["errors"]:
        raise typer.Exit(EXIT_EPISODES_FAILED)


def _tracker_library(tracker: str | None) -> str | None:
    """``tracker`` once its library imports (checked before the evaluation runs).

    Raises:
        ConfigError: ``tracker`` is neither wandb nor trackio.
        MissingDependencyError: it is not installed; the message names the extra.
    """
    if tracker is None:
        return None
    import importlib.util

    from twin.errors import ConfigError, MissingDependencyError

    if tracker not in ("wandb", "trackio"):
        raise ConfigError(f"--tracker must be wandb or trackio, got {tracker!r}")

    if importlib.util.find_spec(tracker) is None:
        raise MissingDependencyError(
            f"--tracker {tracker} needs the {tracker} package, which is not installed: "
            "pip install 'twinrl[trackers]'"
        )
    return tracker


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

"""``twin serve MODEL`` (a local model behind an OpenAI-compatible API, trainer/serving/cli.py) and
``twin mcp TWIN`` (a twin's tools as an MCP server, integrations/mcp_server.py)."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer

from twinrl_cli.app import StoreOpt, app, err_console, errors, needs, parse_overrides, run_target

__all__ = ["mcp", "serve"]


class LogprobsMode(str, enum.Enum):
    """Which logprobs ``twin serve`` returns."""

    processed_logprobs = "processed_logprobs"
    raw_logprobs = "raw_logprobs"


# The request limits: each is a field of the server's ServeLimits (trainer/serving/api.py), which
# owns the defaults; an option left out keeps the server's default.
_LIMIT = "Limit (default: the server's, docs/security.md): "


# long: Typer options are the signature
@app.command()
def serve(
    model: Annotated[
        str, typer.Argument(help="Model: tiny, smollm2, a local HF dir or a checkpoint.")
    ],
    host: Annotated[
        str,
        typer.Option(
            "--host", help="Interface to bind (loopback; docs/security.md before exposing it)."
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port.")] = 8000,
    dtype: Annotated[
        str, typer.Option("--dtype", help="float32 (CPU default), bfloat16 or float16.")
    ] = "float32",
    max_loras: Annotated[
        int, typer.Option("--max-loras", min=1, help="Adapters resident at once.")
    ] = 4,
    served_model_name: Annotated[
        str | None,
        typer.Option(
            "--served-model-name", help="The base model's name in requests (default: MODEL)."
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="cpu or cuda:N.")] = "cpu",
    logprobs_mode: Annotated[
        LogprobsMode,
        typer.Option(
            "--logprobs-mode", help="processed_logprobs (after temperature/top-p) or raw_logprobs."
        ),
    ] = LogprobsMode.processed_logprobs,
    max_batch_rows: Annotated[
        int, typer.Option("--max-batch-rows", min=1, help="Most sequences sampled together.")
    ] = 64,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed for requests without their own seed.")
    ] = 0,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads",
            min=1,
            help="CPU threads (default: one per core of --cpus when pinned, else torch's).",
        ),
    ] = None,
    cpus: Annotated[
        str | None,
        typer.Option(
            "--cpus",
            help="Cores to pin the server to, taskset -c syntax (0 or 0,2-3);"
            " default $TWINRL_ROLLOUT_CPUS.",
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            help="Bearer key required on every route but /health (default $TWINRL_API_KEY;"
            " prefer the variable: arguments show in ps).",
        ),
    ] = None,
    adapter_root: Annotated[
        str | None, typer.Option("--adapter-root", help="Only adapters under this folder load.")
    ] = None,
    max_n: Annotated[
        int | None, typer.Option("--max-n", help=_LIMIT + "most completions per prompt (n).")
    ] = None,
    max_prompts: Annotated[
        int | None, typer.Option("--max-prompts", help=_LIMIT + "most prompts in one request.")
    ] = None,
    max_rows: Annotated[
        int | None,
        typer.Option("--max-rows", help=_LIMIT + "most sequences in one request (prompts x n)."),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option("--max-tokens", help=_LIMIT + "most completion tokens per sequence."),
    ] = None,
    max_prompt_tokens: Annotated[
        int | None, typer.Option("--max-prompt-tokens", help=_LIMIT + "most tokens in one prompt.")
    ] = None,
    max_logprobs: Annotated[
        int | None,
        typer.Option(
            "--max-logprobs",
            help=_LIMIT + "most alternatives per token (logprobs, prompt_logprobs).",
        ),
    ] = None,
    max_stop_token_ids: Annotated[
        int | None, typer.Option("--max-stop-token-ids", help=_LIMIT + "most stop_token_ids.")
    ] = None,
    max_body_bytes: Annotated[
        int | None, typer.Option("--max-body-bytes", help=_LIMIT + "largest request body (bytes).")
    ] = None,
    body_budget_bytes: Annotated[
        int | None,
        typer.Option(
            "--body-budget-bytes",
            help=_LIMIT + "bytes of request bodies read or being answered at once.",
        ),
    ] = None,
    read_timeout: Annotated[
        float | None,
        typer.Option(
            "--read-timeout",
            help=_LIMIT + "seconds a whole request may take to arrive; also the idle limit.",
        ),
    ] = None,
    http_threads: Annotated[
        int | None,
        typer.Option("--http-threads", help=_LIMIT + "requests handled at once (handler threads)."),
    ] = None,
    max_connections: Annotated[
        int | None,
        typer.Option(
            "--max-connections", help=_LIMIT + "open connections (served + waiting); more get 503."
        ),
    ] = None,
) -> None:
    """Serve a local model over an OpenAI-compatible API (trainer/serving/)."""
    given: dict[str, Any] = {
        "max_n": max_n, "max_prompts": max_prompts, "max_rows": max_rows, "max_tokens": max_tokens,
        "max_prompt_tokens": max_prompt_tokens, "max_logprobs": max_logprobs,
        "max_stop_token_ids": max_stop_token_ids, "max_body_bytes": max_body_bytes,
        "body_budget_bytes": body_budget_bytes, "read_timeout": read_timeout,
        "http_threads": http_threads, "max_connections": max_connections,
    }  # fmt: skip
    limits = {name: value for name, value in given.items() if value is not None}
    with needs("serve", "trainer.serving.cli:serve"):
        from trainer.serving.cli import serve as serve_model
    run_target(
        serve_model, model=model, host=host, port=port, dtype=dtype, max_loras=max_loras,
        served_model_name=served_model_name, device=device, logprobs_mode=logprobs_mode.value,
        max_batch_rows=max_batch_rows, seed=seed, threads=threads, cpus=cpus, api_key=api_key,
        adapter_root=adapter_root, **limits,
    )  # fmt: skip


@app.command("mcp")
def mcp(
    twin_name: Annotated[
        str, typer.Argument(metavar="TWIN", help="Registered twin, e.g. Returns.")
    ],
    http: Annotated[
        bool,
        typer.Option("--http", help="Streamable HTTP at http://HOST:PORT/mcp instead of stdio."),
    ] = False,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8765,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", help="Twin option KEY=VALUE, repeatable.")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="TWINRL_API_KEY",
            show_envvar=True,
            help="HTTP: Bearer key every request must send (prefer the variable).",
        ),
    ] = None,
    max_sessions: Annotated[
        int,
        typer.Option("--max-sessions", min=1, help="HTTP: most live sessions; more are refused."),
    ] = 1024,
    idle_timeout: Annotated[
        float,
        typer.Option(
            "--idle-timeout",
            min=0.001,
            help="HTTP: seconds without requests before a session expires with its episode.",
        ),
    ] = 1800.0,
    store: StoreOpt = None,
    no_store: Annotated[
        bool, typer.Option("--no-store", help="Do not write ended episodes to the run store.")
    ] = False,
) -> None:
    """Serve a twin's tools as an MCP server (integrations.mcp_server; docs/integrations.md).
    Ended episodes go to the run store as one eval run (policy mcp)."""
    with needs("mcp", "integrations.mcp_server:serve"):
        from integrations.mcp_server import serve as serve_twin
    with errors():
        config = parse_overrides(overrides)
        from twin.errors import ConfigError, TwinError
        from twin.store import RunStore

        try:
            run_store = None if no_store else RunStore(store)
        except (TwinError, OSError) as exc:
            if store is not None:  # the store asked for must work
                raise ConfigError(f"cannot open the run store {store!r}: {exc}") from None
            # A host (Claude Desktop, Cursor) may start the server where it cannot write the
            # default store: serve anyway, and say where episodes are not going.
            err_console.print(f"warning: episodes are not stored ({exc}); pass --store PATH")
            run_store = None
    try:
        run_target(
            serve_twin, twin_name, transport="http" if http else "stdio", host=host, port=port,
            api_key=api_key, max_sessions=max_sessions, idle_timeout_s=idle_timeout,
            store=run_store, **config,
        )  # fmt: skip
    finally:
        if run_store is not None:
            run_store.close()

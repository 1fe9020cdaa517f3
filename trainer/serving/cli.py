"""``twin serve MODEL``: the entry point of the sampler server (``python -m trainer.serving``).

:func:`serve` loads the model, builds the completions server (``trainer/serving/completions.py``)
and serves it over HTTP (``trainer/serving/http.py``) until interrupted; :func:`run_cli` is the
same with its own argument parser, for the child process
:class:`trainer.serving.process.ServerProcess` starts.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from trainer.serving.api import API_KEY_ENV, LogprobsMode, ServeLimits, validation_message
from twin.errors import ConfigError

__all__ = ["run_cli", "serve"]

log = logging.getLogger("twinrl.serve")


def _load(model: str, dtype: str, device: str) -> tuple[Any, Any]:
    """Load ``tiny``, ``smollm2`` or a local HF dir with the trainer's loader."""
    from trainer.models import load_model

    return load_model(model, dtype, device)


# long: an entry point whose options are its signature and docstring (the body is ~45 lines)
def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "float32",
    max_loras: int = 4,
    *,
    served_model_name: str | None = None,
    device: str = "cpu",
    logprobs_mode: LogprobsMode = "processed_logprobs",
    max_batch_rows: int = 64,
    seed: int = 0,
    threads: int | None = None,
    cpus: str | None = None,
    api_key: str | None = None,
    adapter_root: str | None = None,
    **limits: Any,
) -> None:
    """Serve ``model`` until interrupted (``twin serve MODEL``).

    Args:
        model: ``tiny``, ``smollm2`` or a local HF model dir.
        host: Interface to bind (loopback by default; see ``docs/security.md`` before exposing it).
        port: TCP port.
        dtype: ``float32`` (CPU default), ``bfloat16`` or ``float16``.
        max_loras: Adapters resident at once.
        served_model_name: The base model's name in requests (default: ``model``).
        device: ``cpu`` or ``cuda:N``.
        logprobs_mode: ``processed_logprobs`` (after temperature/top-p) or ``raw_logprobs``.
        max_batch_rows: Most sequences sampled together.
        seed: Seed for requests without their own ``seed``.
        threads: CPU threads (default: one per core of ``cpus`` when pinned, else torch's
            default). Idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE`` when started by
            :class:`ServerProcess`).
        cpus: Cores to pin the server to, ``taskset -c`` syntax (``0`` or ``0,2-3``); default
            ``$TWINRL_ROLLOUT_CPUS``, which the async trainer exports with
            ``devices.cpu_affinity: auto``.
        api_key: Required as ``Authorization: Bearer`` on every route but ``/health``
            (default ``$TWINRL_API_KEY``; prefer the variable: arguments show in ``ps``).
        adapter_root: Only adapters under this folder load.
        limits: :class:`ServeLimits` fields (``max_n``, ``max_tokens``, ``read_timeout``, ...).

    Raises:
        ConfigError: a limit is not a valid value.
    """
    serve_limits = _limits(limits)
    import torch

    from trainer.placement import place_rollout_process
    from trainer.serving.completions import CompletionServer
    from trainer.serving.http import exposure_warnings, make_http_server

    pinned = place_rollout_process(threads, cpus)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
    # str(): `twin serve --api-key 123` arrives as an int through the CLI's YAML values
    api_key = str(api_key) if api_key is not None else os.environ.get(API_KEY_ENV) or None
    for warning in exposure_warnings(host, api_key, adapter_root):
        log.warning("%s", warning)
    if pinned:
        cores = ",".join(map(str, pinned))
        log.info("pinned to cores %s with %d thread(s)", cores, torch.get_num_threads())
    net, tokenizer = _load(model, dtype, device)
    core = CompletionServer(
        net,
        tokenizer,
        model_name=served_model_name or model,
        max_loras=max_loras,
        max_batch_rows=max_batch_rows,
        logprobs_mode=logprobs_mode,
        seed=seed,
        limits=serve_limits,
        adapter_root=adapter_root,
    )
    httpd = make_http_server(core, host, port, api_key=api_key)
    print(
        f"twin serve: {served_model_name or model} on http://{host}:{httpd.server_address[1]}/v1"
        + (" (API key required)" if api_key else ""),
        flush=True,
    )
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        core.close()


def _limits(limits: dict[str, Any]) -> ServeLimits:
    """``twin serve``'s limit options as :class:`ServeLimits`; a ConfigError naming a bad one."""
    unknown = sorted(set(limits) - set(ServeLimits.model_fields))
    if unknown:
        options = ", ".join("--" + name.replace("_", "-") for name in ServeLimits.model_fields)
        raise ConfigError(
            f"unknown twin serve option(s) {', '.join(unknown)}; the limits are {options}"
        )
    try:
        return ServeLimits(**limits)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, "twin serve option")) from None


def run_cli(argv: Sequence[str] | None = None) -> None:
    """Parse ``argv`` (default: ``sys.argv``) and :func:`serve`."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer.serving",
        description="Serve a local model over vLLM's completions API.",
    )
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--logprobs-mode",
        default="processed_logprobs",
        choices=["processed_logprobs", "raw_logprobs"],
    )
    parser.add_argument("--max-batch-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpus", default=None, help="cores to pin to, e.g. 0 or 0,2-3")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"bearer key required on /v1 routes (default ${API_KEY_ENV})",
    )
    parser.add_argument("--adapter-root", default=None, help="only adapters under this folder load")
    for name, info in ServeLimits.model_fields.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=info.annotation, default=info.default,
            help=f"{info.description} (default {info.default})",
        )  # fmt: skip
    args = vars(parser.parse_args(argv))
    serve(**args)

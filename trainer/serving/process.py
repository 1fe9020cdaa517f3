"""Process management: a server in a child process (start, wait for ``/health``, stop).

:class:`ManagedServer` is shared by ``twin serve`` (:class:`ServerProcess`, the sampler server the
trainer starts) and the vLLM launcher (``trainer/vllm.py``). Nothing here imports torch.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainer.serving.api import API_KEY_ENV, LogprobsMode
from twin.errors import TwinError
from twin.policies.http import tls_context

__all__ = ["ManagedServer", "ServerProcess", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ManagedServer:
    """A server in a child process: start, wait for ``/health``, stop; the log goes to a file.

    Subclasses give :meth:`command` and :meth:`environment`.
    """

    name = "server"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | Path | None = None,
        startup_timeout: float = 120.0,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    @property
    def url(self) -> str:
        """``http://host:port`` (no path)."""
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ``http://host:port/v1``."""
        return f"{self.url}/v1"

    def command(self) -> list[str]:
        """The argv to run. Override."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The child's environment. Override to add variables."""
        return dict(os.environ)

    def start(self) -> ManagedServer:
        """Start the child and wait until ``/health`` answers 200.

        Raises:
            TwinError: the child exited or did not become healthy within ``startup_timeout``;
                the message holds the command and the tail of its log.
        """
        if self.process is not None and self.process.poll() is None:
            return self
        if self.log_path is None:
            import tempfile

            self.log_path = Path(tempfile.mkstemp(prefix=f"twin-{self.name}-", suffix=".log")[1])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        self.wait_healthy(self.startup_timeout)
        return self

    def healthy(self) -> bool:
        """True when ``GET /health`` answers 200 now."""
        import httpx

        try:
            return (
                httpx.get(f"{self.url}/health", timeout=2.0, verify=tls_context()).status_code
                == 200
            )
        except httpx.HTTPError:
            return False

    def alive(self) -> bool:
        """True while the child process runs."""
        return self.process is not None and self.process.poll() is None

    def wait_healthy(self, timeout: float) -> None:
        """Poll ``/health`` until it answers 200.

        Raises:
            TwinError: the child died or ``timeout`` passed; the log tail is in the message.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise TwinError(
                    f"{self.name} exited with code {self.process.returncode} before it became "
                    f"healthy.\ncommand: {' '.join(self.command())}\nlog "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.2)
        tail = self.log_tail()
        self.stop()
        raise TwinError(
            f"{self.name} did not answer {self.url}/health within {timeout:.0f} s; raise the "
            f"startup timeout or read its log.\ncommand: {' '.join(self.command())}\nlog "
            f"{self.log_path}:\n{tail}"
        )

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the child's log."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_bytes()[-20_000:].decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the child (SIGTERM, then SIGKILL after ``timeout``)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> ManagedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess(ManagedServer):
    """``twin serve`` in a child process on a free loopback port (for the trainer and tests).

    Example::

        with ServerProcess("tiny") as server:
            ServerSampler(server.base_url, "tiny")

    Args:
        model: ``tiny``, ``smollm2`` or a local HF dir.
        dtype: Weights dtype.
        max_loras: Adapters resident at once.
        served_model_name: Base model name in requests (default ``model``).
        device: ``cpu`` or ``cuda:N``.
        logprobs_mode: See :class:`trainer.serving.completions.CompletionServer`.
        python: Interpreter to run (default: this one).
        threads: CPU threads of the child (default: torch's choice, or one per pinned core); set,
            it also gets ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` and ``OMP_WAIT_POLICY=PASSIVE``
            (idle threads sleep instead of spinning on cores the learner needs).
        cpus: Cores to pin the child to (``taskset -c`` syntax); default ``$TWINRL_ROLLOUT_CPUS``.
        api_key: The child's API key, handed over in ``$TWINRL_API_KEY`` (not on its command
            line); None: the child inherits this process's ``$TWINRL_API_KEY``, if any.
        adapter_root: Only adapters under this folder load (``--adapter-root``).
        host, port, log_path, startup_timeout: See :class:`ManagedServer`.
    """

    name = "twin serve"

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "float32",
        max_loras: int = 4,
        served_model_name: str | None = None,
        device: str = "cpu",
        logprobs_mode: LogprobsMode = "processed_logprobs",
        python: str | None = None,
        threads: int | None = None,
        seed: int = 0,
        cpus: str | None = None,
        api_key: str | None = None,
        adapter_root: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.api_key = api_key
        self.adapter_root = Path(adapter_root).resolve() if adapter_root is not None else None
        self.model = model
        self.dtype = dtype
        self.max_loras = max_loras
        self.served_model_name = served_model_name or model
        self.device = device
        self.logprobs_mode = logprobs_mode
        self.python = python or sys.executable
        self.threads = threads
        self.seed = seed
        self.cpus = cpus

    def command(self) -> list[str]:
        """``python -m trainer.serving MODEL --host .. --port .. ...``."""
        return [
            self.python,
            "-m",
            "trainer.serving",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-loras",
            str(self.max_loras),
            "--served-model-name",
            self.served_model_name,
            "--device",
            self.device,
            "--logprobs-mode",
            self.logprobs_mode,
            "--seed",
            str(self.seed),
            *(["--threads", str(self.threads)] if self.threads else []),
            *(["--cpus", self.cpus] if self.cpus else []),
            *(["--adapter-root", str(self.adapter_root)] if self.adapter_root else []),
        ]

    def environment(self) -> dict[str, str]:
        """This process's environment, offline, with the repository importable."""
        env = dict(os.environ)
        env["HF_HUB_OFFLINE"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key
        if self.threads:
            from trainer.placement import thread_env

            env.update(thread_env(self.threads))
        elif self.cpus or env.get("TWINRL_ROLLOUT_CPUS"):
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # OpenMP reads it once, as torch loads
        return env

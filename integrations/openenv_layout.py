"""``twin openenv init TWIN DIR``: a twin as an OpenEnv environment package, in the layout
OpenEnv's own tooling reads (``openenv validate``, ``openenv build``, ``openenv push``,
``AutoEnv``)::

    DIR/
      openenv.yaml          spec_version 1, runtime fastapi, app server.app:app, port 8000
      pyproject.toml        openenv-<twin>: the client needs openenv-core only; extra [server]
      README.md             a Hugging Face Space card (sdk: docker, app_port: 8000)
      __init__.py           TwinAction, TwinObservation, TwinState, TwinEnvClient
      models.py, client.py  the wire types and the WebSocket client, on openenv-core alone
      server/app.py         the twin behind OpenEnv's server (integrations.openenv_server), main()
      server/Dockerfile     python:3.11-slim, installs the package with its server extra
      uv.lock               written by `uv lock` when uv is installed (`--lock`)

The client side (``models.py``, ``client.py``) imports nothing of twinrl: a harness installs the
package (or copies the two files) beside ``openenv-core`` and plays. The server side needs
twinrl itself: the ``server`` extra names it (``--requirement``, default
``twinrl[openenv]``, or e.g. a wheel's URL where twinrl is not on your index).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import yaml

from integrations._episode import resolve_twin
from twin.core import Twin
from twin.errors import ConfigError

__all__ = ["CLIENT_PY", "MODELS_PY", "write_layout"]

#: The wire types, on openenv-core alone (fields as integrations.openenv_server sends them).
MODELS_PY = '''\
"""The wire types of a twinrl twin served by OpenEnv; they need openenv-core only."""

from typing import Any

from openenv.core import Action, Observation, State
from pydantic import Field


class TwinAction(Action):
    """One tool call of the agent."""

    tool: str = Field(description="The tool's name, as in the reset observation's `tools`.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="The tool's arguments.")


class TwinObservation(Observation):
    """The opening messages and tool schemas after reset; a tool's result after step."""

    episode_id: str | None = None
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: str = ""
    error: bool = False
    reward_components: dict[str, float] | None = None


class TwinState(State):
    """The episode's status; reward, submission and outcome only once it has ended."""

    status: str = "not_started"
    twin: str | None = None
    split: str | None = None
    index: int | None = None
    case_id: str | None = None
    turns: int = 0
    invalid_calls: int = 0
    submission: Any = None
    reward: dict[str, Any] | None = None
    outcome: Any = None
'''

#: OpenEnv's WebSocket client for the types above.
CLIENT_PY = '''\
"""OpenEnv's WebSocket client for a twinrl twin; needs openenv-core only.

    async with TwinEnvClient(base_url="http://127.0.0.1:8000") as env:
        first = await env.reset(split="test", index=0)
        result = await env.step(TwinAction(tool=..., arguments={...}))
"""

from typing import Any
from urllib.parse import quote

from openenv.core import EnvClient
from openenv.core.client_types import StepResult

try:
    from .models import TwinAction, TwinObservation, TwinState
except ImportError:  # the files copied beside a script
    from models import TwinAction, TwinObservation, TwinState


class TwinEnvClient(EnvClient):
    """A twin's episodes over OpenEnv's WebSocket (``api_key`` when the server wants one)."""

    def __init__(self, base_url: str, *, api_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        if api_key:  # EnvClient sets no headers: the key goes in the query
            self._ws_url += ("&" if "?" in self._ws_url else "?") + "api_key=" + quote(api_key)

    def _step_payload(self, action: TwinAction) -> dict[str, Any]:
        return {"tool": action.tool, "arguments": action.arguments}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult:
        obs = TwinObservation(**payload.get("observation", {}), reward=payload.get("reward"),
                              done=bool(payload.get("done", False)))
        return StepResult(observation=obs, reward=payload.get("reward"), done=obs.done)

    def _parse_state(self, payload: dict[str, Any]) -> TwinState:
        return TwinState(**payload)
'''

_INIT_PY = '''\
"""The {twin} twin (twinrl) as an OpenEnv environment: the client side needs openenv-core only."""

from .client import TwinEnvClient
from .models import TwinAction, TwinObservation, TwinState

__all__ = ["TwinAction", "TwinEnvClient", "TwinObservation", "TwinState"]
'''

_APP_PY = '''\
"""The {twin} twin behind OpenEnv's server (twinrl's integrations.openenv_server).

    uvicorn server.app:app --port 8000     # or: python -m server.app, or: server (the script)
"""

import argparse
import os

from integrations.openenv_server import build_app, serve

TWIN = {twin!r}
CONFIG = {config!r}

app = build_app(TWIN, api_key=os.environ.get("TWINRL_API_KEY") or None, **CONFIG)


def main() -> None:
    """Serve the twin (HOST and PORT from the flags or $HOST / $PORT)."""
    parser = argparse.ArgumentParser(
        description=f"Serve the {{TWIN}} twin as an OpenEnv environment."
    )
    parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    ns = parser.parse_args()
    serve(TWIN, host=ns.host, port=ns.port, api_key=os.environ.get("TWINRL_API_KEY") or None,
          **CONFIG)


if __name__ == "__main__":
    main()
'''

_DOCKERFILE = """\
# The {twin} twin as an OpenEnv environment (twinrl). Build from the environment's folder:
#   docker build -t {name} -f server/Dockerfile .
FROM python:3.11-slim
WORKDIR /app/env
COPY . /app/env
# CPU-only torch is not needed: the server runs the twin, not a model.
RUN pip install --no-cache-dir ".[server]"
ENV HOST=0.0.0.0 PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=3s --start-period=20s --retries=3 \\
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
CMD ["sh", "-c", "cd /app/env && uvicorn server.app:app --host $HOST --port $PORT --ws websockets"]
"""

_README = """\
---
title: {twin} twin (twinrl)
sdk: docker
app_port: 8000
tags: [openenv]
---

# {twin} twin as an OpenEnv environment

{description}

Serve it: `pip install ".[server]" && server --port 8000` (or `docker build -t {name} -f
server/Dockerfile .`). Play it with openenv-core alone:

```python
from {package} import TwinAction, TwinEnvClient

async with TwinEnvClient(base_url="http://127.0.0.1:8000") as env:
    first = await env.reset(split="test", index=0)   # .observation.messages, .tools
    result = await env.step(TwinAction(tool="...", arguments={{}}))
    result.done, result.reward, result.observation.reward_components
```

Set `TWINRL_API_KEY` on the server to require a key (clients: `TwinEnvClient(..., api_key=KEY)`).
Generated by `twin openenv init {twin}`.
"""


def _package_name(twin: Twin) -> str:
    return re.sub(r"[^a-z0-9]+", "_", twin.name.lower()).strip("_") + "_env"


def write_layout(
    twin: Twin | str,
    dest: str | Path,
    *,
    requirement: str = "twinrl[openenv]",
    config: dict[str, Any] | None = None,
    overwrite: bool = False,
    lock: bool = False,
) -> Path:
    """Write ``twin``'s OpenEnv environment package into ``dest`` (see the module docstring).

    Args:
        twin: A twin or a registered twin name (built with ``config``).
        dest: The folder to write (created; it must be empty unless ``overwrite``).
        requirement: What the ``server`` extra installs to get twinrl.
        config: Twin options the server builds the twin with (e.g. ``{"max_turns": 12}``).
        overwrite: Write into a folder that already has files.
        lock: Run ``uv lock`` in the folder (needs ``uv`` on PATH and the package index).

    Returns:
        The folder.

    Raises:
        ConfigError: a non-empty folder without ``overwrite``, or ``lock`` without ``uv``.
    """
    config = dict(config or {})
    the_twin = resolve_twin(twin, **config) if isinstance(twin, str) else twin
    # The registered name (`Catalog-v1`) when given: a class's `name` is shared by its versions.
    registered = twin if isinstance(twin, str) else the_twin.name
    root = Path(dest)
    if root.exists() and any(root.iterdir()) and not overwrite:
        raise ConfigError(f"{str(root)!r} is not empty; choose a new folder or pass --force")
    package = root.name if root.name.isidentifier() else _package_name(the_twin)
    name = package.removesuffix("_env").replace("_", "-")
    (root / "server").mkdir(parents=True, exist_ok=True)
    files = {
        "openenv.yaml": yaml.safe_dump(
            {
                "spec_version": 1,
                "name": package,
                "type": "space",
                "runtime": "fastapi",
                "app": "server.app:app",
                "port": 8000,
            },
            sort_keys=False,
        ),
        "pyproject.toml": _pyproject(package, the_twin, requirement),
        "README.md": _README.format(
            twin=the_twin.name,
            name=name,
            package=package,
            description=(the_twin.description or "").strip(),
        ),
        "__init__.py": _INIT_PY.format(twin=the_twin.name),
        "models.py": MODELS_PY,
        "client.py": CLIENT_PY,
        "server/__init__.py": "",
        "server/app.py": _APP_PY.format(twin=registered, config=config),
        "server/Dockerfile": _DOCKERFILE.format(twin=the_twin.name, name=name),
        "server/requirements.txt": f"openenv-core[core]>=0.3\n{requirement}\n",
    }
    for rel, text in files.items():
        (root / rel).write_text(text)
    if lock:
        uv = shutil.which("uv")
        if uv is None:
            raise ConfigError("--lock runs `uv lock`, and uv is not installed: pip install uv")
        done = subprocess.run([uv, "lock"], cwd=root, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ConfigError(f"`uv lock` failed in {str(root)!r}: {done.stderr.strip()[-500:]}")
    return root


def _pyproject(package: str, twin: Twin, requirement: str) -> str:
    return textwrap.dedent(f'''\
        [build-system]
        requires = ["setuptools>=68", "wheel"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "openenv-{package.removesuffix("_env").replace("_", "-")}"
        version = "{twin.version}"
        description = "The {twin.name} twin (twinrl) as an OpenEnv environment"
        requires-python = ">=3.10"
        # The client needs openenv-core only; serving needs twinrl (the server extra).
        dependencies = ["openenv-core[core]>=0.3"]

        [project.optional-dependencies]
        server = ["{requirement}"]

        [project.scripts]
        server = "{package}.server.app:main"

        [tool.setuptools]
        packages = ["{package}", "{package}.server"]
        package-dir = {{ "{package}" = ".", "{package}.server" = "server" }}
        ''')

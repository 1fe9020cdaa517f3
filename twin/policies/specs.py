"""Policies from specs: :func:`make_policy` (``random``, ``openai:MODEL``, a twin's baselines,
plugins), the spec file :class:`PolicySettings` and the plugin kinds."""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from twin.errors import ConfigError
from twin.policies.openai_chat import OpenAIChatPolicy
from twin.policies.scripted import RandomPolicy, ReplayPolicy
from twin.protocols import Policy, PolicyHost

__all__ = [
    "POLICY_ENTRY_POINT_GROUP",
    "POLICY_FORMS",
    "PolicySettings",
    "load_policy_file",
    "make_policy",
    "policy_kinds",
]


# -- settings ----------------------------------------------------------------------------------
class PolicySettings(BaseModel):
    """A policy and its request settings, as a policy spec file holds them (YAML or JSON)::

        policy: openai:smollm2
        base_url: http://127.0.0.1:18000/v1
        timeout: 600          # seconds per request
        max_tokens: 128       # per turn
        temperature: 0.0
        top_p: 0.95
        retries: 3
        concurrency: 4        # episodes in flight
        extra_body: {chat_template_kwargs: {enable_thinking: false}}

    Every field but ``policy`` is optional (None: the command line's or the default value).
    ``api_key`` is accepted but better left to ``$OPENAI_API_KEY``; it is never stored.
    """

    model_config = ConfigDict(extra="forbid")

    policy: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    timeout: float | None = Field(default=None, gt=0)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    retries: int | None = Field(default=None, ge=0)
    concurrency: int | None = Field(default=None, ge=1)
    extra_body: dict[str, Any] | None = None

    def merged(self, **overrides: Any) -> PolicySettings:
        """These settings with every non-None override on top (the command line wins)."""
        data = self.model_dump()
        data.update({k: v for k, v in overrides.items() if v is not None})
        return PolicySettings.model_validate(data)

    def request_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`OpenAIChatPolicy` that are set (base URL and key apart)."""
        keys = ("timeout", "max_tokens", "temperature", "top_p", "retries", "extra_body")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


def load_policy_file(path: str | os.PathLike[str]) -> PolicySettings:
    """Read a policy spec file (see :class:`PolicySettings`).

    Raises:
        ConfigError: the file is missing, not YAML/JSON, not a mapping, or has unknown or
            invalid fields (the message names them and lists the allowed ones).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"policy file {str(p)!r} not found; give a YAML or JSON mapping")
    from twin.yamlsafe import load_yaml_file

    data = load_yaml_file(p, what="policy file")  # YAML is a superset of JSON; bounded size
    if not isinstance(data, dict):
        raise ConfigError(
            f"policy file {str(p)!r} must hold a mapping (policy: openai:MODEL, timeout: ...), "
            f"got {type(data).__name__}"
        )
    try:
        return PolicySettings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(file)'}: {e['msg']}" for e in exc.errors()
        )
        allowed = ", ".join(PolicySettings.model_fields)
        raise ConfigError(
            f"policy file {str(p)!r}: {problems} (allowed fields: {allowed})"
        ) from None


# -- specs -------------------------------------------------------------------------------------
POLICY_FORMS = (
    "random[:SEED]",
    "replay:FILE (YAML/JSON list of turns)",
    "openai:MODEL (base URL from --base-url or $OPENAI_BASE_URL, key from $OPENAI_API_KEY)",
    "anthropic:MODEL (Anthropic's Messages API; key from $ANTHROPIC_API_KEY; twinrl[providers])",
    "openai-responses:MODEL (OpenAI's Responses API; key from $OPENAI_API_KEY; twinrl[providers])",
    "hf:PATH|smollm2 (a local model through the trainer)",
)


# What the ``train`` extra installs: the ``hf:`` policy (the trainer's model) needs them.
_TRAIN_PACKAGES = frozenset({"torch", "transformers", "tokenizers", "peft", "gguf"})

#: Entry-point group of policy kinds: ``NAME = "module:factory"`` makes ``NAME:ARG`` a policy
#: spec, built by ``factory(spec, twin)``. twinrl's own ``hf:`` is one (``trainer.hf_policy``), so
#: the core never imports the trainer.
POLICY_ENTRY_POINT_GROUP = "twin.policies"


def policy_kinds() -> dict[str, Any]:
    """The policy kinds installed as plugins: ``{name: importlib.metadata.EntryPoint}``."""
    return {ep.name: ep for ep in entry_points(group=POLICY_ENTRY_POINT_GROUP)}


def make_policy(
    spec: str,
    twin: PolicyHost | None = None,
    *,
    seed: int = 0,
    base_url: str | None = None,
    api_key: str | None = None,
    **options: Any,
) -> Policy:
    """A policy from a command-line spec.

    Specs: ``random`` / ``random:SEED``, ``replay:FILE``, ``openai:MODEL``, a baseline of the
    twin (``Twin.baselines() -> {name: factory(twin) -> policy}``, e.g. ``heuristic``, ``oracle``)
    and the kinds registered in the entry-point group ``twin.policies``, e.g. ``hf:PATH`` /
    ``hf:smollm2`` (twinrl's ``trainer.hf_policy.HFPolicy.from_spec(spec, twin)``).

    Args:
        spec: The spec.
        twin: The twin the policy will act in (baselines and ``hf:`` need it).
        seed: Seed of ``random``.
        base_url: Base URL of ``openai:`` (default ``$OPENAI_BASE_URL``).
        api_key: API key of ``openai:`` (default ``$OPENAI_API_KEY``).
        **options: Passed to :class:`OpenAIChatPolicy` (``temperature``, ``max_tokens``, ...).

    Raises:
        ConfigError: an unknown spec; the message lists every allowed form.
    """
    kind, _, arg = spec.partition(":")
    baselines = _baselines(twin)
    if spec in baselines:
        return baselines[spec](twin)
    if kind == "random":
        try:
            return RandomPolicy(seed=int(arg) if arg else seed, name=spec)
        except ValueError:
            raise ConfigError(
                f"policy {spec!r}: the seed after 'random:' must be an integer"
            ) from None
    if kind == "replay" and arg:
        return ReplayPolicy.from_file(arg)
    if kind == "openai" and arg:
        return OpenAIChatPolicy(base_url=base_url, model=arg, api_key=api_key, **options)
    if kind in ("anthropic", "openai-responses") and arg:
        from twin.policies.providers import make_provider_policy

        return make_provider_policy(kind, arg, base_url=base_url, api_key=api_key, **options)
    plugins = policy_kinds()
    if kind in plugins and arg:
        try:  # the plugin may import its libraries when loaded or only when it builds
            return plugins[kind].load()(spec, twin)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] not in _TRAIN_PACKAGES:
                raise ConfigError(
                    f"policy {spec!r} needs {plugins[kind].value} (entry point {kind!r} of "
                    f"{POLICY_ENTRY_POINT_GROUP!r}), which could not be imported ({exc})"
                ) from None
            raise ConfigError(
                f"policy {spec!r} runs a local model and needs {exc.name}, which is not "
                "installed; install the training extra: pip install 'twinrl[train]'"
            ) from None
    forms = list(POLICY_FORMS) + [f"{name} (a baseline of this twin)" for name in baselines]
    forms += [
        f"{name}:... (plugin {ep.value})" for name, ep in sorted(plugins.items()) if name != "hf"
    ]
    raise ConfigError(f"unknown policy spec {spec!r}; allowed: " + "; ".join(forms))


def _baselines(twin: PolicyHost | None) -> dict[str, Any]:
    if twin is None:  # make_policy without a twin: only the generic forms
        return {}
    return dict(twin.baselines() or {})

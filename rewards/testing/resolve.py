"""Which reward a rollout file is checked against, and which twin its cases run on.

Twins come only from the registry's public API (:func:`twin.registry.make_shared_twin`, one
twin per name and config per process): the kit keeps no twins of its own. What it keeps is the
rewards given without a twin: :func:`register_reward` and a file's ``reward: module:attr``.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rewards._reward import Reward
from rewards._terms import Term
from twin.cases import Case
from twin.errors import ConfigError, UnknownTwinError
from twin.registry import list_twins, make_shared_twin
from twin.trajectory import Trajectory

if TYPE_CHECKING:
    from twin.core import Twin

__all__ = [
    "FACTORIES_ATTR",
    "Scorer",
    "clear_cache",
    "register_reward",
    "resolve_scorer",
    "rollout_twin",
    "trusted_reward_packages",
    "unregister_reward",
]

#: A scorer: ``scorer(trajectory, case) -> RewardResult``.
Scorer = Callable[[Trajectory, Case], Any]

# Rewards registered by twin name (lower case): (factory, prefer it over the twin's own reward).
_REGISTERED: dict[str, tuple[Callable[[], Scorer], bool]] = {}
# Rewards made from a registered factory or a file's `reward:`, so that a factory runs once per
# process and not once per case: ("registered", twin) or ("import", "module:attr").
_MADE: dict[tuple[str, str], Scorer] = {}
_LOCK = threading.RLock()


def register_reward(twin: str, factory: Callable[[], Scorer], *, override: bool = False) -> None:
    """Register a reward for a twin name, used when the twin itself cannot be made.

    Args:
        twin: Twin name as rollout files write it (case-insensitive).
        factory: Zero-argument callable returning a scorer (a ``Reward`` or any
            ``(trajectory, case) -> RewardResult``).
        override: Prefer this reward even when the twin can be made (tests use it).
    """
    with _LOCK:
        _REGISTERED[twin.lower()] = (factory, override)
        _MADE.pop(("registered", twin.lower()), None)


def unregister_reward(twin: str) -> None:
    """Remove a reward registered with :func:`register_reward` (no error if there is none)."""
    with _LOCK:
        _REGISTERED.pop(twin.lower(), None)
        _MADE.pop(("registered", twin.lower()), None)


def clear_cache() -> None:
    """Forget the rewards made from factories and the registry's shared twins (and nothing else)."""
    from twin.registry import forget_shared_twins

    with _LOCK:
        _MADE.clear()
    forget_shared_twins()


def rollout_twin(name: str, config: dict[str, Any] | None = None) -> Twin:
    """The twin a rollout file names, made by the registry (one per name and config per process).

    Raises:
        UnknownTwinError: no twin of that name is registered, or it cannot be loaded.
        ConfigError: an option the twin does not take.
    """
    return make_shared_twin(name, **dict(config or {}))


def trusted_reward_packages() -> list[str]:
    """The packages a rollout file's ``reward: module:attr`` may import from by default: the
    reward library and the package of every registered twin (entry-point plugins included)."""
    packages = {"rewards"}
    for spec in list_twins():
        module = spec.entry_point.partition(":")[0]
        packages.add(module.rpartition(".")[0] or module)
    return sorted(packages)


def _check_import_allowed(spec: str, allow_import: bool) -> None:
    module = spec.partition(":")[0].strip()
    if allow_import or not module:
        return
    trusted = trusted_reward_packages()
    if any(module == p or module.startswith(p + ".") for p in trusted):
        return
    raise ConfigError(
        f"reward {spec!r}: a rollout file may only name rewards of the reward library or of "
        "registered "
        f"twins (modules under {', '.join(trusted)}); importing {module!r} would run its code. If "
        "you "
        "trust the file, run `twin reward test --allow-import` (Python: allow_import=True; pytest: "
        "--rollouts-allow-import)"
    )


#: The module attribute naming the zero-argument reward factories a module declares, e.g.
#: ``__reward_factories__ = ("make_reward",)``: the only functions a rollout file may have called.
FACTORIES_ATTR = "__reward_factories__"


def _as_reward(obj: Any, spec: str) -> Reward | None:
    """``obj`` as a :class:`Reward` (a term alone scores as a reward of that one term), or None."""
    if isinstance(obj, Reward):
        return obj
    if isinstance(obj, Term):
        return Reward({obj: 1.0}, name=obj.name)
    return None


def _import_reward(spec: str, allow_import: bool = False) -> Scorer:
    """The reward ``spec`` names. Nothing is called unless it is a reward factory its module
    declares (or ``allow_import`` trusts the file): a plain function of a trusted package is
    still refused, since calling it could run anything (a demo, a CLI's ``main``)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"reward must be 'module:attr', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
        obj: Any = getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"reward {spec!r} could not be imported: {exc}") from None
    reward = _as_reward(obj, spec)
    if reward is not None:
        return reward
    declared = getattr(module, FACTORIES_ATTR, ())
    if callable(obj) and isinstance(declared, (tuple, list, frozenset, set)) and attr in declared:
        made = _as_reward(obj(), spec)
        if made is None:
            raise ConfigError(f"reward factory {spec!r} returned no Reward or term")
        return made
    if allow_import and callable(obj):  # the caller trusts the file: factories and plain scorers
        params = [
            p for p in inspect.signature(obj).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]  # fmt: skip
        return obj() if not params else obj
    raise ConfigError(
        f"reward {spec!r} is {_kind(obj)}, not a Reward, a term or a reward factory its module "
        "declares "
        f"(in {FACTORIES_ATTR}); a rollout file names rewards only, and nothing else is called. If "
        "you trust the file, run `twin reward test --allow-import` (Python: allow_import=True)"
    )


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        return f"the class {obj.__name__}"
    if callable(obj):
        return f"the function {getattr(obj, '__name__', type(obj).__name__)}"
    return f"a {type(obj).__name__}"


def _made(key: tuple[str, str], make: Callable[[], Scorer]) -> Scorer:
    with _LOCK:
        if key not in _MADE:
            _MADE[key] = make()
        return _MADE[key]


def resolve_scorer(
    twin: str,
    config: dict[str, Any] | None = None,
    reward: str | None = None,
    *,
    allow_import: bool = False,
) -> Scorer:
    """The scorer rollout files for ``twin`` are checked against.

    Order: the file's ``reward:`` entry; a reward registered with ``override=True``; the twin's
    ``score`` (the twin made by :func:`rollout_twin`); a registered reward.

    Args:
        twin: The twin's name or id.
        config: The twin's config.
        reward: ``module:attr`` of a ``Reward``, a term, or a zero-argument reward factory
            that its module lists in ``__reward_factories__``.
        allow_import: Import ``reward`` from any module; by default only from
            :func:`trusted_reward_packages`.

    Raises:
        UnknownTwinError: nothing could be resolved; the message says what was tried.
        ConfigError: ``reward`` is outside the trusted packages and ``allow_import`` is false.
    """
    if reward:
        # checked on every call, before the memo: a trusted caller's import is no licence
        _check_import_allowed(reward, allow_import)
        # the memo is per permission: a trusted caller's import is no licence for an untrusted one
        return _made(("import" if not allow_import else "import-trusted", reward),
                     lambda: _import_reward(reward, allow_import))  # fmt: skip
    with _LOCK:
        registered = _REGISTERED.get(twin.lower())
    if registered is not None and registered[1]:
        return _made(("registered", twin.lower()), registered[0])
    try:
        return rollout_twin(twin, config).score
    except (UnknownTwinError, ImportError) as exc:  # a twin whose optional library is missing
        if registered is None:
            raise UnknownTwinError(
                f"no reward for twin {twin!r}: {exc}; register one with "
                "rewards.testing.register_reward or give `reward: module:attr` in the file"
            ) from None
        return _made(("registered", twin.lower()), registered[0])

"""Register twins by id and make them: ``twin.make("twin/Returns-v0")`` or ``twin.make("returns")``.

Like Gymnasium's registry: a plain module-level ``registry: dict[str, TwinSpec]``, specs with
string entry points (``"envs.returns:ReturnsTwin"``), versioned ids ``twin/<Name>-v<N>``. Each
spec is also registered with Gymnasium, so ``gymnasium.make("twin/Returns-v0")`` works after
``import twin``.

Third-party packages add twins through the entry-point group ``twin.envs``::

    [project.entry-points."twin.envs"]
    Returns = "envs.returns:ReturnsTwin"

The group is read when :mod:`twin` is imported, without importing the twins themselves: the id
comes from the entry-point name (version 0) until the class is loaded. A plugin that is missing
or broken only warns.
"""

from __future__ import annotations

import difflib
import importlib
import json
import re
import threading
import warnings
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from twin.errors import UnknownTwinError

if TYPE_CHECKING:
    from twin.core import Twin
    from twin.env import TwinEnv

__all__ = [
    "TwinSpec",
    "ENTRY_POINT_GROUP",
    "forget_shared_twins",
    "list_twins",
    "load_plugins",
    "make",
    "make_shared_twin",
    "make_twin",
    "register",
    "registry",
    "spec",
]

#: Entry-point group third-party packages register their twins in.
ENTRY_POINT_GROUP = "twin.envs"

_ID = re.compile(r"^(?:twin/)?(?P<name>[A-Za-z_][\w.]*?)(?:-v(?P<version>\d+))?$")


@dataclass
class TwinSpec:
    """How to make one registered twin.

    Attributes:
        id: ``twin/<Name>-v<N>``.
        entry_point: ``"module:Class"`` of the :class:`twin.core.Twin` subclass.
        name: The twin's name.
        version: The twin's version.
        kwargs: Default config, overridden by the keyword arguments of :func:`make`.
        cls: The class itself when it was registered as a class (a class defined in a function
            or a notebook cannot be imported back from its entry point).
    """

    id: str
    entry_point: str
    name: str
    version: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)
    cls: type[Twin] | None = field(default=None, repr=False, compare=False)

    def load(self) -> type[Twin]:
        """Import and return the twin class.

        Raises:
            UnknownTwinError: the module or class cannot be imported (the message says why).
        """
        if self.cls is not None:
            return self.cls
        module_name, _, attr = self.entry_point.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split(".") if attr else ():
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise UnknownTwinError(
                f"{self.id}: cannot load entry point {self.entry_point!r} "
                f"({type(exc).__name__}: {exc}); is the package installed?"
            ) from exc
        from twin.core import Twin

        if not (isinstance(obj, type) and issubclass(obj, Twin)):
            raise UnknownTwinError(f"{self.id}: {self.entry_point!r} is not a Twin subclass")
        real_id = f"twin/{obj.name}-v{obj.version}"
        if real_id not in registry:
            # An entry point only knows its name; once imported, the class's own name and version
            # become an id too (e.g. twin/Catalog-v1 for a plugin registered as Catalog-v0).
            register(obj, id=real_id, **self.kwargs)
        return obj

    def make_twin(self, **config: Any) -> Twin:
        """Instantiate the twin with ``kwargs`` updated by ``config``."""
        return self.load()(**{**self.kwargs, **config})


#: Every registered twin by id.
registry: dict[str, TwinSpec] = {}


def _is_preview(s: TwinSpec) -> bool:
    """Whether a spec's class says ``preview = True`` (a bare name then resolves to an older
    version); a class that cannot be loaded counts as no preview."""
    try:
        return bool(getattr(s.load(), "preview", False))
    except UnknownTwinError:
        return False


def register(
    entry_point_or_class: str | type[Twin],
    *,
    id: str | None = None,  # noqa: A002 - Gymnasium's name for it
    name: str | None = None,
    version: int | None = None,
    **kwargs: Any,
) -> TwinSpec:
    """Register a twin class (or a lazy ``"module:Class"`` entry point) under ``twin/<Name>-v<N>``.

    Args:
        entry_point_or_class: The :class:`twin.core.Twin` subclass, or ``"module:Class"``.
        id: The id; default ``twin/<name>-v<version>``.
        name: For a string entry point, the twin's name (else parsed from ``id`` or imported).
        version: For a string entry point, the version (default 0).
        **kwargs: Default config of :func:`make`.

    Returns:
        The spec, also stored in :data:`registry` and registered with Gymnasium.
    """
    cls = None
    if isinstance(entry_point_or_class, str):
        entry_point = entry_point_or_class
        if ":" not in entry_point:
            raise ValueError(f"entry point must look like 'module:Class', got {entry_point!r}")
        if name is None and id is not None:
            name, parsed_version = _split_id(id)
            version = parsed_version if version is None else version
        if name is None:  # nothing says what it is called: import it to find out
            loaded = TwinSpec("?", entry_point, "?").load()
            name, version = loaded.name, loaded.version if version is None else version
    else:
        cls = entry_point_or_class
        entry_point = f"{cls.__module__}:{cls.__qualname__}"
        name = name or cls.name
        version = cls.version if version is None else version
    version = int(version or 0)
    spec_ = TwinSpec(id or f"twin/{name}-v{version}", entry_point, name, version, dict(kwargs), cls)
    registry[spec_.id] = spec_
    _register_with_gymnasium(spec_)
    return spec_


def spec(id_or_name: str) -> TwinSpec:
    """The spec for an id (``twin/Returns-v0``) or a name (``Returns``, ``returns``,
    ``Returns-v0``).

    A name without a version means its latest version.

    Raises:
        UnknownTwinError: nothing matches; the message suggests the closest ids and lists all.
    """
    if id_or_name in registry:
        return registry[id_or_name]
    if not isinstance(id_or_name, str):
        raise UnknownTwinError(f"a twin id is a string like 'twin/Returns-v0', got {id_or_name!r}")
    m = _ID.match(id_or_name.strip())
    if m is not None:
        name = m.group("name").lower()
        version = m.group("version")
        found = [
            s
            for s in registry.values()
            if s.name.lower() == name and (version is None or s.version == int(version))
        ]
        if found:
            if (
                version is None
            ):  # the latest version that is not a preview (a class's `preview = True`)
                found = [s for s in found if not _is_preview(s)] or found
            return max(found, key=lambda s: s.version)
    known = sorted(registry)
    keys = {k.lower(): k for k in known}
    keys.update({registry[k].name.lower(): k for k in known})
    close = difflib.get_close_matches(id_or_name.lower(), list(keys), n=1, cutoff=0.5)
    hint = f" Did you mean {keys[close[0]]!r}?" if close else ""
    raise UnknownTwinError(
        f"no twin {id_or_name!r}.{hint} Known twins: {', '.join(known) or '(none)'}. "
        "Register one with twin.register(MyTwin) or the entry-point group 'twin.envs'."
    )


def make_twin(id_or_name: str, **config: Any) -> Twin:
    """Make the :class:`twin.core.Twin` registered as ``id_or_name`` with ``config``.

    Raises:
        UnknownTwinError: unknown id or name, or its entry point cannot be loaded.
        ConfigError: an option the twin does not take.
    """
    return spec(id_or_name).make_twin(**config)


# One twin per (spec, config): the spec object is kept with its twin so that registering the id
# again (a new spec, maybe another class) makes a new twin instead of returning the old one.
_SHARED: dict[tuple[str, str], tuple[TwinSpec, Twin]] = {}
_SHARED_LOCK = threading.RLock()


def make_shared_twin(id_or_name: str, **config: Any) -> Twin:
    """The twin registered as ``id_or_name`` with ``config``, made once per process and reused.

    Building a twin's world may take seconds, so tools that run many episodes of the same twin
    (the rollout-testing kit in ``rewards/testing/``) share one instance; a twin's world is
    read-only during episodes. Names and ids that resolve to the same spec share the twin
    (``catalog`` and ``twin/Catalog-v1``). Registering the id again makes a new one.

    Args:
        id_or_name: As for :func:`make_twin`.
        **config: The twin's config options; JSON-equal configs share a twin.

    Raises:
        UnknownTwinError: unknown id or name, or its entry point cannot be loaded.
        ConfigError: an option the twin does not take.
    """
    spec_ = spec(id_or_name)
    key = (spec_.id, json.dumps(config, sort_keys=True, default=repr))
    with _SHARED_LOCK:
        cached = _SHARED.get(key)
        if cached is None or cached[0] is not spec_:
            _SHARED[key] = (spec_, spec_.make_twin(**config))
        return _SHARED[key][1]


def forget_shared_twins() -> None:
    """Drop every twin :func:`make_shared_twin` made (the next call makes a new one)."""
    with _SHARED_LOCK:
        _SHARED.clear()


def make(id_or_name: str, *, render_mode: str | None = None, **config: Any) -> TwinEnv:
    """Make a :class:`twin.env.TwinEnv` of the twin registered as ``id_or_name``.

    Args:
        id_or_name: ``twin/Returns-v0``, ``Returns-v0``, ``Returns`` or ``returns``.
        render_mode: ``None`` or ``"ansi"``.
        **config: Options of the twin's config (``seed``, ``max_turns``, ...).
    """
    from twin.env import TwinEnv

    return TwinEnv(make_twin(id_or_name, **config), render_mode=render_mode)


def list_twins() -> list[TwinSpec]:
    """Every registered spec, sorted by id."""
    return [registry[k] for k in sorted(registry)]


def load_plugins(group: str = ENTRY_POINT_GROUP) -> list[TwinSpec]:
    """Register the twins of every installed entry point in ``group`` (without importing them).

    A broken entry point only warns, so one bad plugin cannot break ``import twin``.
    """
    found = []
    try:
        eps = entry_points(group=group)
    except Exception as exc:  # a broken distribution's metadata
        warnings.warn(f"twinrl: could not read entry points {group!r}: {exc}", stacklevel=2)
        return found
    for ep in eps:
        try:
            name, version = _split_id(ep.name)
            sid = f"twin/{name}-v{version}"
            if sid not in registry:
                found.append(register(ep.value, id=sid, name=name, version=version))
        except Exception as exc:
            warnings.warn(
                f"twinrl: skipped twin plugin {ep.name!r} = {ep.value!r}: {exc}", stacklevel=2
            )
    return found


# -- internals ---------------------------------------------------------------------------------
def _split_id(text: str) -> tuple[str, int]:
    m = _ID.match(text.strip())
    if m is None:
        raise ValueError(
            f"a twin id looks like 'twin/<Name>-v<N>' (e.g. 'twin/Returns-v0'), got {text!r}"
        )
    return m.group("name"), int(m.group("version") or 0)


def _gym_entry(twin_id: str, render_mode: str | None = None, **config: Any) -> TwinEnv:
    """Gymnasium's entry point for every twin id (``gymnasium.make`` calls it)."""
    return make(twin_id, render_mode=render_mode, **config)


def _register_with_gymnasium(spec_: TwinSpec) -> None:
    import gymnasium

    if spec_.id in gymnasium.registry:
        del gymnasium.registry[spec_.id]
    gymnasium.register(
        id=spec_.id,
        entry_point="twin.registry:_gym_entry",
        kwargs={"twin_id": spec_.id},
        # The episode length is the twin's own max_turns (truncation), not a TimeLimit wrapper.
        max_episode_steps=None,
        disable_env_checker=False,
    )

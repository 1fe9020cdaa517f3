"""Reading user YAML (recipes, rollout files, replay files) with bounded cost.

``yaml.safe_load`` constructs nothing dangerous, but a few hundred bytes of nested aliases
(``b: [*a, *a, ...]``, ``c: [*b, *b, ...]``) describe a document with billions of nodes: the
loader shares the aliased objects, so loading is cheap, and then whatever walks the result (a
validator, ``repr`` in an error message, a copy) runs for minutes and takes gigabytes. Here a
document is refused before it is constructed when its size *with every alias expanded* exceeds
``max_nodes``, when the file is larger than ``max_bytes``, or when it is not UTF-8 text::

    data = load_yaml_file("run.yaml", what="recipe")        # ConfigError on any of the above
    data = load_yaml_text("[1, 2]", what="override")
    clip(repr(value))                                       # an error message's bounded quote

Every error is a one-line :class:`~twin.errors.ConfigError` that names the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from twin.errors import ConfigError

__all__ = ["MAX_BYTES", "MAX_NODES", "clip", "load_yaml_file", "load_yaml_text"]

#: Largest file read (bytes); recipes and rollout files are a few KiB.
MAX_BYTES = 16 * 1024 * 1024
#: Most nodes of a document counted with every alias expanded (scalars, sequences, mappings).
MAX_NODES = 1_000_000
#: Longest quote of user input in an error message.
CLIP = 200


def clip(text: str, limit: int = CLIP) -> str:
    """``text`` on one line, cut to ``limit`` characters (with the length it had)."""
    one = " ".join(str(text).split())
    if len(one) <= limit:
        return one
    return f"{one[:limit]}... ({len(one)} characters)"


class _Loader(yaml.SafeLoader):
    """The safe loader; a separate class so that nothing registered here leaks into PyYAML's."""


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Nodes of the document under ``root`` with every alias expanded, stopping past ``limit``.

    Iterative (deep nesting does not hit Python's recursion limit) and memoised per node
    object, so it is linear in the distinct nodes however much the aliases multiply them.

    Raises:
        ValueError: a node that contains itself (a recursive alias).
    """
    size: dict[int, int] = {}
    active: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in size:
            continue
        if isinstance(node, yaml.SequenceNode):
            children: list[yaml.Node] = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            size[key] = 1
            continue
        if children_done:
            active.discard(key)
            size[key] = min(1 + sum(size[id(c)] for c in children), limit + 1)
            continue
        if key in active:
            raise ValueError("a node contains itself through an alias (recursive YAML)")
        active.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in active:
                raise ValueError("a node contains itself through an alias (recursive YAML)")
            if id(child) not in size:
                stack.append((child, False))
    return size[id(root)]


def load_yaml_text(text: str, *, what: str, max_nodes: int = MAX_NODES) -> Any:
    """Parse one YAML document with the safe loader, refusing alias bombs.

    Args:
        text: The YAML text.
        what: How errors name the source, e.g. ``"recipe 'run.yaml'"``.
        max_nodes: Most nodes with aliases expanded.

    Returns:
        The document (None for an empty one).

    Raises:
        ConfigError: not valid YAML, more than one document, nested too deeply, recursive, or
            larger than ``max_nodes`` once aliases are expanded.
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            size = _expanded_size(node, max_nodes)
        except ValueError as exc:
            raise ConfigError(f"{what}: {exc}") from None
        if size > max_nodes:
            raise ConfigError(
                f"{what}: the YAML expands to more than {max_nodes:,} nodes once its aliases "
                "(*name) "
                "are expanded; write the values out or use fewer nested aliases"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: not valid YAML ({clip(str(exc), 300)})") from None
    except RecursionError:
        raise ConfigError(f"{what}: the YAML is nested too deeply") from None
    finally:
        loader.dispose()


def load_yaml_file(
    path: str | Path, *, what: str, max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES
) -> Any:
    """Read a UTF-8 YAML file with :func:`load_yaml_text`'s bounds.

    Args:
        path: The file.
        what: The kind of file for error messages (``"recipe"``, ``"rollout file"``).
        max_bytes: Largest file accepted.
        max_nodes: Most nodes with aliases expanded.

    Raises:
        ConfigError: missing, a folder, unreadable, too large, not UTF-8 text, or not valid YAML.
    """
    p = Path(path)
    name = f"{what} {str(p)!r}"
    try:
        if p.is_dir():
            raise ConfigError(f"{name} is a folder; give a YAML file")
        size = p.stat().st_size
        if size > max_bytes:
            raise ConfigError(
                f"{name} is {size:,} bytes; YAML files up to {max_bytes:,} bytes are read"
            )
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{name} could not be read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{name} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); give "
            "a YAML file"
        ) from None
    if "\x00" in text:
        raise ConfigError(f"{name} is a binary file (it holds NUL bytes); give a YAML file")
    return load_yaml_text(text, what=name, max_nodes=max_nodes)

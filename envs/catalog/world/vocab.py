"""Read the vocabularies the generated world is composed from (``data/catalog/*.yml``).

A name in a vocabulary may carry synonyms: ``"Sofas|couches, settees"`` is the name ``Sofas``
with the synonyms ``couches`` and ``settees``.
"""

from __future__ import annotations

import hashlib
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from twin.errors import ConfigError
from twin.resources import data_path

__all__ = ["VOCAB_FILES", "load_vocab", "slug", "split_name", "vocab_digest"]

#: The vocabulary files of data/catalog/ that shape a generated world.
VOCAB_FILES = ("taxonomy.yml", "attributes.yml", "registry.yml", "policy.yml")

_SLUG = re.compile(r"[^a-z0-9]+")


def slug(text: str) -> str:
    """``"Chef's Knives & Sets"`` -> ``"chef_s_knives_sets"``: a handle made of ``[a-z0-9_]``."""
    return _SLUG.sub("_", text.lower()).strip("_")


def split_name(entry: str) -> tuple[str, tuple[str, ...]]:
    """``"Sofas|couches, settees"`` -> ``("Sofas", ("couches", "settees"))``."""
    name, _, rest = str(entry).partition("|")
    synonyms = tuple(s.strip() for s in re.split(r"[,;]", rest) if s.strip())
    return name.strip(), synonyms


def _read(name: str) -> Any:
    path = data_path("catalog", name)
    with open(path, encoding="utf-8") as fh:
        try:
            return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc


@lru_cache(maxsize=1)
def load_vocab() -> dict[str, Any]:
    """The parsed vocabularies: ``{"taxonomy": ..., "attributes": ..., "registry": ...}``.

    Raises:
        ConfigError: a file is malformed; the message names the file and the entry.
    """
    vocab = {name.split(".")[0]: _read(name) for name in VOCAB_FILES}
    _check_taxonomy(vocab["taxonomy"], vocab["attributes"])
    return vocab


def vocab_digest() -> str:
    """SHA-256 over the vocabulary files' bytes: part of the cache key of a generated world."""
    h = hashlib.sha256()
    for name in VOCAB_FILES:
        h.update(name.encode())
        h.update(Path(data_path("catalog", name)).read_bytes())
    return h.hexdigest()


def _check_taxonomy(tax: dict[str, Any], attributes: dict[str, Any]) -> None:
    where = "data/catalog/taxonomy.yml"
    codes: set[str] = set()
    for vert in tax.get("verticals", []):
        code = vert.get("code", "")
        if not re.fullmatch(r"[a-z]{2}", code) or code in codes:
            raise ConfigError(
                f"{where}: vertical code must be two unique lowercase letters, got {code!r}"
            )
        codes.add(code)
        for handle in vert.get("attributes", []):
            if handle not in attributes:
                raise ConfigError(
                    f"{where}: vertical {code} attaches unknown attribute {handle!r}; "
                    f"define it in data/catalog/attributes.yml"
                )
        for group, values in vert["facets"].items():
            _check_names(values, f"{where}: {code} facet {group}")
        dept_names = [split_name(d["name"])[0] for d in vert["departments"]]
        _check_names(dept_names, f"{where}: {code} departments")
        for dept in vert["departments"]:
            label = f"{where}: {code} / {split_name(dept['name'])[0]}"
            _check_names([str(t).partition("@")[0] for t in dept["types"]], f"{label} types")
            for t in dept["types"]:
                for group in (g.strip() for g in str(t).partition("@")[2].split(",") if g.strip()):
                    if group not in vert["facets"]:
                        raise ConfigError(
                            f"{label}: type {t!r} splits by unknown facet group {group!r}; "
                            f"groups: {sorted(vert['facets'])}"
                        )
            for group in dept.get("facets", []):
                if group not in vert["facets"]:
                    raise ConfigError(
                        f"{label}: facet group {group!r} is not one of {sorted(vert['facets'])}"
                    )
            for handle in dept.get("attributes", []):
                if handle not in attributes:
                    raise ConfigError(f"{label}: unknown attribute {handle!r}")
            if dept.get("policy", "ok") not in ("ok", "prohibited"):
                raise ConfigError(
                    f"{label}: policy must be 'ok' or 'prohibited', got {dept['policy']!r}"
                )


def _check_names(entries: list[str], label: str) -> None:
    seen: set[str] = set()
    for entry in entries:
        name = split_name(entry)[0]
        if not name or not (name[0].isupper() or name[0].isdigit()):
            # an unquoted "Name|syn, syn" inside a YAML flow list splits at the comma
            raise ConfigError(
                f"{label}: entry {entry!r} must start with a capital letter or digit; "
                f"quote entries whose synonyms contain commas"
            )
        if name.lower() in seen:
            raise ConfigError(f"{label}: duplicate name {name!r}")
        seen.add(name.lower())

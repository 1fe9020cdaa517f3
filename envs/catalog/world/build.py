"""``build_world``: generate (or load) a catalog world, cache it on disk, serve it from memory.

The first build of a given key writes ``world.duckdb``, its snapshot ``world.snap`` (what warm
loads read) and the tantivy index ``index/`` into a
private temporary folder and renames it into place, so two processes building the same cache
never see half a world: the loser of the race drops its copy and reads the winner's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from envs.catalog.world.generate import generate_taxonomy
from envs.catalog.world.model import CatalogWorld
from envs.catalog.world.registry import generate_registry
from envs.catalog.world.search import TaxonomyIndex, build_index
from envs.catalog.world.store import read_snapshot, read_world, write_snapshot, write_world
from envs.catalog.world.vocab import vocab_digest

__all__ = ["WORLD_VERSION", "build_world", "cache_root", "world_key"]

#: Bump when the generator, loader or storage changes what a seed produces.
WORLD_VERSION = "1"

_DB = "world.duckdb"
_SNAP = "world.snap"
_INDEX = "index"
_DONE = "DONE"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where worlds are cached: ``cache_dir``, else ``$TWINRL_CACHE/catalog``, else
    ``~/.cache/twinrl/catalog``."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("TWINRL_CACHE") or Path.home() / ".cache" / "twinrl") / "catalog"


def _source_fingerprint(taxonomy_path: Path | None) -> str:
    """What the world is made from: our vocabularies, or the loaded files' names, sizes and
    mtimes."""
    if taxonomy_path is None:
        return "generated"
    from envs.catalog.world.shopify import shopify_files  # local: the loader is optional

    h = hashlib.sha256()
    for f in shopify_files(taxonomy_path):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"shopify:{taxonomy_path}:{h.hexdigest()}"


def _code_digest() -> str:
    """SHA-256 of this package's source: a changed generator never serves a stale cache."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def world_key(seed: int, taxonomy_path: Path | None, config: dict[str, Any] | None = None) -> str:
    """The cache key: world version, code, vocabularies, seed, source and config."""
    payload = json.dumps(
        {
            "version": WORLD_VERSION,
            "code": _code_digest(),
            "vocab": vocab_digest(),
            "seed": seed,
            "source": _source_fingerprint(taxonomy_path),
            "config": config or {},
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def _progress(enabled: bool, total: int, desc: str):  # noqa: ANN202
    if not enabled:
        return nullcontext(None)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step")


def _generate(
    seed: int, taxonomy_path: Path | None, config: dict[str, Any], bar: Any
) -> dict[str, Any]:
    def step(label: str) -> None:
        if bar is not None:
            bar.set_postfix_str(label)
            bar.update(1)

    if taxonomy_path is None:
        categories, attributes, bands = generate_taxonomy(seed, config.get("generator"))
        source = "generated"
    else:
        from envs.catalog.world.shopify import load_shopify

        categories, attributes, bands = load_shopify(taxonomy_path, seed=seed)
        source = f"shopify:{taxonomy_path}"
    step("taxonomy")
    brands, sellers, recalls = generate_registry(
        categories, bands, seed, **config.get("registry", {})
    )
    step("brands")
    return {
        "source": source,
        "categories": categories,
        "attributes": attributes,
        "brands": brands,
        "sellers": sellers,
        "recalls": recalls,
    }


def _index_rows(categories: dict) -> list[tuple[str, str, str, tuple[str, ...]]]:
    return [(c.id, c.name, c.full_name, c.synonyms) for c in categories.values()]


def build_world(
    seed: int = 0,
    taxonomy_path: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = False,
    *,
    config: dict[str, Any] | None = None,
) -> CatalogWorld:
    """Build the catalog world for ``seed``, or load it from the on-disk cache.

    Args:
        seed: World seed; the same seed gives a byte-identical world (see ``digest()``).
        taxonomy_path: A checkout of Shopify's product taxonomy (``data/categories/*.yml``,
            ``data/attributes.yml``, ``data/values.yml``) to load instead of generating one.
        cache_dir: Cache folder; default ``$TWINRL_CACHE/catalog`` or ``~/.cache/twinrl/catalog``.
        progress: Show a progress bar while building.
        config: Generator knobs: ``{"generator": {"scale": 1.0}, "registry": {"n_brands": 2400,
            "n_sellers": 3000, "n_recalls": 320}}``.

    Returns:
        The world, with its search index opened from the cache.
    """
    config = dict(config or {})
    path = Path(taxonomy_path).resolve() if taxonomy_path is not None else None
    root = cache_root(cache_dir)
    folder = root / world_key(seed, path, config)
    if (folder / _DONE).exists():
        return _load(folder)

    with _progress(progress, 4, "catalog world") as bar:
        parts = _generate(seed, path, config, bar)
        root.mkdir(parents=True, exist_ok=True)
        _sweep(root)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
        try:
            write_world(
                tmp / _DB,
                meta={
                    "version": WORLD_VERSION,
                    "seed": str(seed),
                    "built_at": f"{time.time():.0f}",
                },
                **parts,
            )
            write_snapshot(tmp / _SNAP, parts)
            if bar is not None:
                bar.set_postfix_str("duckdb")
                bar.update(1)
            build_index(tmp / _INDEX, _index_rows(parts["categories"]))
            (tmp / _DONE).write_text(WORLD_VERSION)
            if bar is not None:
                bar.set_postfix_str("search index")
                bar.update(1)
            try:
                os.rename(tmp, folder)
            except OSError:
                if not (folder / _DONE).exists():
                    # a stale, unfinished folder (a killed build): replace it
                    shutil.rmtree(folder, ignore_errors=True)
                    os.rename(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    index = TaxonomyIndex(
        folder / _INDEX, [(c.id, c.name, c.full_name) for c in parts["categories"].values()]
    )
    return CatalogWorld(index=index, **parts)


def _sweep(root: Path, max_age_s: float = 3600.0) -> None:
    """Remove temporary folders that builds killed mid-way left behind (older than an hour)."""
    now = time.time()
    for tmp in root.glob(".*-*"):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # another process swept it first


def _load(folder: Path) -> CatalogWorld:
    data = read_snapshot(folder / _SNAP)
    if data is None:  # no usable snapshot: read the storage of record
        data = read_world(folder / _DB)
        data.pop("meta")
    index = TaxonomyIndex(
        folder / _INDEX, [(c.id, c.name, c.full_name) for c in data["categories"].values()]
    )
    return CatalogWorld(index=index, **data)

"""The catalog twin's world: taxonomy, attribute schemas, brand registry, sellers and recalls.

Built once (generated from our vocabularies in ``data/catalog/``, or loaded from a Shopify
product-taxonomy checkout), stored in DuckDB, cached on disk and served from in-memory indexes
plus a tantivy search index::

    from envs.catalog.world import build_world

    world = build_world(seed=0)                      # ~13,000 generated categories
    world.search("running shoes")                    # [{"id", "name", "full_name", "score"}, ...]
    world.lookup_brand("Norvalle")["matches"][0]     # (Brand(name="Norvale", ...), 92.3)
    world.msrp("Norvale", "hg-5-1")                  # (low, high) or None
"""

from envs.catalog.world.build import WORLD_VERSION, build_world, cache_root, world_key
from envs.catalog.world.model import Attribute, AttributeLink, Brand, CatalogWorld, Category, Recall
from envs.catalog.world.shopify import load_shopify

__all__ = [
    "WORLD_VERSION",
    "Attribute",
    "AttributeLink",
    "Brand",
    "CatalogWorld",
    "Category",
    "Recall",
    "build_world",
    "cache_root",
    "load_shopify",
    "world_key",
]

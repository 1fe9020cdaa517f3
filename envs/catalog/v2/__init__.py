"""Catalog v2 (``twin/Catalog-v2``): four decisions, borderline evidence, real catalogue content,
varied text and held-out tactics over v1's world. See ``docs/catalog-v2.md``."""

from envs.catalog.v2.twin import CatalogConfigV2, CatalogTwinV2

__all__ = ["CatalogConfigV2", "CatalogTwinV2"]

"""Catalog v0 (``twin/Catalog-v0``): three verdicts over templated listings. Frozen: its cases are
compared byte for byte with a digest taken before v1 existed (``tests/envs/catalog/test_v1.py``)."""

from envs.catalog.v0.twin import CatalogConfig, CatalogTwin

__all__ = ["CatalogConfig", "CatalogTwin"]

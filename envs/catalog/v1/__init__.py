"""Catalog v1 (``twin/Catalog-v1``, the latest): evidence gathered with the tools decides the
verdict. The world overlay (:mod:`.world`), the store's rules (:mod:`.rules`), the cases
(:mod:`.listings`), the twin (:mod:`.twin`) and the careful reference policy (:mod:`.careful`)."""

from envs.catalog.v1.twin import CatalogConfigV1, CatalogTwinV1

__all__ = ["CatalogConfigV1", "CatalogTwinV1"]

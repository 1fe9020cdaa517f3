"""The catalog store twin: a ~13k-category taxonomy, a brand registry, planted listings.

``CatalogTwin`` is registered as ``twin/Catalog-v0`` and ``CatalogTwinV1`` as ``twin/Catalog-v1``
(the latest: ``twin.make("catalog")``); ``CatalogTwinV2`` as ``twin/Catalog-v2``
(a preview: ask for it by id)::

    import twin
    env = twin.make("Catalog", seed=0)                      # generated world
    env = twin.make("Catalog", taxonomy_path="path/to/shopify-product-taxonomy")
"""

from envs.catalog.v0 import CatalogConfig, CatalogTwin
from envs.catalog.v1 import CatalogConfigV1, CatalogTwinV1
from envs.catalog.v2 import CatalogConfigV2, CatalogTwinV2

__all__ = [
    "CatalogConfig",
    "CatalogConfigV1",
    "CatalogConfigV2",
    "CatalogTwin",
    "CatalogTwinV1",
    "CatalogTwinV2",
]

"""The catalog store twin: a ~13k-category taxonomy, a brand registry, planted listings.

``CatalogTwin`` is registered as ``twin/Catalog-v0``::

    import twin
    env = twin.make("Catalog", seed=0)                      # generated world
    env = twin.make("Catalog", taxonomy_path="path/to/shopify-product-taxonomy")
"""

from envs.catalog.twin import CatalogConfig, CatalogTwin

__all__ = ["CatalogConfig", "CatalogTwin"]

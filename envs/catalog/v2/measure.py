"""``python -m envs.catalog.v2.measure``: catalog v2's ``twin check`` rows at full size.

The figures of docs/catalog-v2.md: 1,000 test and 5,000 train cases, text over 10,000 listings::

    TWINRL_SHOPIFY_TAXONOMY=PATH python -m envs.catalog.v2.measure   # Shopify's taxonomy at PATH
    python -m envs.catalog.v2.measure --taxonomy none     # the generated taxonomy
"""

from __future__ import annotations

from envs.catalog.v2.checks import v2_checks


def main(argv: list[str] | None = None) -> int:
    """Every v2 row at full size; exit status 1 when a row fails."""
    import argparse

    from envs.catalog.v2.twin import CatalogTwinV2

    ap = argparse.ArgumentParser(prog="python -m envs.catalog.v2.measure")
    ap.add_argument(
        "--taxonomy", default="auto", help="a Shopify checkout, 'auto' (default) or 'none'"
    )
    ap.add_argument("--test", type=int, default=1000)
    ap.add_argument("--train", type=int, default=5000)
    ap.add_argument("--text", type=int, default=10_000, help="listings the text figures read")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    tax = None if args.taxonomy == "none" else args.taxonomy
    twin = CatalogTwinV2(
        seed=args.seed,
        taxonomy_path=tax,
        test_size=max(args.test, 1000),
        train_size=max(args.train, args.text, 10_000),
    )
    print(f"twin/Catalog-v2, taxonomy {twin.config.taxonomy_path or 'generated'}, seed {args.seed}")
    rows = v2_checks(twin, 2, n_test=args.test, n_train=args.train, n_text=args.text)
    for r in rows:
        print(
            f"{r['status']:4}  {r['check']:16}  {r['name']:38} "
            f" {r['figure']}  [{r['threshold']}]  {r['note']}"
        )
    return int(any(r["status"] == "fail" for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())

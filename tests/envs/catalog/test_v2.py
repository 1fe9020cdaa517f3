"""Catalog v2 (issue #23): four decisions, borderline evidence, held-out tactics, a ceiling policy
that plays the written policy from tool outputs only, and the constant and cheap policies far
below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from envs.catalog.v2.listings import HELD_OUT, KIND_DECISION
from twin.errors import ConfigError


@pytest.fixture(scope="module")
def v2(twin_v1):
    """Catalog v2 on the generated world (the offline default), seed 0."""
    from envs.catalog import CatalogTwinV2

    t = CatalogTwinV2(seed=0, taxonomy_path=None, train_size=2000, dev_size=200, test_size=400)
    _ = t.world
    return t


def test_v2_is_a_preview_beside_v1(v2):
    import twin as twinlib

    assert twinlib.spec("catalog").id == "twin/Catalog-v1"
    assert twinlib.spec("Catalog-v2").load() is type(v2)


def test_cases_are_deterministic_and_labelled_by_kind(v2):
    from envs.catalog import CatalogTwinV2

    fresh = CatalogTwinV2(seed=0, taxonomy_path=None, train_size=2000, dev_size=200, test_size=400)
    for i in range(0, 400, 23):
        a, b = v2.case("test", i), fresh.case("test", i)
        assert (a.kind, a.task, a.truth) == (b.kind, b.task, b.truth)
        assert a.truth["decision"] == KIND_DECISION[a.kind]
        assert (a.truth["request"] is None) == (a.truth["decision"] != "escalate")
    with pytest.raises(ConfigError):
        CatalogTwinV2(case_mix={"cleen": 1.0}, taxonomy_path=None)


def test_held_out_kinds_and_leaves(v2):
    train = [v2.case("train", i) for i in range(600)]
    test = [v2.case("test", i) for i in range(400)]
    assert not {c.kind for c in train} & set(HELD_OUT)
    assert set(HELD_OUT) <= {c.kind for c in test}
    assert not {c.truth["category_id"] for c in train} & {c.truth["category_id"] for c in test}
    # every decision and every request appears in the test split
    assert {c.truth["decision"] for c in test} == {"ok", "counterfeit", "prohibited", "escalate"}
    assert {c.truth["request"] for c in test} - {None} == {
        "invoice",
        "authorisation_letter",
        "safety_certificate",
        "recall_remedy_notice",
    }


def test_ceiling_imports_no_labelling_code():
    src = Path(__file__).resolve().parents[3] / "envs" / "catalog" / "v2" / "ceiling.py"
    tree = ast.parse(src.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert modules <= {"__future__", "json", "re", "zlib", "collections.abc", "typing"}, modules


def test_ceiling_reads_the_labellers_thresholds_from_the_prompt():
    """The rules' thresholds are defined once (envs/catalog/v2/rules.py): the prompt states them
    and the ceiling reads them back from the prompt, so all three agree."""
    from envs.catalog.v2 import rules
    from envs.catalog.v2.ceiling import read_rules
    from envs.catalog.v2.twin import SYSTEM_PROMPT_V2

    got = read_rules([{"role": "system", "content": SYSTEM_PROMPT_V2}])
    assert got == {
        "imitation": rules.IMITATION,
        "price_bands": (*(b for b, _ in rules.PRICE_BANDS), rules.PRICE_FLOOR_POINTS),
        "near_name": rules.NEAR_NAME,
        "recent_year": rules.RECENT_YEAR,
        "new_account_days": rules.NEW_ACCOUNT_DAYS,
        "few_sales": rules.FEW_SALES,
        "low_rating": rules.LOW_RATING,
        "established": (
            rules.ESTABLISHED_DAYS,
            rules.ESTABLISHED_RATING,
            rules.ESTABLISHED_SALES,
        ),
        "remove_at": rules.REMOVE_AT,
        "review_at": rules.REVIEW_AT,
    }
    assert [p for _, p in rules.PRICE_BANDS] == [0, 1, 2, 3]  # the points the text states
    with pytest.raises(ValueError, match="imitation"):
        read_rules([{"role": "system", "content": "Decide one of: ok, counterfeit."}])


def test_submit_needs_a_request_to_escalate(v2):
    from twin.errors import ToolError

    case = v2.case("test", 0)
    with pytest.raises(ToolError, match="request"):
        v2.submit(case.truth["category_id"], dict(case.truth["attributes"]), "escalate")


def test_twin_check_passes_on_catalog_v2(v2):
    """`twin check` on v2 at the fast suite's size (2 cases per kind; v2's own rows on 200 test
    and 600 train cases): every row passes, v2's rows included."""
    from twin.doctor import doctor

    report = doctor(v2, cases=2, subprocess_check=False)
    names = {(r.check, r.name) for r in report.rows}
    assert ("cheap policies", "decision tree depth 6") in names and (
        "natural mix",
        "cost per 1,000 listings",
    ) in names
    assert report.ok, [(r.check, r.name, r.figure, r.note) for r in report.failures()]


def test_content_rules_read_the_product_noun():
    from envs.catalog.v2 import content

    assert not content.conditions_apply("fb", "Food, Beverages & Tobacco > Snacks > Potato Chips")
    assert not content.conditions_apply("hb", "Health & Beauty > Hair Care > Shampoos")
    assert content.conditions_apply("hb", "Health & Beauty > Hair Care > Hair Dryers")
    assert content.conditions_apply(
        "vp", "Vehicles & Parts > Engine Oil Circulation > Oil Drain Plugs"
    )
    assert content.restricted("Baby & Toddler > Baby Transport > Strollers", "ok")
    assert not content.restricted("Toys & Games > Dolls > Doll Strollers", "ok")
    assert not content.restricted("Home & Garden > Vacuums > Battery-Powered Robot Vacuums", "ok")
    lo, hi = content.price_prior("el", "Electronics > Computers > Laptops")
    assert lo >= 300 and hi <= 2500
    case_lo, case_hi = content.price_prior("el", "Electronics > Phone Accessories > Phone Cases")
    assert case_hi <= 60
    wlo, whi = content.written_range("el", "Electronics > Computers > Laptops")
    assert content.msrp_for("AnyBrand", "el", "Electronics > Computers > Laptops", "el-1")[0] >= wlo


def test_taxonomy_auto_finds_an_installed_shopify_checkout(tmp_path, monkeypatch):
    from envs.catalog.v2.twin import shopify_default

    (tmp_path / "data" / "categories").mkdir(parents=True)
    monkeypatch.setenv("TWINRL_SHOPIFY_TAXONOMY", str(tmp_path))
    assert shopify_default() == str(tmp_path.resolve())
    monkeypatch.setenv("TWINRL_SHOPIFY_TAXONOMY", str(tmp_path / "nothing"))
    assert shopify_default() is None  # named but without the files: the generated taxonomy
    monkeypatch.delenv("TWINRL_SHOPIFY_TAXONOMY")
    assert shopify_default() is None


def test_item_types_resolve_to_their_leaf():
    from envs.catalog.v2.content import item_key, item_type_variants

    for style, text in item_type_variants("Women's Ankle Boots", "Norvale", "NV-1234"):
        bare = text.replace("Norvale", "").replace("NV-1234", "")
        assert item_key(bare) == item_key("Women's Ankle Boots"), (style, text)


def test_natural_mix_has_deployment_base_rates(v2):
    from collections import Counter

    from envs.catalog import CatalogTwinV2

    nat = CatalogTwinV2(seed=0, taxonomy_path=None, mix="natural", test_size=1000)
    shares = Counter(KIND_DECISION[nat.kind_of("test", i)] for i in range(1000))
    assert shares["ok"] == 920 and shares["counterfeit"] == 30 and shares["prohibited"] == 10
    assert shares["escalate"] == 40
    ev = CatalogTwinV2(seed=0, taxonomy_path=None, test_size=1000)
    evaluation = Counter(KIND_DECISION[ev.kind_of("test", i)] for i in range(1000))
    assert evaluation == {"ok": 450, "counterfeit": 200, "prohibited": 100, "escalate": 250}

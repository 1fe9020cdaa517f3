"""``python -m bench.world_timing``: the catalog world's figures, each printed beside its target."""

from __future__ import annotations


def test_world_timing_measures_every_figure(catalog_cache, capsys):
    from bench.world_timing import TARGETS, main

    figures = main(["--queries", "20"])
    printed = capsys.readouterr().out
    assert figures["categories"] > 1000  # the generated seed-0 world
    timed = {key: value for key, value in figures.items() if key != "categories"}
    assert set(TARGETS) <= set(timed) and all(value > 0 for value in timed.values())
    for key, target in TARGETS.items():
        verdict = "met" if figures[key] <= target else "MISSED"
        assert f"target <= {target:g}  {verdict}" in printed.split(key, 1)[1].splitlines()[0]

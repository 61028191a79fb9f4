"""Composite numbers (ARO's mean of four, vl_compo's and fsc-clip's averages): a mean only over every part, the
parts it lacks named, composites of composites, and the published reference beside each headline."""
from __future__ import annotations

import json
import math

import pytest

from evaluation import harness
from evaluation.benchmarks import BENCHMARKS, COMBINED, CombinedAggregate, Composite
from evaluation.benchmarks.sources import PUBLICATIONS, Published, published
from evaluation.harness import BenchmarkResult, combined_aggregates, markdown_tables, missing_benchmarks

ARO_PARTS = {"aro_vg_relation": {"macro": 60.0}, "aro_vg_attribution": {"macro": 62.0},
             "aro_coco_order": {"precision_at_1": 1.0, "precision_at_1_argmax": 46.0},
             "aro_flickr_order": {"precision_at_1": 2.0, "precision_at_1_argmax": 60.0}}


def test_aro_mean_uses_the_authors_rule_of_each_set():
    values = combined_aggregates(ARO_PARTS)["aro"]
    assert values["mean"] == pytest.approx((60 + 62 + 46 + 60) / 4)  # the argmax Precision@1, not the strict one
    assert values["aro_coco_order/precision_at_1_argmax"] == 46.0 and values["parts_scored"] == 4.0


def test_a_composite_without_every_part_is_nan_and_names_what_it_lacks():
    partial = {name: ARO_PARTS[name] for name in ("aro_vg_relation", "aro_coco_order")}
    values = combined_aggregates(partial)["aro"]
    assert math.isnan(values["mean"]) and values["parts_scored"] == 2.0
    assert math.isnan(values["aro_flickr_order/precision_at_1_argmax"])
    assert missing_benchmarks("aro", partial) == ["aro_vg_attribution", "aro_flickr_order"]
    assert "aro" not in combined_aggregates({"sugarcrepe": {"overall_macro": 70.0}})  # no part: not shown


def test_an_undefined_part_makes_the_mean_undefined_and_an_absent_key_is_an_error():
    undefined = {**ARO_PARTS, "aro_vg_relation": {"macro": None}}
    assert math.isnan(combined_aggregates(undefined)["aro"]["mean"])
    assert combined_aggregates(undefined)["aro"]["parts_scored"] == 3.0
    with pytest.raises(ValueError, match="aro_vg_attribution reports no 'macro'"):
        combined_aggregates({**ARO_PARTS, "aro_vg_attribution": {"micro": 1.0}})


def test_composites_of_composites_resolve_in_registry_order(monkeypatch):
    outer = Composite("outer", "ARO's mean and SugarCrepe's macro", (("aro", "mean"), ("sugarcrepe", "overall_macro")),
                      published({"mean": 50.0}, "vl_compo"))
    monkeypatch.setitem(COMBINED, "outer", outer)
    aggregates = {**ARO_PARTS, "sugarcrepe": {"overall_macro": 70.0}}
    values = combined_aggregates(aggregates)["outer"]
    assert values["mean"] == pytest.approx(((60 + 62 + 46 + 60) / 4 + 70) / 2)
    assert harness.benchmark_parts("outer") == [*ARO_PARTS, "sugarcrepe"]
    lacking = combined_aggregates({"sugarcrepe": {"overall_macro": 70.0}, "aro_vg_relation": {"macro": 1.0}})
    assert math.isnan(lacking["outer"]["mean"]) and lacking["outer"]["parts_scored"] == 1.0  # aro's mean is NaN
    assert missing_benchmarks("outer", ["sugarcrepe", "aro_vg_relation"]) == ["aro_vg_attribution",
                                                                               "aro_coco_order", "aro_flickr_order"]


def test_results_table_shows_the_published_reference_and_what_a_composite_lacks():
    results = [BenchmarkResult(name, [{"id": "0"}], values, 0.1)
               for name, values in list(ARO_PARTS.items())[:3]]
    table = markdown_tables(results, {"model": "ViT-B-32"})
    header = next(line for line in table.splitlines() if line.startswith("| benchmark"))
    assert "OpenAI CLIP ViT-B/32, published" in header
    row = next(line for line in table.splitlines() if line.startswith("| aro_vg_relation "))
    assert "macro 59.90 (vl_compo)" in row
    composite = next(line for line in table.splitlines() if line.startswith("| aro = mean("))
    assert "lacks aro_flickr_order" in composite and "mean n/a" in composite and "mean 57.55 (vl_compo)" in composite


def test_aggregates_json_lists_the_missing_parts(tmp_path):
    results = [BenchmarkResult(name, [{"id": "0"}], values, 0.1) for name, values in list(ARO_PARTS.items())[:2]]
    harness.write_tables(tmp_path, results, {r.name: {"model": "m"} for r in results}, {"model": "m"})
    document = json.loads((tmp_path / "aggregates.json").read_text())
    assert document["combined"]["aro"]["missing"] == ["aro_coco_order", "aro_flickr_order"]
    assert document["combined"]["aro"]["aggregates"]["mean"] is None


def test_a_composite_never_mixes_two_runs():
    results = [BenchmarkResult(name, [{"id": "0"}], values, 0.1) for name, values in ARO_PARTS.items()]
    same = {name: {"weights_sha256": "a"} for name in ARO_PARTS}
    assert "aro" in harness.results_combined(results, same)
    mixed = {**same, "aro_flickr_order": {"weights_sha256": "b"}}
    assert "aro" not in harness.results_combined(results, mixed)


def test_every_registered_combined_number_is_well_formed():
    names = list(COMBINED)
    for position, (name, combined) in enumerate(COMBINED.items()):
        assert combined.name == name and name not in BENCHMARKS and combined.description, name
        for part in combined.parts:  # a part is a benchmark or a combined number computed earlier
            assert part in BENCHMARKS or names.index(part) < position, (name, part)
        if isinstance(combined, CombinedAggregate):
            for part in combined.parts:
                assert set(combined.keys) <= set(BENCHMARKS[part].headline), (name, part)
        for key, value in combined.published.items():
            assert key in combined.headline and value.source in PUBLICATIONS, (name, key)
    with pytest.raises(ValueError, match="two or more distinct parts"):
        Composite("lonely", "one part", (("aro_vg_relation", "macro"),))
    with pytest.raises(ValueError, match="unknown publication"):
        Published(1.0, "no_such_paper")


def test_every_published_number_names_a_known_publication():
    for name, cls in BENCHMARKS.items():  # its key is checked against a real run in test_benchmark_registry.py
        for key, value in cls.published.items():
            assert value.source in PUBLICATIONS and 0 <= value.value <= 100, (name, key)


# vl_compo's results.csv, row ViT-B-32 / openai: each benchmark's column, and comp_avg 41.15145899.
VL_COMPO_VIT_B_32 = {"aro": 57.55243829, "colorswap": 12.0, "crepe": 23.70755529, "eqben": 26.49190578,
                     "imagecode": 21.72024327, "mmvp_vlm": 6.666666667, "sugarcrepe": 73.02574342,
                     "svo_probes": 84.13824737, "valse": 67.53352271, "vl_checklist": 70.76843289,
                     "whatsup_six_sets": 41.46275226, "winoground": 8.75}


def test_vl_compo_comp_avg_reproduces_the_published_number_from_its_parts():
    suite = COMBINED["vl_compo_comp_avg"]
    aggregates = {part: {key: VL_COMPO_VIT_B_32[part]} for part, key in suite.terms}
    assert suite.compute(aggregates)["mean"] == pytest.approx(41.15145899, abs=1e-7)
    assert suite.published["mean"].value == pytest.approx(41.15, abs=0.005)
    fsc = COMBINED["fsc_clip_comp"]
    assert set(fsc.parts) == set(suite.parts) - {"colorswap", "mmvp_vlm"} | {"spec"}

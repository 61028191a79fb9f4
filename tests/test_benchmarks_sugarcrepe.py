"""SugarCrepe: official files, strict scoring (ties wrong), and the published CLIP ViT-B/32 aggregates."""
from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
import pytest

from datamodules.benchmarks import BENCHMARKS, MissingBenchmarkData, build_benchmark
from datamodules.benchmarks.sugarcrepe import SUBSETS, SugarCrepe

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "sugarcrepe"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="the shared data folder is not beside the repo")
PUBLISHED = {"replace_obj": 90.92, "replace_att": 80.08, "replace_rel": 69.20, "swap_obj": 61.38,
             "swap_att": 63.96, "add_obj": 77.21, "add_att": 68.79, "overall_micro": 76.56}


@needs_shared
def test_published_clip_numbers_from_the_per_item_oracle():
    """The BiVLC authors' per-item outcomes of OpenAI CLIP ViT-B/32 give exactly the paper's numbers."""
    with open(SHARED / "clip_vit_b32_per_item_correct.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    outcomes = [{"subset": f"{row['type']}_{row['subtype']}", "correct": row["correct"] == "1"} for row in rows]
    result = SugarCrepe.aggregate(outcomes)
    for key, value in PUBLISHED.items():
        assert round(result[key], 2) == value, key
    assert round(result["overall_macro"], 2) == round(np.mean([PUBLISHED[s] for s in SUBSETS]), 2)
    assert round(result["replace"], 2) == 80.76 and round(result["swap"], 2) == 63.27
    assert round(result["add"], 2) == 75.09


@needs_shared
def test_reads_the_official_files_by_key(tmp_path):
    for subset in SUBSETS:
        shutil.copy(SHARED / f"{subset}.json", tmp_path)
    benchmark = build_benchmark("sugarcrepe", tmp_path, images=tmp_path / "coco")
    items = benchmark.items()
    assert len(items) == 7511  # swap_obj lost key "108" upstream
    ids = {item.id for item in items}
    assert "swap_obj/107" in ids and "swap_obj/108" not in ids and "swap_obj/109" in ids
    first = items[0]
    assert first.images[0].path.startswith(str(tmp_path / "coco")) and first.images[0].path.endswith(".jpg")
    assert len(first.texts) == 2 and first.meta["subset"] == "replace_obj"


def test_strict_comparison_makes_ties_wrong(tmp_path):
    for subset in SUBSETS:
        entry = '{"0": {"filename": "1.jpg", "caption": "a", "negative_caption": "b"}}'
        (tmp_path / f"{subset}.json").write_text(entry)
    benchmark = SugarCrepe(tmp_path)
    item = benchmark.items()[0]
    assert benchmark.outcome(item, np.array([[0.3, 0.2]]))["correct"] is True
    assert benchmark.outcome(item, np.array([[0.3, 0.3]]))["correct"] is False
    assert benchmark.outcome(item, np.array([[0.2, 0.3]]))["correct"] is False


def test_hand_made_outcomes_aggregate_micro_and_macro():
    outcomes = [{"subset": "replace_obj", "correct": True}, {"subset": "replace_obj", "correct": True},
                {"subset": "replace_att", "correct": False}] + \
               [{"subset": s, "correct": True} for s in SUBSETS[2:]]
    result = SugarCrepe.aggregate(outcomes)
    assert result["replace_obj"] == 100.0 and result["replace_att"] == 0.0
    assert result["replace"] == pytest.approx(300.0 / 4)  # micro over the 4 replace items
    assert result["overall_micro"] == pytest.approx(100.0 * 7 / 8)
    assert result["overall_macro"] == pytest.approx(100.0 * 6 / 7)


def test_missing_root_names_the_expected_files(tmp_path):
    with pytest.raises(MissingBenchmarkData, match="replace_obj.json"):
        build_benchmark("sugarcrepe", tmp_path)
    with pytest.raises(KeyError, match="sugarcrepe"):
        build_benchmark("sugar", tmp_path)
    assert "sugarcrepe" in BENCHMARKS

"""SugarCrepe: official files, strict scoring (ties wrong), and the published CLIP ViT-B/32 aggregates."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from evaluation.benchmarks import BENCHMARKS, MissingBenchmarkData, build_benchmark
from evaluation.benchmarks.sugarcrepe import SUBSETS, SugarCrepe
from testkit.fixtures import fixture

PUBLISHED = {"replace_obj": 90.92, "replace_att": 80.08, "replace_rel": 69.20, "swap_obj": 61.38,
             "swap_att": 63.96, "add_obj": 77.21, "add_att": 68.79, "overall_micro": 76.56}
# The same per-item outcomes on the current annotation files, which lack swap_obj key "108" (an item CLIP gets
# right): only swap_obj, swap and both overall averages move.
ON_CURRENT_FILES = {**PUBLISHED, "swap_obj": 61.22, "overall_micro": 76.55, "overall_macro": 73.05,
                    "replace": 80.76, "swap": 63.23, "add": 75.09}
DROPPED_ITEM = ("swap_obj", "000000310622.jpg", "A West 32nd sign under a Korea Way road sign. ",
                "A Korea Way sign under a West 32nd road sign.")


def _oracle_rows() -> list[dict]:
    """The BiVLC authors' per-item CLIP ViT-B/32 outcomes (7,512 rows, the paper's item set)."""
    with open(fixture("sugarcrepe/clip_vit_b32_per_item_correct.csv"), newline="") as handle:
        return list(csv.DictReader(handle))


def _join_key(subset: str, filename: str, caption: str, negative: str) -> tuple[str, str, str, str]:
    # The subset is part of the key: six (image, caption, negative) triples occur in two subsets each.
    return subset, filename, caption, negative


def test_published_clip_numbers_from_the_per_item_oracle():
    """The BiVLC authors' per-item outcomes of OpenAI CLIP ViT-B/32 give exactly the paper's numbers."""
    rows = _oracle_rows()
    assert len(rows) == 7512  # the paper's item set, swap_obj key "108" included
    outcomes = [{"subset": f"{row['type']}_{row['subtype']}", "correct": row["correct"] == "1"} for row in rows]
    result = SugarCrepe.aggregate(outcomes)
    for key, value in PUBLISHED.items():
        assert round(result[key], 2) == value, key
    assert round(result["overall_macro"], 2) == round(np.mean([PUBLISHED[s] for s in SUBSETS]), 2)
    assert round(result["replace"], 2) == 80.76 and round(result["swap"], 2) == 63.27
    assert round(result["add"], 2) == 75.09


def test_clip_numbers_on_the_current_annotation_files(tmp_path):
    """The oracle's outcomes joined onto the 7,511 items our loader reads: what the current files can give."""
    oracle = {_join_key(f"{row['type']}_{row['subtype']}", row["filename"], row["caption"],
                        row["negative_caption"]): row["correct"] == "1" for row in _oracle_rows()}
    # No images: only the annotations are joined.
    benchmark = SugarCrepe(fixture("sugarcrepe"), images=tmp_path / "coco")
    items = benchmark.items()
    keys = [_join_key(item.meta["subset"], Path(item.images[0].path).name, *item.texts) for item in items]
    assert len(items) == 7511 and len(set(keys)) == len(keys)
    unmatched = [item.id for item, key in zip(items, keys) if key not in oracle]
    assert not unmatched, f"{len(unmatched)} items without an oracle outcome, e.g. {unmatched[:3]}"
    assert set(oracle) - set(keys) == {DROPPED_ITEM} and oracle[DROPPED_ITEM] is True
    # Drive the real per-item rule: the oracle's right answer scores the caption above the negative.
    outcomes = [benchmark.outcome(item, np.array([[1.0, 0.0]] if oracle[key] else [[0.0, 1.0]]))
                for item, key in zip(items, keys)]
    result = SugarCrepe.aggregate(outcomes)
    assert {key: round(result[key], 2) for key in ON_CURRENT_FILES} == ON_CURRENT_FILES


def test_reads_the_official_files_by_key(tmp_path):
    for subset in SUBSETS:
        shutil.copy(fixture(f"sugarcrepe/{subset}.json"), tmp_path)
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


def test_ties_are_recorded_per_item_and_counted(tmp_path):
    """As every other benchmark: a tie is wrong, and the aggregate says how many items tied."""
    for subset in SUBSETS:
        entries = {str(k): {"filename": "1.jpg", "caption": f"a {k}", "negative_caption": "b"} for k in range(2)}
        (tmp_path / f"{subset}.json").write_text(json.dumps(entries))
    benchmark = SugarCrepe(tmp_path)
    scores = {"replace_obj/0": [[0.3, 0.3]], "swap_att/1": [[0.25, 0.25]], "add_att/0": [[0.2, 0.3]]}
    outcomes = [benchmark.outcome(item, np.array(scores.get(item.id, [[0.3, 0.2]]))) for item in benchmark.items()]
    assert [o["id"] for o in outcomes if o["tie"]] == ["replace_obj/0", "swap_att/1"]
    assert not any(o["correct"] for o in outcomes if o["tie"])
    result = SugarCrepe.aggregate(outcomes)
    assert result["ties"] == 2 and result["overall_micro"] == pytest.approx(100.0 * 11 / 14)
    # Outcomes stored before ties were recorded cannot say how many tied: undefined, not 0.
    assert np.isnan(SugarCrepe.aggregate([{k: v for k, v in o.items() if k != "tie"} for o in outcomes])["ties"])


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

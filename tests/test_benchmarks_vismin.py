"""VisMin: the parquet rows, the solution file's per-item pairing, and the authors' kit rule item by item."""
from __future__ import annotations

import csv
import hashlib
import json
import re
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from evaluation.benchmarks.base import ImageRef, MissingBenchmarkData
from evaluation.benchmarks.images import load_image
from evaluation.benchmarks.vismin import CATEGORIES, REVISIONS, VisMin
from evaluation.scorers import FunctionScorer
from testkit.standin.vismin import category_sizes, write_vismin

SOLUTION = Path("solutions") / "sim_solution.csv"


def _shards(root: Path) -> list[Path]:
    return sorted((root / "default" / "test").glob("*.parquet"))


def _dataset_rows(root: Path) -> list[tuple[Path, int, dict]]:
    """(shard, row, record) in release order, read with pyarrow alone."""
    return [(shard, row, record) for shard in _shards(root)
            for row, record in enumerate(pq.read_table(shard, columns=["id", "text_0", "text_1", "category"])
                                         .to_pylist())]


def _solution_rows(root: Path) -> list[dict]:
    with open(root / SOLUTION, newline="") as handle:
        return list(csv.DictReader(handle))


def tied_similarity(ref: ImageRef, text: str) -> float:
    """Deterministic scores in {0.0, ..., 0.6}: exact ties are common."""
    key = f"{ref.member}|{Path(ref.path).name}|{text}".encode()
    return int(hashlib.sha256(key).hexdigest()[:8], 16) % 7 / 10


# ---------------------------------------------------------------- loading


def test_standin_reads_back_ids_texts_images_and_the_solution_pairing(tmp_path):
    benchmark = VisMin(tmp_path, **write_vismin(tmp_path, n_items=40, seed=3))
    items, rows, solution = benchmark.items(), _dataset_rows(tmp_path), _solution_rows(tmp_path)
    assert len(items) == len(rows) == len(solution) == 40 and len(_shards(tmp_path)) == 2
    assert [item.meta["category"] for item in items] == [record["category"] for _, _, record in rows]
    assert [c for c, _ in category_sizes(40)] == list(CATEGORIES) and items[0].id == "object/0"
    for item, (shard, row, record), line in zip(items, rows, solution):
        swapped = line["Text"].startswith("T1_I0 >")
        assert item.id == f"{record['category']}/{record['id']}" and item.meta["swapped"] is swapped
        expected = [record["text_1"], record["text_0"]] if swapped else [record["text_0"], record["text_1"]]
        assert item.texts == expected
        assert item.images == [ImageRef(str(shard), member=f"image_{k}:{row}") for k in (0, 1)]
    assert 5 < sum(item.meta["swapped"] for item in items) < 35
    assert not np.array_equal(np.asarray(load_image(items[7].images[0])), np.asarray(load_image(items[7].images[1])))


def test_the_later_kit_pairing_keeps_the_published_order_and_needs_no_solution_file(tmp_path):
    write_vismin(tmp_path, n_items=12)
    (tmp_path / SOLUTION).unlink()
    with pytest.raises(MissingBenchmarkData, match=re.escape("lacks solutions/sim_solution.csv")):
        VisMin(tmp_path)
    items = VisMin(tmp_path, pairing="text0_image0").items()
    rows = _dataset_rows(tmp_path)
    assert [item.texts for item in items] == [[r["text_0"], r["text_1"]] for _, _, r in rows]
    assert not any(item.meta["swapped"] for item in items)


def test_revisions_fix_the_rule_and_unknown_ones_are_refused(tmp_path):
    write_vismin(tmp_path, n_items=8)
    assert all(revision.pairing == "solution" for revision in REVISIONS.values())
    assert VisMin(tmp_path).pairing == "solution" and VisMin(tmp_path, revision="2f379d5").pairing == "solution"
    assert all(len(revision.commit) == 40 for revision in REVISIONS.values())
    with pytest.raises(ValueError, match="unknown VisMin revision 'efbe15d'; known: c764500, 2f379d5, b791454"):
        VisMin(tmp_path, revision="efbe15d")
    with pytest.raises(ValueError, match="pairing must be one of solution, text0_image0"):
        VisMin(tmp_path, pairing="text1_image0")


def test_missing_files_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match=re.escape(
            "lacks data/test-*.parquet | */test/*.parquet, solutions/sim_solution.csv")):
        VisMin(tmp_path)


# ---------------------------------------------------------------- the rule by hand


def _scorer(values: dict) -> FunctionScorer:
    """s(image k of the item, published text j) from {(k, j): value}."""
    def similarity(ref: ImageRef, text: str) -> float:
        return values[int(ref.member[len("image_"):ref.member.index(":")]), text]
    return FunctionScorer(similarity)


def test_a_swapped_item_is_right_only_when_text_1_goes_with_image_0(tmp_path):
    write_vismin(tmp_path, n_items=1)  # one relation item
    (tmp_path / SOLUTION).write_text("idx,Text,Image,category\n0,T1_I0 > T0_I0 & T0_I1 > T1_I1,"
                                     "T0_I1 > T0_I0 & T1_I0 > T1_I1,relation\n")
    text_0, text_1 = _dataset_rows(tmp_path)[0][2]["text_0"], _dataset_rows(tmp_path)[0][2]["text_1"]
    crossed = {(0, text_1): 0.9, (1, text_0): 0.8, (0, text_0): 0.1, (1, text_1): 0.2}
    [ours] = VisMin(tmp_path).outcomes(_scorer(crossed))
    assert (ours["text"], ours["image"], ours["group"], ours["swapped"], ours["tie"]) == (True, True, True, True, False)
    [later] = VisMin(tmp_path, pairing="text0_image0").outcomes(_scorer(crossed))
    assert (later["text"], later["image"], later["group"]) == (False, False, False)
    # T0_I1 ties T0_I0: the image relation T0_I1 > T0_I0 fails, the text relations still hold
    tied = {**crossed, (1, text_0): 0.5, (0, text_0): 0.5}
    [outcome] = VisMin(tmp_path).outcomes(_scorer(tied))
    assert (outcome["text"], outcome["image"], outcome["tie"]) == (True, False, True)


def test_aggregate_by_hand_per_category_average_and_swapped_count():
    def outcome(category, text, image, swapped=False, tie=False):
        return {"category": category, "text": text, "image": image, "group": text and image, "swapped": swapped,
                "tie": tie}
    outcomes = [outcome("object", True, True, swapped=True), outcome("object", True, False),
                outcome("attribute", False, False, tie=True), outcome("relation", True, True),
                outcome("counting", False, True, swapped=True)]
    result = VisMin.aggregate(outcomes)
    assert (result["text/object"], result["image/object"], result["group/object"]) == (100.0, 50.0, 50.0)
    assert (result["text/counting"], result["image/counting"], result["group/counting"]) == (0.0, 100.0, 0.0)
    table = [100, 50, 50, 0, 0, 0, 100, 100, 100, 0, 100, 0]
    assert result["avg"] == pytest.approx(np.mean(table))
    assert (result["text"], result["group"], result["n"], result["ties"], result["swapped"]) == (60.0, 40.0, 5, 1, 2)
    assert np.isnan(VisMin.aggregate(outcomes[:2])["avg"])  # the paper's average needs all four categories


# ---------------------------------------------------------------- the authors' rule, item by item


def kit_first_release(predictions: list[dict], ground_truth: list[dict]) -> tuple[list[tuple], dict]:
    """`compute_contrastive_accuracy` of rabiulcste/vismin 4fdeb0f (vismin-bench/metric.py), step by step:
    rows zipped by position, the relations of sim_solution.csv evaluated literally, per category in percent
    rounded to 2 decimals. Also returns the per-row (text, image, group)."""
    def holds(prediction, relation):
        left, operator, right = relation.split(" ")
        return {">": prediction[left] > prediction[right], "<": prediction[left] < prediction[right],
                "=": prediction[left] == prediction[right]}[operator]
    counts, per_row = defaultdict(lambda: {"text": 0, "image": 0, "group": 0, "count": 0}), []
    for prediction, truth in zip(predictions, ground_truth):
        text = all(holds(prediction, r) for r in truth["Text"].split(" & "))
        image = all(holds(prediction, r) for r in truth["Image"].split(" & "))
        for key, hit in (("text", text), ("image", image), ("group", text and image), ("count", True)):
            counts[truth["category"]][key] += hit
        per_row.append((text, image, text and image))
    return per_row, {category: {key: round(c[key] * 100 / c["count"], 2) for key in ("text", "image", "group")}
                     for category, c in counts.items()}


def kit_later_release(predictions: list[dict]) -> tuple[list[tuple], dict]:
    """The same function at 680a3ee: text_i-image_i for every row, category from the dataset row."""
    truth = [{"Text": "T0_I0 > T1_I0 & T1_I1 > T0_I1", "Image": "T0_I0 > T0_I1 & T1_I1 > T1_I0",
              "category": p["category"]} for p in predictions]
    return kit_first_release(predictions, truth)


def _kit_predictions(root: Path) -> list[dict]:
    """eval.py's loop: T{j}_I{i} = similarity(image i, text j) for every row in dataset order."""
    predictions = []
    for shard, row, record in _dataset_rows(root):
        images = [ImageRef(str(shard), member=f"image_{i}:{row}") for i in (0, 1)]
        scores = {f"T{j}_I{i}": tied_similarity(images[i], record[f"text_{j}"]) for i in (0, 1) for j in (0, 1)}
        predictions.append({"idx": record["id"], **scores, "category": record["category"]})
    return predictions


@pytest.mark.parametrize("pairing", ["solution", "text0_image0"])
def test_the_authors_kit_and_ours_agree_on_every_item_and_category(tmp_path, pairing):
    benchmark = VisMin(tmp_path, pairing=pairing, **write_vismin(tmp_path, n_items=300, seed=5))
    outcomes = benchmark.outcomes(FunctionScorer(tied_similarity))
    predictions = _kit_predictions(tmp_path)
    if pairing == "solution":
        per_row, per_category = kit_first_release(predictions, _solution_rows(tmp_path))
    else:
        per_row, per_category = kit_later_release(predictions)
    assert [(o["text"], o["image"], o["group"]) for o in outcomes] == per_row
    result = VisMin.aggregate(outcomes)
    assert {c: {s: round(result[f"{s}/{c}"], 2) for s in ("text", "image", "group")} for c in CATEGORIES} \
        == per_category
    assert 20 < result["ties"] < 300 and result["n"] == 300  # the scorer ties often, yet not always
    assert result["avg"] == pytest.approx(np.mean([result[f"{s}/{c}"] for c in CATEGORIES
                                                   for s in ("text", "image", "group")]))


def test_aggregates_recompute_from_json_round_tripped_outcomes(tmp_path):
    benchmark = VisMin(tmp_path, **write_vismin(tmp_path, n_items=60, seed=2))
    outcomes = benchmark.outcomes(FunctionScorer(tied_similarity))
    stored = json.loads(json.dumps(outcomes))
    assert VisMin.aggregate(stored) == VisMin.aggregate(outcomes)
    assert set(VisMin.published) <= set(VisMin.headline) <= set(VisMin.aggregate(outcomes))
    assert len({o["id"] for o in outcomes}) == 60


# ---------------------------------------------------------------- malformed files


def _rewrite_solution_line(root: Path, line: int, text: str) -> None:
    lines = (root / SOLUTION).read_text().splitlines()
    lines[line - 1] = text
    (root / SOLUTION).write_text("\n".join(lines) + "\n")


def test_a_solution_file_that_does_not_fit_the_dataset_names_the_file_and_line(tmp_path):
    write_vismin(tmp_path, n_items=12)
    _rewrite_solution_line(tmp_path, 3, "1,T0_I0 > T1_I0,T0_I0 > T0_I1,object")
    with pytest.raises(ValueError, match=r"sim_solution.csv: line 3: relations .* are neither"):
        VisMin(tmp_path).items()
    write_vismin(tmp_path, n_items=12)
    _rewrite_solution_line(tmp_path, 2, "0,T0_I0 > T1_I0 & T1_I1 > T0_I1,T0_I0 > T0_I1 & T1_I1 > T1_I0,counting")
    with pytest.raises(ValueError, match=r"line 2 is item counting/0, but the dataset row at that position "
                                         r"\(.*0000.parquet: row 0\) is object/0"):
        VisMin(tmp_path).items()
    write_vismin(tmp_path, n_items=12)
    lines = (tmp_path / SOLUTION).read_text().splitlines()
    (tmp_path / SOLUTION).write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(ValueError, match="11 rows for 12 dataset items"):
        VisMin(tmp_path).items()


def test_truncated_and_non_utf8_solution_files_are_named(tmp_path):
    write_vismin(tmp_path, n_items=12)
    data = (tmp_path / SOLUTION).read_bytes()
    (tmp_path / SOLUTION).write_bytes(data[:-40])
    with pytest.raises(ValueError, match=r"sim_solution.csv: line 13 has the wrong number of cells"):
        VisMin(tmp_path).items()
    (tmp_path / SOLUTION).write_bytes(data[:30] + b"\xff\xfe" + data[30:])
    with pytest.raises(ValueError, match=r"sim_solution.csv: not a UTF-8 text file"):
        VisMin(tmp_path).items()
    (tmp_path / SOLUTION).write_text("id,Text,Image,category\n")
    with pytest.raises(ValueError, match=r"sim_solution.csv: missing column\(s\) idx"):
        VisMin(tmp_path).items()


def test_malformed_shards_name_the_file(tmp_path):
    write_vismin(tmp_path, n_items=12)
    shard = _shards(tmp_path)[1]
    table = pq.read_table(shard)
    pq.write_table(table.drop_columns(["category"]), shard)
    with pytest.raises(ValueError, match=r"0001.parquet: missing column\(s\) category"):
        VisMin(tmp_path).items()
    shard.write_bytes(b"PAR1 truncated")
    with pytest.raises(ValueError, match=r"0001.parquet: cannot read the parquet shard"):
        VisMin(tmp_path).items()
    write_vismin(tmp_path / "twice", n_items=6)
    shutil.copy(_shards(tmp_path / "twice")[0], tmp_path / "twice" / "default" / "test" / "0002.parquet")
    with pytest.raises(ValueError, match=r"item ids repeat across the test shards \(e.g. \['attribute/0', 'object/0'"):
        VisMin(tmp_path / "twice", pairing="text0_image0").items()

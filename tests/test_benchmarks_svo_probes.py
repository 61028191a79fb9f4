"""SVO-Probes: the official CSV, the notebook's selection of rows per negative type, the pairwise rule for a
similarity score, and rows whose images are missing (counted, never scored)."""
from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from evaluation.benchmarks import MissingBenchmarkData
from evaluation.benchmarks.base import OTHER, ImageRef
from evaluation.benchmarks.svo_probes import COLUMNS, NEGATIVE_TYPES, OTHER_TYPE, SVOProbes, negative_type
from evaluation.harness import run_benchmark
from evaluation.scorers import FunctionScorer
from testkit.standin.svo_probes import FIRST_ID, write_svo_probes


def _standin(root: Path, n_items: int = 21, missing_every: int = 7) -> SVOProbes:
    return SVOProbes(root, **write_svo_probes(root, n_items=n_items, missing_every=missing_every))


def _csv_rows(root: Path) -> list[dict]:
    with open(root / "svo_probes.csv", newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _write_rows(root: Path, rows: list[dict], fieldnames=COLUMNS) -> None:
    with open(root / "svo_probes.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)


def tied_similarity(ref: ImageRef, text: str) -> float:
    """A deterministic similarity in {0.0, 0.1, 0.2}: about a third of rows tie."""
    digest = hashlib.sha256(f"{Path(ref.path).name}|{text}".encode()).digest()
    return digest[0] % 3 / 10


# ---------------------------------------------------------------- loading


def test_standin_items_are_the_rows_with_both_images_in_csv_order(tmp_path):
    benchmark = _standin(tmp_path, n_items=21, missing_every=7)  # rows 6, 13, 20 lack their negative image
    rows = _csv_rows(tmp_path)
    items = benchmark.items()
    assert [item.id for item in items] == [str(k) for k in range(21) if k % 7 != 6]
    for item in items:
        row = rows[int(item.id)]
        assert item.texts == [row["sentence"]]
        assert [ref.path for ref in item.images] == [str(tmp_path / "images" / f"{row[key]}.jpg")
                                                     for key in ("pos_image_id", "neg_image_id")]
        assert item.meta == {"negative": NEGATIVE_TYPES[int(item.id) % 3]}
        assert row[item.meta["negative"]] == "True"
    assert items[0].images[0].path.endswith(f"{FIRST_ID}.jpg")
    # The runner checks and encodes the scorable rows' images only, all of which are there.
    assert len(benchmark.image_refs()) == 2 * 18 and all(Path(r.path).is_file() for r in benchmark.image_refs())
    assert SVOProbes(tmp_path).images == tmp_path / "images"  # the default images folder


def test_a_pandas_index_column_and_float_ids_are_read_and_the_images_option_is_honoured(tmp_path):
    write_svo_probes(tmp_path / "a", n_items=9, missing_every=0)
    rows = _csv_rows(tmp_path / "a")
    (tmp_path / "b").mkdir()
    # pandas writes its index as a nameless first column, and an int column with a gap as floats ("20000.0").
    _write_rows(tmp_path / "b", [{"": k, **row, "pos_image_id": f"{row['pos_image_id']}.0"}
                                 for k, row in enumerate(rows)], fieldnames=("", *COLUMNS))
    ours = SVOProbes(tmp_path / "b", images=tmp_path / "a" / "images")
    reference = SVOProbes(tmp_path / "a")
    assert [(i.id, i.texts, i.images, i.meta) for i in ours.items()] == \
        [(i.id, i.texts, i.images, i.meta) for i in reference.items()]


def test_images_are_never_read_as_coco_or_visual_genome_ids(tmp_path):
    benchmark = _standin(tmp_path, n_items=3)
    assert benchmark.image_origin(ImageRef(str(tmp_path / "images" / "000000391895.jpg"))).source == OTHER
    assert benchmark.coco_image_ids() == set()


# ---------------------------------------------------------------- malformed input


@pytest.mark.parametrize("edit, message", [
    (lambda row: row.update(verb_neg="yes"), r"svo_probes.csv: line 3: verb_neg must be True or False, got 'yes'"),
    (lambda row: row.update(neg_image_id="12.jpg"), "line 3: neg_image_id must be an integer image id"),
    (lambda row: row.update(pos_image_id="12.5"), r"line 3: pos_image_id must be an integer image id, got '12.5'"),
])
def test_malformed_rows_name_the_file_and_line(tmp_path, edit, message):
    write_svo_probes(tmp_path, n_items=3)
    rows = _csv_rows(tmp_path)
    edit(rows[1])
    _write_rows(tmp_path, rows)
    with pytest.raises(ValueError, match=message):
        SVOProbes(tmp_path).items()


def test_a_short_row_as_a_truncated_file_ends_is_named(tmp_path):
    write_svo_probes(tmp_path, n_items=3)
    path = tmp_path / "svo_probes.csv"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines[:2], lines[2][: lines[2].index(",http")]]) + "\n")
    with pytest.raises(ValueError, match="svo_probes.csv: line 3 has the wrong number of cells"):
        SVOProbes(tmp_path).items()


def test_missing_columns_truncation_encoding_and_absent_file_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match="svo_probes.csv"):
        SVOProbes(tmp_path)
    write_svo_probes(tmp_path, n_items=4)
    path = tmp_path / "svo_probes.csv"
    text = path.read_text()
    rows = _csv_rows(tmp_path)
    _write_rows(tmp_path, [{k: v for k, v in row.items() if k != "obj_neg"} for row in rows],
                fieldnames=[c for c in COLUMNS if c != "obj_neg"])
    with pytest.raises(ValueError, match="svo_probes.csv: missing column.*obj_neg"):
        SVOProbes(tmp_path).items()
    path.write_text(text[: text.index('"', text.index("\n") + 1) + 5])  # cut inside a quoted triplet
    with pytest.raises(ValueError, match="svo_probes.csv: line 2"):
        SVOProbes(tmp_path).items()
    path.write_bytes(text.encode("utf-8").replace(b"A man", b"A caf\xe9 man", 1))
    with pytest.raises(ValueError, match="svo_probes.csv: not a UTF-8 text file"):
        SVOProbes(tmp_path).items()


# ---------------------------------------------------------------- the rule


def test_positive_must_score_strictly_above_negative(tmp_path):
    benchmark = _standin(tmp_path, n_items=3)
    item = benchmark.items()[1]
    assert benchmark.outcome(item, np.array([[0.3], [0.2]])) == {"id": "1", "negative": "verb_neg",
                                                                  "scorable": True, "correct": True, "tie": False}
    assert benchmark.outcome(item, np.array([[0.3], [0.3]]))["correct"] is False
    assert benchmark.outcome(item, np.array([[0.3], [0.3]]))["tie"] is True
    assert benchmark.outcome(item, np.array([[0.2], [0.3]]))["correct"] is False


def test_negative_type_is_the_single_true_flag():
    assert negative_type({"subj_neg": True, "verb_neg": False, "obj_neg": False}) == "subj_neg"
    assert negative_type({"subj_neg": False, "verb_neg": False, "obj_neg": True}) == "obj_neg"
    assert negative_type({"subj_neg": True, "verb_neg": True, "obj_neg": False}) == OTHER_TYPE
    assert negative_type({"subj_neg": False, "verb_neg": False, "obj_neg": False}) == OTHER_TYPE


def notebook_reference(root: Path, images: Path, similarity) -> dict:
    """`probing_image_text_models.ipynb` written out for a similarity score: rows the model has no score for
    (an image it could not read) dropped (`get_score_dataframe`), the per-type selections
    `subj_neg & ~obj_neg & ~verb_neg` (and likewise), a row right when its positive scores above its negative,
    accuracy per selection, "All" over their concatenation; plus vl_compo's mean of the three."""
    with open(root / "svo_probes.csv", newline="", encoding="utf-8") as handle:
        frame = list(csv.DictReader(handle))
    data = []
    for idx, row in enumerate(frame):
        pos = os.path.join(images, "%d.jpg" % int(row["pos_image_id"]))
        neg = os.path.join(images, "%d.jpg" % int(row["neg_image_id"]))
        if not all(os.path.isfile(p) and os.path.getsize(p) > 0 for p in (pos, neg)):
            continue  # df.drop([idx])
        flags = {name: row[name] == "True" for name in NEGATIVE_TYPES}
        data.append({"idx": idx, **flags, "pos_scores": similarity(pos, row["sentence"]),
                     "neg_scores": similarity(neg, row["sentence"])})
    subj = [d for d in data if d["subj_neg"] and not d["obj_neg"] and not d["verb_neg"]]
    verb = [d for d in data if d["verb_neg"] and not d["obj_neg"] and not d["subj_neg"]]
    obj = [d for d in data if d["obj_neg"] and not d["verb_neg"] and not d["subj_neg"]]

    def accuracy(selection):
        return 100 * float(np.mean([d["pos_scores"] > d["neg_scores"] for d in selection]))

    result = {"subj_neg": accuracy(subj), "verb_neg": accuracy(verb), "obj_neg": accuracy(obj),
              "all": accuracy(subj + verb + obj)}
    result["mean"] = (result["subj_neg"] + result["verb_neg"] + result["obj_neg"]) / 3
    per_row = {str(d["idx"]): d["pos_scores"] > d["neg_scores"] for d in subj + verb + obj}
    return {"accuracy": result, "per_row": per_row}


def test_the_notebook_selection_and_our_rule_agree_on_every_row(tmp_path):
    write_svo_probes(tmp_path, n_items=600, missing_every=7)
    rows = _csv_rows(tmp_path)
    for k in range(0, 600, 25):  # rows in no single type: two flags (k = 25, 75, ...), or none (k = 0, 50, ...)
        flag = str(k % 50 != 0)
        rows[k].update(subj_neg=flag, verb_neg=flag, obj_neg="False")
    _write_rows(tmp_path, rows)
    (tmp_path / "images" / f"{rows[4]['pos_image_id']}.jpg").write_bytes(b"")  # a failed download
    benchmark = SVOProbes(tmp_path)
    outcomes = benchmark.outcomes(FunctionScorer(tied_similarity))
    reference = notebook_reference(tmp_path, tmp_path / "images",
                                   lambda path, text: tied_similarity(ImageRef(path), text))
    assert {o["id"]: o["correct"] for o in outcomes if o["scorable"]} == reference["per_row"]
    assert sum(bool(o.get("tie")) for o in outcomes) > 50
    result = SVOProbes.aggregate(outcomes)
    for key, value in reference["accuracy"].items():
        assert result[key] == pytest.approx(value, abs=1e-9), key
    assert result["other_type_rows"] == 24 and result["rows"] == 600
    assert result["scorable"] + result["unscorable"] + result["other_type_rows"] == 600
    assert not next(o for o in outcomes if o["id"] == "4")["scorable"]


# ---------------------------------------------------------------- missing images, aggregates


def test_the_harness_scores_the_scorable_rows_and_counts_the_rest_with_a_warning(tmp_path, caplog):
    benchmark = _standin(tmp_path, n_items=30, missing_every=7)  # rows 6, 13, 20, 27 lack an image
    with caplog.at_level(logging.WARNING, logger="evaluation.benchmarks.svo_probes"):
        result = run_benchmark(benchmark, FunctionScorer(lambda ref, text: 1.0 if int(Path(ref.path).stem) % 2 == 0
                                                         else 0.0))  # positives have even ids: all right
    assert [o["id"] for o in result.outcomes] == [str(k) for k in range(30)]
    unscored = [o for o in result.outcomes if not o["scorable"]]
    assert [(o["id"], o["negative"], o["missing_images"]) for o in unscored] == [
        (str(k), NEGATIVE_TYPES[k % 3], [FIRST_ID + 2 * k + 1]) for k in (6, 13, 20, 27)]
    assert all("correct" not in o for o in unscored)
    aggregates = result.aggregates
    assert (aggregates["subj_neg"], aggregates["verb_neg"], aggregates["obj_neg"], aggregates["mean"]) == \
        (100.0, 100.0, 100.0, 100.0)
    assert (aggregates["n"], aggregates["scorable"], aggregates["unscorable"]) == (26, 26, 4)
    assert (aggregates["unscorable/subj_neg"], aggregates["unscorable/verb_neg"],
            aggregates["unscorable/obj_neg"]) == (2, 1, 1)  # rows 6 and 27, 13, 20
    assert aggregates["scorable/subj_neg"] == 8 and aggregates["other_type_rows"] == 0
    assert "4 of 30 rows" in caplog.text and "(subj_neg 2, verb_neg 1, obj_neg 1)" in caplog.text
    stored = [json.loads(json.dumps(o)) for o in result.outcomes]
    assert SVOProbes.aggregate(stored) == aggregates


def test_aggregates_by_hand_macro_and_pooled():
    def scored(negative, correct, tie=False):
        return {"id": f"{negative}{correct}{tie}", "negative": negative, "scorable": True, "correct": correct,
                "tie": tie}

    outcomes = [scored("subj_neg", True), scored("subj_neg", False, tie=True), scored("verb_neg", True),
                scored("obj_neg", True), scored("obj_neg", True), scored("obj_neg", False),
                {"id": "x", "negative": "verb_neg", "scorable": False, "missing_images": [1]},
                {"id": "y", "negative": OTHER_TYPE, "scorable": False, "missing_images": []}]
    result = SVOProbes.aggregate(outcomes)
    assert (result["subj_neg"], result["verb_neg"]) == (50.0, 100.0)
    assert result["obj_neg"] == pytest.approx(200 / 3)
    assert result["mean"] == pytest.approx((50 + 100 + 200 / 3) / 3)  # each type weighs the same
    assert result["all"] == pytest.approx(400 / 6)  # the notebook's pooled "All"
    assert result["ties"] == 1 and result["unscorable"] == 1 and result["unscorable/verb_neg"] == 1
    assert result["other_type_rows"] == 1 and result["rows"] == 8 and result["n"] == 6
    # A type with no scorable row: its accuracy and the mean are undefined, not 0 and not a mean of two.
    no_verbs = SVOProbes.aggregate([o for o in outcomes if o["negative"] != "verb_neg"])
    assert np.isnan(no_verbs["verb_neg"]) and np.isnan(no_verbs["mean"]) and no_verbs["subj_neg"] == 50.0


def test_published_numbers_are_vl_compos_and_the_mean_is_theirs():
    values = {key: number.value for key, number in SVOProbes.published.items()}
    assert values == {"subj_neg": 84.07, "verb_neg": 79.73, "obj_neg": 88.62, "mean": 84.14}
    assert {number.source for number in SVOProbes.published.values()} == {"vl_compo"}
    assert np.mean([values[t] for t in NEGATIVE_TYPES]) == pytest.approx(values["mean"], abs=0.005)

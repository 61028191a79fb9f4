"""What'sUp: the authors' file formats, strict gold-beats-all scoring, pair / set accuracy by object pair."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from evaluation import evaluate
from evaluation.benchmarks.base import MissingBenchmarkData
from testkit.standin import whatsup as standin
from evaluation.benchmarks.whatsup import (
    WHATSUP_BENCHMARKS,
    WhatsUpA,
    WhatsUpB,
    WhatsUpCocoOne,
    WhatsUpCocoTwo,
    WhatsUpGqaOne,
    WhatsUpGqaTwo,
    coco_two_object_preposition,
    gqa_two_object_preposition,
    one_object_preposition,
    parse_controlled_name,
)
from evaluation.harness import combined_aggregates
from evaluation.scorers import FunctionScorer

WRITERS = {"whatsup_a": standin.write_whatsup_a, "whatsup_b": standin.write_whatsup_b,
           "whatsup_coco_one": standin.write_whatsup_coco_one, "whatsup_coco_two": standin.write_whatsup_coco_two,
           "whatsup_gqa_one": standin.write_whatsup_gqa_one, "whatsup_gqa_two": standin.write_whatsup_gqa_two}


def _built(cls, root: Path, n_items: int = 20):
    return cls(root, **WRITERS[cls.name](root, n_items=n_items, seed=0))


# ---------------------------------------------------------------- loading


def test_controlled_a_standin_loads_with_pairs_prepositions_gold_first_and_rerooted_images(tmp_path):
    benchmark = _built(WhatsUpA, tmp_path)
    items = benchmark.items()
    records = json.loads((tmp_path / "controlled_images_dataset.json").read_text())
    assert len(items) == 20 and [item.id for item in items] == [str(i) for i in range(20)]
    first = items[0]
    assert first.meta["object_pair"] == ["mug", "plate"] and first.meta["preposition"] == "on"
    assert first.texts[0] == "A mug on a plate" and len(first.texts) == 4
    assert sorted(first.texts) == sorted(["A mug on a plate", "A mug under a plate", "A mug to the left of a plate",
                                          "A mug to the right of a plate"])
    assert records[0]["image_path"] == "data/controlled_images/mug_on_plate.jpeg"
    assert first.images[0].path == str(tmp_path / "images" / "mug_on_plate.jpeg")
    assert all(Path(item.images[0].path).is_file() for item in items)
    assert [item.texts for item in items] == [r["caption_options"] for r in records]
    # default image folder is the authors' folder name under the root
    assert WhatsUpA(tmp_path).items()[0].images[0].path == str(tmp_path / "controlled_images" / "mug_on_plate.jpeg")


def test_controlled_b_file_names_parse_multi_word_objects_and_in_front_of(tmp_path):
    assert parse_controlled_name("data/controlled_clevr/beer-bottle_in-front_of_armchair.jpeg") == \
        ("beer-bottle", "in-front_of", "armchair")
    assert parse_controlled_name("data/controlled_images/mug_left_of_table.jpeg") == ("mug", "left_of", "table")
    assert parse_controlled_name("x/cap_under_chair.jpeg") == ("cap", "under", "chair")
    items = _built(WhatsUpB, tmp_path, n_items=8).items()
    assert [item.meta["preposition"] for item in items[:4]] == ["left_of", "right_of", "in-front_of", "behind"]
    assert items[2].texts[0] == "A mug in front of a plate" and items[2].images[0].path.endswith(
        "mug_in-front_of_plate.jpeg")
    assert WhatsUpB(tmp_path).items()[0].images[0].path.startswith(str(tmp_path / "controlled_clevr"))


@pytest.mark.parametrize("cls, name_of, folder", [
    (WhatsUpCocoOne, lambda i: f"{i:012d}.jpg", "val2017"), (WhatsUpCocoTwo, lambda i: f"{i:012d}.jpg", "val2017"),
    (WhatsUpGqaOne, lambda i: f"{i}.jpg", "vg_images"), (WhatsUpGqaTwo, lambda i: f"{i}.jpg", "vg_images")])
def test_spatial_standins_load_two_options_gold_first(tmp_path, cls, name_of, folder):
    benchmark = _built(cls, tmp_path)
    records = json.loads((tmp_path / cls.annotation_file).read_text())
    items = benchmark.items()
    assert len(items) == 20 and [item.id for item in items] == [str(i) for i in range(20)]
    assert [item.texts for item in items] == [[gold, wrong] for _, gold, wrong in records]
    assert items[3].images[0].path == str(tmp_path / "images" / name_of(records[3][0]))
    assert all(Path(item.images[0].path).is_file() for item in items)
    assert cls(tmp_path).items()[0].images[0].path == str(tmp_path / folder / name_of(records[0][0]))


def test_spatial_preposition_labels_follow_the_reference(tmp_path):
    assert one_object_preposition("A dog on the left") == "left"
    assert coco_two_object_preposition("A dog to the right of a cat") == "right"
    assert coco_two_object_preposition("A dog under a table") == "below"  # the reference's fallback
    assert gqa_two_object_preposition("A cup in front of a plate") == "front"
    assert gqa_two_object_preposition("A lamp on a desk") == "top"
    items = _built(WhatsUpGqaTwo, tmp_path, n_items=4).items()
    assert [item.meta["preposition"] for item in items] == ["left", "right", "front", "behind"]


# ---------------------------------------------------------------- per-item rule


def test_gold_must_strictly_beat_every_option_and_ties_are_counted(tmp_path):
    benchmark = _built(WhatsUpA, tmp_path, n_items=4)
    item = benchmark.items()[1]
    right = benchmark.outcome(item, np.array([[0.6, 0.5, 0.1, 0.59]]))
    assert right["correct"] is True and right["tie"] is False
    assert right["object_pair"] == ["mug", "plate"] and right["preposition"] == "under"
    tie = benchmark.outcome(item, np.array([[0.6, 0.1, 0.6, 0.2]]))
    assert tie["correct"] is False and tie["tie"] is True  # np.argmax would have called this right
    beaten = benchmark.outcome(item, np.array([[0.5, 0.1, 0.2, 0.7]]))
    assert beaten["correct"] is False and beaten["tie"] is False
    spatial = _built(WhatsUpCocoOne, tmp_path / "coco", n_items=2)
    assert spatial.outcome(spatial.items()[0], np.array([[0.3, 0.3]]))["correct"] is False
    assert spatial.outcome(spatial.items()[0], np.array([[0.31, 0.3]]))["correct"] is True
    assert json.loads(json.dumps(right)) == right


# ---------------------------------------------------------------- aggregates by hand


def _controlled(pair: str, prep: str, correct: bool, tie: bool = False) -> dict:
    return {"object_pair": pair.split("/"), "preposition": prep, "correct": correct, "tie": tie}


def test_pair_and_set_accuracy_by_hand_with_an_incomplete_and_a_duplicated_set():
    outcomes = [
        *[_controlled("mug/plate", p, True) for p in ("on", "under", "left_of", "right_of")],  # all right
        _controlled("cap/chair", "on", True), _controlled("cap/chair", "under", True),
        _controlled("cap/chair", "left_of", True), _controlled("cap/chair", "right_of", False, tie=True),
        _controlled("book/table", "on", True), _controlled("book/table", "under", True),  # no left / right
    ]
    result = WhatsUpA.aggregate(outcomes)
    assert result["accuracy"] == pytest.approx(100 * 9 / 10) and result["ties"] == 1 and result["n"] == 10
    # pair hits: mug/plate 2 of 2, cap/chair on-under only, book/table on-under only -> 4 of 6
    assert result["pair_accuracy"] == pytest.approx(100 * 4 / 6)
    assert result["set_accuracy"] == pytest.approx(100 / 3)
    assert result["object_pairs"] == 3 and result["irregular_sets"] == 1
    assert result["prep/on"] == 100.0 and result["prep/right_of"] == 50.0 and result["prep/left_of"] == 100.0
    # a preposition seen twice is right only if both items are
    duplicated = outcomes[:4] + [_controlled("mug/plate", "on", False)]
    again = WhatsUpA.aggregate(duplicated)
    assert again["set_accuracy"] == 0.0 and again["pair_accuracy"] == 50.0 and again["irregular_sets"] == 1


def test_pair_and_set_accuracy_equal_the_reference_formula_on_complete_sets():
    rng = np.random.default_rng(3)
    pairs = [f"obj{k}/thing{k}" for k in range(7)]
    outcomes = [_controlled(pair, p, bool(rng.random() < 0.6)) for pair in pairs
                for p in ("left_of", "right_of", "in-front_of", "behind")]
    result = WhatsUpB.aggregate(outcomes)
    # the reference: pair_correct * 100 / (N / 2) and set_correct * 100 / (N / 4)
    by_pair = {pair: {o["preposition"]: o["correct"] for o in outcomes if "/".join(o["object_pair"]) == pair}
               for pair in pairs}
    pair_correct = sum((d["left_of"] and d["right_of"]) + (d["in-front_of"] and d["behind"]) for d in by_pair.values())
    set_correct = sum(all(d.values()) for d in by_pair.values())
    assert result["pair_accuracy"] == pytest.approx(pair_correct * 100 / (len(outcomes) / 2))
    assert result["set_accuracy"] == pytest.approx(set_correct * 100 / (len(outcomes) / 4))
    assert result["irregular_sets"] == 0
    # subset A pairs on with under, so B's prepositions would all count as missing there
    assert WhatsUpA.aggregate(outcomes)["set_accuracy"] == 0.0


def test_spatial_aggregate_is_micro_with_per_preposition_accuracy():
    outcomes = [{"preposition": "left", "correct": True, "tie": False},
                {"preposition": "left", "correct": False, "tie": True},
                {"preposition": "right", "correct": True, "tie": False}]
    result = WhatsUpGqaOne.aggregate(outcomes)
    assert result["accuracy"] == pytest.approx(200 / 3) and result["ties"] == 1
    assert result["prep/left"] == 50.0 and result["prep/right"] == 100.0


# ---------------------------------------------------------------- end to end


def _gold_table(benchmark) -> dict:
    return {(item.images[0].path, text): rank for item in benchmark.items() for rank, text in enumerate(item.texts)}


def test_end_to_end_controlled_a_with_a_known_answer(tmp_path):
    """The scorer ranks gold first except on "under" items, where gold ties the best distractor."""
    benchmark = _built(WhatsUpA, tmp_path, n_items=20)
    rank = _gold_table(benchmark)
    under = {item.images[0].path for item in benchmark.items() if item.meta["preposition"] == "under"}

    def similarity(ref, text):
        if ref.path in under:
            return 1.0 if rank[ref.path, text] <= 1 else 0.0  # gold ties the first distractor
        return 1.0 if rank[ref.path, text] == 0 else 0.0

    result = WhatsUpA.aggregate(benchmark.outcomes(FunctionScorer(similarity)))
    assert result["accuracy"] == 75.0 and result["ties"] == 5 and result["prep/under"] == 0.0
    assert result["prep/on"] == 100.0
    assert result["pair_accuracy"] == 50.0  # 5 object pairs: left/right right, on/under wrong
    assert result["set_accuracy"] == 0.0


def test_end_to_end_coco_two_with_a_known_answer(tmp_path):
    """Two items share each image; the scorer prefers the wrong caption for "above" items only."""
    benchmark = _built(WhatsUpCocoTwo, tmp_path, n_items=20)
    rank = _gold_table(benchmark)
    above = {text for item in benchmark.items() if item.meta["preposition"] == "above" for text in item.texts}

    def similarity(ref, text):
        gold = rank[ref.path, text] == 0
        return float(not gold) if text in above else float(gold)

    result = WhatsUpCocoTwo.aggregate(benchmark.outcomes(FunctionScorer(similarity)))
    assert result["accuracy"] == 75.0 and result["prep/above"] == 0.0 and result["prep/below"] == 100.0
    assert result["ties"] == 0


# ---------------------------------------------------------------- Table 1: macro averages over sets

HAND_MADE_SETS = {
    "whatsup_a": {"accuracy": 25.0, "pair_accuracy": 50.0, "set_accuracy": 0.0, "ties": 3.0},
    "whatsup_b": {"accuracy": 40.0, "pair_accuracy": 10.0, "set_accuracy": 20.0, "ties": 0.0},
    "whatsup_coco_one": {"accuracy": 60.0}, "whatsup_coco_two": {"accuracy": 45.0},
    "whatsup_gqa_one": {"accuracy": 50.0}, "whatsup_gqa_two": {"accuracy": 47.0}}


def test_table_1_macro_averages_from_hand_made_set_aggregates():
    combined = combined_aggregates(HAND_MADE_SETS)
    # the What'sUp means, and the suites whose What'sUp part is the six-set mean (NaN: their other parts are absent)
    assert list(combined) == ["whatsup_ab", "whatsup_coco_spatial", "whatsup_gqa_spatial", "whatsup_six_sets",
                              "vl_compo_comp_avg", "fsc_clip_comp"]
    assert np.isnan(combined["vl_compo_comp_avg"]["mean"]) and combined["vl_compo_comp_avg"]["parts_scored"] == 1
    assert combined["whatsup_ab"] == {
        "accuracy": 32.5, "pair_accuracy": 30.0, "set_accuracy": 10.0,
        "whatsup_a/accuracy": 25.0, "whatsup_b/accuracy": 40.0, "whatsup_a/pair_accuracy": 50.0,
        "whatsup_b/pair_accuracy": 10.0, "whatsup_a/set_accuracy": 0.0, "whatsup_b/set_accuracy": 20.0}
    assert combined["whatsup_coco_spatial"]["accuracy"] == 52.5
    assert combined["whatsup_gqa_spatial"]["accuracy"] == 48.5
    assert combined["whatsup_six_sets"]["accuracy"] == 44.5  # (25 + 40 + 60 + 45 + 50 + 47) / 6
    # unweighted by set size: a 412-item and a 2,247-item set count the same (a micro mean would not)
    assert combined_aggregates(dict(HAND_MADE_SETS, whatsup_gqa_two={"accuracy": 41.0}))["whatsup_six_sets"] == {
        "accuracy": 43.5, **{f"{name}/accuracy": values["accuracy"] for name, values in
                             dict(HAND_MADE_SETS, whatsup_gqa_two={"accuracy": 41.0}).items()}}


def test_a_combined_aggregate_needs_every_part_and_every_key():
    only_a_b_and_coco_one = {k: v for k, v in HAND_MADE_SETS.items() if k in ("whatsup_a", "whatsup_b",
                                                                          "whatsup_coco_one")}
    assert list(combined_aggregates(only_a_b_and_coco_one)) == ["whatsup_ab"]
    undefined = dict(HAND_MADE_SETS, whatsup_coco_two={"accuracy": None})  # how aggregates.json stores NaN
    assert np.isnan(combined_aggregates(undefined)["whatsup_coco_spatial"]["accuracy"])
    without_pairs = dict(HAND_MADE_SETS, whatsup_b={"accuracy": 40.0})
    with pytest.raises(ValueError, match="'whatsup_ab': whatsup_b reports no 'pair_accuracy'"):
        combined_aggregates(without_pairs)


def test_table_1_averages_through_the_cli_results_files_and_reaggregate(tmp_path, capsys):
    options = []
    for name, write in WRITERS.items():
        options += [f"options.{name}.images={write(tmp_path / 'bench' / name, n_items=8, seed=3)['images']}"]
    out = tmp_path / "eval"
    evaluate.main(["--model", "ViT-Tiny-16-64", "--benchmarks", ",".join(WRITERS), "--data-root",
                   str(tmp_path / "bench"), "--out", str(out), "--num-workers", "0", "--no-progress", *options])
    document = json.loads((out / "aggregates.json").read_text())
    sets = {name: entry["aggregates"] for name, entry in document["benchmarks"].items()}
    ab = document["combined"]["whatsup_ab"]
    assert ab["parts"] == ["whatsup_a", "whatsup_b"]
    for key in ("accuracy", "pair_accuracy", "set_accuracy"):
        assert ab["aggregates"][key] == pytest.approx((sets["whatsup_a"][key] + sets["whatsup_b"][key]) / 2)
    gqa = document["combined"]["whatsup_gqa_spatial"]["aggregates"]["accuracy"]
    assert gqa == pytest.approx((sets["whatsup_gqa_one"]["accuracy"] + sets["whatsup_gqa_two"]["accuracy"]) / 2)
    markdown = (out / "results.md").read_text()
    assert "| whatsup_ab = mean(whatsup_a, whatsup_b) | 16 | accuracy " in markdown
    assert "## whatsup_six_sets" in markdown
    with open(out / "results.csv", newline="") as handle:
        rows = {(row["benchmark"], row["metric"]): row["value"] for row in csv.DictReader(handle)}
    assert float(rows["whatsup_coco_spatial", "accuracy"]) == pytest.approx(
        document["combined"]["whatsup_coco_spatial"]["aggregates"]["accuracy"])
    capsys.readouterr()
    evaluate.main(["--reaggregate", str(out)])
    printed = capsys.readouterr().out
    assert "whatsup_ab {'accuracy': " in printed and "whatsup_six_sets {'accuracy': " in printed


# ---------------------------------------------------------------- missing and malformed files


@pytest.mark.parametrize("cls", WHATSUP_BENCHMARKS)
def test_missing_annotation_file_is_named(tmp_path, cls):
    with pytest.raises(MissingBenchmarkData, match=cls.annotation_file):
        cls(tmp_path)


def _write(root: Path, name: str, payload) -> Path:
    (root / name).write_text(json.dumps(payload))
    return root


def test_malformed_controlled_records_name_the_file_and_record(tmp_path):
    good = {"image_path": "data/controlled_images/mug_on_plate.jpeg", "caption_options": ["a", "b", "c", "d"]}
    three = {**good, "caption_options": ["a", "b", "c"]}
    _write(tmp_path, "controlled_images_dataset.json", [good, three])
    with pytest.raises(ValueError, match=r"controlled_images_dataset.json: record 1 'caption_options'"):
        WhatsUpA(tmp_path).items()
    odd = {**good, "image_path": "data/controlled_images/mug_on-top-of_plate.jpeg"}
    _write(tmp_path, "controlled_images_dataset.json", [odd])
    with pytest.raises(ValueError, match="record 0 'image_path'.*on-top-of"):
        WhatsUpA(tmp_path).items()
    _write(tmp_path, "controlled_clevr_dataset.json", [good])
    with pytest.raises(ValueError, match="controlled_clevr_dataset.json: record 0 'image_path'"):
        WhatsUpB(tmp_path).items()  # "on" is a subset A preposition
    _write(tmp_path, "controlled_images_dataset.json", {"0": good})
    with pytest.raises(ValueError, match="expected a JSON list"):
        WhatsUpA(tmp_path).items()


def test_malformed_spatial_records_name_the_file_and_record(tmp_path):
    _write(tmp_path, "coco_qa_one_obj.json", [[139, "A dog on the left", "A dog on the right"], [139, "only gold"]])
    with pytest.raises(ValueError, match=r"coco_qa_one_obj.json: record 1 must be \[image_id"):
        WhatsUpCocoOne(tmp_path).items()
    _write(tmp_path, "coco_qa_two_obj.json", [["n123", "A dog left of a cat", "A dog right of a cat"]])
    with pytest.raises(ValueError, match="record 0"):  # COCO ids are numbers
        WhatsUpCocoTwo(tmp_path).items()
    _write(tmp_path, "vg_qa_two_obj.json", [["2345", "A cup behind a plate", "A cup in front of a plate"]])
    assert WhatsUpGqaTwo(tmp_path).items()[0].images[0].path.endswith("vg_images/2345.jpg")

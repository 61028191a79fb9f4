"""VALSE: the official piece files, the mturk validity filter, strict scoring and the three averages."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from evaluation.benchmarks.base import ImageRef, MissingBenchmarkData
from testkit.standin.valse import write_valse
from evaluation.benchmarks.valse import PIECES, Valse
from evaluation.scorers import FunctionScorer

N_ITEMS = 20
VALID_INDICES = [i for i in range(N_ITEMS) if i % 5 != 4]  # the stand-in makes every fifth record invalid


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    root = tmp_path_factory.mktemp("valse") / "valse"
    options = write_valse(root, n_items=N_ITEMS)
    return root, options


def write_piece(root: Path, piece: str, records: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{piece}.json").write_text(json.dumps(records))


def record(caption_votes: int = 3, dataset: str = "visual7w", **fields) -> dict:
    base = {"dataset": dataset, "image_file": "v7w_1.jpg", "caption": "There are no people.",
            "foil": "There are people.", "mturk": {"foil": 3 - caption_votes, "caption": caption_votes, "other": 0}}
    return {**base, **fields}


def test_standin_loads_valid_items_with_caption_first_and_mapped_images(standin):
    root, options = standin
    items = Valse(root, **options).items()
    assert len(items) == len(PIECES) * len(VALID_INDICES) == 176
    by_id = {item.id: item for item in items}
    assert "existence/existence_visual7w_0" in by_id and "existence/existence_visual7w_4" not in by_id
    assert {item.meta["piece"] for item in items} == set(PIECES)
    first = by_id["counting-hard/counting_visual7w_3"]
    assert first.texts == ["counting-hard caption 3", "counting-hard foil 3"]  # gold (caption) first
    images = root.parent / "valse_images"
    assert first.images == [ImageRef(str(images / "visual7w" / "v7w_3.jpg"))]
    # coco2017 (plurals) and coco_2017 (relations) are both COCO val2017 file names
    assert by_id["plurals/plurals:coco2017:2"].images[0].path == str(images / "val2017" / "000000000002.jpg")
    assert by_id["relations/relations:coco_2017:2"].images[0].path == str(images / "val2017" / "000000000002.jpg")
    # one dataset value (VisDial_v1.0), two folders: each image is taken from the folder that holds it
    assert by_id["coreference-standard/coref_train_1"].images[0].path == \
        str(images / "coco2014" / "COCO_train2014_000000000001.jpg")
    assert by_id["coreference-hard/coref_test_1"].images[0].path == \
        str(images / "visdial_val2018" / "VisualDialog_val2018_000000000001.jpg")
    assert by_id["foil-it/1"].images[0].path == str(images / "coco2014" / "COCO_val2014_000000000001.jpg")
    assert all(Path(ref.path).is_file() for item in items for ref in item.images)


def test_mturk_filter_drops_and_counts_records_with_fewer_than_two_caption_votes(tmp_path):
    write_piece(tmp_path, "existence", {"a": record(3), "b": record(1), "c": record(2), "d": record(0)})
    benchmark = Valse(tmp_path, pieces=["existence"], images={"visual7w": tmp_path})
    items = benchmark.items()
    assert [item.id for item in items] == ["existence/a", "existence/c"]
    outcomes = [benchmark.outcome(item, np.array([[0.3, 0.1]])) for item in items]
    result = Valse.aggregate(outcomes)
    assert result["invalid_items"] == 2 and result["invalid_items/existence"] == 2 and result["valid_items"] == 2


def test_strict_comparison_makes_ties_wrong(tmp_path):
    write_piece(tmp_path, "existence", {"a": record()})
    benchmark = Valse(tmp_path, pieces=["existence"])
    item = benchmark.items()[0]
    assert benchmark.outcome(item, np.array([[0.3, 0.2]]))["correct"] is True
    tie = benchmark.outcome(item, np.array([[0.3, 0.3]]))
    assert tie["correct"] is False and tie["tie"] is True
    assert benchmark.outcome(item, np.array([[0.2, 0.3]]))["correct"] is False


def test_default_image_folder_is_root_images_dataset_value(tmp_path):
    write_piece(tmp_path, "foil-it", {"1": record(dataset="FOIL dataset", image_file="COCO_val2014_000000000001.jpg")})
    item = Valse(tmp_path, pieces=["foil-it"]).items()[0]
    assert item.images[0].path == str(tmp_path / "images" / "FOIL dataset" / "COCO_val2014_000000000001.jpg")


def outcome(piece: str, correct: bool, invalid: int = 0, tie: bool = False) -> dict:
    return {"id": piece, "piece": piece, "correct": correct, "tie": tie, "invalid_in_piece": invalid}


def test_hand_made_outcomes_give_macro_pieces_macro_phenomena_and_micro():
    outcomes = [outcome("counting-hard", True, 3), outcome("counting-hard", False, 3, tie=True),
                outcome("counting-small-quant", True), outcome("counting-adversarial", False, 1)]
    outcomes += [outcome(piece, True) for piece in PIECES if not piece.startswith("counting")]
    result = Valse.aggregate(outcomes)
    assert result["counting-hard"] == 50.0 and result["counting-adversarial"] == 0.0
    assert result["phenomenon/counting"] == pytest.approx(50.0)  # (50 + 100 + 0) / 3
    assert result["phenomenon/actions"] == 100.0
    assert result["macro_pieces"] == pytest.approx((50 + 100 + 0 + 8 * 100) / 11)
    assert result["macro_phenomena"] == pytest.approx((6 * 100 + 50) / 7)
    assert result["micro"] == pytest.approx(100 * 10 / 12)
    assert result["ties"] == 1 and result["valid_items"] == 12
    assert result["invalid_items"] == 4 and result["invalid_items/counting-hard"] == 3


def test_aggregate_over_a_subset_of_pieces_averages_only_those():
    result = Valse.aggregate([outcome("plurals", True), outcome("counting-hard", False)])
    assert result["macro_pieces"] == 50.0 and result["macro_phenomena"] == 50.0
    assert "existence" not in result and "phenomenon/existence" not in result


def test_end_to_end_with_a_function_scorer_on_standin_data(standin):
    """Counting captions always win; elsewhere the caption wins on even indices and ties on odd ones."""
    root, options = standin

    def similarity(image: ImageRef, text: str) -> float:
        piece, kind, index = re.fullmatch(r"(\S+) (caption|foil) (\d+)", text).groups()
        wins = piece.startswith("counting") or int(index) % 2 == 0
        return 1.0 if kind == "caption" and wins else 0.0

    result = Valse.aggregate(Valse(root, **options).outcomes(FunctionScorer(similarity)))
    even_share = 100 * sum(i % 2 == 0 for i in VALID_INDICES) / len(VALID_INDICES)  # 8 of 16
    assert result["counting-hard"] == 100.0 and result["existence"] == even_share == 50.0
    assert result["macro_pieces"] == pytest.approx((3 * 100 + 8 * 50) / 11)
    assert result["macro_phenomena"] == pytest.approx((100 + 6 * 50) / 7)
    assert result["micro"] == pytest.approx(100 * (3 * 16 + 8 * 8) / 176)
    assert result["ties"] == 8 * 8 and result["invalid_items"] == 11 * 4


def test_missing_files_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match="existence.json.*foil-it.json"):
        Valse(tmp_path)
    write_piece(tmp_path, "plurals", {"a": record(dataset="coco2017")})
    assert len(Valse(tmp_path, pieces=["plurals"]).items()) == 1  # a subset needs only its files
    with pytest.raises(ValueError, match="unknown pieces.*plural"):
        Valse(tmp_path, pieces=["plural"])


def test_malformed_records_and_unmapped_datasets_are_clear_errors(tmp_path):
    write_piece(tmp_path, "existence", {"ok": record(), "bad": {"dataset": "visual7w", "caption": "x", "foil": "y"}})
    with pytest.raises(ValueError, match=r"existence.json: record 'bad' lacks an integer mturk.caption"):
        Valse(tmp_path, pieces=["existence"]).items()
    write_piece(tmp_path, "existence", {"k": record(foil="")})
    with pytest.raises(ValueError, match=r"record 'k': the foil is empty"):
        Valse(tmp_path, pieces=["existence"]).items()
    write_piece(tmp_path, "existence", {"k": record(dataset="Visual Genome")})
    with pytest.raises(ValueError, match=r"dataset 'Visual Genome'.*`images` option"):
        Valse(tmp_path, pieces=["existence"]).items()

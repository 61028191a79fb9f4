"""CREPE productivity: the official CSV layout, the crop, the argsort rank (ties right), vl_compo's pooling."""
from __future__ import annotations

import ast
import csv
import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image

from evaluation.benchmarks.base import ImageRef, MissingBenchmarkData
from evaluation.benchmarks.crepe import COMPLEXITIES, TYPES, CrepeProductivity, csv_name, rank_outcome
from evaluation.benchmarks.images import load_image
from evaluation.scorers import ClipScorer, FunctionScorer
from testkit.standin.crepe import FIRST_VG_ID, write_crepe

# ytaek-oh/vl_compo individual_results.csv, ViT-B-32 / openai, and results.csv's `crepe` for the same row.
VL_COMPO = {"atom": 18.962594643462538, "swap": 17.25860904794058, "negate": 34.90146217418945}
VL_COMPO_CREPE = 23.70755529


def tied_similarity(ref: ImageRef, text: str) -> float:
    """A deterministic score in {0.0, 0.1, ..., 1.0}: many exact ties among an item's candidates."""
    digest = hashlib.md5(f"{ref.path}|{ref.box}|{text}".encode()).hexdigest()
    return round((int(digest, 16) % 11) / 10, 1)


@pytest.fixture
def standin(tmp_path) -> CrepeProductivity:
    return CrepeProductivity(tmp_path, **write_crepe(tmp_path, n_items=120, seed=0))


def _csv(root: Path, negative_type: str, complexity: int) -> Path:
    return root / "prod_hard_negatives" / csv_name(negative_type, complexity)


# ---------------------------------------------------------------- loading


def test_standin_reads_back_rows_candidates_regions_and_images(standin, tmp_path):
    items = standin.items()
    assert len(items) == 120 and len({item.id for item in items}) == 120
    assert [item.id for item in items[:3]] == ["atom/4/0", "atom/4/1", "atom/4/2"]  # file order, then row order
    with open(_csv(tmp_path, "swap", 5), newline="") as handle:
        rows = list(csv.DictReader(handle))
    swap_5 = [item for item in items if item.meta == {"type": "swap", "complexity": 5}]
    assert len(swap_5) == len(rows) > 0
    for item, row in zip(swap_5, rows):
        assert item.texts == [row["caption"], *ast.literal_eval(row["hard_negs"])]  # the caption is text 0
        assert item.images[0].box == tuple(int(row[k]) for k in ("x", "y", "width", "height"))
        folder = "VG_100K" if int(row["image_id"]) % 2 == 0 else "VG_100K_2"  # VG_100K_2 when VG_100K lacks it
        assert item.images[0].path == str(tmp_path / folder / f"{row['image_id']}.jpg")
    assert all(Path(item.images[0].path).is_file() for item in items)
    assert {item.meta["complexity"] for item in items} == set(COMPLEXITIES)


def test_flat_input_dir_uncropped_images_and_a_chosen_type(tmp_path):
    write_crepe(tmp_path / "zip", n_items=30)
    shutil.copytree(tmp_path / "zip" / "prod_hard_negatives", tmp_path / "flat")  # root = the --input-dir itself
    nested = CrepeProductivity(tmp_path / "zip")
    flat = CrepeProductivity(tmp_path / "flat", images=tmp_path / "zip", crop=False, types=["negate"])
    assert [item.id for item in flat.items()] == [item.id for item in nested.items() if item.id.startswith("negate")]
    assert all(item.images[0].box is None for item in flat.items())
    with pytest.raises(ValueError, match="types must be among atom, swap, negate"):
        CrepeProductivity(tmp_path / "zip", types=["comp"])


def test_missing_files_and_images_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match="prod_hard_negatives/atom/prod_vg_hard_negs_atom_complexity_4.csv "
                                                   r"\| atom/prod_vg_hard_negs_atom_complexity_4.csv"):
        CrepeProductivity(tmp_path)
    write_crepe(tmp_path, n_items=12)
    _csv(tmp_path, "negate", 12).unlink()
    with pytest.raises(MissingBenchmarkData, match="negate_complexity_12.csv"):
        CrepeProductivity(tmp_path)
    assert len(CrepeProductivity(tmp_path, types=["atom", "swap"]).items()) == 8
    shutil.rmtree(tmp_path / "VG_100K_2")
    item = CrepeProductivity(tmp_path, types=["atom"]).items()[1]  # item 3, whose image was in VG_100K_2
    assert item.images[0].path == str(tmp_path / "VG_100K" / f"{FIRST_VG_ID + 3}.jpg")  # named, not found


@pytest.mark.parametrize("edit, message", [
    (lambda text: text.replace("hard_negs", "negatives"), "missing column.*hard_negs"),
    (lambda text: text.replace("['", "[", 1), r"row 0: hard_negs is not a Python list literal"),
    (lambda text: text.replace(",\"['", ",\"[1, '", 1), "row 0: hard_negs is not a list of strings"),
    (lambda text: text.replace(f"\n{FIRST_VG_ID},", "\nVG1,", 1), "row 0: image_id is not a Visual Genome id"),
    (lambda text: text.rstrip("\n").rsplit(",", 1)[0] + ",0\n", r"row \d+: empty region"),
    (lambda text: text.rstrip("\n").rsplit(",", 1)[0] + "\n", r"line \d+ has the wrong number of cells"),
    (lambda text: text[:-40] + '"unterminated\n', "wrong number of cells|not a valid CSV"),
])
def test_malformed_rows_name_the_file_and_row(tmp_path, edit, message):
    write_crepe(tmp_path, n_items=12)
    path = _csv(tmp_path, "atom", 4)
    path.write_text(edit(path.read_text()))
    with pytest.raises(ValueError, match=message) as raised:
        CrepeProductivity(tmp_path).items()
    assert str(path) in str(raised.value)


def test_a_file_that_is_not_utf8_names_itself(tmp_path):
    write_crepe(tmp_path, n_items=12)
    path = _csv(tmp_path, "swap", 4)
    path.write_bytes(path.read_bytes().replace(b" a ", " \u00e0 ".encode("latin-1"), 1))
    with pytest.raises(ValueError, match=f"{path}: not a UTF-8 text file"):
        CrepeProductivity(tmp_path).items()


def test_the_crop_is_torchvisions_crop_of_the_official_script(standin):
    """`TF.crop(image, y, x, height, width)` as `CsvDataset.__getitem__`, a region past the border included."""
    for item in standin.items()[:8]:
        ref = item.images[0]
        x, y, width, height = ref.box
        official = TF.crop(Image.open(ref.path).convert("RGB"), y, x, height, width)
        assert np.array_equal(np.asarray(load_image(ref)), np.asarray(official)), item.id
    assert standin.items()[0].images[0].box[2] > 48  # item 0's region reaches past the 48-pixel-wide image


# ---------------------------------------------------------------- the rule


def test_rank_on_hand_made_rows_ties_count_for_the_caption():
    assert rank_outcome(np.array([0.9, 0.1, 0.2])) == {"rank": 0, "candidates": 3, "correct": True,
                                                        "correct_strict": True, "tie": False}
    assert rank_outcome(np.array([0.5, 0.6, 0.1, 0.7]))["rank"] == 2
    tie = rank_outcome(np.array([0.5, 0.5, 0.1]))
    assert (tie["rank"], tie["correct"], tie["correct_strict"], tie["tie"]) == (0, True, False, True)
    assert rank_outcome(np.array([0.5, 0.5, 0.6]))["rank"] == 1  # a tie below a better negative: rank 1


def official_rank(logits: torch.Tensor) -> int:
    """`get_one2many_rank`: the position of the ground truth (index 0) in the descending argsort."""
    ranking = torch.argsort(logits[None, :], descending=True)
    return int(torch.where(ranking == 0)[1].numpy()[0])


def test_torch_argsort_puts_the_caption_first_among_equals_up_to_16_candidates():
    """The claim behind the rule: on the CPU, `torch.argsort` keeps equal values in index order for <= 16 values."""
    rng = np.random.default_rng(0)
    for size in range(2, 17):
        for _ in range(200):
            row = rng.integers(0, 3, size=size).astype(np.float32)
            assert official_rank(torch.from_numpy(row)) == rank_outcome(row)["rank"], row


# ---------------------------------------------------------------- the official rule, item by item


def official_crepe(root: Path, images: Path, similarity) -> dict:
    """`crepe_prod_eval_clip.py` step by step, for every type and complexity: read the CSV (`BaseCsvDataset`, here
    without pandas), find the image (`get_image_by_id`), crop it (`TF.crop`), score `[caption] + hard_negs`, rank
    (`get_one2many_rank`) and take R@1 (`get_one2many_metrics`); then vl_compo's pooling per type."""
    ranks, per_file, pooled = {}, {}, {}
    for negative_type in TYPES:
        type_ranks = []
        for complexity in COMPLEXITIES:
            with open(root / "prod_hard_negatives" / csv_name(negative_type, complexity), newline="") as handle:
                rows = list(csv.DictReader(handle))
            preds = []
            for number, row in enumerate(rows):
                path = next(p for p in (images / "VG_100K" / f"{row['image_id']}.jpg",
                                        images / "VG_100K_2" / f"{row['image_id']}.jpg") if p.exists())
                region = ImageRef(str(path), box=(int(row["x"]), int(row["y"]), int(row["width"]), int(row["height"])))
                texts = [str(row["caption"])] + list(ast.literal_eval(row["hard_negs"]))
                logits = torch.tensor([similarity(region, text) for text in texts], dtype=torch.float64)
                preds.append(official_rank(logits))
                ranks[f"{negative_type}/{complexity}/{number}"] = preds[-1]
            per_file[f"{negative_type}/complexity_{complexity}"] = (100 * float(np.mean(np.array(preds) < 1))
                                                                    if preds else math.nan)
            type_ranks += preds
        pooled[negative_type] = 100 * float(np.mean(np.array(type_ranks) < 1))
    return {"ranks": ranks, "per_file": per_file, "pooled": pooled}


def test_official_rule_equals_ours_on_every_item(tmp_path):
    benchmark = CrepeProductivity(tmp_path, **write_crepe(tmp_path, n_items=400, seed=3))
    outcomes = benchmark.outcomes(FunctionScorer(tied_similarity))
    official = official_crepe(tmp_path, tmp_path, tied_similarity)
    assert {o["id"]: o["rank"] for o in outcomes} == official["ranks"]
    assert sum(o["tie"] for o in outcomes) > 50 and any(o["tie"] and o["correct"] for o in outcomes)
    assert max(o["candidates"] for o in outcomes) <= 16  # the range where torch's order of equals is checked
    result = CrepeProductivity.aggregate(outcomes)
    for key, value in official["per_file"].items():
        assert (math.isnan(value) and math.isnan(result[key])) or result[key] == pytest.approx(value), key
    for negative_type, value in official["pooled"].items():
        assert result[negative_type] == pytest.approx(value)
    assert result["mean"] == pytest.approx(np.mean(list(official["pooled"].values())))


# ---------------------------------------------------------------- aggregates


def _outcome(negative_type: str, complexity: int, row: list[float]) -> dict:
    return {"id": f"{negative_type}/{complexity}/{len(row)}", "type": negative_type, "complexity": complexity,
            **rank_outcome(np.array(row))}


def test_aggregate_by_hand_pooled_per_type_and_per_complexity():
    outcomes = [_outcome("atom", 4, [0.9, 0.1]), _outcome("atom", 4, [0.1, 0.9]), _outcome("atom", 5, [0.5, 0.5]),
                _outcome("swap", 4, [0.2, 0.3, 0.1]), _outcome("negate", 12, [0.7, 0.1])]
    result = CrepeProductivity.aggregate(outcomes)
    assert result["atom/complexity_4"] == 50.0 and result["atom/complexity_5"] == 100.0
    assert result["atom"] == pytest.approx(200 / 3)  # pooled over the type's items, not the mean of 50 and 100
    assert result["atom_strict"] == pytest.approx(100 / 3)  # the tie counted wrong
    assert (result["swap"], result["negate"]) == (0.0, 100.0)
    assert result["mean"] == pytest.approx((200 / 3 + 0 + 100) / 3)
    assert math.isnan(result["atom/complexity_6"]) and result["ties"] == 1 and result["n"] == 5
    assert math.isnan(CrepeProductivity.aggregate(outcomes[:3])["mean"])  # swap and negate absent: no mean


def test_vl_compo_crepe_is_the_mean_of_its_three_pooled_types():
    assert np.mean(list(VL_COMPO.values())) == pytest.approx(VL_COMPO_CREPE, abs=1e-8)
    published = {key: value.value for key, value in CrepeProductivity.published.items()}
    assert published == {**{k: round(v, 2) for k, v in VL_COMPO.items()}, "mean": round(VL_COMPO_CREPE, 2)}
    # pooled, not a mean over complexities: each is an integer count over the type's items
    for negative_type, items in (("atom", 17698), ("swap", 7405), ("negate", 17303)):
        assert VL_COMPO[negative_type] * items / 100 == pytest.approx(round(VL_COMPO[negative_type] * items / 100))


def test_aggregates_recompute_from_json_round_tripped_outcomes(standin):
    outcomes = standin.outcomes(FunctionScorer(tied_similarity))
    stored = [json.loads(json.dumps(outcome)) for outcome in outcomes]
    first, again = CrepeProductivity.aggregate(outcomes), CrepeProductivity.aggregate(stored)
    assert first.keys() == again.keys()
    assert all((math.isnan(first[k]) and math.isnan(again[k])) or first[k] == again[k] for k in first)


def test_end_to_end_with_a_tiny_clip_on_cropped_regions(tmp_path):
    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained("ViT-Tiny-16-64", None, batch_size=64)
    benchmark = CrepeProductivity(tmp_path, **write_crepe(tmp_path, n_items=27))
    outcomes = benchmark.outcomes(scorer)
    item = benchmark.items()[4]
    direct = scorer.score(item.images, item.texts)[0]
    assert outcomes[4]["rank"] == int(np.sum(direct[1:] > direct[0]))
    assert set(CrepeProductivity.headline) <= set(CrepeProductivity.aggregate(outcomes))

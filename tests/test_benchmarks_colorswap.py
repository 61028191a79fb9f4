"""ColorSwap: the hub's parquet and the authors' JSON layout, and Winoground's scores as vlm_eval.py counts them."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from evaluation.benchmarks.base import GENERATED, ImageRef, MissingBenchmarkData
from evaluation.benchmarks.colorswap import ColorSwap
from evaluation.benchmarks.images import load_image
from evaluation.scorers import ClipScorer, FunctionScorer
from testkit.standin.colorswap import write_colorswap

RIGHT = np.array([[0.9, 0.1], [0.2, 0.8]])  # s[image i, caption j]
TEXT_WRONG = np.array([[0.5, 0.6], [0.1, 0.9]])
IMAGE_TIE = np.array([[0.5, 0.1], [0.5, 0.9]])


def tied_similarity(ref: ImageRef, text: str) -> float:
    """Deterministic scores in {0.0, ..., 0.5}, keyed by the image's name: exact ties are common."""
    name = ref.member or Path(ref.path).name
    return int(hashlib.sha256(f"{name}|{text}".encode()).hexdigest()[:8], 16) % 6 / 10


def _pixels(ref: ImageRef) -> np.ndarray:
    return np.asarray(load_image(ref))


# ---------------------------------------------------------------- loading


def test_the_parquet_and_json_layouts_read_the_same_items(tmp_path):
    parquet = ColorSwap(tmp_path / "p", **write_colorswap(tmp_path / "p", n_items=9, seed=2))
    archive = ColorSwap(tmp_path / "j", **write_colorswap(tmp_path / "j", n_items=9, seed=2, layout="json"))
    assert (parquet.layout, archive.layout, ColorSwap(tmp_path / "p").layout) == ("parquet", "json", "parquet")
    records = json.loads((tmp_path / "j" / "data" / "test.json").read_text())
    shard = tmp_path / "p" / "data" / "test-00000-of-00001.parquet"
    for row, (cell, file, record) in enumerate(zip(parquet.items(), archive.items(), records)):
        assert (cell.id, cell.texts, cell.meta) == (file.id, file.texts, file.meta)
        assert cell.id == str(record["id"]) and cell.texts == [record["caption_1"], record["caption_2"]]
        assert cell.meta == {"image_source": record["image_source"], "caption_source": record["caption_source"]}
        assert cell.images == [ImageRef(str(shard), member=f"image_{k}:{row}") for k in (1, 2)]
        assert file.images == [ImageRef(str(tmp_path / "j" / "data" / record[f"image_{k}"])) for k in (1, 2)]
        for cell_ref, file_ref in zip(cell.images, file.images):
            assert np.array_equal(_pixels(cell_ref), _pixels(file_ref))
    assert file.images[0].path.endswith(f"data/images/img_{record['id']}_1.png")
    elsewhere = ColorSwap(tmp_path / "j", images=tmp_path / "pngs").items()[0].images[1].path
    assert elsewhere == str(tmp_path / "pngs" / "images" / f"img_{records[0]['id']}_2.png")


def test_layout_choice_and_missing_files_are_named(tmp_path):
    write_colorswap(tmp_path / "p", n_items=3)
    write_colorswap(tmp_path / "j", n_items=3, layout="json")
    with pytest.raises(MissingBenchmarkData, match=re.escape("layout='json' but") + ".*lacks data/test.json"):
        ColorSwap(tmp_path / "p", layout="json")
    with pytest.raises(MissingBenchmarkData, match=re.escape("lacks data/test-*.parquet | */test/*.parquet")):
        ColorSwap(tmp_path / "j", layout="parquet")
    with pytest.raises(MissingBenchmarkData, match=re.escape(
            "expected files: data/test-*.parquet | */test/*.parquet | data/test.json")):
        ColorSwap(tmp_path / "empty")
    with pytest.raises(ValueError, match="layout must be one of auto, json, parquet"):
        ColorSwap(tmp_path / "p", layout="zip")


def test_every_image_is_generated_for_the_leakage_guard(tmp_path):
    benchmark = ColorSwap(tmp_path, **write_colorswap(tmp_path, n_items=4))
    assert {benchmark.image_origin(ref).source for ref in benchmark.image_refs()} == {GENERATED}
    assert benchmark.coco_image_ids() == set()


# ---------------------------------------------------------------- the rule


def test_outcomes_on_hand_made_matrices(tmp_path):
    benchmark = ColorSwap(tmp_path, **write_colorswap(tmp_path, n_items=1))
    [item] = benchmark.items()
    right, text_wrong, tie = (benchmark.outcome(item, m) for m in (RIGHT, TEXT_WRONG, IMAGE_TIE))
    assert (right["text"], right["image"], right["group"], right["tie"]) == (True, True, True, False)
    assert (text_wrong["text"], text_wrong["image"], text_wrong["group"]) == (False, True, False)
    assert (tie["text"], tie["image"], tie["tie"]) == (True, False, True)
    assert right["id"] == item.id and right["image_source"] == item.meta["image_source"]


def vlm_eval_counts(items, similarity) -> tuple[list[tuple], dict]:
    """Top34051/colorswap 4f2c9e4 `vlm_eval.py`'s per-sample scores and printed percentages, with the model's
    answers replaced by a similarity model's choices: the option scoring strictly higher, None on a tie (an
    answer that names neither, which vlm_eval.py counts wrong)."""
    def choose(options, first, second):
        return options[0] if first > second else options[1] if second > first else None
    text_scores, image_scores = [], []
    for item in items:
        s = [[similarity(image, caption) for caption in item.texts] for image in item.images]
        chosen_image_1 = choose("AB", s[0][0], s[0][1])  # image 1 between caption (A) 1 and (B) 2
        chosen_image_2 = choose("AB", s[1][0], s[1][1])
        text_scores.append("A" == chosen_image_1 and "B" == chosen_image_2)
        chosen_caption_1 = choose(("first", "second"), s[0][0], s[1][0])  # caption 1 between the two images
        chosen_caption_2 = choose(("first", "second"), s[0][1], s[1][1])
        image_scores.append(chosen_caption_1 == "first" and chosen_caption_2 == "second")
    group_scores = [text and image for text, image in zip(text_scores, image_scores)]
    printed = {name: sum(scores) / len(scores) * 100
               for name, scores in (("text", text_scores), ("image", image_scores), ("group", group_scores))}
    return list(zip(text_scores, image_scores, group_scores)), printed


@pytest.mark.parametrize("layout", ["parquet", "json"])
def test_the_authors_counting_and_ours_agree_on_every_item(tmp_path, layout):
    benchmark = ColorSwap(tmp_path, **write_colorswap(tmp_path, n_items=300, seed=6, layout=layout))
    outcomes = benchmark.outcomes(FunctionScorer(tied_similarity))
    per_item, printed = vlm_eval_counts(benchmark.items(), tied_similarity)
    assert [(o["text"], o["image"], o["group"]) for o in outcomes] == per_item
    result = ColorSwap.aggregate(outcomes)
    assert {score: result[score] for score in ("text", "image", "group")} == pytest.approx(printed)
    assert 30 < result["ties"] < 300 and result["n"] == 300


def test_aggregates_by_source_and_from_json_round_tripped_outcomes(tmp_path):
    benchmark = ColorSwap(tmp_path, **write_colorswap(tmp_path, n_items=30, seed=1))
    outcomes = benchmark.outcomes(FunctionScorer(tied_similarity))
    result = ColorSwap.aggregate(outcomes)
    assert ColorSwap.aggregate(json.loads(json.dumps(outcomes))) == result
    midjourney = [o for o in outcomes if o["image_source"] == "midjourney"]
    assert result["group/image_source/midjourney"] == pytest.approx(100 * np.mean([o["group"] for o in midjourney]))
    assert result["text/caption_source/human"] == pytest.approx(
        100 * np.mean([o["text"] for o in outcomes if o["caption_source"] == "human"]))
    assert set(ColorSwap.published) == set(ColorSwap.headline) == {"text", "image", "group"}


def test_both_layouts_score_alike_with_a_tiny_clip(tmp_path):
    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained("ViT-Tiny-16-64", None, batch_size=64)
    outcomes = [ColorSwap(tmp_path / layout, **write_colorswap(tmp_path / layout, n_items=6, layout=layout))
                .outcomes(scorer) for layout in ("parquet", "json")]
    assert outcomes[0] == outcomes[1] and len(outcomes[0]) == 6


# ---------------------------------------------------------------- malformed files


def test_malformed_json_names_the_file_and_record(tmp_path):
    write_colorswap(tmp_path, n_items=3, layout="json")
    path = tmp_path / "data" / "test.json"
    records = json.loads(path.read_text())
    del records[1]["caption_source"]
    path.write_text(json.dumps(records))
    with pytest.raises(ValueError, match=r"test.json: record 1 lacks field 'caption_source'"):
        ColorSwap(tmp_path).items()
    text = path.read_text()
    path.write_text(text[:len(text) // 2])
    with pytest.raises(ValueError, match=r"test.json: not a (UTF-8 text|whole JSON) file"):
        ColorSwap(tmp_path).items()
    path.write_bytes(b'[{"id": 1, "caption_1": "a r\xe9d cup"}]')
    with pytest.raises(ValueError, match=r"test.json: not a (UTF-8 text|whole JSON) file"):
        ColorSwap(tmp_path).items()
    path.write_text('{"id": 1}')
    with pytest.raises(ValueError, match=r"test.json: expected a JSON list of records, found dict"):
        ColorSwap(tmp_path).items()


def test_malformed_shards_name_the_file_and_repeated_ids_are_refused(tmp_path):
    write_colorswap(tmp_path, n_items=4)
    shard = tmp_path / "data" / "test-00000-of-00001.parquet"
    original = shard.read_bytes()
    pq.write_table(pq.read_table(shard).drop_columns(["image_source"]), shard)
    with pytest.raises(ValueError, match=r"test-00000-of-00001.parquet: missing column\(s\) image_source"):
        ColorSwap(tmp_path).items()
    shard.write_bytes(original[:len(original) // 2])
    with pytest.raises(ValueError, match=r"test-00000-of-00001.parquet: cannot read the parquet shard"):
        ColorSwap(tmp_path).items()
    shard.write_bytes(original)
    shutil.copy(shard, tmp_path / "data" / "test-00000-of-00001-0a9b.parquet")
    with pytest.raises(ValueError, match=r"item ids repeat \(e.g. \['1', '10', '4'\]\)"):
        ColorSwap(tmp_path).items()

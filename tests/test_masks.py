"""Token masks from cache records: our rule (exact spans of every occurrence) and MACCO's original rule
(`data.comp_mask_rule=first_bpe_match`), from the scene graph of the record to the dataset's `comp_mask`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import open_clip
import pytest
from PIL import Image

from core.config import ConfigError
from lightning_modules import load_run_config
from datamodules.coco import CocoCaptions, CocoDataModule
from datamodules.masks import CaptionMasks, PatchGeometry, composition_words
from datamodules.transforms import CropResize

TOKENIZER = open_clip.get_tokenizer("ViT-B-32")


def span(caption: str, word: str, occurrence: int = 0) -> list:
    """[start, end] of the `occurrence`-th whole-word `word` in `caption`."""
    starts = [i for i in range(len(caption)) if caption.startswith(word, i)
              and (i == 0 or not caption[i - 1].isalpha())
              and (i + len(word) == len(caption) or not caption[i + len(word)].isalpha())]
    return [starts[occurrence], starts[occurrence] + len(word)]


def record(caption: str, relations: list, attributes: list) -> dict:
    """A cache record as `datamodules.preprocess.caption_record` writes it, for hand-made graphs: relations are
    lists of (word, occurrence), attributes (word, occurrence); the object list is left empty."""
    relation_spans = [[span(caption, w, k) for w, k in words] for words in relations]
    attribute_spans = [span(caption, w, k) for w, k in attributes]
    comp = sorted([s for words in relation_spans for s in words] + attribute_spans)
    return {"caption_id": 1, "image_id": 1, "caption": caption, "obj_spans": [], "comp_spans": comp, "phrases": [],
            "graph": {"caption": caption, "entities": [{"head": [0, 1], "words": [], "attributes": attribute_spans,
                                                        "span": [0, 1]}],
                      "relations": [{"subject": 0, "words": words, "object": 0} for words in relation_spans],
                      "phrases": []}}


def masked(mask: np.ndarray) -> list:
    return np.flatnonzero(mask).tolist()


def test_composition_words_rebuild_the_original_relation_strings():
    """The parser leaves "the" out of "to the left of"; the original's relation string holds it."""
    caption = "two red cubes to the left of a man holding a sign up"
    rec = record(caption, [[("to", 0), ("left", 0), ("of", 0)], [("holding", 0), ("up", 0)]],
                 [("two", 0), ("red", 0)])
    assert composition_words(rec) == ["to the left of", "holding", "up", "two", "red"]


def comp_masks(rec: dict, rule: str) -> list:
    masks = CaptionMasks([rec], TOKENIZER, 77, rule)
    return masked(masks.token_masks(0, 77)[1])


def test_first_bpe_match_rule_masks_first_occurrences_and_whole_relations():
    caption = "a man on a horse on a beach"  # SOT a man on a horse on a beach EOT
    rec = record(caption, [[("on", 0)], [("on", 1)]], [])
    assert comp_masks(rec, "every_occurrence") == [3, 6]  # ours: each listed occurrence
    assert comp_masks(rec, "first_bpe_match") == [3]  # the original: "on" twice, its first match twice
    caption = "two red cubes to the left of a red ball"
    rec = record(caption, [[("to", 0), ("left", 0), ("of", 0)]], [("red", 0), ("red", 1)])
    assert comp_masks(rec, "every_occurrence") == [2, 4, 6, 7, 9]
    assert comp_masks(rec, "first_bpe_match") == [2, 4, 5, 6, 7]  # "the" in the relation; "red" once


def test_unknown_rule_is_an_error():
    with pytest.raises(ValueError, match="first_bpe_match"):
        CaptionMasks([], TOKENIZER, 77, "first_match")
    with pytest.raises(ConfigError, match="comp_mask_rule"):
        load_run_config([], ["data.comp_mask_rule=first_match"])


def test_the_dataset_builds_comp_mask_with_the_configured_rule(tmp_path):
    caption = "a man on a horse on a beach"
    Image.new("RGB", (48, 48)).save(tmp_path / "1.png")
    (tmp_path / "captions.json").write_text(json.dumps({
        "images": [{"id": 1, "file_name": "1.png", "height": 48, "width": 48}],
        "annotations": [{"id": 1, "image_id": 1, "caption": caption}]}))
    rec = record(caption, [[("on", 0)], [("on", 1)]], [])
    transform = CropResize(32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    for rule, expected in (("every_occurrence", [3, 6]), ("first_bpe_match", [3])):
        data = CocoCaptions(tmp_path / "captions.json", tmp_path, TOKENIZER, transform, mask_records={1: rec},
                            geometry=PatchGeometry(32, 2, random_rectangle_prob=0.0), comp_mask_rule=rule)
        assert masked(data[0]["comp_mask"].numpy()) == expected, rule


def test_the_datamodule_passes_the_configured_rule(monkeypatch):
    import datamodules.preprocess

    cfg = load_run_config([Path(__file__).resolve().parents[1] / "configs" / "macco.yaml"],
                      ["data.comp_mask_rule=first_bpe_match"])
    monkeypatch.setattr(datamodules.preprocess, "mask_records", lambda data, prep, split: {})
    datamodule = CocoDataModule(cfg.data, TOKENIZER, None, None, preprocess=cfg.preprocess,
                                image_config={"size": 224, "mean": (0.5,) * 3, "std": (0.5,) * 3}, grid_size=7)
    options = datamodule._mask_options("train")
    assert options["comp_mask_rule"] == "first_bpe_match" and options["geometry"].grid_size == 7


# ----- phrase boxes -> patch mask: boxes the training crop cuts away --------------------------------------
def reference_clamped_mask(boxes, crop, output_size: int, grid: int) -> np.ndarray:
    """MACCO's original box -> patch rule, written out box by box and patch by patch in plain Python floats.

    Each edge of a box is moved into the crop and clamped on its own side only (left / top to >= 0, right /
    bottom to <= the crop's width / height), scaled to the network input, and the patch indices from
    floor(lo / patch) to floor((hi - 1e-5) / patch) are each clamped into the grid.
    """
    top, left, height, width = (float(v) for v in crop)
    patch, scale_x, scale_y = output_size / grid, output_size / width, output_size / height
    mask = np.zeros((grid, grid), dtype=bool)
    for x0, y0, x1, y1 in ([float(v) for v in box[:4]] for box in boxes):
        lo_x, hi_x = max(x0 - left, 0.0) * scale_x, min(x1 - left, width) * scale_x
        lo_y, hi_y = max(y0 - top, 0.0) * scale_y, min(y1 - top, height) * scale_y
        first_col, last_col = (min(max(int(v // patch), 0), grid - 1) for v in (lo_x, hi_x - 1e-5))
        first_row, last_row = (min(max(int(v // patch), 0), grid - 1) for v in (lo_y, hi_y - 1e-5))
        for row in range(first_row, last_row + 1):
            for col in range(first_col, last_col + 1):
                mask[row, col] = True
    return mask.reshape(-1)


def patches(rows, cols, grid: int = 7) -> list:
    return sorted(r * grid + c for r in rows for c in cols)


CROP = (20, 40, 160, 200)  # top, left, height, width in original pixels; output 224, 7 x 7 patches of 32
PARTLY_OUTSIDE = (10.0, 50.0, 100.0, 120.0)  # left edge before the crop: columns 0..2, rows 1..4
BEYOND_RIGHT = (260.0, 60.0, 290.0, 90.0)  # wholly right of the crop: column 6, rows 1..3
BEYOND_TOP_LEFT = (0.0, 0.0, 30.0, 10.0)  # wholly above and left: the corner patch 0
BEYOND_BOTTOM = (100.0, 190.0, 150.0, 240.0)  # wholly below: row 6, columns 2..3


@pytest.mark.parametrize("box, expected", [
    (PARTLY_OUTSIDE, patches(range(1, 5), range(0, 3))),
    (BEYOND_RIGHT, patches(range(1, 4), [6])),
    (BEYOND_TOP_LEFT, [0]),
    (BEYOND_BOTTOM, patches([6], range(2, 4))),
])
def test_clamp_puts_boxes_outside_the_crop_on_its_border_patches(box, expected):
    clamp = CaptionMasks.patch_mask(np.array([box], np.float32), CROP, None, PatchGeometry(224, 7))
    assert masked(clamp) == expected
    assert np.array_equal(clamp, reference_clamped_mask([box], CROP, 224, 7))
    drop = CaptionMasks.patch_mask(np.array([box], np.float32), CROP, None,
                                   PatchGeometry(224, 7, out_of_crop_boxes="drop"))
    assert masked(drop) == (expected if box == PARTLY_OUTSIDE else [])  # ours: a box cut away masks nothing


def test_clamp_follows_the_original_rule_on_random_boxes_and_crops():
    rng = np.random.default_rng(0)
    for _ in range(500):
        width, height = rng.integers(50, 400, size=2)
        crop = (int(rng.integers(0, 40)), int(rng.integers(0, 40)), int(height), int(width))
        corners = rng.uniform(-50, 500, size=(int(rng.integers(1, 4)), 2, 2))
        boxes = np.concatenate([corners.min(axis=1), corners.max(axis=1)], axis=1).astype(np.float32)
        grid, size = [(7, 224), (4, 64), (14, 224)][int(rng.integers(3))]
        assert np.array_equal(CaptionMasks.patch_mask(boxes, crop, rng, PatchGeometry(size, grid)),
                              reference_clamped_mask(boxes, crop, size, grid)), (boxes, crop)
    assert not CaptionMasks.patch_mask(np.zeros((0, 4), np.float32), CROP, rng, PatchGeometry(224, 7)).any()


def test_patch_geometry_refuses_unknown_rules_and_an_overlap_threshold_with_clamp():
    with pytest.raises(ValueError, match="out_of_crop_boxes='clip' is not one of clamp, drop"):
        PatchGeometry(224, 7, out_of_crop_boxes="clip")
    with pytest.raises(ValueError, match="patch_mask_min_overlap=0.5 needs data.out_of_crop_boxes=drop"):
        PatchGeometry(224, 7, min_overlap=0.5)
    PatchGeometry(224, 7, min_overlap=0.5, out_of_crop_boxes="drop")


def test_the_dataset_clamps_a_box_outside_its_crop_onto_the_border(tmp_path):
    caption = "a man on a horse"
    Image.new("RGB", (96, 48)).save(tmp_path / "1.png")  # evaluation crop: the centred 48 x 48 square at x 24..72
    (tmp_path / "captions.json").write_text(json.dumps({
        "images": [{"id": 1, "file_name": "1.png", "height": 48, "width": 96}],
        "annotations": [{"id": 1, "image_id": 1, "caption": caption}]}))
    rec = record(caption, [[("on", 0)]], [])
    rec["phrases"] = [{"text": "a man", "boxes": [[2.0, 30.0, 12.0, 40.0, 0.9]]}]  # left of the crop, lower half
    transform = CropResize(32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    expected = {"clamp": [2], "drop": []}  # 2 x 2 grid: the lower-left patch, or nothing
    for rule, patch_indices in expected.items():
        data = CocoCaptions(tmp_path / "captions.json", tmp_path, TOKENIZER, transform, mask_records={1: rec},
                            geometry=PatchGeometry(32, 2, random_rectangle_prob=0.0, out_of_crop_boxes=rule))
        assert masked(data[0]["patch_mask"].numpy()) == patch_indices, rule


@pytest.mark.parametrize("config, rule, box_aware", [("macco.yaml", "clamp", False), ("macco_ours.yaml", "drop", True)])
def test_the_datamodule_passes_the_box_rule_and_crop_sampling(monkeypatch, config, rule, box_aware):
    import datamodules.preprocess

    cfg = load_run_config([Path(__file__).resolve().parents[1] / "configs" / config])
    monkeypatch.setattr(datamodules.preprocess, "mask_records", lambda data, prep, split: {})
    datamodule = CocoDataModule(cfg.data, TOKENIZER, None, None, preprocess=cfg.preprocess,
                                image_config={"size": 224, "mean": (0.5,) * 3, "std": (0.5,) * 3}, grid_size=7)
    assert datamodule._mask_options("train")["geometry"].out_of_crop_boxes == rule
    assert datamodule._transform(True).box_aware is box_aware and datamodule._transform(True).train

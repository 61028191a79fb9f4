"""Token masks from cache records: our rule (exact spans of every occurrence) and MACCO's original rule
(`data.comp_mask_rule=first_bpe_match`), from the scene graph of the record to the dataset's `comp_mask`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import open_clip
import pytest
from PIL import Image

from core.config import ConfigError, load_config
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
        load_config([], ["data.comp_mask_rule=first_match"])


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

    cfg = load_config([Path(__file__).resolve().parents[1] / "configs" / "macco.yaml"],
                      ["data.comp_mask_rule=first_bpe_match"])
    monkeypatch.setattr(datamodules.preprocess, "mask_records", lambda data, prep, split: {})
    datamodule = CocoDataModule(cfg.data, TOKENIZER, None, None, preprocess=cfg.preprocess,
                                image_config={"size": 224, "mean": (0.5,) * 3, "std": (0.5,) * 3}, grid_size=7)
    options = datamodule._mask_options("train")
    assert options["comp_mask_rule"] == "first_bpe_match" and options["geometry"].grid_size == 7

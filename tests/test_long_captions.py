"""Long captions for SmartCLIP's paper recipe, on real files in tmp_path: the ShareGPT4V JSON (its held-out first
1000 records), a caption field of a COCO-style JSON, and the random sentence prefix drawn at every access and
tokenised to 248 tokens."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import open_clip
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from core.config import DataConfig
from datamodules.annotations import SHAREGPT4V_VAL_RECORDS, read_annotation_file
from datamodules.coco import CocoCaptions, CocoDataModule, random_sentence_prefix

SENTENCES = ["A kitchen with a stove", "A red kettle sits on it", "Two chairs stand by the table",
             "A cat sleeps under the table", "Rain falls outside the window."]
LONG = ". ".join(SENTENCES)


@pytest.fixture(scope="module")
def tokenizer():
    return open_clip.get_tokenizer("ViT-B-32", context_length=248)


@pytest.fixture(scope="module")
def transform():
    return open_clip.image_transform(32, is_train=False)


def write_sharegpt4v(path: Path, images: list) -> Path:
    """ShareGPT4V's format: a list of {id, image, conversations: [question, answer]}."""
    entries = [{"id": str(index), "image": image,
                "conversations": [{"from": "human", "value": "<image>\nDescribe the image."},
                                  {"from": "gpt", "value": f"Caption {index}.\nSecond line {index}."}]}
               for index, image in enumerate(images)]
    path.write_text(json.dumps(entries))
    return path


def test_sharegpt4v_holds_out_its_first_1000_records_and_keeps_coco_ids(tmp_path):
    images = ["coco/train2017/000000000009.jpg"] * SHAREGPT4V_VAL_RECORDS + [
        "coco/train2017/000000000025.jpg", "sam/images/sa_1000.jpg", "llava/llava_pretrain/images/00000/000000010.jpg"]
    path = str(write_sharegpt4v(tmp_path / "share-captioner.json", images))
    val = read_annotation_file(path, ("val",))
    train = read_annotation_file(path, ("train", "restval"))
    assert len(val) == SHAREGPT4V_VAL_RECORDS and [r.caption_id for r in train] == [1000, 1001, 1002]
    assert train[0].caption == "Caption 1000. Second line 1000."  # the answer, newlines as spaces
    assert [r.file_name for r in train] == images[1000:]
    # COCO images keep their COCO id (leakage checks); the others get ids no COCO image has
    assert [r.image_id for r in train] == [25, -1002, -1003]
    with pytest.raises(ValueError, match="'val'.*'train'"):
        read_annotation_file(path, ("test",))


def test_the_caption_field_of_a_coco_json(tmp_path):
    document = {"images": [{"id": 1, "file_name": "1.png"}],
                "annotations": [{"id": 7, "image_id": 1, "caption": "a kitchen", "long_caption": f" {LONG} "}]}
    path = tmp_path / "long.json"
    path.write_text(json.dumps(document))
    assert read_annotation_file(str(path))[0].caption == "a kitchen"
    assert read_annotation_file(str(path), caption_field="long_caption")[0].caption == LONG
    with pytest.raises(ValueError, match="annotation 7 has no caption text under data.caption_field='dense'"):
        read_annotation_file(str(path), caption_field="dense")
    share = write_sharegpt4v(tmp_path / "share.json", ["a.jpg"])
    with pytest.raises(ValueError, match="COCO captions JSON files only"):
        read_annotation_file(str(share), ("val",), caption_field="long_caption")


def test_random_sentence_prefix_draws_1_to_n_sentences_uniformly():
    rng = np.random.default_rng(0)
    draws = [random_sentence_prefix(LONG, rng) for _ in range(5000)]
    prefixes = [". ".join(SENTENCES[:k]) for k in range(1, 6)]
    counts = Counter(draws)
    assert set(counts) == set(prefixes)  # only whole leading sentences, the last one with its own period
    assert all(abs(counts[p] / 5000 - 0.2) < 0.03 for p in prefixes)  # uniform: 0.2 +- 5 standard errors
    assert random_sentence_prefix("One sentence only.", rng) == "One sentence only."


def official_prefixes(answer: str) -> list:
    """SmartCLIP's training caption rule, written out: newlines become spaces, the text is split at ". " as it is
    (not stripped), and the first k pieces are joined back, for every k in 1..n."""
    pieces = answer.replace("\n", " ").split(". ")
    return [". ".join(pieces[:k]) for k in range(1, len(pieces) + 1)]


@pytest.mark.parametrize("answer, count", [
    ("A cat sleeps. A dog barks. ", 3),  # a trailing ". ": an empty last sentence
    ("A cat sleeps. A dog barks.\n", 3),  # the same once the newline is a space
    ("One. . Two. ", 4),
    ("A cat sleeps.\nA dog barks.", 2),  # nothing to strip: the same either way
])
def test_sentence_prefixes_split_the_caption_as_read_not_stripped(tmp_path, tokenizer, transform, answer, count):
    Image.new("RGB", (40, 40)).save(tmp_path / "1.png")
    entry = {"id": "0", "image": "1.png", "conversations": [{"from": "human", "value": "<image>\nDescribe it."},
                                                          {"from": "gpt", "value": answer}]}
    (tmp_path / "share.json").write_text(json.dumps([entry]))
    data = CocoCaptions(tmp_path / "share.json", tmp_path, tokenizer, transform, karpathy_splits=("val",),
                        caption_sentences="random_prefix")
    drawn = {tuple(data[(0, seed)]["text"].tolist()) for seed in range(60)}
    expected = {tuple(tokenizer([prefix])[0].tolist()) for prefix in official_prefixes(answer)}
    assert len(expected) == count and drawn == expected
    # a COCO JSON's long-caption field is split as read too
    document = {"images": [{"id": 1, "file_name": "1.png"}],
                "annotations": [{"id": 7, "image_id": 1, "caption": "a cat", "long": answer.replace("\n", " ")}]}
    (tmp_path / "long.json").write_text(json.dumps(document))
    data = CocoCaptions(tmp_path / "long.json", tmp_path, tokenizer, transform, caption_field="long",
                        caption_sentences="random_prefix")
    assert {tuple(data[(0, seed)]["text"].tolist()) for seed in range(60)} == expected


@pytest.fixture
def long_dir(tmp_path: Path) -> Path:
    """Two images; caption 0 has 5 sentences, caption 1 a last sentence that passes 248 tokens."""
    (tmp_path / "images").mkdir()
    for image_id in (1, 2):
        Image.new("RGB", (40, 40), (60 * image_id, 0, 0)).save(tmp_path / "images" / f"{image_id}.png")
    endless = "a tiny blue cube next to a red ball " * 40
    document = {"images": [{"id": i, "file_name": f"{i}.png"} for i in (1, 2)],
                "annotations": [{"id": 0, "image_id": 1, "caption": LONG},
                                {"id": 1, "image_id": 2, "caption": f"A room. {endless}"}]}
    (tmp_path / "captions.json").write_text(json.dumps(document))
    return tmp_path


def test_each_access_reads_a_seeded_random_prefix_tokenised_then(long_dir, tokenizer, transform):
    data = CocoCaptions(long_dir / "captions.json", long_dir / "images", tokenizer, transform,
                        caption_sentences="random_prefix")
    assert data.context_length == 248
    prefixes = {". ".join(SENTENCES[:k]): k for k in range(1, 6)}
    texts = {tuple(data[(0, seed)]["text"].tolist()) for seed in range(40)}
    assert texts == {tuple(tokenizer([p])[0].tolist()) for p in prefixes}  # every prefix, exactly tokenised
    assert torch.equal(data[(0, 3)]["text"], data[(0, 3)]["text"])  # the sample's seed fixes its draw
    truncated = {seed: data[(1, seed)] for seed in range(12)}
    flags = {sample["truncated"] for sample in truncated.values()}
    assert flags == {True, False}  # "A room" alone fits; the whole caption is truncated, with EOS last
    assert all(int(s["text"][-1]) == 49407 for s in truncated.values() if s["truncated"])
    whole = CocoCaptions(long_dir / "captions.json", long_dir / "images", tokenizer, transform)
    assert torch.equal(whole[0]["text"], tokenizer([LONG])[0].long()) and whole.num_truncated_captions == 1


def test_prefixes_train_whole_captions_validate_and_masks_are_refused(long_dir, tokenizer, transform):
    data = OmegaConf.structured(DataConfig(root=str(long_dir), train_annotations="captions.json", train_images="images",
                                           val_annotations="captions.json", val_images="images", batch_size=1,
                                           num_workers=0, train_caption_sentences="random_prefix"))
    module = CocoDataModule(data, tokenizer, transform, transform)
    module.setup("fit")
    assert module.train_dataset._texts is not None and module.val_dataset._texts is None
    with pytest.raises(ValueError, match="random_prefix"):
        CocoCaptions(long_dir / "captions.json", long_dir / "images", tokenizer, transform,
                     caption_sentences="random_prefix", mask_records={})

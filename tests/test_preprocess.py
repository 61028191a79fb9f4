"""The offline preprocessing job and its cache: counts, resume after a crash, corrupt shards, masks in batches."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch

import datamodules.preprocess as preprocess
from core.config import load_config
from modeling.encoders import register_model_configs
from datamodules.annotations import CaptionRecord
from datamodules.cache import CacheError, open_cache
from datamodules.coco import CocoDataModule
from datamodules.shapes import generate
from parsers.grounding import boxes_to_patch_mask, build_grounder
from parsers.scene_graph import SceneGraphParser

TOKENIZER = open_clip.get_tokenizer("ViT-B-32")
register_model_configs("configs/models")


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    generate(root, n_train=12, n_val=6, image_size=64, seed=1)
    return root


def shapes_config(root: Path, cache_root: Path, *overrides: str):
    return load_config([], [
        f"data.root={root}", "data.train_annotations=annotations/captions_train.json",
        "data.train_images=images/train", "data.val_annotations=annotations/captions_val.json",
        "data.val_images=images/val", f"preprocess.cache_root={cache_root}", "preprocess.grounder=annotations",
        "preprocess.train_scene_graphs=annotations/scene_graphs_train.json",
        "preprocess.val_scene_graphs=annotations/scene_graphs_val.json", "preprocess.shard_size=5", *overrides])


def cache_files(cache_root: Path) -> dict:
    return {p.relative_to(cache_root).as_posix(): p.read_bytes() for p in sorted(cache_root.rglob("shard-*.jsonl.gz"))}


def test_shapes_world_counts_and_records(shapes_root, tmp_path):
    manifests = preprocess.run(shapes_config(shapes_root, tmp_path))
    train = manifests["train"]
    assert train["complete"] and train["num_shards"] == 5  # 24 captions / 5 per shard
    counts = train["counts"]
    assert counts["captions"] == 24 and counts["parsed"] == 24 and counts["unreadable_images"] == 0
    assert counts["no_object"] == 0 and counts["phrases"] > 24
    assert counts["grounded"] + counts["phrases_without_boxes"] == counts["phrases"]
    assert counts["grounded"] >= 0.8 * counts["phrases"]  # parsed phrases match the ground-truth phrases
    cache = open_cache(next(p.parent for p in tmp_path.rglob("manifest.json")
                            if json.loads(p.read_text())["counts"]["captions"] == 24))
    for record in cache.read_all():
        for start, end in record["obj_spans"] + record["comp_spans"]:
            assert 0 <= start < end <= len(record["caption"])
        assert all(len(box) == 5 for phrase in record["phrases"] for box in phrase["boxes"])


def test_resume_after_a_crash_skips_finished_shards_and_matches_a_clean_run(shapes_root, tmp_path, monkeypatch):
    clean_root, crash_root = tmp_path / "clean", tmp_path / "crash"
    preprocess.run(shapes_config(shapes_root, clean_root))
    original, calls = preprocess.process_shard, []

    def crash_on_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated kill")
        return original(*args, **kwargs)

    monkeypatch.setattr(preprocess, "process_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        preprocess.run(shapes_config(shapes_root, crash_root))
    monkeypatch.setattr(preprocess, "process_shard", original)
    resumed_calls = []
    monkeypatch.setattr(preprocess, "process_shard", lambda *a, **k: resumed_calls.append(1) or original(*a, **k))
    preprocess.run(shapes_config(shapes_root, crash_root))
    assert len(resumed_calls) == 5 + 3 - 2  # 5 train + 3 val shards, 2 finished before the crash
    assert cache_files(crash_root) == cache_files(clean_root)


def test_shard_split_over_workers_covers_everything_once(shapes_root, tmp_path):
    cfg = shapes_config(shapes_root, tmp_path)
    first = preprocess.run(cfg, shard=(0, 2))
    assert not first["train"]["complete"] and first["train"]["finished_shards"] == 3  # shards 0, 2, 4
    second = preprocess.run(cfg, shard=(1, 2))
    assert second["train"]["complete"] and second["train"]["counts"]["captions"] == 24


def test_corrupt_shard_is_named_on_load_and_rebuilt_on_rerun(shapes_root, tmp_path, caplog):
    cfg = shapes_config(shapes_root, tmp_path)
    assert preprocess.run(cfg)["train"]["rebuilt_shards"] == 0
    victim = sorted(tmp_path.rglob("shard-00001-of-00005.jsonl.gz"))[0]
    victim.write_bytes(victim.read_bytes()[:-7])  # truncated
    cache = open_cache(victim.parent)
    with pytest.raises(CacheError, match=victim.name):
        list(cache.read_all())
    assert not cache.is_done(1)
    with caplog.at_level(logging.INFO):
        manifests = preprocess.run(cfg)
    assert len(list(open_cache(victim.parent).read_all())) == 24
    # The rebuild is reported: a warning naming the shard, and a count in the job's summary.
    assert manifests["train"]["rebuilt_shards"] == 1 and manifests["val"]["rebuilt_shards"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "shard 1 of 5" in warnings[0] and victim.name in warnings[0]
    assert "train done in" in caplog.text and "1 damaged shards rebuilt" in caplog.text


def test_missing_cache_is_a_clear_error(tmp_path):
    with pytest.raises(CacheError, match="datamodules.preprocess"):
        open_cache(tmp_path / "nothing")


def write_captions(root: Path, captions: list, broken_image: bool = False) -> None:
    (root / "images").mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (40, 30), (200, 10, 10)).save(root / "images" / "1.png")
    (root / "images" / "2.png").write_bytes(b"not a png" if broken_image else (root / "images" / "1.png").read_bytes())
    document = {"images": [{"id": 1, "file_name": "1.png"}, {"id": 2, "file_name": "2.png"}],
                "annotations": [{"id": i + 1, "image_id": 1 + i % 2, "caption": c} for i, c in enumerate(captions)]}
    (root / "captions.json").write_text(json.dumps(document))


def test_captions_without_entities_and_unreadable_images_are_counted_not_fatal(tmp_path):
    write_captions(tmp_path / "data", ["It is.", "a dog on a red sofa", "wow", "two cats"], broken_image=True)
    cfg = load_config([], [f"data.root={tmp_path / 'data'}", "data.train_annotations=captions.json",
                           "data.train_images=images", "data.val_annotations=",
                           f"preprocess.cache_root={tmp_path / 'c'}",
                           "preprocess.grounder=none"])
    counts = preprocess.run(cfg)["train"]["counts"]
    assert counts["captions"] == 4 and counts["no_object"] == 2 and counts["unreadable_images"] == 1
    assert counts["no_composition"] >= 2 and counts["grounded"] == 0


def test_images_of_another_size_than_recorded_or_slivers_are_counted_with_the_unreadable(tmp_path, caplog):
    """Their boxes would be in the wrong frame (or cropped away): logged, counted, and given no boxes."""
    from PIL import Image

    root = tmp_path / "data"
    (root / "images").mkdir(parents=True)
    sizes = {"right.png": ((40, 30), (40, 30)), "resized.png": ((40, 30), (80, 60)),
             "sliver.png": ((3000, 30), (3000, 30))}  # name: (file size, recorded size)
    for name, (size, _) in sizes.items():
        Image.new("RGB", size, (200, 10, 10)).save(root / "images" / name)
    document = {"images": [{"id": i, "file_name": name, "width": recorded[0], "height": recorded[1]}
                           for i, (name, (_, recorded)) in enumerate(sizes.items(), start=1)],
                "annotations": [{"id": i, "image_id": i, "caption": "a dog on a red sofa"} for i in (1, 2, 3)]}
    (root / "captions.json").write_text(json.dumps(document))
    cfg = load_config([], [f"data.root={root}", "data.train_annotations=captions.json", "data.train_images=images",
                           "data.val_annotations=", f"preprocess.cache_root={tmp_path / 'c'}",
                           "preprocess.grounder=none"])
    with caplog.at_level(logging.WARNING):
        counts = preprocess.run(cfg)["train"]["counts"]
    assert counts["captions"] == 3 and counts["unreadable_images"] == 2
    assert "resized.png: the file is 40x30 but the annotations record 80x60" in caplog.text
    assert "sliver.png: 3000x30 has an aspect ratio over 10:1" in caplog.text


def test_datamodule_reads_masks_from_the_cache(shapes_root, tmp_path):
    cfg = shapes_config(shapes_root, tmp_path, "data.masks=true", "data.batch_size=4", "data.num_workers=0",
                        "data.random_rectangle_prob=0")
    preprocess.run(cfg)
    model, train_tf, val_tf = open_clip.create_model_and_transforms("ViT-Tiny-16-64")
    datamodule = CocoDataModule(cfg.data, TOKENIZER, train_tf, val_tf, preprocess=cfg.preprocess,
                                image_config=model.visual.preprocess_cfg, grid_size=4)
    datamodule.setup("fit")
    batch = next(iter(datamodule.val_dataloader()))
    assert batch["obj_mask"].shape == batch["comp_mask"].shape == (4, 77) and batch["obj_mask"].dtype == torch.bool
    assert batch["patch_mask"].shape == (4, 16)
    assert batch["obj_mask"].any(dim=1).all() and batch["comp_mask"].any(dim=1).all()
    assert not (batch["obj_mask"] & batch["comp_mask"]).any()
    shapes = {"square", "circle", "triangle", "diamond"}
    for ids, obj, comp in zip(batch["text"], batch["obj_mask"], batch["comp_mask"]):
        object_words, composition_words = set(TOKENIZER.decode(ids[obj].tolist()).split()), \
            set(TOKENIZER.decode(ids[comp].tolist()).split())
        assert object_words & shapes, object_words
        assert not composition_words & shapes, composition_words  # shapes are objects, never composition
    assert batch["patch_mask"].any()  # phrases were grounded (a sampled phrase without boxes masks nothing)


def test_mask_samples_from_per_sample_generators_equal_the_global_seeding(shapes_root, tmp_path, monkeypatch):
    """The training split with masks (box-aware crops, patch masks): crops drawn from per-sample generators equal
    those drawn after torch.manual_seed(seed), exactly, and no global generator is seeded or consumed."""
    from test_coco_datamodule import assert_samples_are_the_global_seedings

    cfg = shapes_config(shapes_root, tmp_path, "data.masks=true", "data.box_aware_crop=true")
    preprocess.run(cfg)
    model, train_tf, val_tf = open_clip.create_model_and_transforms("ViT-Tiny-16-64")
    datamodule = CocoDataModule(cfg.data, TOKENIZER, train_tf, val_tf, preprocess=cfg.preprocess,
                                image_config=model.visual.preprocess_cfg, grid_size=4)
    datamodule.setup("fit")
    data = datamodule.train_dataset
    keys = [(index, seed) for index in range(len(data)) for seed in (1, 99)]
    assert_samples_are_the_global_seedings(data, keys, monkeypatch)


def gt_object_phrases(caption: str, boxes: dict) -> list:
    """Ground-truth object phrases of `caption` as the shapes world writes them: one per object, by position."""
    return [{"text": text, "type": "attribute", "char_span": [caption.index(text), caption.index(text) + len(text)],
             "boxes": [box]} for text, box in boxes.items()]


def test_same_phrase_words_in_two_captions_of_an_image_get_each_captions_own_boxes(tmp_path):
    """Both captions parse to the relation phrase "square left of circle", about different squares: matched by
    position within its own caption, each phrase gets exactly the boxes of the objects it names."""
    from PIL import Image

    Image.new("RGB", (64, 64)).save(tmp_path / "1.png")
    red, blue, circle = [0, 0, 10, 10], [0, 20, 10, 30], [40, 0, 50, 10]
    captions = {1: ("a red square left of a green circle", {"red square": red, "green circle": circle}),
                2: ("a blue square left of a green circle", {"blue square": blue, "green circle": circle})}
    records = [CaptionRecord(i, 7, "1.png", text) for i, (text, _) in captions.items()]
    gt = {i: gt_object_phrases(text, boxes) for i, (text, boxes) in captions.items()}
    graphs = SceneGraphParser().parse([r.caption for r in records])
    requests = preprocess.image_requests(records, graphs, tmp_path, gt)
    grounder = build_grounder("annotations")
    rows = preprocess.caption_rows(records, graphs, requests, grounder.ground(requests), gt)
    boxes = [{p["text"]: sorted(b[:4] for b in p["boxes"]) for p in row["phrases"]} for row in rows]
    assert boxes[0]["square left of circle"] == sorted([red, circle])
    assert boxes[1]["square left of circle"] == sorted([blue, circle])
    assert (boxes[0]["red square"], boxes[1]["blue square"]) == ([red], [blue])


def test_patch_mask_of_a_sample_is_one_of_its_phrases(shapes_root, tmp_path):
    cfg = shapes_config(shapes_root, tmp_path, "data.masks=true", "data.random_rectangle_prob=0")
    preprocess.run(cfg)
    model, train_tf, val_tf = open_clip.create_model_and_transforms("ViT-Tiny-16-64")
    datamodule = CocoDataModule(cfg.data, TOKENIZER, train_tf, val_tf, preprocess=cfg.preprocess,
                                image_config=model.visual.preprocess_cfg, grid_size=4)
    datamodule.setup("validate")
    dataset = datamodule.val_dataset
    sample = dataset[0]
    masks = dataset.masks
    candidates = [boxes_to_patch_mask(masks.phrase_boxes(0, p), (0, 0, 64, 64), 64, 4)
                  for p in range(masks.num_phrases(0))]
    assert any(np.array_equal(sample["patch_mask"].numpy(), c) for c in candidates)


def test_the_configured_caption_field_is_parsed_and_keys_the_cache(shapes_root, tmp_path):
    # Masks must describe the captions the DataModule trains on: with data.caption_field the cache parses that
    # field, under its own key (a cache of the "caption" field is never reused for it).
    document = json.loads((shapes_root / "annotations" / "captions_train.json").read_text())
    for annotation in document["annotations"]:
        annotation["long_caption"] = annotation["caption"] + " on a grey background"
    (shapes_root / "annotations" / "long_train.json").write_text(json.dumps(document))
    overrides = ["data.train_annotations=annotations/long_train.json", "data.val_annotations=null"]
    plain = preprocess.run(shapes_config(shapes_root, tmp_path, *overrides))["train"]
    long = preprocess.run(shapes_config(shapes_root, tmp_path, *overrides, "data.caption_field=long_caption"))["train"]
    assert plain["settings"] != long["settings"] and long["settings"]["caption_field"] == "long_caption"
    cfg = shapes_config(shapes_root, tmp_path, *overrides, "data.caption_field=long_caption")
    records = preprocess.mask_records(cfg.data, cfg.preprocess, "train")
    assert len(records) == 24
    assert all(record["caption"].endswith(" on a grey background") for record in records.values())

"""Karpathy captions, excluded evaluation images, and the geometry-aware crop transform."""
from __future__ import annotations

import json
from pathlib import Path

import open_clip
import pytest
import torch
from PIL import Image
from torchvision.transforms import Compose, InterpolationMode, Normalize, RandomResizedCrop, ToTensor

from core.config import REPO_ROOT
from lightning_modules import load_run_config
from datamodules.annotations import read_annotation_file
from datamodules.coco import CocoCaptions, read_image_ids
from datamodules.transforms import (CropResize, GlobalStateFromGenerator, box_overlaps_crop, center_square,
                                   random_resized_crop, seeded_generator, with_generator)

TOKENIZER = open_clip.get_tokenizer("ViT-B-32")
KARPATHY = {"dataset": "coco", "images": [
    {"filepath": "val2014", "filename": "COCO_val2014_000000000001.jpg", "imgid": 0, "cocoid": 1, "split": "train",
     "sentids": [10, 11], "sentences": [{"raw": "A dog on a sofa. ", "sentid": 10, "imgid": 0, "tokens": []},
                                        {"raw": "a brown dog", "sentid": 11, "imgid": 0, "tokens": []}]},
    {"filepath": "val2014", "filename": "COCO_val2014_000000000002.jpg", "imgid": 1, "cocoid": 2, "split": "restval",
     "sentids": [12], "sentences": [{"raw": "two cats", "sentid": 12, "imgid": 1, "tokens": []}]},
    {"filepath": "val2014", "filename": "COCO_val2014_000000000003.jpg", "imgid": 2, "cocoid": 3, "split": "test",
     "sentids": [13], "sentences": [{"raw": "a red bus", "sentid": 13, "imgid": 2, "tokens": []}]},
]}


@pytest.fixture
def karpathy_root(tmp_path) -> Path:
    (tmp_path / "val2014").mkdir()
    for image in KARPATHY["images"]:
        Image.new("RGB", (40, 30), (10, 200, 10)).save(tmp_path / "val2014" / image["filename"], format="PNG")
    (tmp_path / "dataset_coco.json").write_text(json.dumps(KARPATHY))
    return tmp_path


def test_karpathy_splits_ids_and_paths(karpathy_root):
    train = read_annotation_file(str(karpathy_root / "dataset_coco.json"))
    assert [(r.caption_id, r.image_id, r.caption) for r in train] == [
        (10, 1, "A dog on a sofa."), (11, 1, "a brown dog"), (12, 2, "two cats")]
    assert train[0].file_name == "val2014/COCO_val2014_000000000001.jpg"
    test = read_annotation_file(str(karpathy_root / "dataset_coco.json"), ("test",))
    assert [r.caption for r in test] == ["a red bus"]
    with pytest.raises(ValueError, match="none of the splits"):
        read_annotation_file(str(karpathy_root / "dataset_coco.json"), ("validation",))


def test_excluded_images_are_removed_and_counted(karpathy_root, tmp_path):
    ids_file = tmp_path / "exclude.txt"
    ids_file.write_text("# Karpathy test images\n2\n\n")
    assert read_image_ids(str(ids_file)) == {2}
    (tmp_path / "exclude.json").write_text("[1, 2]")
    assert read_image_ids(str(tmp_path / "exclude.json")) == {1, 2}
    dataset = CocoCaptions(karpathy_root / "dataset_coco.json", karpathy_root, TOKENIZER,
                           open_clip.image_transform(32, is_train=False), exclude_image_ids={2})
    assert len(dataset) == 2 and dataset.num_excluded_images == 1 and dataset.num_excluded_captions == 1
    assert "1 excluded images" in dataset.summary()
    with pytest.raises(FileNotFoundError, match="exclude_image_ids"):
        read_image_ids(str(tmp_path / "missing.txt"))


def test_center_square_and_overlap():
    assert center_square(100, 60) == (0, 20, 60, 60)
    assert center_square(60, 100) == (20, 0, 60, 60)
    crop = (10, 10, 20, 20)  # top, left, height, width
    assert box_overlaps_crop((0, 0, 11, 11), crop)
    assert not box_overlaps_crop((0, 0, 10, 40), crop)  # touches the crop's edge only
    assert not box_overlaps_crop((31, 31, 40, 40), crop)


def test_eval_transform_matches_open_clip_preprocessing():
    image = Image.effect_mandelbrot((96, 64), (-2, -1, 1, 1), 50).convert("RGB")
    model_cfg = {"size": (32, 32), "mean": (0.48, 0.45, 0.40), "std": (0.26, 0.26, 0.27)}
    ours, crop = CropResize.from_open_clip(model_cfg, train=False)(image)
    theirs = open_clip.image_transform(32, is_train=False, mean=model_cfg["mean"], std=model_cfg["std"])(image)
    assert crop == (0, 16, 64, 64) and ours.shape == theirs.shape == (3, 32, 32)
    assert (ours - theirs).abs().mean() < 0.05  # same region, same resize; rounding differs slightly


def test_the_paper_config_draws_the_training_crop_as_torchvision_does():
    """configs/macco.yaml: MACCO's RandomResizedCrop(224, scale (0.9, 1.0), bicubic), one draw per sample, the same
    region and pixels for the same generator state, also when that region cuts away the phrase's only box."""
    cfg = load_run_config([REPO_ROOT / "configs" / "macco.yaml"])
    mean, std = (0.48, 0.45, 0.40), (0.26, 0.26, 0.27)
    ours = CropResize.from_open_clip({"size": 224, "mean": mean, "std": std}, train=True, scale=cfg.data.crop_scale,
                                     box_aware=cfg.data.box_aware_crop)
    official = RandomResizedCrop(224, scale=(0.9, 1.0), interpolation=InterpolationMode.BICUBIC)
    pixels = Compose([official, ToTensor(), Normalize(mean, std)])
    image = Image.effect_mandelbrot((240, 220), (-2, -1, 1, 1), 50).convert("RGB")
    corner_box = [(0.0, 0.0, 3.0, 3.0)]
    missed, crops = 0, set()
    for seed in range(30):
        torch.manual_seed(seed)
        tensor, crop = ours(image, corner_box)
        torch.manual_seed(seed)
        assert crop == tuple(official.get_params(image, official.scale, official.ratio))
        torch.manual_seed(seed)
        assert torch.equal(tensor, pixels(image))
        missed += not box_overlaps_crop(corner_box[0], crop)
        crops.add(crop)
    assert missed > 0 and len(crops) > 20  # random regions; those that cut the box away are kept, not re-drawn


def test_training_crop_is_box_aware_and_seeded():
    image = Image.new("RGB", (200, 100))
    transform = CropResize(32, (0.5,) * 3, (0.5,) * 3, train=True, scale=(0.05, 0.1), box_aware=True)
    corner_box = [(0.0, 0.0, 50.0, 50.0)]
    torch.manual_seed(0)
    blind = [transform.sample_crop(image) for _ in range(50)]
    assert sum(box_overlaps_crop(corner_box[0], c) for c in blind) < 30  # a small crop misses it often
    torch.manual_seed(0)
    crops = [transform.sample_crop(image, corner_box) for _ in range(50)]
    assert sum(box_overlaps_crop(corner_box[0], c) for c in crops) >= 45  # re-drawn until it keeps the box
    torch.manual_seed(0)
    assert [transform.sample_crop(image, corner_box) for _ in range(50)] == crops


@pytest.mark.parametrize("size, scale", [((96, 64), (0.08, 1.0)), ((240, 220), (0.9, 1.0)), ((400, 20), (0.9, 1.0)),
                                         ((20, 400), (0.5, 1.0)), ((33, 31), (0.9, 1.0))])
def test_a_seeded_generator_draws_torchvisions_crop_of_the_global_seed(size, scale):
    """`random_resized_crop` from a generator seeded with s == RandomResizedCrop.get_params after
    torch.manual_seed(s), including the centre-crop fallback of extreme aspect ratios (400 x 20)."""
    image = Image.new("RGB", size)
    ratio = (3 / 4, 4 / 3)
    for seed in range(200):
        torch.manual_seed(seed)
        expected = tuple(RandomResizedCrop.get_params(image, list(scale), list(ratio)))
        assert random_resized_crop(*size, scale, ratio, seeded_generator(seed)) == expected, seed


def test_open_clips_training_transform_from_a_generator_equals_it_under_the_global_seed():
    image = Image.effect_mandelbrot((90, 70), (-2, -1, 1, 1), 50).convert("RGB")
    official = open_clip.image_transform(32, is_train=True)
    drawing = with_generator(official)
    assert not isinstance(drawing, GlobalStateFromGenerator)  # open_clip's steps are all known
    for seed in range(20):
        torch.manual_seed(seed)
        assert torch.equal(drawing(image, seeded_generator(seed)), official(image))


def test_an_unknown_transform_runs_on_the_global_generator_in_the_generators_state():
    def noisy(image):
        return torch.rand(3)

    drawing = with_generator(noisy)
    assert isinstance(drawing, GlobalStateFromGenerator)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    torch.manual_seed(7)
    expected = noisy(None)
    torch.set_rng_state(state)
    assert torch.equal(drawing(None, seeded_generator(7)), expected)
    assert torch.equal(torch.get_rng_state(), state)  # restored

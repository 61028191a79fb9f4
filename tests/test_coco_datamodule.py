"""COCO captions dataset and DataModule on real files in tmp_path (PNG images, captions JSON, NegCLIP TSV)."""
from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lightning as L
import numpy as np
import open_clip
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from core.config import DataConfig, HardNegativesConfig
from datamodules.annotations import read_annotation_file, read_negclip_tsv
from datamodules import coco
from datamodules.coco import CocoCaptions, CocoDataModule, UnreadableImageError, build_dataloader
from datamodules.hard_negatives import NeighbourTable, build_neighbour_table, draw_positions
from testkit.fixtures import fixture

EOT = 49407
IMAGE_SIZE = 32


@pytest.fixture(scope="module")
def tokenizer():
    return open_clip.get_tokenizer("ViT-B-32")


@pytest.fixture(scope="module")
def transform():
    return open_clip.image_transform(IMAGE_SIZE, is_train=False)


def write_png(path: Path, seed: int = 0, size: int = 48) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def write_coco(path: Path, file_names: dict, annotations: list, size: int = 48) -> Path:
    """A captions JSON: `file_names` maps image id -> file name; annotations are (id, image_id, caption[, negs]);
    every image is recorded as `size` x `size`."""
    document = {"images": [{"id": i, "file_name": name, "height": size, "width": size}
                           for i, name in file_names.items()],
                "annotations": [_annotation(*fields) for fields in annotations]}
    path.write_text(json.dumps(document))
    return path


def _annotation(annotation_id: int, image_id: int, caption: str, negatives: list | None = None) -> dict:
    annotation = {"id": annotation_id, "image_id": image_id, "caption": caption}
    if negatives is not None:
        annotation["neg_captions"] = negatives
    return annotation


@pytest.fixture
def coco_dir(tmp_path: Path) -> Path:
    """Three images and four captions (with COCO's stray whitespace), with 1, 3, 2 and 1 negatives."""
    for image_id in (1, 2, 3):
        write_png(tmp_path / "images" / f"{image_id:012d}.png", seed=image_id)
    write_coco(tmp_path / "captions.json", {i: f"{i:012d}.png" for i in (1, 2, 3)}, [
        (10, 1, "A red square left of a blue circle. \n", ["A blue square left of a red circle."]),
        (11, 1, "  a red square", ["a blue square ", "a green square", "a red circle"]),
        (12, 2, "Two green triangles.", ["Two red triangles.", "One green triangle."]),
        (13, 3, "A small circle.\n", ["A big circle."]),
    ])
    return tmp_path


def dataset(root: Path, tokenizer, transform, **options) -> CocoCaptions:
    return CocoCaptions(root / "captions.json", root / "images", tokenizer, transform, **options)


def tokens(tokenizer, *captions: str) -> torch.Tensor:
    return tokenizer(list(captions))


# ----- samples ------------------------------------------------------------------------------------------
def test_sample_keys_shapes_and_dtypes(coco_dir, tokenizer, transform):
    sample = dataset(coco_dir, tokenizer, transform, num_hard_negatives=2)[0]
    assert set(sample) == {"image", "text", "neg_text", "image_id", "caption_id", "truncated", "bad_image"}
    assert sample["image"].shape == (3, IMAGE_SIZE, IMAGE_SIZE) and sample["image"].dtype == torch.float32
    assert sample["text"].shape == (77,) and sample["text"].dtype == torch.long
    assert sample["neg_text"].shape == (2, 77) and sample["neg_text"].dtype == torch.long
    assert (sample["image_id"], sample["caption_id"]) == (1, 10)
    assert sample["truncated"] is False and sample["bad_image"] is False


def test_text_and_negatives_equal_the_tokenizer_output(coco_dir, tokenizer, transform):
    data = dataset(coco_dir, tokenizer, transform, num_hard_negatives=2)
    assert torch.equal(data[2]["text"], tokens(tokenizer, "Two green triangles.")[0])
    # One negative, K=2: it is repeated.
    assert torch.equal(data[0]["neg_text"], tokens(tokenizer, *["A blue square left of a red circle."] * 2))
    # Three negatives, K=2: two distinct ones of the three, drawn at this access.
    three = tokens(tokenizer, "a blue square", "a green square", "a red circle")
    drawn = data[1]["neg_text"]
    assert not torch.equal(drawn[0], drawn[1]) and all((three == row).all(-1).any() for row in drawn)
    # Two negatives, K=2: both, in a random order.
    two = tokens(tokenizer, "Two red triangles.", "One green triangle.")
    assert sorted(map(tuple, data[2]["neg_text"].tolist())) == sorted(map(tuple, two.tolist()))
    assert [data[i]["image_id"] for i in range(4)] == [1, 1, 2, 3]


def test_no_negatives_key_without_hard_negatives(coco_dir, tokenizer, transform):
    assert "neg_text" not in dataset(coco_dir, tokenizer, transform)[0]


def test_captions_and_negatives_are_stripped(coco_dir):
    records = read_annotation_file(str(coco_dir / "captions.json"))
    assert [r.caption for r in records] == ["A red square left of a blue circle.", "a red square",
                                            "Two green triangles.", "A small circle."]
    assert records[1].neg_captions == ("a blue square", "a green square", "a red circle")


def test_annotations_without_negatives_are_an_error_when_negatives_are_asked_for(tmp_path, tokenizer,
                                                                                   transform):
    write_png(tmp_path / "images" / "a.png")
    write_coco(tmp_path / "captions.json", {1: "a.png"}, [(1, 1, "a cat", ["a dog"]), (2, 1, "a cat", [])])
    with pytest.raises(ValueError, match=r"captions\.json.*1 of 2 annotations have no neg_captions"):
        dataset(tmp_path, tokenizer, transform, num_hard_negatives=1)


def test_max_samples_keeps_the_first_annotations(coco_dir, tokenizer, transform):
    data = dataset(coco_dir, tokenizer, transform, max_samples=2)
    assert [data[i]["caption_id"] for i in range(len(data))] == [10, 11]


# ----- bad input ----------------------------------------------------------------------------------------
def write_with_missing_image(root: Path) -> None:
    write_png(root / "images" / "present.png")
    write_coco(root / "captions.json", {1: "present.png", 2: "gone.png"},
               [(1, 1, "a cat"), (2, 2, "a dog"), (3, 2, "a puppy"), (4, 1, "a kitten")])


def test_missing_image_is_an_error_naming_the_file(tmp_path, tokenizer, transform):
    write_with_missing_image(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"1 image file\(s\).*gone\.png"):
        dataset(tmp_path, tokenizer, transform)


def test_missing_image_is_dropped_and_counted_with_skip(tmp_path, tokenizer, transform, caplog):
    write_with_missing_image(tmp_path)
    with caplog.at_level(logging.WARNING, logger="datamodules.coco"):
        data = dataset(tmp_path, tokenizer, transform, on_bad_image="skip")
    assert data.num_missing_images == 1 and data.num_images == 1
    assert [data[i]["caption_id"] for i in range(len(data))] == [1, 4]
    assert any("gone.png" in r.getMessage() and r.name == "datamodules.coco" for r in caplog.records)


def write_corrupt_images(root: Path) -> None:
    """Sample 0 fine, 1 garbage bytes, 2 a PNG cut in half, 3 fine."""
    good = write_png(root / "images" / "good.png")
    (root / "images" / "garbage.png").write_bytes(b"this is not an image")
    whole = io.BytesIO()
    Image.open(good).save(whole, format="PNG")
    (root / "images" / "truncated.png").write_bytes(whole.getvalue()[:len(whole.getvalue()) // 2])
    write_coco(root / "captions.json", {1: "good.png", 2: "garbage.png", 3: "truncated.png"},
               [(1, 1, "first"), (2, 2, "second"), (3, 3, "third"), (4, 1, "fourth")])


@pytest.mark.parametrize("index, name", [(1, "garbage.png"), (2, "truncated.png")])
def test_corrupt_image_is_an_error_naming_the_file(tmp_path, tokenizer, transform, index, name):
    write_corrupt_images(tmp_path)
    data = dataset(tmp_path, tokenizer, transform)
    with pytest.raises(UnreadableImageError, match=re.escape(name)) as raised:
        data[index]
    assert isinstance(raised.value.__cause__, OSError)  # the PIL error, chained


def test_corrupt_image_is_substituted_and_reported_once_with_skip(tmp_path, tokenizer, transform, caplog):
    write_corrupt_images(tmp_path)
    data = dataset(tmp_path, tokenizer, transform, on_bad_image="skip")
    with caplog.at_level(logging.WARNING, logger="datamodules.coco"):
        substitute = data[1]  # garbage, then truncated, then the "fourth" sample
        data[1]
    assert substitute["bad_image"] is True and substitute["caption_id"] == 4
    assert torch.equal(substitute["text"], data[3]["text"]) and data[3]["bad_image"] is False
    messages = [r.getMessage() for r in caplog.records if r.name == "datamodules.coco"]
    assert sum("garbage.png" in m for m in messages) == 1 and sum("truncated.png" in m for m in messages) == 1


def test_only_unreadable_images_raise_after_bounded_tries_with_skip(tmp_path, tokenizer, transform):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "bad.png").write_bytes(b"garbage")
    write_coco(tmp_path / "captions.json", {1: "bad.png"}, [(1, 1, "a"), (2, 1, "b")])
    with pytest.raises(UnreadableImageError, match="consecutive unreadable images"):
        dataset(tmp_path, tokenizer, transform, on_bad_image="skip")[0]


def test_over_long_captions_are_counted_and_truncated_with_eot_last(tmp_path, tokenizer, transform):
    write_png(tmp_path / "images" / "a.png")
    # "a" is one BPE token: 75 words + SOT + EOT fill the context exactly; 76 do not fit.
    captions = ["a " * 75, "a " * 76, "a " * 200, "short"]
    write_coco(tmp_path / "captions.json", {1: "a.png"}, [(i, 1, c) for i, c in enumerate(captions)])
    data = dataset(tmp_path, tokenizer, transform)
    assert data.num_truncated_captions == 2
    assert [data[i]["truncated"] for i in range(4)] == [False, True, True, False]
    assert data[2]["text"][-1] == EOT and torch.equal(data[2]["text"], tokens(tokenizer, captions[2])[0])


def test_empty_caption_is_an_error_naming_the_annotation(tmp_path, tokenizer, transform):
    write_png(tmp_path / "images" / "a.png")
    write_coco(tmp_path / "captions.json", {1: "a.png"}, [(7, 1, "a cat"), (8, 1, "  \n")])
    with pytest.raises(ValueError, match="annotation 8 has an empty caption"):
        dataset(tmp_path, tokenizer, transform)
    data = dataset(tmp_path, tokenizer, transform, on_bad_image="skip")
    assert len(data) == 1 and data.num_empty_captions == 1


def test_missing_or_invalid_annotation_file_is_an_error_naming_it(tmp_path, tokenizer, transform):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "captions.json"))):
        dataset(tmp_path, tokenizer, transform)
    (tmp_path / "captions.json").write_text('{"images": [')
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "captions.json")) + ".*not valid JSON"):
        dataset(tmp_path, tokenizer, transform)


# ----- odd images: bit depth, degenerate geometry, a size the annotations do not record ------------------
def test_a_16_bit_png_gives_the_sample_of_its_8_bit_version(tmp_path, tokenizer, transform):
    gray = np.random.default_rng(0).integers(0, 256, (48, 48), dtype=np.uint8)
    for folder, pixels in (("eight", gray), ("sixteen", gray.astype(np.uint16) * 257)):
        (tmp_path / folder / "images").mkdir(parents=True)
        Image.fromarray(pixels).save(tmp_path / folder / "images" / "a.png")
        write_coco(tmp_path / folder / "captions.json", {1: "a.png"}, [(1, 1, "a gray square")])
    eight, sixteen = (dataset(tmp_path / folder, tokenizer, transform)[0]["image"] for folder in ("eight", "sixteen"))
    assert torch.equal(sixteen, eight)  # PIL's own conversion would give a white image


# file name -> (file width, height); the annotations record each file's own size except "resized.png"'s.
ODD_IMAGES = {"good.png": (48, 48), "one_pixel.png": (1, 1), "sliver.png": (10000, 10), "resized.png": (40, 48)}
MASK_GRID = 4


def write_odd_images(root: Path) -> None:
    """Captions 1-4 on the images of ODD_IMAGES in order, caption 5 on the good one again."""
    (root / "images").mkdir(parents=True)
    for name, size in ODD_IMAGES.items():
        Image.new("RGB", size, (200, 30, 30)).save(root / "images" / name)
    images = [{"id": i, "file_name": name, "width": 48 if name == "resized.png" else size[0], "height": size[1]}
              for i, (name, size) in enumerate(ODD_IMAGES.items(), start=1)]
    annotations = [{"id": i, "image_id": i, "caption": "a red square"} for i in range(1, 5)]
    annotations.append({"id": 5, "image_id": 1, "caption": "a red square"})
    (root / "captions.json").write_text(json.dumps({"images": images, "annotations": annotations}))


def box_record(caption_id: int, box: list) -> dict:
    """A cache record whose one phrase has one box (original pixels, xyxy, score)."""
    caption = "a red square"
    return {"caption_id": caption_id, "image_id": 0, "caption": caption, "obj_spans": [], "comp_spans": [],
            "phrases": [{"text": caption, "kind": "object", "boxes": [box + [1.0]]}],
            "graph": {"caption": caption, "entities": [], "relations": [], "phrases": []}}


def odd_dataset(root: Path, tokenizer, **options) -> CocoCaptions:
    """With patch masks; each phrase box lies at the left end of its image (outside a sliver's centre crop)."""
    from datamodules.masks import PatchGeometry
    from datamodules.transforms import CropResize

    records = {i: box_record(i, [0, 0, 1, 1] if i == 2 else [0, 0, 10, 10]) for i in range(1, 6)}
    return dataset(root, tokenizer, CropResize(32, (0.5,) * 3, (0.5,) * 3), mask_records=records,
                   geometry=PatchGeometry(32, MASK_GRID, random_rectangle_prob=0.0), **options)


@pytest.mark.parametrize("index, name, reason", [
    (1, "one_pixel.png", f"shorter than {MASK_GRID} px"),
    (2, "sliver.png", "aspect ratio over 10:1"),
    (3, "resized.png", "the file is 40x48 but the annotations record 48x48"),
])
def test_odd_image_is_an_error_naming_the_file_and_why(tmp_path, tokenizer, index, name, reason):
    write_odd_images(tmp_path)
    data = odd_dataset(tmp_path, tokenizer)
    assert data[0]["patch_mask"].any()
    with pytest.raises(UnreadableImageError, match=f"{re.escape(name)}: .*{re.escape(reason)}"):
        data[index]


def test_odd_images_are_substituted_counted_and_logged_with_skip(tmp_path, tokenizer, caplog):
    write_odd_images(tmp_path)
    data = odd_dataset(tmp_path, tokenizer, on_bad_image="skip")
    with caplog.at_level(logging.WARNING, logger="datamodules.coco"):
        samples = [data[i] for i in range(len(data))]
    assert [s["bad_image"] for s in samples] == [False, True, True, True, False]
    assert [s["caption_id"] for s in samples] == [1, 5, 5, 5, 5]  # the next usable sample stands in
    assert all(s["patch_mask"].any() for s in samples)  # never the empty mask of a sliver's crop
    messages = [r.getMessage() for r in caplog.records if r.name == "datamodules.coco"]
    assert all(sum(name in m for m in messages) == 1 for name in ("one_pixel.png", "sliver.png", "resized.png"))


def test_without_masks_only_the_size_and_the_aspect_ratio_matter(tmp_path, tokenizer, transform):
    write_odd_images(tmp_path)
    data = dataset(tmp_path, tokenizer, transform, on_bad_image="skip")
    assert [data[i]["bad_image"] for i in range(len(data))] == [False, False, True, True, False]


# ----- NegCLIP TSV --------------------------------------------------------------------------------------
def write_negclip_tsv(path: Path, rows: list) -> Path:
    """Rows of (title, filepath, neg_caption list[, neg_image list]), written the way pandas
    `to_csv(sep="\\t")` does."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter="\t")
        writer.writerow(["", "title", "filepath", "neg_caption", "neg_image"])
        for index, (title, filepath, negatives, *neg_image) in enumerate(rows):
            writer.writerow([index, title, filepath, repr(negatives), repr(neg_image[0] if neg_image else [1, 2, 3])])
    return path


def test_negclip_tsv_is_read_and_images_resolved(tmp_path, tokenizer, transform):
    nested = "coco/val2014/COCO_val2014_000000391895.jpg"
    flat = "coco/val2014/COCO_val2014_000000000042.jpg"
    write_png(tmp_path / "images" / nested)
    write_png(tmp_path / "images" / os.path.basename(flat))
    tsv = write_negclip_tsv(tmp_path / "train.tsv", [
        ('A sign that says "Stop"\n', nested, ['A "Stop" that says sign .', "A sign that stops ."]),
        ("A dog on a bed.", flat, ["A bed on a dog ."]),
    ])
    data = CocoCaptions(tsv, tmp_path / "images", tokenizer, transform, num_hard_negatives=2)
    assert [(data[i]["image_id"], data[i]["caption_id"]) for i in range(2)] == [(391895, 0), (42, 1)]
    assert data.image_path(0) == str(tmp_path / "images" / nested)
    assert data.image_path(1) == str(tmp_path / "images" / os.path.basename(flat))
    assert torch.equal(data[0]["text"], tokens(tokenizer, 'A sign that says "Stop"')[0])
    assert torch.equal(data[1]["neg_text"], tokens(tokenizer, "A bed on a dog .", "A bed on a dog ."))
    assert read_negclip_tsv(str(tsv))[0].caption == 'A sign that says "Stop"'


def test_real_negclip_tsv_parses():
    records = read_negclip_tsv(str(fixture("negclip/valid_neg_clip.tsv")))
    # 4,848 lines, but 8 quoted captions span two lines: 4,839 rows after the header.
    assert len(records) == 4839
    first = records[0]
    assert first.caption == "A child holding a flowered umbrella and petting a yak."
    assert (first.caption_id, first.image_id) == (0, 184613)
    assert first.file_name == "coco/val2014/COCO_val2014_000000184613.jpg"
    assert first.neg_captions == ("A umbrella holding a flowered child and petting a yak .",
                                  "A child petting a flowered umbrella and holding a yak .")
    for index, record in enumerate(records[:50]):
        assert record.caption_id == index and record.caption == record.caption.strip() != ""
        assert record.image_id == int(re.search(r"_(\d{12})\.jpg$", record.file_name).group(1))
        assert record.neg_captions and all(isinstance(n, str) and n for n in record.neg_captions)
    assert all(r.caption == r.caption.strip() for r in records)


# ----- loaders ------------------------------------------------------------------------------------------
@pytest.fixture
def eleven_samples(tmp_path, tokenizer, transform) -> CocoCaptions:
    write_png(tmp_path / "images" / "a.png", size=IMAGE_SIZE)
    write_coco(tmp_path / "captions.json", {1: "a.png"}, [(i, 1, f"caption {i}") for i in range(11)], IMAGE_SIZE)
    return dataset(tmp_path, tokenizer, transform)


def epoch_batches(data: CocoCaptions, rank: int, epoch: int, seed: int = 0) -> list:
    loader = build_dataloader(data, batch_size=2, num_workers=0, world_size=2, rank=rank, train=True,
                              seed=seed)
    loader.sampler.set_epoch(epoch)
    return [batch["caption_id"].tolist() for batch in loader]


def test_train_loader_shards_are_disjoint_full_and_equal(eleven_samples):
    rank0, rank1 = epoch_batches(eleven_samples, 0, 0), epoch_batches(eleven_samples, 1, 0)
    assert len(rank0) == len(rank1) == 2  # 11 samples -> 5 per rank -> 2 full batches of 2
    assert all(len(batch) == 2 for batch in rank0 + rank1)
    assert not set(sum(rank0, [])) & set(sum(rank1, []))


def test_train_order_is_seeded_by_epoch(eleven_samples):
    assert epoch_batches(eleven_samples, 0, 1) == epoch_batches(eleven_samples, 0, 1)
    assert epoch_batches(eleven_samples, 0, 1) != epoch_batches(eleven_samples, 0, 0)
    assert epoch_batches(eleven_samples, 0, 1, seed=1) != epoch_batches(eleven_samples, 0, 1, seed=0)


def data_config(root: Path, **overrides):
    fields = dict(root=str(root), train_annotations="captions.json", train_images="images",
                  val_annotations="captions.json", val_images="images", batch_size=2, num_workers=0)
    return OmegaConf.structured(DataConfig(**{**fields, **overrides}))


def test_datamodule_builds_splits_and_rank_sharded_loaders(coco_dir, tokenizer, transform):
    augment = open_clip.image_transform(IMAGE_SIZE, is_train=True)
    module = CocoDataModule(data_config(coco_dir, val_batch_size=3, train_augment=False), tokenizer,
                            augment, transform, seed=5)
    module.setup("validate")
    assert module.train_dataset is None and len(module.val_dataset) == 4
    module.setup("fit")
    assert module.train_dataset.transform is transform  # train_augment=False
    module.trainer = SimpleNamespace(world_size=2, global_rank=1)
    train, val = module.train_dataloader(), module.val_dataloader()
    assert (train.sampler.num_replicas, train.sampler.rank, train.sampler.seed) == (2, 1, 5)
    assert train.drop_last and train.sampler.shuffle and train.batch_size == 2
    assert not val.drop_last and not val.sampler.shuffle and val.batch_size == 3


def test_training_set_smaller_than_one_global_batch_is_an_error(coco_dir, tokenizer, transform):
    module = CocoDataModule(data_config(coco_dir, batch_size=3), tokenizer, transform, transform)
    module.setup("fit")
    module.trainer = SimpleNamespace(world_size=2, global_rank=0)
    with pytest.raises(ValueError, match="4 samples, fewer than one global batch"):
        module.train_dataloader()


class EpochRecorder(L.LightningModule):
    """Records the training sampler's epoch at the start of every epoch."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.sampler_epochs = []

    def on_train_epoch_start(self) -> None:
        self.sampler_epochs.append(self.trainer.train_dataloader.sampler.epoch)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return (self.weight * batch["image"].mean()) ** 2

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_lightning_sets_the_epoch_of_our_sampler(coco_dir, tokenizer, transform):
    module = CocoDataModule(data_config(coco_dir, val_batch_size=4), tokenizer, transform, transform)
    recorder = EpochRecorder()
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=1, use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(recorder, datamodule=module)
    assert recorder.sampler_epochs == [0, 1, 2]


def augmented_epoch(data: CocoCaptions, epoch: int, num_workers: int) -> torch.Tensor:
    loader = build_dataloader(data, batch_size=4, num_workers=num_workers, world_size=1, rank=0, train=True)
    loader.sampler.set_epoch(epoch)
    return torch.cat([batch["image"] for batch in loader])


def test_augmentation_is_a_function_of_seed_epoch_and_index(tmp_path, tokenizer):
    """Same crops with 0 or 2 workers (so a resumed run sees the same ones); new crops next epoch."""
    for image_id in range(8):
        write_png(tmp_path / "images" / f"{image_id}.png", seed=image_id)
    write_coco(tmp_path / "captions.json", {i: f"{i}.png" for i in range(8)},
               [(i, i, f"caption {i}") for i in range(8)])
    random_crop = open_clip.image_transform(IMAGE_SIZE, is_train=True)
    data = CocoCaptions(tmp_path / "captions.json", tmp_path / "images", tokenizer, random_crop)
    torch.manual_seed(0)
    before = torch.rand(1)
    in_process = augmented_epoch(data, 0, num_workers=0)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(1), before)  # loading did not consume the global RNG
    assert torch.equal(in_process, augmented_epoch(data, 0, num_workers=2))
    assert not torch.equal(in_process, augmented_epoch(data, 1, num_workers=0))


def globally_seeded(monkeypatch):
    """The crops as they were drawn before per-sample generators: torch.manual_seed(seed) on the global generator
    right before each transform call, which then draws from it."""
    def seed_globally(seed):
        if seed is not None:
            torch.manual_seed(seed)
        return None

    monkeypatch.setattr(coco, "crop_generator", seed_globally)


def forbid_global_seeding(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a global generator was seeded or forked")

    for owner, name in ((torch, "manual_seed"), (torch, "seed"), (torch.random, "fork_rng"),
                        (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all")):
        monkeypatch.setattr(owner, name, refused)


def samples_of(data: CocoCaptions, keys) -> list:
    return [data[key] for key in keys]


def assert_same_samples(first: list, second: list) -> None:
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key], key


def assert_samples_are_the_global_seedings(data, keys, monkeypatch) -> list:
    """`data[key]` for each (index, seed) key touches no global generator, and equals what seeding the global one
    before each transform call drew; returns the samples."""
    state = torch.get_rng_state()
    with monkeypatch.context() as forbidden:
        forbid_global_seeding(forbidden)
        new = samples_of(data, keys)
    assert torch.equal(torch.get_rng_state(), state)
    with monkeypatch.context() as old:
        globally_seeded(old)
        assert_same_samples(new, samples_of(data, keys))
    return new


def test_per_sample_generators_draw_the_crops_of_the_global_seeding_and_leave_it_alone(negclip_dir, tokenizer,
                                                                                      monkeypatch):
    """Sample and neighbour crops from per-sample generators equal those drawn under torch.manual_seed(seed),
    exactly, for open_clip's training transform; no global generator (CPU or CUDA) is seeded, forked or consumed."""
    data = negclip(negclip_dir, tokenizer, open_clip.image_transform(IMAGE_SIZE, is_train=True))
    keys = [(index, seed) for index in range(len(data)) for seed in (0, 17, 2 ** 31 + 5)]
    torch.manual_seed(3)
    new = assert_samples_are_the_global_seedings(data, keys, monkeypatch)
    assert len({tuple(sample["image"].flatten()[:8].tolist()) for sample in new}) > len(data)  # crops vary by seed


# ----- NegCLIP hard negatives: drawn at every access, seeded; neg_image neighbours ---------------------
# Row i: image id i + 1, caption "caption i", 1 + i % 3 negatives, neg_image = the next three rows.
NEIGHBOURS = {i: [(i + 1) % 6, (i + 2) % 6, (i + 3) % 6] for i in range(6)}


def negclip_rows() -> list:
    return [(f"caption {i}", f"coco/val2014/{negclip_image(i)}", [f"neg {i} {c}" for c in "abc"[:1 + i % 3]],
             NEIGHBOURS[i]) for i in range(6)]


def negclip_image(row: int) -> str:
    return f"COCO_val2014_{row + 1:012d}.jpg"


def write_negclip_dir(root: Path, rows: list) -> Path:
    for i in range(len(rows)):
        write_png(root / "images" / negclip_image(i), seed=i)  # a flat folder: the TSV's fallback path
    write_negclip_tsv(root / "train.tsv", rows)
    return root


@pytest.fixture
def negclip_dir(tmp_path) -> Path:
    return write_negclip_dir(tmp_path, negclip_rows())


def negclip(root: Path, tokenizer, transform, **options) -> CocoCaptions:
    options = {"num_hard_negatives": 1, "hard_negative_images": True, **options}
    return CocoCaptions(root / "train.tsv", root / "images", tokenizer, transform, **options)


def position_in(table: torch.Tensor, row: torch.Tensor) -> int:
    """Which row of `table` [N, L] equals `row` [L] (it must be one of them)."""
    matches = torch.nonzero((table == row).all(-1)).flatten().tolist()
    assert len(matches) == 1, "not one of the expected captions"
    return matches[0]


def test_a_hard_caption_is_drawn_at_random_at_every_access(negclip_dir, tokenizer, transform):
    data = negclip(negclip_dir, tokenizer, transform, hard_negative_images=False)
    three = tokens(tokenizer, "neg 2 a", "neg 2 b", "neg 2 c")
    # Uniform over 3: all are seen in 40 unseeded accesses but with probability 3 (2/3)^40 ~ 3e-7.
    assert {position_in(three, data[2]["neg_text"][0]) for _ in range(40)} == {0, 1, 2}


def test_draws_are_a_function_of_the_augmentation_seed(negclip_dir, tokenizer, transform):
    data = negclip(negclip_dir, tokenizer, transform)
    first, again = data[(2, 7)], data[(2, 7)]
    for key in ("neg_text", "neg_image", "neg_image_text", "neg_image_neg_text"):
        assert torch.equal(first[key], again[key]), key
    assert first["neg_image_id"] == again["neg_image_id"]
    three = tokens(tokenizer, "neg 2 a", "neg 2 b", "neg 2 c")
    draws = [data[(2, seed)] for seed in range(30)]
    assert {position_in(three, s["neg_text"][0]) for s in draws} == {0, 1, 2}
    assert {s["neg_image_id"] for s in draws} == {row + 1 for row in NEIGHBOURS[2]}


def test_choices_are_uniform_distinct_while_possible_and_cycled():
    rng = np.random.default_rng(0)
    one_of_three = np.bincount([draw_positions(rng, 3, 1)[0] for _ in range(6000)], minlength=3)
    assert np.all(np.abs(one_of_three - 2000) < 200)  # binomial sd ~37
    assert all(len(set(draw_positions(rng, 3, 2).tolist())) == 2 for _ in range(50))
    assert sorted(draw_positions(rng, 2, 5).tolist()) in ([0, 0, 0, 1, 1], [0, 0, 1, 1, 1])
    table = NeighbourTable([[4, 7, 9], [], [2]])
    neighbours = np.bincount([table.draw(0, rng) for _ in range(6000)], minlength=10)
    assert neighbours.sum() == neighbours[[4, 7, 9]].sum() and np.all(np.abs(neighbours[[4, 7, 9]] - 2000) < 200)
    assert table.anchor_rows.tolist() == [0, 2]


def epoch_draws(data: CocoCaptions, epoch: int, num_workers: int = 0, batches_done: int = 0) -> list:
    """Per sample of a seeded training epoch: caption id, hard caption, neighbour id, neighbour's hard caption."""
    loader = build_dataloader(data, batch_size=2, num_workers=num_workers, world_size=1, rank=0, train=True,
                              seed=3)
    loader.sampler.set_epoch(epoch)
    if batches_done:
        loader.load_state_dict({"epoch": epoch, "batches_done": batches_done})  # what a resume does
    return [(int(b["caption_id"][i]), b["neg_text"][i, 0].tolist(), int(b["neg_image_id"][i]),
             b["neg_image_neg_text"][i, 0].tolist()) for b in loader for i in range(len(b["caption_id"]))]


def test_draws_change_with_the_epoch_and_are_the_same_with_workers_and_after_a_resume(negclip_dir, tokenizer,
                                                                                   transform):
    data = negclip(negclip_dir, tokenizer, transform)
    epoch0 = epoch_draws(data, 0)
    assert len(epoch0) == 6
    assert epoch_draws(data, 0, num_workers=2) == epoch0
    assert epoch_draws(data, 0, batches_done=1) == epoch0[2:]  # a run resumed after one batch
    by_caption = lambda draws: {d[0]: d[1:] for d in draws}  # noqa: E731
    assert by_caption(epoch_draws(data, 1)) != by_caption(epoch0)


def test_the_neighbour_joins_with_its_own_image_caption_and_hard_caption(negclip_dir, tokenizer, transform):
    data, rows = negclip(negclip_dir, tokenizer, transform), negclip_rows()
    for seed in range(8):
        sample = data[(1, seed)]
        neighbour = sample["neg_image_id"] - 1
        assert neighbour in NEIGHBOURS[1]
        title, _, negatives, _ = rows[neighbour]
        assert torch.equal(sample["text"], tokens(tokenizer, "caption 1")[0])
        assert torch.equal(sample["neg_image_text"], tokens(tokenizer, title)[0])
        position_in(tokens(tokenizer, *negatives), sample["neg_image_neg_text"][0])
        with Image.open(negclip_dir / "images" / negclip_image(neighbour)) as image:
            assert torch.equal(sample["neg_image"], transform(image.convert("RGB")))


def test_a_batch_holds_2b_images_and_4b_texts_with_the_neighbours_own_captions(negclip_dir, tokenizer, transform):
    loader = build_dataloader(negclip(negclip_dir, tokenizer, transform), batch_size=3, num_workers=0,
                              world_size=1, rank=0, train=True)
    batch = next(iter(loader))
    images = torch.cat([batch["image"], batch["neg_image"]])
    texts = torch.cat([batch["text"], batch["neg_image_text"], batch["neg_text"].flatten(0, 1),
                       batch["neg_image_neg_text"].flatten(0, 1)])
    assert images.shape == (6, 3, IMAGE_SIZE, IMAGE_SIZE) and texts.shape == (12, 77)
    rows = negclip_rows()
    for i, caption_id in enumerate(batch["caption_id"].tolist()):
        neighbour = int(batch["neg_image_id"][i]) - 1
        assert neighbour in NEIGHBOURS[caption_id]
        assert torch.equal(batch["neg_image_text"][i], tokens(tokenizer, rows[neighbour][0])[0])
        position_in(tokens(tokenizer, *rows[caption_id][2]), batch["neg_text"][i, 0])
        position_in(tokens(tokenizer, *rows[neighbour][2]), batch["neg_image_neg_text"][i, 0])


def test_neg_image_indices_outside_the_file_are_an_error_or_counted_skips(tmp_path, tokenizer, transform):
    rows = negclip_rows()
    rows[2] = (*rows[2][:3], [3, 99, -1])
    rows[4] = (*rows[4][:3], [6, 7])  # nothing left: not trained on, still row 3's neighbour
    write_negclip_dir(tmp_path, rows)
    with pytest.raises(ValueError, match=r"train\.tsv: 4 neg_image indices lie outside the file's 6 data rows "
                                         r"\(row 2 lists 99, row 2 lists -1, row 4 lists 6, row 4 lists 7\).*skip"):
        negclip(tmp_path, tokenizer, transform)
    data = negclip(tmp_path, tokenizer, transform, on_bad_image="skip")
    counts = data.neighbour_counts
    assert (counts.out_of_range, counts.unavailable, counts.without_neighbour) == (4, 0, 1)
    assert [data[i]["caption_id"] for i in range(len(data))] == [0, 1, 2, 3, 5]
    assert {data[(2, seed)]["neg_image_id"] for seed in range(10)} == {4}  # row 2 keeps row 3 only
    assert {data[(3, seed)]["neg_image_id"] for seed in range(30)} == {5, 6, 1}  # rows 4, 5, 0
    assert "1 samples without a neighbour" in data.summary()


def test_rows_the_dataset_does_not_hold_are_never_drawn(negclip_dir, tokenizer, transform):
    excluded = negclip(negclip_dir, tokenizer, transform, exclude_image_ids={4})  # row 3: listed by rows 0, 1, 2
    assert excluded.neighbour_counts.unavailable == 3 and len(excluded) == 5
    assert 4 not in {excluded[(i, seed)]["neg_image_id"] for i in range(len(excluded)) for seed in range(8)}
    first_three = negclip(negclip_dir, tokenizer, transform, max_samples=3)  # row 2 lists rows 3, 4, 5 only
    counts = first_three.neighbour_counts
    assert (counts.unavailable, counts.without_neighbour, len(first_three)) == (1 + 2 + 3, 1, 2)
    (negclip_dir / "images" / negclip_image(5)).unlink()  # row 5: listed by rows 2, 3, 4
    with pytest.raises(FileNotFoundError, match=negclip_image(5)):
        negclip(negclip_dir, tokenizer, transform)
    missing = negclip(negclip_dir, tokenizer, transform, on_bad_image="skip")
    assert missing.neighbour_counts.unavailable == 3 and len(missing) == 5
    assert 6 not in {missing[(i, seed)]["neg_image_id"] for i in range(len(missing)) for seed in range(8)}


def test_an_unreadable_neighbour_image_is_an_error_or_substituted(negclip_dir, tokenizer, transform):
    (negclip_dir / "images" / negclip_image(1)).write_bytes(b"not an image")  # row 0's neighbour 1 of 3
    strict = negclip(negclip_dir, tokenizer, transform)
    with pytest.raises(UnreadableImageError, match=negclip_image(1)):
        for seed in range(30):
            strict[(0, seed)]
    samples = [negclip(negclip_dir, tokenizer, transform, on_bad_image="skip")[(0, seed)] for seed in range(30)]
    # Drawing row 1 as the neighbour replaces the sample by the next readable one: row 1 is unreadable itself,
    # so row 2, whose neighbours 3, 4, 5 are readable.
    assert {(s["bad_image"], s["caption_id"]) for s in samples} == {(False, 0), (True, 2)}
    assert all(s["neg_image_id"] != 2 for s in samples)


def test_hard_negative_images_need_the_neg_image_column(coco_dir, tmp_path, tokenizer, transform):
    with pytest.raises(ValueError, match=r"captions\.json: 4 of 4 annotations have no neg_image"):
        dataset(coco_dir, tokenizer, transform, hard_negative_images=True)
    rows = negclip_rows()
    rows[3] = (*rows[3][:3], "4, 5")  # written as a quoted string, not a list
    write_negclip_tsv(tmp_path / "bad.tsv", rows)
    with pytest.raises(ValueError, match=r"bad\.tsv: row 3 has a neg_image that is not a list of row indices"):
        read_negclip_tsv(str(tmp_path / "bad.tsv"))


def test_only_the_training_split_gets_neighbours(negclip_dir, tokenizer, transform):
    config = data_config(negclip_dir, train_annotations="train.tsv", val_annotations="train.tsv")
    negatives = OmegaConf.structured(HardNegativesConfig(captions=1, images=True))
    module = CocoDataModule(config, tokenizer, transform, transform, hard_negatives=negatives)
    module.setup("fit")
    assert {"neg_image", "neg_image_text", "neg_image_neg_text", "neg_text"} <= set(module.train_dataset[0])
    assert not {"neg_image", "neg_text"} & set(module.val_dataset[0])


def test_real_negclip_tsv_neighbours_are_rows_of_the_file():
    tsv = str(fixture("negclip/valid_neg_clip.tsv"))
    records = read_negclip_tsv(tsv)
    assert records[0].neg_image_rows == (2973, 1515, 2235)
    table, counts = build_neighbour_table(records, len(records), "error", tsv)
    assert (counts.out_of_range, counts.unavailable, counts.without_neighbour) == (0, 0, 0)
    assert len(table.anchor_rows) == len(records) and np.all(table.counts == 3)

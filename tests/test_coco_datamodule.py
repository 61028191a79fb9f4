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

from datamodules.annotations import read_annotation_file, read_negclip_tsv
from datamodules.coco import CocoCaptions, CocoDataModule, UnreadableImageError, build_dataloader
from lightning_modules.config import DataConfig

REAL_NEGCLIP_TSV = Path(__file__).resolve().parents[2] / "shared" / "data" / "negclip" / "valid_neg_clip.tsv"
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


def write_coco(path: Path, file_names: dict, annotations: list) -> Path:
    """A captions JSON: `file_names` maps image id -> file name; annotations are (id, image_id, caption[, negs])."""
    document = {"images": [{"id": i, "file_name": name, "height": 48, "width": 48}
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
    # Three negatives, K=2: the first two.
    assert torch.equal(data[1]["neg_text"], tokens(tokenizer, "a blue square", "a green square"))
    assert torch.equal(data[2]["neg_text"], tokens(tokenizer, "Two red triangles.", "One green triangle."))
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


# ----- NegCLIP TSV --------------------------------------------------------------------------------------
def write_negclip_tsv(path: Path, rows: list) -> Path:
    """Rows of (title, filepath, neg_caption list), written the way pandas `to_csv(sep="\\t")` does."""
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, delimiter="\t")
        writer.writerow(["", "title", "filepath", "neg_caption", "neg_image"])
        for index, (title, filepath, negatives) in enumerate(rows):
            writer.writerow([index, title, filepath, repr(negatives), "[1, 2, 3]"])
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


@pytest.mark.skipif(not REAL_NEGCLIP_TSV.is_file(), reason="the shared data folder is not beside the repo")
def test_real_negclip_tsv_parses():
    records = read_negclip_tsv(str(REAL_NEGCLIP_TSV))
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
    write_coco(tmp_path / "captions.json", {1: "a.png"}, [(i, 1, f"caption {i}") for i in range(11)])
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

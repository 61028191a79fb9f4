"""COCO 5k and Flickr30k 1k image-text retrieval on the Karpathy test split (R@1/5/10 both ways).

Annotation files, the first one found under `root` is read (option `annotation_file` picks one explicitly):

| format | COCO (`coco_retrieval`) | Flickr30k (`flickr30k_retrieval`) | image path |
|---|---|---|---|
| Karpathy | `dataset_coco.json` | `dataset_flickr30k.json` | `<images>/[<filepath>/]<filename>` |
| BLIP/ALBEF | `coco_karpathy_<split>.json` | `flickr30k_<split>.json` | `<images>/<image>` |
| COCO captions | option `annotation_file` | option `annotation_file` | `<images>/<file_name>` |

- Karpathy: `{"images": [{"filepath" (COCO only), "filename", "split", "sentences": [{"raw", ...}], ...}]}`
  (COCO's `filepath` is "val2014" or "train2014");
  the images whose `split` equals option `split` (default "test": 5,000 / 1,000 images) are kept.
- BLIP: a list of `{"image": "val2014/COCO_val2014_....jpg", "caption": [captions]}` (the val/test files;
  the train file has one caption per record and is not a retrieval split).
- COCO captions: `{"images": [{"id", "file_name"}], "annotations": [{"image_id", "caption"}]}`
  (clip_benchmark's `coco_test_karpathy.json`), images in file order, captions in annotation order.

Option `images` is the folder the paths above are joined to; default `<root>/flickr30k-images` for the
Karpathy Flickr file (bare file names) and `<root>` otherwise (COCO paths carry `val2014/`, BLIP Flickr paths
`flickr30k-images/`).

Captions are used raw (clip_benchmark's convention), stripped of surrounding whitespace; an empty one (or one
that `pre_caption` empties) is a damaged file, refused. Option
`pre_caption=True` applies BLIP's `pre_caption` instead (`aro.pre_caption`: lowercase, `.!"()*#:;~` to
spaces, at most 30 words), as ARO's retrieval loaders do (docs/evaluation.md#traps: reproductions of COCO
I2T R@5 differ by about 2 points between protocols).

Scoring: every caption is a text-to-image query whose single correct image is its own; every image is an
image-to-text query whose correct set is all of its captions. A query's rank is the number of wrong
candidates scoring at least as high as its best correct candidate (a tie counts against, like every
benchmark here); R@K is the share of queries with rank < K. clip_benchmark takes `torch.topk`, which breaks
ties by index, so numbers can differ where scores tie exactly (a caption string repeated under another
image does); `i2t_tied` / `t2i_tied` count the queries with such a tie.

The [images, captions] matrix (5,000 x 25,010 for COCO) is never held whole: it is scored in image chunks
(option `chunk_size`). I2T ranks come from each chunk's rows; T2I ranks need each caption's score with its
own image first, so a second pass over the same chunks counts the images that beat it. The two passes make
the same `scorer.score` calls, which must return the same values (checked).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from evaluation.benchmarks.annotations import read_json, require, required_text, required_texts
from evaluation.benchmarks.aro import pre_caption as blip_pre_caption
from evaluation.benchmarks.base import Benchmark, ImageRef, MissingBenchmarkData, Outcome, percent, Scorer, unique
from evaluation.benchmarks.sources import DataSource, published

RECALL_AT = (1, 5, 10)


@dataclass
class CaptionedImages:
    """Retrieval data: images, all captions in image order, and the image index of every caption."""

    images: list[ImageRef]
    captions: list[str]
    caption_image: np.ndarray


class Ranks(NamedTuple):
    """Per-query strict rank of the first correct candidate, and how many wrong candidates tie with it."""

    rank: np.ndarray
    ties: np.ndarray


class _Retrieval(Benchmark):
    """Shared loader and scorer for the Karpathy-split retrieval benchmarks.

    Args:
        root: folder with one of the annotation files (see the module docstring).
        images: folder the annotation's image paths are relative to (default depends on the format).
        split: Karpathy split to keep ("test"; BLIP files exist for "val" and "test").
        annotation_file: a COCO-captions-format JSON (relative to root, or absolute) read instead.
        pre_caption: apply BLIP's caption normalisation (ARO's protocol) instead of raw captions.
        chunk_size: images scored per `scorer.score` call.
    """

    headline = tuple(f"{d}_r{k}" for d in ("i2t", "t2i") for k in RECALL_AT) + ("rsum",)
    karpathy_file: str = ""
    blip_file: str = ""  # formatted with the split
    karpathy_image_dir: str = ""  # where Karpathy's bare file names live, under root, by default

    def __init__(self, root: str | Path, images: str | Path | None = None, split: str = "test",
                 annotation_file: str | Path | None = None, pre_caption: bool = False,
                 chunk_size: int = 1024):
        self.split = split
        self.annotation_file = str(annotation_file) if annotation_file is not None else None
        super().__init__(root)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.images = Path(images) if images is not None else None
        self.pre_caption, self.chunk_size = pre_caption, chunk_size

    def required_files(self) -> list[str]:
        if self.annotation_file is not None:
            return [self.annotation_file]
        return [f"{self.karpathy_file} | {self.blip_file.format(split=self.split)}"]

    @cached_property
    def data(self) -> CaptionedImages:
        """Images and captions of the split, read from the first annotation file found."""
        if self.annotation_file is not None:
            path = self.root / self.annotation_file
            records = read_coco_captions(path, self.images or self.root)
        elif (self.root / self.karpathy_file).exists():
            path, images = self.root / self.karpathy_file, self.images or self.root / self.karpathy_image_dir
            records = read_karpathy(path, images, self.split)
        else:
            path = self.root / self.blip_file.format(split=self.split)
            records = read_blip(path, self.images or self.root)
        clean = blip_pre_caption if self.pre_caption else str.strip  # ARO's max_words=30
        cleaned = [(image, [clean(c) for c in captions]) for image, captions in records]
        return captioned_images(cleaned, path)

    def image_refs(self) -> list[ImageRef]:
        return unique(self.data.images)

    def outcomes(self, scorer: Scorer, progress: bool = False) -> list[Outcome]:
        data = self.data
        scorer.prepare(unique(data.images), unique(data.captions), progress=progress)

        def score_rows(start: int, stop: int) -> np.ndarray:
            return np.asarray(scorer.score(data.images[start:stop], data.captions))

        i2t, t2i = retrieval_ranks(score_rows, data.caption_image, len(data.images), self.chunk_size, progress)
        return ([{"id": f"i2t/{n}", "direction": "i2t", "rank": int(r), "ties": int(t)}
                 for n, (r, t) in enumerate(zip(i2t.rank, i2t.ties))]
                + [{"id": f"t2i/{n}", "direction": "t2i", "rank": int(r), "ties": int(t)}
                   for n, (r, t) in enumerate(zip(t2i.rank, t2i.ties))])

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        """R@K per direction (percent), their sum `rsum`, query counts and tied-query counts."""
        result: dict[str, float] = {}
        for direction in ("i2t", "t2i"):
            queries = [o for o in outcomes if o["direction"] == direction]
            for k in RECALL_AT:
                result[f"{direction}_r{k}"] = percent([o["rank"] < k for o in queries])
            result[f"{direction}_tied"] = sum(1 for o in queries if o.get("ties", 0) > 0)
        result["rsum"] = sum(result[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in RECALL_AT)
        result["images"] = sum(1 for o in outcomes if o["direction"] == "i2t")
        result["captions"] = sum(1 for o in outcomes if o["direction"] == "t2i")
        return result


class CocoRetrieval(_Retrieval):
    """COCO Karpathy 5k test; arguments as `_Retrieval` (images default `<root>`, holding `val2014/`)."""

    name = "coco_retrieval"
    description = "COCO 5k (Karpathy test) image-text retrieval: R@1/5/10 both ways (%)"
    data_source = DataSource(
        home="https://cs.stanford.edu/people/karpathy/deepimagesent/",
        licence="annotations CC BY 4.0 (COCO); images: Flickr terms",
        size="dataset_coco.json 140 MB (or BLIP's coco_karpathy_test.json, 2 MB); images: COCO val2014, 6.2 GB",
        by_hand="caption_datasets.zip from the page above (dataset_coco.json) or https://storage.googleapis.com/"
                "sfr-vision-language-research/datasets/coco_karpathy_test.json into <root>; COCO val2014 images "
                "(http://images.cocodataset.org/zips/val2014.zip) unzipped into <root>")
    published = published({"i2t_r1": 50.12, "i2t_r5": 75.0, "i2t_r10": 83.54, "t2i_r1": 30.45, "t2i_r5": 55.97,
                           "t2i_r10": 66.86}, "vl_compo")
    karpathy_file = "dataset_coco.json"
    blip_file = "coco_karpathy_{split}.json"


class Flickr30kRetrieval(_Retrieval):
    """Flickr30k Karpathy 1k test; arguments as `_Retrieval` (Karpathy file: images default
    `<root>/flickr30k-images`; BLIP file: `<root>`)."""

    name = "flickr30k_retrieval"
    description = "Flickr30k 1k (Karpathy test) image-text retrieval: R@1/5/10 both ways (%)"
    data_source = DataSource(
        home="https://cs.stanford.edu/people/karpathy/deepimagesent/",
        licence="research use (Flickr30k's terms, by a sign-up form)",
        size="dataset_flickr30k.json 36 MB (or BLIP's flickr30k_test.json); images 4.2 GB",
        by_hand="caption_datasets.zip from the page above (dataset_flickr30k.json) or https://storage.googleapis."
                "com/sfr-vision-language-research/datasets/flickr30k_test.json into <root>; images after the form "
                "at https://forms.illinois.edu/sec/229675, unzipped into <root>/flickr30k-images")
    published = published({"i2t_r1": 78.8, "i2t_r5": 94.9, "i2t_r10": 98.2, "t2i_r1": 58.76, "t2i_r5": 83.5,
                           "t2i_r10": 90.04}, "vl_compo")
    karpathy_file = "dataset_flickr30k.json"
    blip_file = "flickr30k_{split}.json"
    karpathy_image_dir = "flickr30k-images"


# --- annotation readers: each returns [(image, [raw captions])] in file order -----------------------------

def read_karpathy(path: Path, images: Path, split: str) -> list[tuple[ImageRef, list[str]]]:
    """Images of `split` from Karpathy's `dataset_*.json`; `filepath` (COCO only) sits between root and name."""
    data = _load_json(path, dict)
    _require(data, ("images",), path, "top level")
    records = []
    for index, entry in enumerate(data["images"]):
        _require(entry, ("filename", "split", "sentences"), path, f"images[{index}]")
        if entry["split"] != split:
            continue  # the file holds every split; only this one's captions are the benchmark's
        require(isinstance(entry["sentences"], list), f"{path}: images[{index}].sentences is not a list")
        captions = [required_text(_field(sentence, "raw", path, f"images[{index}].sentences[{k}]"),
                                  f"{path}: images[{index}].sentences[{k}]", "raw")
                    for k, sentence in enumerate(entry["sentences"])]
        folder = images / entry["filepath"] if "filepath" in entry else images
        records.append((ImageRef(str(folder / entry["filename"])), captions))
    require(bool(records), f"{path}: no image has split {split!r}")
    return records


def read_blip(path: Path, images: Path) -> list[tuple[ImageRef, list[str]]]:
    """BLIP/ALBEF `coco_karpathy_test.json` / `flickr30k_test.json`: `[{"image", "caption": [...]}]`."""
    records = []
    for index, entry in enumerate(_load_json(path, list)):
        _require(entry, ("image", "caption"), path, f"[{index}]")
        require(isinstance(entry["caption"], list), f"{path}: [{index}].caption is not a list of captions (a BLIP "
                                                    "train file has one per record; use the val/test files)")
        records.append((ImageRef(str(images / entry["image"])), required_texts(entry["caption"], f"{path}: [{index}]")))
    return records


def read_coco_captions(path: Path, images: Path) -> list[tuple[ImageRef, list[str]]]:
    """COCO captions format: `images[{id, file_name}]` and `annotations[{image_id, caption}]`."""
    data = _load_json(path, dict)
    _require(data, ("images", "annotations"), path, "top level")
    captions: dict[int, list[str]] = {}
    for index, annotation in enumerate(data["annotations"]):
        _require(annotation, ("image_id", "caption"), path, f"annotations[{index}]")
        caption = required_text(annotation["caption"], f"{path}: annotations[{index}]")
        captions.setdefault(annotation["image_id"], []).append(caption)
    records = []
    for index, image in enumerate(data["images"]):
        _require(image, ("id", "file_name"), path, f"images[{index}]")
        records.append((ImageRef(str(images / image["file_name"])), captions.pop(image["id"], [])))
    require(not captions, f"{path}: annotations refer to image ids not in images: {sorted(captions)[:5]}")
    return records


def captioned_images(records: Sequence[tuple[ImageRef, list[str]]], path: Path) -> CaptionedImages:
    """Flatten per-image caption lists read from `path`; an image without captions cannot be an I2T query, and a
    caption its cleaning left empty (`pre_caption` of punctuation only) would be scored as the empty string."""
    for image, captions in records:
        require(bool(captions), f"{path}: image {image.path} has no captions")
        for caption in captions:
            required_text(caption, f"{path}: image {image.path}", "caption (as cleaned)")
    return CaptionedImages(images=[image for image, _ in records],
                           captions=[c for _, captions in records for c in captions],
                           caption_image=np.array([i for i, (_, cs) in enumerate(records) for _ in cs], dtype=np.int64))


def _load_json(path: Path, kind: type):
    if not path.exists():
        raise MissingBenchmarkData(f"{path} does not exist")
    data = read_json(path)
    require(isinstance(data, kind), f"{path}: expected a JSON {kind.__name__} at top level, got {type(data).__name__}")
    return data


def _require(record: object, keys: Sequence[str], path: Path, where: str) -> None:
    require(isinstance(record, dict) and all(key in record for key in keys),
            f"{path}: {where} lacks one of the keys {list(keys)}")


def _field(record: object, key: str, path: Path, where: str):
    _require(record, (key,), path, where)
    return record[key]


# --- ranks from the chunked similarity matrix -------------------------------------------------------------

def retrieval_ranks(score_rows: Callable[[int, int], np.ndarray], caption_image: np.ndarray, n_images: int,
                    chunk_size: int, progress: bool = False) -> tuple[Ranks, Ranks]:
    """Strict I2T and T2I ranks from similarity rows `score_rows(start, stop) -> [stop - start, captions]`.

    Pass 1 gives every image's rank (its row is complete) and every caption's score with its own image;
    pass 2 counts, per caption, the other images scoring at least that. With a single chunk the first
    pass's matrix is reused.
    """
    n_captions = len(caption_image)
    i2t_rank, i2t_ties = np.zeros(n_images, np.int64), np.zeros(n_images, np.int64)
    gold = np.empty(n_captions)
    chunks = list(_chunks(n_images, chunk_size))
    last = None
    for start, stop in tqdm(chunks, desc="retrieval: image queries", disable=not progress):
        similarity, own = _checked_rows(score_rows, start, stop, n_captions), _own(caption_image, start, stop)
        best = np.where(own, similarity, -np.inf).max(axis=1, keepdims=True)
        i2t_rank[start:stop] = ((similarity >= best) & ~own).sum(axis=1)
        i2t_ties[start:stop] = ((similarity == best) & ~own).sum(axis=1)
        rows, columns = np.nonzero(own)
        gold[columns] = similarity[rows, columns]
        last = similarity
    t2i_rank, t2i_ties = np.zeros(n_captions, np.int64), np.zeros(n_captions, np.int64)
    for start, stop in tqdm(chunks, desc="retrieval: caption queries", disable=not progress or len(chunks) == 1):
        similarity = last if len(chunks) == 1 else _checked_rows(score_rows, start, stop, n_captions)
        own = _own(caption_image, start, stop)
        rows, columns = np.nonzero(own)
        if not np.array_equal(similarity[rows, columns], gold[columns]):
            raise RuntimeError("the scorer returned different similarities for the same images and captions; "
                               "retrieval ranks need a deterministic scorer")
        t2i_rank += ((similarity >= gold) & ~own).sum(axis=0)
        t2i_ties += ((similarity == gold) & ~own).sum(axis=0)
    return Ranks(i2t_rank, i2t_ties), Ranks(t2i_rank, t2i_ties)


def _chunks(total: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, size):
        yield start, min(start + size, total)


def _own(caption_image: np.ndarray, start: int, stop: int) -> np.ndarray:
    """[stop - start, captions] mask: caption j belongs to image start + i."""
    return caption_image[None, :] == np.arange(start, stop)[:, None]


def _checked_rows(score_rows: Callable[[int, int], np.ndarray], start: int, stop: int, n_captions: int) -> np.ndarray:
    similarity = np.asarray(score_rows(start, stop))
    if not np.issubdtype(similarity.dtype, np.floating):
        similarity = similarity.astype(np.float64)  # float32 stays float32: a COCO chunk is 100 MB, not 200
    if similarity.shape != (stop - start, n_captions):
        raise ValueError(f"scorer returned shape {similarity.shape}, expected {(stop - start, n_captions)}")
    if not np.isfinite(similarity).all():
        raise ValueError(f"scorer returned non-finite similarities for images {start}..{stop - 1}")
    return similarity

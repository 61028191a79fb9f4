"""Cola (Ray et al., NeurIPS 2023 Datasets and Benchmarks): attributes bound to the right objects.

Official files and rules are those of `arijitray1993/COLA`, commit 1fa52fb (`README.md`, `scripts/eval.py`).

Multi-object setting (`cola_multi_object`): `<root>/data/COLA_multiobjects_matching_benchmark.json`, a JSON list
of 210 records `[image 0 URL, caption 0, image 1 URL, caption 1]`; caption i describes image i and not the other.
Every URL is `https://cs-people.bu.edu/array/data/vg_gqa_images/<id>.jpg`, `<id>` the Visual Genome id (218
distinct images; GQA's images are VG's under the same names). An image is read from `<images>/<id>.jpg`, the URL's
file name, in a flat folder (default `<root>/images`): the layout that downloading the URLs into one folder
gives, and that of GQA's `images/` folder, so either can be used as it is. The leakage guard reads those names as
Visual Genome ids (`vg_images_by_id`). With s[i, j] = similarity(image i, caption j), `ColaMultiObjAcc`
(`scripts/eval.py`) counts an item correct iff

    s[0, 0] > s[1, 0]  and  s[1, 1] > s[0, 1]

that is, each caption picks its own image (the text-to-image direction; Winoground's "image" score), both strict,
so a tie is wrong; `tie` marks an item where either comparison is an exact tie. The headline is the mean over the
210 items (`np.mean` of the per-item booleans in the script's `__main__`).

Single-object setting (`cola_single_object`): `<root>/data/COLA_singleobjects_benchmark_<subset>.json` for the
subsets GQA, CLEVR and PACO (those present are read). Per `README.md` each holds the label captions ("square white
plate", 320 for GQA) and records `[image_file, objects_attributes_annotation, label, hard_list]`, `label` and
`hard_list` being 0/1 per label. `ColaSingleObjAP` (`scripts/eval.py`) scores every image against every label
and, per label: skips it if no image has it (`label` all 0) or if no image is in its hard set (`hard_list` all 0);
otherwise takes the average precision (torchmetrics `average_precision`) of the label's scores over the images of
its hard set, the label's presence as the target; the result is the unweighted mean over the labels kept. Here each
kept label is one item: its hard-set images x its caption, the outcome its AP (in percent). AP follows
torchmetrics' and scikit-learn's definition, sum over distinct score thresholds t (descending) of
(recall(t) - recall(t_previous)) x precision(t), so tied scores form one threshold and their order does not
matter; `tie` marks a label where a positive ties a negative (the AP then depends on the tie being one threshold).
A kept label whose hard set holds no positive has no AP (recall is 0/0): the torchmetrics releases whose call
signature `eval.py` uses (before 0.11, which made `task` required) compute it as 0/0, which would make the whole
mean NaN, and current releases return 0 with a warning. We leave such labels out of the mean, count them in
`undefined` and log a warning.

This loader was written without the single-object files' contents (they are large and were not inspected), so
their layout is taken from `README.md` and `scripts/eval.py`, which disagree: the README says "two keys: `labels`
and `data`", the script indexes `[0]` and `[1]`. Both are read: a JSON object with those keys or a two-element
list. A label is a string or, as third-party loaders of these files suggest, a pair `[[attribute, ...], object]`,
read as the words joined by spaces. A record may lack the annotation (the README says PACO's does): three elements
`[image_file, label, hard_list]` are read too. An image is `<images>/<subset>/<file name of image_file>` (default
`<root>/images/<subset>/`): only the file name of a record's path is used, the rest being wherever the authors
stored the images. GQA images are Visual Genome images named by id, and are reported as such to the leakage
guard.

Published numbers: the repository's README and files print none, and vl_compo does not report Cola, so
`published` is empty rather than unsourced.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import numpy as np

from evaluation.benchmarks.annotations import read_json, require, required_text
from evaluation.benchmarks.base import (VISUAL_GENOME, ImageOrigin, ImageRef, Item, ItemBenchmark, Outcome, Scorer,
                                        percent, visual_genome_id_from_name)
from evaluation.benchmarks.sources import DataSource, Download, published

log = logging.getLogger(__name__)

COMMIT = "1fa52fba9cff4e6ffb7bfcf3550838748347273b"
REPOSITORY = "https://github.com/arijitray1993/COLA"
RAW = f"https://raw.githubusercontent.com/arijitray1993/COLA/{COMMIT}"
MULTI_OBJECT_FILE = "data/COLA_multiobjects_matching_benchmark.json"
MULTI_OBJECT_SHA256 = "e2846dcc958e3277813ca572bce53db96fd5dd65caaa57ccd20dc1ce51d73ec0"
MULTI_OBJECT_SIZE = 56746
SUBSETS = ("GQA", "CLEVR", "PACO")


def single_object_file(subset: str) -> str:
    """The path of a single-object subset's file under root, as the authors publish it."""
    return f"data/COLA_singleobjects_benchmark_{subset}.json"


# ---------------------------------------------------------------- multi-object


def url_file_name(url: str) -> str:
    """The file name an image URL downloads to (`.../vg_gqa_images/2390970.jpg` -> `2390970.jpg`)."""
    return PurePosixPath(urlparse(url).path).name


def multi_object_scores(similarity: np.ndarray) -> dict[str, bool]:
    """`ColaMultiObjAcc` from s[image i, caption j]: each caption scores its own image strictly higher."""
    s = np.asarray(similarity, dtype=np.float64)
    caption_0, caption_1 = bool(s[0, 0] > s[1, 0]), bool(s[1, 1] > s[0, 1])
    return {"correct": caption_0 and caption_1, "caption_0": caption_0, "caption_1": caption_1,
            "tie": bool(s[0, 0] == s[1, 0] or s[1, 1] == s[0, 1])}


class ColaMultiObject(ItemBenchmark):
    """Cola multi-object matching (210 items of 2 images x 2 captions) from the official JSON file.

    Args:
        root: the folder holding `data/COLA_multiobjects_matching_benchmark.json` (the repository layout).
        images: the flat folder of `<Visual Genome id>.jpg` images (downloaded URLs, or GQA's `images/`);
            default `<root>/images`.

    Aggregates: `accuracy` (percent of items where each caption picks its own image), `ties`, `n`.
    """

    name = "cola_multi_object"
    headline = ("accuracy",)
    description = "Cola multi-object: each caption must pick its own image of a swapped pair (%)"
    data_source = DataSource(
        home=REPOSITORY,
        licence="MIT (repository LICENSE); images: Visual Genome, CC BY 4.0",
        size="one JSON file, 57 KB (210 items); 218 Visual Genome images, fetched one by one from their URLs",
        downloads=(Download(url=f"{RAW}/{MULTI_OBJECT_FILE}", target=MULTI_OBJECT_FILE, sha256=MULTI_OBJECT_SHA256,
                            size=MULTI_OBJECT_SIZE),),
        by_hand="Images: the records link 218 Visual Genome images, "
                "https://cs-people.bu.edu/array/data/vg_gqa_images/<id>.jpg; save each as <root>/images/<id>.jpg, "
                "e.g. from <root>: python -c \"import json; [print(u) for r in json.load(open("
                "'data/COLA_multiobjects_matching_benchmark.json')) for u in (r[0], r[2])]\" | sort -u | "
                "wget -nc -P images -i -  (their bytes are not pinned). GQA's images folder (images.zip from "
                "https://cs.stanford.edu/people/dorarad/gqa/download.html) holds them under the same names: pass it "
                "as the `images` option instead.",
    )
    published = published({}, "cola")
    vg_images_by_id = True

    def __init__(self, root: str | Path, images: str | Path | None = None):
        super().__init__(root)
        self.images = Path(images) if images else self.root / "images"

    def required_files(self) -> list[str]:
        return [MULTI_OBJECT_FILE]

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        path = self.root / MULTI_OBJECT_FILE
        records = read_json(path)
        require(isinstance(records, list), f"{path}: expected a JSON list of records, found {type(records).__name__}")
        return [self._item(path, index, record) for index, record in enumerate(records)]

    def _item(self, path: Path, index: int, record) -> Item:
        require(isinstance(record, list) and len(record) == 4 and all(isinstance(v, str) and v for v in record),
                f"{path}: record {index} is not [image 0 URL, caption 0, image 1 URL, caption 1]: {record!r:.200}")
        names = [url_file_name(record[0]), url_file_name(record[2])]
        require(all(names), f"{path}: record {index} has an image URL without a file name: {record!r:.200}")
        texts = [required_text(record[k], f"{path}: record {index}", f"caption {n}") for n, k in enumerate((1, 3))]
        return Item(id=str(index), images=[ImageRef(str(self.images / name)) for name in names], texts=texts)

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        return {"id": item.id, **multi_object_scores(similarity)}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        return {"accuracy": percent([bool(o["correct"]) for o in outcomes]),
                "ties": float(sum(bool(o["tie"]) for o in outcomes)), "n": float(len(outcomes))}


# ---------------------------------------------------------------- single-object


def average_precision(scores: Sequence[float], targets: Sequence[bool]) -> float:
    """Average precision of `scores` ranking the `targets` (torchmetrics' binary AP, scikit-learn's
    `average_precision_score`): sum over distinct thresholds, highest first, of the recall gained there times the
    precision there. Tied scores form one threshold, so their order does not matter. NaN without a positive."""
    scores, targets = np.asarray(scores, dtype=np.float64), np.asarray(targets, dtype=bool)
    positives = int(targets.sum())
    if positives == 0:
        return float("nan")
    order = np.argsort(-scores, kind="stable")
    ranked_scores, ranked_targets = scores[order], targets[order]
    # A threshold ends where the next score differs (and at the last item).
    ends = np.append(np.flatnonzero(np.diff(ranked_scores) != 0), len(ranked_scores) - 1)
    true_positives = np.cumsum(ranked_targets)[ends]
    precision = true_positives / (ends + 1)
    recall_gained = np.diff(true_positives, prepend=0) / positives
    return float(np.sum(recall_gained * precision))


def positive_ties_negative(scores: Sequence[float], targets: Sequence[bool]) -> bool:
    """Whether some positive has exactly the score of some negative."""
    scores, targets = np.asarray(scores, dtype=np.float64), np.asarray(targets, dtype=bool)
    return bool(np.intersect1d(scores[targets], scores[~targets]).size)


def label_caption(label, where: str) -> str:
    """A label's caption: the string, or a `[[attribute, ...], object]` pair as its words joined by spaces; the
    caption and every word of a pair must be non-empty."""
    if isinstance(label, str):
        return required_text(label, where, "label")
    pair = isinstance(label, list) and len(label) == 2 and isinstance(label[0], list) and isinstance(label[1], str)
    require(pair and all(isinstance(word, str) for word in label[0]),
            f"{where}: a label is a caption or [[attribute, ...], object], found {label!r:.200}")
    words = [*label[0], label[1]]
    return " ".join(required_text(word, where, f"label word {k}") for k, word in enumerate(words))


def split_single_object_file(content, path: Path) -> tuple[list, list]:
    """(labels, records) of a single-object file: `{"labels": ..., "data": ...}` (README) or `[labels, data]`
    (`scripts/eval.py`)."""
    if isinstance(content, dict):
        require("labels" in content and "data" in content, f"{path}: expected the keys 'labels' and 'data'")
        labels, records = content["labels"], content["data"]
    else:
        require(isinstance(content, list) and len(content) == 2,
                f"{path}: expected {{'labels': [...], 'data': [...]}} or [labels, data]")
        labels, records = content
    require(isinstance(labels, list) and labels, f"{path}: 'labels' must be a non-empty list")
    require(isinstance(records, list), f"{path}: 'data' must be a list of records")
    return labels, records


def zero_one_rows(rows: list, width: int, path: Path, field: str) -> np.ndarray:
    """The records' `field` vectors as a boolean matrix [records, labels]; every value must be 0 or 1."""
    for index, row in enumerate(rows):
        require(isinstance(row, list) and len(row) == width and {type(v) for v in row} <= {int, float, bool},
                f"{path}: record {index}: {field} must be a list of {width} numbers (one per label)")
    matrix = np.asarray(rows, dtype=np.float64).reshape(len(rows), width)
    bad = np.argwhere(~np.isin(matrix, (0.0, 1.0)))
    require(not len(bad), f"{path}: record {bad[0][0] if len(bad) else ''}: {field} values must be 0 or 1")
    return matrix == 1


class ColaSingleObject(ItemBenchmark):
    """Cola single-object retrieval: per label, AP over its hard images; mAP per subset (GQA, CLEVR, PACO).

    Args:
        root: the folder holding `data/COLA_singleobjects_benchmark_<subset>.json` (at least one subset).
        images: the folder holding one image folder per subset (`GQA/`, `CLEVR/`, `PACO/`), each image under the
            file name of its record's `image_file`; default `<root>/images`.

    Aggregates: `<subset>` (mAP in percent over the subset's labels with an AP; NaN for a subset without its
    file), `labels/<subset>` (labels averaged), `undefined` (kept labels whose hard set has no positive), `ties`
    (labels where a positive ties a negative), `n` (labels scored).
    """

    name = "cola_single_object"
    headline = SUBSETS
    description = "Cola single-object: mAP of each label's hard images, per subset (%)"
    data_source = DataSource(
        home=REPOSITORY,
        licence="MIT (repository LICENSE); images: Visual Genome / GQA (CC BY 4.0), CLEVR (CC BY 4.0), PACO "
                "(its own terms)",
        size="three JSON files (large; size not pinned); images from GQA, CLEVR and PACO",
        by_hand="Annotations: " + ", ".join(f"{RAW}/{single_object_file(subset)}" for subset in SUBSETS) +
                " into <root>/data/ (their bytes are not pinned). Images: each record's image under its file name "
                "in <root>/images/<subset>/: GQA from images.zip of "
                "https://cs.stanford.edu/people/dorarad/gqa/download.html (its images/ folder as images/GQA), CLEVR "
                "from CLEVR_v1.0 (https://cs.stanford.edu/people/jcjohns/clevr/), PACO from "
                "https://github.com/facebookresearch/paco.",
    )
    published = published({}, "cola")

    def __init__(self, root: str | Path, images: str | Path | None = None):
        super().__init__(root)
        self.images = Path(images) if images else self.root / "images"

    def required_files(self) -> list[str]:
        return [" | ".join(single_object_file(subset) for subset in SUBSETS)]

    def subsets(self) -> list[str]:
        """The subsets whose file is under root."""
        return [subset for subset in SUBSETS if (self.root / single_object_file(subset)).is_file()]

    def image_origin(self, ref: ImageRef) -> ImageOrigin:
        # GQA names its images by Visual Genome id; CLEVR's and PACO's bare numbers (if any) are not VG ids.
        if Path(ref.path).parent == self.images / "GQA":
            vg = visual_genome_id_from_name(ref.path, bare_ids=True)
            if vg is not None:
                return ImageOrigin(VISUAL_GENOME, vg)
        return super().image_origin(ref)

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        return [item for subset in self.subsets() for item in self._subset_items(subset)]

    def _subset_items(self, subset: str) -> list[Item]:
        path = self.root / single_object_file(subset)
        labels, records = split_single_object_file(read_json(path), path)
        captions = [label_caption(label, f"{path}: label {k}") for k, label in enumerate(labels)]
        for index, record in enumerate(records):
            require(isinstance(record, list) and len(record) in (3, 4) and isinstance(record[0], str) and record[0],
                    f"{path}: record {index} is not [image_file, (objects_attributes_annotation,) label, hard_list]")
        present = zero_one_rows([record[-2] for record in records], len(labels), path, "label")
        hard = zero_one_rows([record[-1] for record in records], len(labels), path, "hard_list")
        folder = self.images / subset
        refs = [ImageRef(str(folder / PurePosixPath(record[0]).name)) for record in records]
        items, absent, no_hard = [], 0, 0
        for k, caption in enumerate(captions):
            candidates = np.flatnonzero(hard[:, k])
            # The official order of the two skips: a label no image has, then a label with no hard image.
            if not present[:, k].any():
                absent += 1
            elif candidates.size == 0:
                no_hard += 1
            else:
                items.append(Item(id=f"{subset}/{k}", images=[refs[i] for i in candidates], texts=[caption],
                                  meta={"subset": subset, "targets": present[candidates, k].tolist()}))
        if absent or no_hard:
            log.info("%s %s: %d of %d labels skipped as the official evaluation skips them (%d in no image, %d "
                     "without hard images)", self.name, subset, absent + no_hard, len(labels), absent, no_hard)
        return items

    def outcomes(self, scorer: Scorer, progress: bool = False) -> list[Outcome]:
        results = super().outcomes(scorer, progress=progress)
        undefined = [o["id"] for o in results if o["ap"] is None]
        if undefined:
            log.warning("%s: %d labels have no positive among their hard images, so no AP (e.g. %s); they are left "
                        "out of the mAP and counted in `undefined`", self.name, len(undefined), undefined[:3])
        return results

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        scores, targets = np.asarray(similarity, dtype=np.float64)[:, 0], item.meta["targets"]
        ap = average_precision(scores, targets)
        return {"id": item.id, "subset": item.meta["subset"], "label": item.texts[0],
                "ap": None if np.isnan(ap) else 100.0 * ap, "positives": int(sum(targets)),
                "candidates": len(targets), "tie": positive_ties_negative(scores, targets)}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        result: dict[str, float] = {}
        for subset in SUBSETS:
            values = [float(o["ap"]) for o in outcomes if o["subset"] == subset and o["ap"] is not None]
            result[subset] = float(np.mean(values)) if values else float("nan")
            result[f"labels/{subset}"] = float(len(values))
        result["undefined"] = float(sum(o["ap"] is None for o in outcomes))
        result["ties"] = float(sum(bool(o["tie"]) for o in outcomes))
        result["n"] = float(len(outcomes))
        return result


COLA_BENCHMARKS = (ColaMultiObject, ColaSingleObject)

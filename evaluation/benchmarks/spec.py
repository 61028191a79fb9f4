"""SPEC (Peng et al., CVPR 2024): size, position, existence and count, as choices among near-identical candidates.

Official files: the Hugging Face dataset `wjpoom/SPEC`, one archive `data.zip` whose six subset folders
(`absolute_size`, `relative_size`, `absolute_spatial`, `relative_spatial`, `existence`, `count`) each hold
`image2text.json` and `text2image.json` and the subset's images. Each file is a JSON list of records
`{"query", "keys", "label"}`:
- image-to-text (I2T): `query` is an image path, `keys` the candidate texts, `label` the index of the right one;
- text-to-image (T2I): `query` is a text, `keys` the candidate image paths, `label` likewise.
Image paths are relative to the subset folder, which the loader joins to them as written
(`wjpoom/SPEC` commit ad982a4, `spec/dataset.py`: `Image2TextDataset`, `Text2ImageDataset`). The authors
extract the archive into a data root and read `<data root>/<subset>/`; a copy whose subsets sit one level
down in `data/` (an archive with a top folder) is read the same way.

Rule (`spec/models/clip_wrapper.py`, `CLIPWrapper.i2t_evaluate` / `t2i_evaluate`): the query's similarity to
every candidate; the prediction is `argmax` over the candidates, right when it equals `label`; a subset's I2T
(T2I) accuracy is 100 x right / records. Ties follow `torch.argmax`, which returns the first maximal index: a
tie for the top score counts as right when `label` is the first of the tied candidates, as wrong otherwise. We
keep that rule (the published numbers come from it) and record `tie` for every item whose top score the gold
candidate shares with another; the `strict/...` aggregates count those items wrong instead, as the project's
other benchmarks do, so the tie-breaking's weight shows.

Averages (`spec/eval.py`, `main`): the authors print each subset's I2T and T2I and the unweighted mean over
the six subsets of each (`i2t`, `t2i` here). fsc-clip (Oh et al., EMNLP 2024) folds SPEC into its 11-benchmark
`Comp` average as one number, `spec` in `ytaek-oh/fsc-clip` commit 604015d `assets/extended_results.csv`; its
evaluation code (`src/training/eval_compo.py`) calls the unreleased `vl_compo` package, so the formula is
inferred from the published values: every one of the twelve values there times 2160 is an integer, the
pattern of a mean of twelve subset accuracies over 1,000 / 1,500 / 2,000 / 4,500 records
(100 / 12 x k / 18000), while seven of them times 1080 are not, which rules out a mean over one direction's
six, and pooling all 30,000 records (x 300) gives an integer for one value only. So `mean` = the mean of I2T
and T2I over the six subsets, i.e. (`i2t` + `t2i`) / 2.

Reference numbers, OpenAI CLIP ViT-B/32 (open_clip `ViT-B-32` / `openai`), printed by the authors'
`notebooks/evaluate_example_colab.ipynb` (commit ad982a4), I2T / T2I: absolute_size 44.27 / 36.27,
relative_size 34.07 / 32.47, absolute_spatial 12.64 / 12.20, relative_spatial 27.10 / 26.75, existence
57.00 / 52.00, count 25.27 / 23.62; averages 33.39 / 30.55 (so `mean` 31.97, computed, not printed). Their
progress bars (batches of 64) and accuracies fit 1,500 / 1,500 / 4,500 / 2,000 / 1,000 / 4,500 records per
direction in that order.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from evaluation.benchmarks.annotations import load_json_list, require, required_text, required_texts
from evaluation.benchmarks.base import (GENERATED, ImageOrigin, ImageRef, Item, ItemBenchmark, MissingBenchmarkData,
                                        Outcome, percent)
from evaluation.benchmarks.sources import DataSource, Download, published

SUBSETS = ("absolute_size", "relative_size", "absolute_spatial", "relative_spatial", "existence", "count")
DIRECTIONS = ("i2t", "t2i")
ANNOTATION_FILES = {"i2t": "image2text.json", "t2i": "text2image.json"}
# Where the subset folders may lie under root: directly (the authors' layout), or in the archive's own top
# folder when it has one.
SUBSET_PARENTS = ("", "data")

HF_REVISION = "694dfdc74fe72acdc932fd5fc919b6b0268f7a07"  # the commit that uploaded data.zip


def first_argmax(scores: np.ndarray) -> int:
    """The index of the first maximal score, as `torch.argmax` and `np.argmax` return it."""
    return int(np.argmax(np.asarray(scores)))


def choice_outcome(scores: np.ndarray, label: int) -> dict[str, object]:
    """The authors' argmax rule on one record's candidate scores, with the tie that decided it, if any.

    Returns:
        `prediction` (first maximal index), `correct` (prediction == label), `tie` (the gold candidate shares
        the top score with another, so the tie-breaking decided), `strict` (gold strictly above all others).
    """
    scores = np.asarray(scores, dtype=np.float64)
    prediction = first_argmax(scores)
    top = scores[prediction]
    tie = bool(scores[label] == top and np.count_nonzero(scores == top) > 1)
    return {"prediction": prediction, "correct": prediction == label, "tie": tie,
            "strict": bool(scores[label] == top and not tie)}


def check_record(record: object, path: Path, index: int, direction: str) -> None:
    """`{"query": str, "keys": [str, ...], "label": int in range}`; a `DamagedBenchmarkData` naming file and record.
    The texts (the keys of an image-to-text record, the query of a text-to-image one) must be non-empty.

    Repeated candidates are accepted, as the authors' loader accepts them: they score alike and show as ties.
    """
    where = f"{path}: record {index}"
    require(isinstance(record, dict), f"{where} is not a JSON object")
    require(isinstance(record.get("query"), str), f"{where} lacks a string 'query'")
    keys = record.get("keys")
    require(isinstance(keys, list) and len(keys) > 0 and all(isinstance(key, str) for key in keys),
            f"{where}: 'keys' must be a non-empty list of strings")
    if direction == "i2t":
        required_texts(keys, where, "keys")
    else:
        required_text(record["query"], where, "query")
    label = record.get("label")
    require(isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(keys),
            f"{where}: 'label' must be an index into its {len(keys)} keys, got {label!r}")


class Spec(ItemBenchmark):
    """SPEC: 6 subsets x (image-to-text, text-to-image), argmax over the candidates (the authors' rule).

    Each record is one item: I2T items are one image and its candidate texts (similarity [1, L]); T2I items
    are the candidate images and one text ([K, 1]). Item ids are `<subset>/<direction>/<record index>`.

    Args:
        root: the folder the archive was extracted into (holding the six subset folders, or `data/` with them).

    Aggregates: `i2t/<subset>`, `t2i/<subset>` (the authors' per-subset accuracies); `i2t`, `t2i` (their
    means over the six subsets, as the authors print them); `mean` = (`i2t` + `t2i`) / 2 (fsc-clip's `spec`);
    `strict/i2t`, `strict/t2i`, `strict/mean` (ties counted wrong); `ties`, `ties/<direction>`, `n`.
    """

    name = "spec"
    headline = ("i2t", "t2i", "mean")
    description = "SPEC: image-to-text and text-to-image accuracy over 6 subsets, argmax over candidates (%)"
    data_source = DataSource(
        home="https://github.com/wjpoom/SPEC (data: https://huggingface.co/datasets/wjpoom/SPEC)",
        licence="Apache-2.0 (the dataset card's licence; the GitHub repository carries no licence file); the "
                "images are generated",
        size="data.zip 1.56 GB (six subsets; about 15,000 image-to-text and 15,000 text-to-image records)",
        downloads=(Download(
            url=f"https://huggingface.co/datasets/wjpoom/SPEC/resolve/{HF_REVISION}/data.zip", target="data.zip",
            # The sha256 is the Git LFS object id the Hub publishes for this revision's data.zip.
            sha256="77ada96030bd2f8fd93dbb5a988cfa097692464be06cd930be5c35fe5dce7186", size=1555390680,
            unpack="zip"),),
    )
    published = published({
        "i2t/absolute_size": 44.27, "t2i/absolute_size": 36.27, "i2t/relative_size": 34.07,
        "t2i/relative_size": 32.47, "i2t/absolute_spatial": 12.64, "t2i/absolute_spatial": 12.20,
        "i2t/relative_spatial": 27.10, "t2i/relative_spatial": 26.75, "i2t/existence": 57.00,
        "t2i/existence": 52.00, "i2t/count": 25.27, "t2i/count": 23.62, "i2t": 33.39, "t2i": 30.55}, "spec")

    def required_files(self) -> list[str]:
        return [" | ".join(str(Path(parent, subset, ANNOTATION_FILES[direction])) for parent in SUBSET_PARENTS)
                for subset in SUBSETS for direction in DIRECTIONS]

    def check_files(self) -> None:
        super().check_files()
        self.subsets_root = self._find_subsets_root()

    def _find_subsets_root(self) -> Path:
        """The folder holding all six subset folders: root itself, else `root/data`."""
        for parent in SUBSET_PARENTS:
            folder = self.root / parent
            if all((folder / subset / ANNOTATION_FILES[d]).is_file() for subset in SUBSETS for d in DIRECTIONS):
                return folder
        raise MissingBenchmarkData(f"{self.name}: {self.root} holds the SPEC files partly directly and partly in "
                                   f"data/; keep the six subset folders in one place")

    def image_origin(self, ref: ImageRef) -> ImageOrigin:
        return ImageOrigin(GENERATED)  # SPEC's images are synthesised for the benchmark

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        return [item for subset in SUBSETS for direction in DIRECTIONS for item in self._file_items(subset, direction)]

    def _file_items(self, subset: str, direction: str) -> list[Item]:
        folder = self.subsets_root / subset
        path = folder / ANNOTATION_FILES[direction]
        items = []
        for index, record in enumerate(load_json_list(path)):
            check_record(record, path, index, direction)
            meta = {"subset": subset, "direction": direction, "label": record["label"]}
            if direction == "i2t":
                images, texts = [ImageRef(str(folder / record["query"]))], list(record["keys"])
            else:
                images, texts = [ImageRef(str(folder / key)) for key in record["keys"]], [record["query"]]
            items.append(Item(id=f"{subset}/{direction}/{index}", images=images, texts=texts, meta=meta))
        return items

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        similarity = np.asarray(similarity)
        scores = similarity[0, :] if item.meta["direction"] == "i2t" else similarity[:, 0]
        return {"id": item.id, "subset": item.meta["subset"], "direction": item.meta["direction"],
                "label": item.meta["label"], **choice_outcome(scores, int(item.meta["label"]))}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        per_subset = subset_accuracies(outcomes, "correct")
        strict_means = direction_means(subset_accuracies(outcomes, "strict"))  # ties counted wrong
        strict = {f"strict/{key}": value for key, value in strict_means.items()}
        ties = {f"ties/{d}": float(sum(bool(o["tie"]) for o in outcomes if o["direction"] == d)) for d in DIRECTIONS}
        return {**per_subset, **direction_means(per_subset), **strict, **ties,
                "ties": float(sum(bool(o["tie"]) for o in outcomes)), "n": float(len(outcomes))}


def subset_accuracies(outcomes: Sequence[Outcome], rule: str) -> dict[str, float]:
    """`<direction>/<subset>` accuracy, counting as right the outcomes whose `rule` field ("correct" or "strict")
    is true."""
    return {f"{d}/{s}": percent([bool(o[rule]) for o in outcomes if o["subset"] == s and o["direction"] == d])
            for d in DIRECTIONS for s in SUBSETS}


def direction_means(accuracies: dict[str, float]) -> dict[str, float]:
    """Each direction's unweighted mean over the six subsets (as `spec/eval.py` prints it), and their mean.

    A subset without records makes its direction's mean NaN: a mean over fewer subsets is another number.
    """
    means = {d: float(np.mean([accuracies[f"{d}/{s}"] for s in SUBSETS])) for d in DIRECTIONS}
    return {**means, "mean": (means["i2t"] + means["t2i"]) / 2}

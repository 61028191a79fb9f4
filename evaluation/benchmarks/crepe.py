"""CREPE productivity (Ma et al., CVPR 2023): retrieve a caption of growing complexity among its hard negatives.

Official files (`RAIVNLab/CREPE`, commit 1fa81c4, `data/prod_hard_negatives.zip`, read by `crepe_prod_eval_clip.py`
and `crepe_eval_utils.py`): one CSV per negative type and caption complexity,
`<type>/prod_vg_hard_negs_<type>_complexity_<c>.csv` for the types `atom`, `swap`, `negate` and the complexities
4 .. 12 (27 files), under the folder the scripts take as `--input-dir`. `root` is that folder, or the folder holding
it as `prod_hard_negatives/` (the zip's name). Columns read (pandas `read_csv` in `BaseCsvDataset`; here the `csv`
module): `image_id` (a Visual Genome id), `caption`, `hard_negs` (a Python list literal, read with
`ast.literal_eval`), and the region `x`, `y`, `width`, `height`. The candidates of a row are
`[caption] + hard_negs`, in that order (`CsvDataset.__getitem__`), so the ground truth is text 0.

Image (`BaseCsvDataset.get_image_by_id`): `<VG>/VG_100K/<image_id>.jpg`, else `<VG>/VG_100K_2/<image_id>.jpg`, the
first that exists, converted to RGB; `images` is that `<VG>` folder (default: root). With `crop` (the scripts'
default; `--crop` is declared `type=bool`, so any value given on the command line is also true) the image is
cut to the row's region before the model's preprocessing: `TF.crop(image, top=y, left=x, height, width)`, which for
a PIL image is `image.crop((x, y, x + width, y + height))`, no padding, no margin; a region reaching past the image
border is filled with black by PIL. `ImageRef.box = (x, y, width, height)` is applied the same way after decoding.

Rule (`get_one2many_rank`, `get_one2many_metrics`): the row's image against its candidates, cosines of
L2-normalised embeddings; `ranking = torch.argsort(logits, descending=True)` on the CPU, and the rank is the
position of index 0 in it; R@1 = mean(rank < 1) over the file. `torch.argsort` is not a stable sort, but on the CPU
up to 16 values come out with equal values in index order (std::sort insertion-sorts ranges that short; a test
checks it against the installed torch): a negative scoring exactly as the caption then ranks after it, so the rank
is the number of negatives scoring strictly above the caption, and R@1 counts a tie as right. That is the rule here
(`correct`: the caption scores at least as high as every negative), against the project's usual strict `>`, because
the official numbers are computed so. Above 16 candidates torch's order of equal values is not the index order; we
keep the rule above there (`candidates` is stored per item). Ties are real: a negative may tokenise like the caption
(CLIP's tokenizer lower-cases and truncates at 77 tokens, as the scripts' `truncate=True` does). Each outcome also
stores `correct_strict` (a tie wrong) and `tie`.

Aggregation. The scripts print R@1 (and mean / median rank, R@3/5/10) per file, that is per (type, complexity),
and never pool: `<type>/complexity_<c>` is that number. vl_compo (Oh et al., CVPRW 2024) reports one number per type,
R@1 pooled over the type's nine files (micro): its `individual_results.csv` values are integer multiples of
1/17,698 (atom), 1/7,405 (swap) and 1/17,303 (negate) in every one of its 202 rows, the item counts of the three
types, which a mean of nine per-complexity numbers would not be. Those are `atom`, `swap`, `negate`; its `crepe`
(`results.csv`) is their unweighted mean, `mean` here, the headline. The `_strict` variants count ties wrong.

`crepe_prod_eval_clip.py` scores rows in batches of 16 and splits the batch's texts evenly among its images
(`set_size = len(texts) // len(images)`), which assumes every row of a batch has as many negatives; each row is
scored here with its own candidates, the same whenever that holds, and a file whose rows differ is logged.

Published numbers: vl_compo (`ytaek-oh/vl_compo`, commit 43e2eae, `individual_results.csv` and `results.csv`, row
ViT-B-32 / openai): atom 18.96, swap 17.26, negate 34.90, mean 23.71.

Licence: the repository has no LICENSE file, so the annotations may not be redistributed; the tests use the
stand-in only (`testkit/standin/crepe.py`).
"""
from __future__ import annotations

import ast
import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from evaluation.benchmarks.annotations import DamagedBenchmarkData, read_csv_records, require, required_text
from evaluation.benchmarks.base import ImageRef, Item, ItemBenchmark, Outcome, check_option, percent
from evaluation.benchmarks.sources import DataSource, published

log = logging.getLogger(__name__)

TYPES = ("atom", "swap", "negate")
COMPLEXITIES = tuple(range(4, 13))
COLUMNS = ("image_id", "caption", "hard_negs", "x", "y", "width", "height")
VG_FOLDERS = ("VG_100K", "VG_100K_2")  # searched in this order, as `get_image_by_id` does
ZIP_FOLDER = "prod_hard_negatives"
COMMIT = "1fa81c425f442396fe304f170c8eb6dc0747c814"
BY_HAND = (
    f"Annotations: https://raw.githubusercontent.com/RAIVNLab/CREPE/{COMMIT}/data/prod_hard_negatives.zip (not "
    "pinned by hash: its bytes could not be checked when this loader was written); unzip it into <root>, so that "
    "<root> holds prod_hard_negatives/<type>/prod_vg_hard_negs_<type>_complexity_<c>.csv, or <root> is the folder "
    "holding atom/, swap/ and negate/. Images: Visual Genome 1.2, "
    "https://cs.stanford.edu/people/rak248/VG_100K_2/images.zip and "
    "https://cs.stanford.edu/people/rak248/VG_100K_2/images2.zip, unzipped into <root> (VG_100K/ and VG_100K_2/), "
    "or into another folder passed as the `images` option.")


def csv_name(negative_type: str, complexity: int) -> str:
    """A file's path under the `--input-dir` folder, as the scripts build it."""
    return f"{negative_type}/prod_vg_hard_negs_{negative_type}_complexity_{complexity}.csv"


def read_rows(path: Path) -> list[dict]:
    """The records of one CSV file; a file that is not UTF-8 CSV with the expected columns names itself."""
    return [row for _, row in read_csv_records(path, COLUMNS)]


def _number(value: str, where: str, column: str) -> float | int:
    """A region coordinate: an int when it is integral (as pandas reads it), else a float."""
    try:
        number = float(value)
    except ValueError:
        raise DamagedBenchmarkData(f"{where}: {column} is not a number ({value!r})") from None
    require(np.isfinite(number), f"{where}: {column} is not finite ({value!r})")
    return int(number) if number.is_integer() else number


def _negatives(value: str, where: str) -> list[str]:
    """The `hard_negs` list literal, as `ast.literal_eval` reads it."""
    try:
        negatives = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise DamagedBenchmarkData(f"{where}: hard_negs is not a Python list literal ({value[:80]!r})") from None
    require(isinstance(negatives, (list, tuple)) and all(isinstance(text, str) for text in negatives),
            f"{where}: hard_negs is not a list of strings ({value[:80]!r})")
    return [required_text(text, where, f"hard_negs[{k}]") for k, text in enumerate(negatives)]


def rank_outcome(similarity_row: np.ndarray) -> dict:
    """Rank of the ground truth (text 0) among the candidates as the official argsort gives it (for up to 16
    candidates): the number of candidates scoring strictly above it."""
    row = np.asarray(similarity_row, dtype=np.float64)
    above, tied = int(np.sum(row[1:] > row[0])), int(np.sum(row[1:] == row[0]))
    return {"rank": above, "candidates": int(row.size), "correct": above == 0,
            "correct_strict": above == 0 and tied == 0, "tie": tied > 0}


def _mean_or_nan(values: Sequence[float]) -> float:
    """The unweighted mean; NaN when a value is (an absent type is not 0 %)."""
    return float(np.mean(values)) if values and not any(np.isnan(v) for v in values) else float("nan")


class CrepeProductivity(ItemBenchmark):
    """CREPE productivity: image-to-text retrieval among hard negatives, per type and caption complexity.

    Args:
        root: the `--input-dir` folder (holding `atom/`, `swap/`, `negate/`), or the folder holding it as
            `prod_hard_negatives/`.
        images: the Visual Genome folder holding `VG_100K/` and `VG_100K_2/`; default root.
        crop: cut each image to its row's region (the official default); False scores whole images.
        types: the negative types to read (the scripts' `--hard-neg-types`); default all three.

    Aggregates (percent): `atom`, `swap`, `negate` (R@1 pooled over complexities 4-12, vl_compo's numbers),
    `mean` (their unweighted mean, vl_compo's `crepe`; NaN unless all three are read),
    `<type>/complexity_<c>` (R@1 of one official file), the same with ties wrong (`<type>_strict`,
    `mean_strict`), `ties` (items whose caption ties a negative) and `n`.
    """

    name = "crepe"
    headline = ("atom", "swap", "negate", "mean")
    description = "CREPE productivity: R@1 of the caption among its hard negatives, per negative type (%)"
    data_source = DataSource(
        home="https://github.com/RAIVNLab/CREPE",
        licence="no licence file in the repository (not redistributable); images: Visual Genome, CC BY 4.0",
        size="annotations: one zip of 27 CSV files (42,406 rows by vl_compo's counts); images: Visual Genome "
             "VG_100K + VG_100K_2 (about 15 GB)",
        by_hand=BY_HAND)
    published = published({"atom": 18.96, "swap": 17.26, "negate": 34.90, "mean": 23.71}, "vl_compo")

    def __init__(self, root: str | Path, images: str | Path | None = None, crop: bool = True,
                 types: Sequence[str] = TYPES):
        unknown = sorted(set(types) - set(TYPES))
        check_option(not unknown and len(types) > 0, f"types must be among {', '.join(TYPES)}, got {list(types)}")
        self.types = tuple(t for t in TYPES if t in types)  # read by required_files() during the base check
        super().__init__(root)
        self.images = Path(images) if images else self.root
        self.crop = crop

    @property
    def data_dir(self) -> Path:
        """The folder holding `<type>/`: root itself, or `root/prod_hard_negatives` (the zip's name)."""
        nested = self.root / ZIP_FOLDER
        return nested if nested.is_dir() else self.root

    def required_files(self) -> list[str]:
        return [f"{ZIP_FOLDER}/{csv_name(t, c)} | {csv_name(t, c)}" for t in self.types for c in COMPLEXITIES]

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        return [item for t in self.types for c in COMPLEXITIES for item in self._file_items(t, c)]

    def _file_items(self, negative_type: str, complexity: int) -> list[Item]:
        path = self.data_dir / csv_name(negative_type, complexity)
        items = [self._item(path, number, row, negative_type, complexity)
                 for number, row in enumerate(read_rows(path))]
        counts = sorted({len(item.texts) for item in items})
        if len(counts) > 1:
            log.warning("%s: rows have %s candidates; the official batched scoring assumes one count per batch",
                        path, counts)
        return items

    def _item(self, path: Path, number: int, row: dict, negative_type: str, complexity: int) -> Item:
        where = f"{path}: row {number}"
        image_id = row["image_id"].strip()
        require(image_id.isdigit(), f"{where}: image_id is not a Visual Genome id ({row['image_id']!r})")
        caption = required_text(row["caption"], where)
        box = tuple(_number(row[column], where, column) for column in ("x", "y", "width", "height"))
        require(box[2] > 0 and box[3] > 0, f"{where}: empty region (width {box[2]}, height {box[3]})")
        return Item(id=f"{negative_type}/{complexity}/{number}",
                    images=[ImageRef(self._image_path(int(image_id)), box=box if self.crop else None)],
                    texts=[caption, *_negatives(row["hard_negs"], where)],
                    meta={"type": negative_type, "complexity": complexity})

    def _image_path(self, image_id: int) -> str:
        """The first VG folder holding the image, as `get_image_by_id`; `VG_100K` when neither does, so that the
        missing-image check names it."""
        for folder in VG_FOLDERS:
            path = self.images / folder / f"{image_id}.jpg"
            if path.is_file():
                return str(path)
        return str(self.images / VG_FOLDERS[0] / f"{image_id}.jpg")

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        return {"id": item.id, "type": item.meta["type"], "complexity": item.meta["complexity"],
                **rank_outcome(similarity[0])}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        result: dict[str, float] = {}
        for suffix, field in (("", "correct"), ("_strict", "correct_strict")):
            for negative_type in TYPES:
                result[negative_type + suffix] = percent([bool(o[field]) for o in outcomes
                                                          if o["type"] == negative_type])
            result["mean" + suffix] = _mean_or_nan([result[t + suffix] for t in TYPES])
        for negative_type in TYPES:
            for complexity in COMPLEXITIES:
                result[f"{negative_type}/complexity_{complexity}"] = percent(
                    [bool(o["correct"]) for o in outcomes
                     if o["type"] == negative_type and int(o["complexity"]) == complexity])
        result["ties"] = float(sum(bool(o["tie"]) for o in outcomes))
        result["n"] = float(len(outcomes))
        return result


CREPE_BENCHMARKS = (CrepeProductivity,)

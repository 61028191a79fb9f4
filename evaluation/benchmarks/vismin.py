"""VisMin (Awal et al., NeurIPS 2024): 2,084 minimal-change items of 2 images x 2 captions.

Official files: the Hugging Face dataset `mair-lab/vismin-bench`, split `test`, one row per item with the columns
`id`, `text_0`, `text_1`, `image_0`, `image_1` (embedded images) and `category` (object 579, attribute 294,
relation 622, counting 589). The authors' solution files list the rows in that category order with `id`
restarting at 0 in each category, so an item is `<category>/<id>` (the loader checks every row against them).
The repository's main branch holds a `datasets.save_to_disk` folder (`data/test/*.arrow`); the loader reads the
same rows as parquet: the hub's conversion of it (branch `refs/convert/parquet`, `default/test/*.parquet`) or any
`data/test-*.parquet` (`find_test_shards`).

The rows do not say which caption describes which image. The authors' first evaluation kit
(rabiulcste/vismin `4fdeb0f`, `vismin-bench/eval.py`, `vismin-bench/metric.py`) scores each row against
`vismin-bench/solutions/sim_solution.csv` (`idx, Text, Image, category`, rows matched to the dataset's rows by
position): for 1,064 items the relations say text_i describes image_i
(text: T0_I0 > T1_I0 and T1_I1 > T0_I1; image: T0_I0 > T0_I1 and T1_I1 > T1_I0), for 1,020 items they say
text_1 describes image_0 and text_0 image_1 (text: T1_I0 > T0_I0 and T0_I1 > T1_I1; image: T0_I1 > T0_I0 and
T1_I0 > T1_I1), where Tj_Ii = cos(text j, image i) and every relation is a strict `>`. The kit's later version
(`680a3ee`, same paths) deletes sim_solution.csv and scores every row as text_i-image_i, but the dataset's data
files did not change with it: on the hub, `data/` was last changed in commit `b791454` (Nov 21, 2024, the day of
the first kit; that commit's card names sim_solution.csv as the ground truth) and the later commit `2f379d5` only
edits the card, which still does. So the rule of every known revision is the solution file's
(`pairing="solution"`, the default): an item the file marks swapped has its captions reordered to
`[text_1, text_0]`, after which the Winoground rule of `two_by_two_scores` is exactly the kit's relations.
`pairing="text0_image0"` reproduces the later script, which on these files scores the 1,020 swapped items against
the wrong images (it needs no solution file).

Aggregates: text / image / group per category (as `compute_contrastive_accuracy` reports them; strict `>`, so a
tie is wrong and `ties` counts items with any tied comparison) and `avg`, the mean of those 12 numbers (the
paper's "AVG" column); overall text / image / group (pooled), `n`, and `swapped` (items scored as text_1-image_0).

Published (OpenAI CLIP ViT-B/32): the VisMin results table, as printed on the authors' project page
(rabiulcste/vismin `29ce2c0`, `index.html`): object 79.62 / 77.89 / 67.53, attribute 72.11 / 65.99 / 55.10,
relation 8.20 / 4.34 / 0.48, counting 31.24 / 20.71 / 10.53 (text / image / group), AVG 41.15. They were computed
from the authors' internal files (`evals/dataset_zoo/dataset.py` at `29ce2c0` pairs each original image with its
caption and each edited image with the edited caption), not from the hub's rows; the solution file is the
authors' statement of that pairing for the published rows.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from evaluation.benchmarks.annotations import read_csv_records, read_parquet_rows, require
from evaluation.benchmarks.base import ImageRef, Item, Outcome, check_option
from evaluation.benchmarks.sources import DataSource, Download, published
from evaluation.benchmarks.two_by_two import (SCORES, TEST_SHARD_PATTERNS, TwoByTwoBenchmark, caption_pair,
                                              find_test_shards, grouped_scores, overall_scores, require_fields)

CATEGORIES = ("object", "attribute", "relation", "counting")  # the paper's column order
COLUMNS = {"id": int, "text_0": str, "text_1": str, "category": str}
SOLUTION_FILE = "solutions/sim_solution.csv"
SOLUTION_COLUMNS = ("idx", "Text", "Image", "category")
KIT_COMMIT = "4fdeb0fdf9d1dfdeb5f0e3ae5df222be393ae36b"  # rabiulcste/vismin, the first evaluation kit

# The two (Text, Image) relation pairs sim_solution.csv uses: text i with image i, or text 1 with image 0.
ALIGNED = ("T0_I0 > T1_I0 & T1_I1 > T0_I1", "T0_I0 > T0_I1 & T1_I1 > T1_I0")
SWAPPED = ("T1_I0 > T0_I0 & T0_I1 > T1_I1", "T0_I1 > T0_I0 & T1_I0 > T1_I1")
PAIRINGS = ("solution", "text0_image0")


@dataclass(frozen=True)
class Revision:
    """A revision of `mair-lab/vismin-bench`: its commit, its branch and the caption-image pairing of its rows."""

    commit: str
    branch: str
    pairing: str


# Every revision known to hold the data files of commit b791454 (the hub's file history), hence its pairing.
REVISIONS = {
    "c764500": Revision("c76450021083d26140ff4801b7dee73103cb77e6", "refs/convert/parquet", "solution"),
    "2f379d5": Revision("2f379d5b9a3af7f10d3266f6389b7b351e54c493", "main", "solution"),
    "b791454": Revision("b791454ffb8beb4747129daa73644805ff243569", "main", "solution"),
}
DEFAULT_REVISION = "c764500"  # the parquet conversion the loader reads directly

BY_HAND = (
    "the dataset (CC-BY-4.0; 2,084 items, images embedded, about 1.5 GB) as the hub's parquet conversion: "
    "`huggingface-cli download --repo-type dataset mair-lab/vismin-bench --revision "
    f"{REVISIONS['c764500'].commit} --local-dir <root>` (gives <root>/default/test/*.parquet). Alternatively "
    f"download main at {REVISIONS['2f379d5'].commit} (a `save_to_disk` folder, data/test/*.arrow) and write its "
    "test split as <root>/data/test-00000-of-00001.parquet with `datasets.load_from_disk(<root>/data)['test']"
    ".to_parquet(...)`. sim_solution.csv, the per-item pairing, is fetched from GitHub.")


class VisMin(TwoByTwoBenchmark):
    """VisMin, from the parquet rows of `mair-lab/vismin-bench` and the first kit's `solutions/sim_solution.csv`.

    Each item's images are `[image_0, image_1]`; its captions are `[text_0, text_1]`, or `[text_1, text_0]` for an
    item the pairing marks swapped, so that caption i describes image i (the outcome fields `text_i0`, ... refer
    to that order).

    Args:
        root: the dataset folder (holding `default/test/*.parquet` or `data/test-*.parquet`, and
            `solutions/sim_solution.csv` for the solution pairing).
        revision: the dataset revision the files are from (`REVISIONS`), which fixes the pairing rule.
        pairing: override the revision's rule: "solution" (sim_solution.csv) or "text0_image0" (the later kit).

    Aggregates: `<score>/<category>` and `avg` (their mean; the paper's table), `text`, `image`, `group`
    (pooled), `ties`, `n`, `swapped`.
    """

    name = "vismin"
    headline = tuple(f"{score}/{category}" for category in CATEGORIES for score in SCORES) + ("avg",)
    description = "VisMin: text / image / group scores per minimal-change category (%)"
    outcome_fields = ("category", "swapped")
    data_source = DataSource(
        home="https://huggingface.co/datasets/mair-lab/vismin-bench",
        licence="CC-BY-4.0 (dataset card); sim_solution.csv is from rabiulcste/vismin, which states no licence",
        size="2,084 items with embedded images (about 1.5 GB); sim_solution.csv 151 kB",
        downloads=(Download(
            url=f"https://raw.githubusercontent.com/rabiulcste/vismin/{KIT_COMMIT}/vismin-bench/{SOLUTION_FILE}",
            target=SOLUTION_FILE, sha256="20ce74b5e9b904d3f9de2a5e201fe34fb3bc62001ebb7a98b6f7ddeeb0847f9e",
            size=150852),),
        by_hand=BY_HAND)
    published = published({
        "text/object": 79.62, "image/object": 77.89, "group/object": 67.53,
        "text/attribute": 72.11, "image/attribute": 65.99, "group/attribute": 55.10,
        "text/relation": 8.20, "image/relation": 4.34, "group/relation": 0.48,
        "text/counting": 31.24, "image/counting": 20.71, "group/counting": 10.53, "avg": 41.15}, "vismin")

    def __init__(self, root: str | Path, revision: str = DEFAULT_REVISION, pairing: str | None = None):
        check_option(revision in REVISIONS, f"unknown VisMin revision {revision!r}; known: {', '.join(REVISIONS)}")
        pairing = pairing or REVISIONS[revision].pairing
        check_option(pairing in PAIRINGS, f"pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")
        self.revision, self.pairing = revision, pairing  # read by required_files() during the base class's check
        super().__init__(root)

    def required_files(self) -> list[str]:
        data = " | ".join(TEST_SHARD_PATTERNS)
        return [data, SOLUTION_FILE] if self.pairing == "solution" else [data]

    def read_items(self) -> list[Item]:
        rows = [(shard, row, record) for shard in find_test_shards(self.root)
                for row, record in enumerate(_shard_records(shard))]
        swapped = self._swapped(rows) if self.pairing == "solution" else [False] * len(rows)
        items = [_item(shard, row, record, flag) for (shard, row, record), flag in zip(rows, swapped)]
        repeated = sorted(item_id for item_id, count in Counter(item.id for item in items).items() if count > 1)
        require(not repeated, f"{self.root}: item ids repeat across the test shards (e.g. {repeated[:3]}); "
                              "keep one revision's shards")
        return items

    def _swapped(self, rows: list[tuple[Path, int, dict]]) -> list[bool]:
        """Per dataset row, whether sim_solution.csv pairs text_1 with image_0; its rows are matched by position
        (as the kit's `zip`), and each must name the row's own id and category."""
        path = self.root / SOLUTION_FILE
        solution = read_solution(path)
        require(len(solution) == len(rows), f"{path}: {len(solution)} rows for {len(rows)} dataset items; the "
                                            "solution file and the dataset are from different releases")
        for (line, idx, category, _), (shard, row, record) in zip(solution, rows):
            require((idx, category) == (record["id"], record["category"]),
                    f"{path}: line {line} is item {category}/{idx}, but the dataset row at that position "
                    f"({shard}: row {row}) is {record['category']}/{record['id']}")
        return [swapped for _, _, _, swapped in solution]

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        names = {score: score for score in SCORES}
        result = {**overall_scores(outcomes, names), **grouped_scores(outcomes, lambda o: str(o["category"]), names)}
        # NaN unless all four categories are there: the paper's average is over its whole table.
        table = [result.get(f"{score}/{category}", float("nan")) for category in CATEGORIES for score in SCORES]
        result["avg"] = float(np.mean(table))
        result["swapped"] = float(sum(bool(o["swapped"]) for o in outcomes))
        return result


def read_solution(path: Path) -> list[tuple[int, int, str, bool]]:
    """The rows of sim_solution.csv as (line, idx, category, swapped); a `DamagedBenchmarkData` names the file and
    line."""
    return [_solution_row(path, line, row) for line, row in read_csv_records(path, SOLUTION_COLUMNS)]


def _solution_row(path: Path, line: int, row: dict) -> tuple[int, int, str, bool]:
    idx, text, image, category = (row[column] for column in SOLUTION_COLUMNS)
    require(idx.strip().isdigit(), f"{path}: line {line}: idx {idx!r} is not a whole number")
    relations = (text.strip(), image.strip())
    require(relations in (ALIGNED, SWAPPED), f"{path}: line {line}: relations {relations} are neither "
                                             "text_i-image_i nor text_1-image_0")
    return line, int(idx), category, relations == SWAPPED


def _shard_records(shard: Path) -> list[dict]:
    """The text columns of one parquet shard, each row checked."""
    records = read_parquet_rows(shard, COLUMNS, ("image_0", "image_1"))
    for row, record in enumerate(records):
        require_fields(record, COLUMNS, f"{shard}: row {row}")
    return records


def _item(shard: Path, row: int, record: dict, swapped: bool) -> Item:
    texts = caption_pair(record, ("text_1", "text_0") if swapped else ("text_0", "text_1"), f"{shard}: row {row}")
    images = [ImageRef(str(shard), member=f"{column}:{row}") for column in ("image_0", "image_1")]
    return Item(id=f"{record['category']}/{record['id']}", images=images, texts=texts,
                meta={"category": record["category"], "swapped": swapped})

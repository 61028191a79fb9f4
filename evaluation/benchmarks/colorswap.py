"""ColorSwap (Burapacheep et al., 2024): 300 test items of 2 generated images x 2 captions that swap colour words.

Official files, two releases of the same records (`id`, `caption_1`, `caption_2`, `image_1`, `image_2`,
`image_source`, `caption_source`; caption k describes image k):
- the Hugging Face dataset `stanfordnlp/colorswap` (MIT, gated: accept its conditions, then log in), parquet with
  the images embedded: the test split as `data/test-*.parquet` or, on the hub's conversion branch,
  `<config>/test/*.parquet` (`find_test_shards`);
- the authors' Google Drive archive named in their README (Top34051/colorswap `4f2c9e4`, `README.md`):
  `data/test.json`, a JSON list whose `image_1` / `image_2` are paths like `images/img_0_1.png` relative to
  `data/`, where `images.zip` is extracted.

Rule: the authors publish no contrastive scoring code (their README points to a Colab notebook); their
`vlm_eval.py` (same commit) scores generative models on the same 300 test ids with Winoground's definitions: text
right iff both images choose their own caption, image right iff both captions choose their own image, group iff
both. For a similarity model these are Winoground's strict comparisons (`two_by_two_scores`): a tie is wrong and
`ties` counts items with any tied comparison. vlm_eval.py skips items whose model response failed ("error");
a similarity model has no such items, so every item is scored.

Published (OpenAI CLIP ViT-B/32): vl_compo (ytaek-oh/vl_compo `43e2eae`, `individual_results.csv`) text 35.67,
image 15.00, group 12.00 on the 300 test items (107, 45 and 36 right).
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Sequence

from evaluation.benchmarks.annotations import load_json_list, read_parquet_rows, require
from evaluation.benchmarks.base import (GENERATED, ImageOrigin, ImageRef, Item, MissingBenchmarkData, Outcome,
                                        check_option)
from evaluation.benchmarks.sources import DataSource, published
from evaluation.benchmarks.two_by_two import (SCORES, TEST_SHARD_PATTERNS, TwoByTwoBenchmark, caption_pair,
                                              find_test_shards, grouped_scores, overall_scores, require_fields)

COLUMNS = {"id": int, "caption_1": str, "caption_2": str, "image_source": str, "caption_source": str}
IMAGE_COLUMNS = ("image_1", "image_2")
JSON_FILE = "data/test.json"
LAYOUTS = ("auto", "json", "parquet")


class ColorSwap(TwoByTwoBenchmark):
    """ColorSwap's test split: images `[image_1, image_2]`, captions `[caption_1, caption_2]`.

    Args:
        root: the dataset folder (holding `data/test-*.parquet`, `<config>/test/*.parquet` or `data/test.json`).
        layout: "parquet", "json" or "auto" (the parquet shards when present, else the JSON file).
        images: the folder the JSON records' image paths are relative to; default `<root>/data`.

    Aggregates: `text`, `image`, `group`; `<score>/image_source/<source>` and `<score>/caption_source/<source>`;
    `ties`, `n`.
    """

    name = "colorswap"
    headline = SCORES
    description = "ColorSwap: text / image / group scores on the test split (%)"
    outcome_fields = ("image_source", "caption_source")
    data_source = DataSource(
        home="https://huggingface.co/datasets/stanfordnlp/colorswap",
        licence="MIT (dataset card and Top34051/colorswap)",
        size="300 test items, 600 generated images (the train split adds 700 items)",
        by_hand="gated on the hub: accept the conditions on the dataset page, `huggingface-cli login`, then "
                "`huggingface-cli download --repo-type dataset stanfordnlp/colorswap --local-dir <root>` (no "
                "revision hash is recorded here: note the commit you download). Or the authors' archive "
                "https://drive.google.com/file/d/1xdG94DQdz_eQVH1lrEeaHVz_BNkrVgb5 extracted as <root>/data "
                "(data/test.json, and data/images.zip unzipped in data/).")
    published = published({"text": 35.67, "image": 15.0, "group": 12.0}, "vl_compo")

    def __init__(self, root: str | Path, layout: str = "auto", images: str | Path | None = None):
        check_option(layout in LAYOUTS, f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        super().__init__(root)
        self.layout = self._present_layout(layout)
        self.images = Path(images) if images else self.root / "data"

    def required_files(self) -> list[str]:
        return [" | ".join((*TEST_SHARD_PATTERNS, JSON_FILE))]

    def _present_layout(self, layout: str) -> str:
        """The layout to read: "auto" prefers the parquet shards; an explicit one must have its files."""
        has_shards = bool(find_test_shards(self.root))
        if layout == "auto":
            return "parquet" if has_shards else "json"
        if not (has_shards if layout == "parquet" else (self.root / JSON_FILE).is_file()):
            expected = " | ".join(TEST_SHARD_PATTERNS) if layout == "parquet" else JSON_FILE
            raise MissingBenchmarkData(f"{self.name}: layout={layout!r} but {self.root} lacks {expected}; "
                                       f"expected files: {expected}")
        return layout

    def image_origin(self, ref: ImageRef) -> ImageOrigin:
        return ImageOrigin(GENERATED)  # every ColorSwap image is made by a diffusion model for the benchmark

    def read_items(self) -> list[Item]:
        items = self._parquet_items() if self.layout == "parquet" else self._json_items()
        repeated = sorted(item_id for item_id, count in Counter(item.id for item in items).items() if count > 1)
        require(not repeated, f"{self.root}: item ids repeat (e.g. {repeated[:3]}); keep one copy of the test split")
        return items

    def _parquet_items(self) -> list[Item]:
        items = []
        for shard in find_test_shards(self.root):
            for row, record in enumerate(_shard_records(shard)):
                images = [ImageRef(str(shard), member=f"{column}:{row}") for column in IMAGE_COLUMNS]
                items.append(_item(record, images, f"{shard}: row {row}"))
        return items

    def _json_items(self) -> list[Item]:
        path = self.root / JSON_FILE
        items = []
        for index, record in enumerate(load_json_list(path)):
            require(isinstance(record, dict), f"{path}: record {index} is not a JSON object")
            require_fields(record, {**COLUMNS, **dict.fromkeys(IMAGE_COLUMNS, str)}, f"{path}: record {index}")
            items.append(_item(record, [ImageRef(str(self.images / record[column])) for column in IMAGE_COLUMNS],
                               f"{path}: record {index}"))
        return items

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        names = {score: score for score in SCORES}
        return {**overall_scores(outcomes, names),
                **grouped_scores(outcomes, lambda o: str(o["image_source"]), names, "{score}/image_source/{group}"),
                **grouped_scores(outcomes, lambda o: str(o["caption_source"]), names,
                                 "{score}/caption_source/{group}")}


def _item(record: dict, images: list[ImageRef], where: str) -> Item:
    return Item(id=str(record["id"]), images=images, texts=caption_pair(record, ("caption_1", "caption_2"), where),
                meta={key: record[key] for key in ColorSwap.outcome_fields})


def _shard_records(shard: Path) -> list[dict]:
    """The text columns of one parquet shard, each row checked."""
    records = read_parquet_rows(shard, COLUMNS, IMAGE_COLUMNS)
    for row, record in enumerate(records):
        require_fields(record, COLUMNS, f"{shard}: row {row}")
    return records

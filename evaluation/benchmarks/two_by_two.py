"""The 2 images x 2 captions family: Winoground, BiVLC, BiSCoR-Ctrl and the shapes-world swap set.

Every item holds images (I0, I1) and captions (C0, C1), caption i describing image i, scored as the matrix
s[i, j] = similarity(image i, caption j). The Winoground protocol (Thrush et al., CVPR 2022), also BiVLC's
`evaluate_BiVLC` (`IMirandaM/BiVLC`, `src/CLIP_fine_tuning/CLIP_utils.py`):
- text  (BiVLC "I2T"):  s(C0,I0) > s(C1,I0) and s(C1,I1) > s(C0,I1)  -- each image picks its caption;
- image (BiVLC "T2I"):  s(C0,I0) > s(C0,I1) and s(C1,I1) > s(C1,I0)  -- each caption picks its image;
- group: text and image.
Comparisons are strict, so a tie is wrong (BiVLC's code also uses `>`); `ties` counts items with any tied
comparison. Chance is 25 / 25 / 16.7. The four single comparisons are kept in each outcome (`text_i0`,
`text_i1`, `image_c0`, `image_c1`, the columns of BiVLC's per-item CSVs), so every aggregate, including the
shapes world's 2-way caption accuracy, is recomputed from stored outcomes.
"""
from __future__ import annotations

import re
from abc import abstractmethod
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from evaluation.benchmarks.annotations import read_json, read_jsonl, read_parquet_rows, require, required_text
from evaluation.benchmarks.base import (GENERATED, ImageOrigin, ImageRef, Item, ItemBenchmark, MissingBenchmarkData,
                                        Outcome, check_option, percent)
from evaluation.benchmarks.sources import DataSource, published

SCORES = ("text", "image", "group")


def two_by_two_scores(similarity: np.ndarray) -> dict[str, bool]:
    """Text / image / group and the four comparisons behind them, from s[image i, caption j]."""
    s = np.asarray(similarity, dtype=np.float64)
    comparisons = {"text_i0": (s[0, 0], s[0, 1]), "text_i1": (s[1, 1], s[1, 0]),
                   "image_c0": (s[0, 0], s[1, 0]), "image_c1": (s[1, 1], s[0, 1])}
    won = {name: bool(mine > other) for name, (mine, other) in comparisons.items()}
    text, image = won["text_i0"] and won["text_i1"], won["image_c0"] and won["image_c1"]
    tie = any(mine == other for mine, other in comparisons.values())
    return {"text": text, "image": image, "group": text and image, **won, "tie": tie}


def overall_scores(outcomes: Sequence[Outcome], names: dict[str, str]) -> dict[str, float]:
    """Each score in percent under its published name, plus the number of items and of tied items."""
    result = {names[score]: percent([bool(o[score]) for o in outcomes]) for score in SCORES}
    return {**result, "ties": float(sum(bool(o["tie"]) for o in outcomes)), "n": float(len(outcomes))}


def grouped_scores(outcomes: Sequence[Outcome], group_of: Callable[[Outcome], str], names: dict[str, str],
                   label: str = "{score}/{group}") -> dict[str, float]:
    """Each score per group (sorted), keyed `label.format(score=<published name>, group=<group>)`."""
    groups: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        groups[group_of(outcome)].append(outcome)
    return {label.format(score=names[score], group=group): percent([bool(o[score]) for o in members])
            for group, members in sorted(groups.items()) for score in SCORES}


class TwoByTwoBenchmark(ItemBenchmark):
    """A benchmark of 2x2 items; subclasses read their files and name the meta fields kept per outcome."""

    outcome_fields: tuple[str, ...] = ()

    def check_files(self) -> None:
        # As Benchmark.check_files, except that an alternative may be a glob pattern (shard names vary between
        # dataset revisions), present when it matches a file; `Benchmark.check_files` tests `exists()` only.
        missing = [name for name in self.required_files()
                   if not any(option_present(self.root, option) for option in name.split("|"))]
        if missing:
            raise MissingBenchmarkData(f"{self.name}: {self.root} lacks {', '.join(missing)}; expected files: "
                                       f"{', '.join(self.required_files())}")

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        return self.read_items()

    @abstractmethod
    def read_items(self) -> list[Item]:
        """Every item, read from the official files."""

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        return {"id": item.id, **{key: item.meta[key] for key in self.outcome_fields},
                **two_by_two_scores(similarity)}


def require_fields(record: dict, fields: dict[str, type | tuple[type, ...]], where: str) -> None:
    """Every field present with the expected type."""
    for field, kind in fields.items():
        require(isinstance(record.get(field), kind), f"{where} lacks field {field!r} of type {kind}")


def caption_pair(record: dict, fields: Sequence[str], where: str) -> list[str]:
    """The item's two captions, the values of `fields`, each non-empty."""
    return [required_text(record.get(field), where, field) for field in fields]


# ---------------------------------------------------------------- parquet test shards (Winoground, BiVLC)

# Where a Hugging Face dataset's test split lies as parquet, in order of preference: the repository's own files
# (`data/test-*`, all a dataset card promises: one shard or several, some revisions add a hash to the name),
# then the hub's converted-parquet branch `refs/convert/parquet` (`<config>/test/0000.parquet`, ...).
TEST_SHARD_PATTERNS = ("data/test-*.parquet", "*/test/*.parquet")
GLOB_CHARACTERS = re.compile(r"[*?[]")


def find_test_shards(root: Path) -> list[Path]:
    """The test split's parquet shards under root, in name order, from the first pattern that matches a file.

    Only one layout is read, since a folder holding both would otherwise count every item twice; and only one
    folder of it: shards of two converted configs are an error, not a silent concatenation.
    """
    root = Path(root)
    for pattern in TEST_SHARD_PATTERNS:
        shards = sorted(path for path in root.glob(pattern) if path.is_file())
        if shards:
            folders = sorted({str(shard.parent.relative_to(root)) for shard in shards})
            require(len(folders) == 1, f"{root}: test shards in several folders ({', '.join(folders)}); "
                                       "keep one config's shards under root")
            return shards
    return []


def option_present(root: Path, option: str) -> bool:
    """Whether one alternative of a required file is there: a path that exists, or a pattern matching a file."""
    option = option.strip()
    if GLOB_CHARACTERS.search(option):
        return any(path.is_file() for path in root.glob(option))
    return (root / option).exists()


# ---------------------------------------------------------------- Winoground

WINOGROUND_JSONL = "data/examples.jsonl"
WINOGROUND_FIELDS = {"id": int, "caption_0": str, "caption_1": str, "tag": str, "secondary_tag": (str, type(None)),
                     "num_main_preds": int, "collapsed_tag": str}


class Winoground(TwoByTwoBenchmark):
    """Winoground (400 items), from the Hugging Face dataset files `facebook/winoground`.

    Two layouts are read: `data/examples.jsonl` whose `image_0` / `image_1` are names without extension,
    the images being `<images>/<name>.png` (unzipped `data/images.zip`), or parquet with the images embedded:
    the repository's `data/test-*.parquet` (today the one file `data/test-00000-of-00001.parquet`; the card
    promises only the prefix) or the hub's converted `<config>/test/*.parquet` (`default/test/0000.parquet`).
    Several shards are read in name order (`find_test_shards`); ids must be unique across them.

    Args:
        root: the dataset folder (holding `data/`, or `default/` for the converted parquet).
        images: folder of the PNG images for the JSONL layout; default `<root>/data/images`.
        source: "jsonl", "parquet" or "auto" (the parquet shards when present, else the JSONL file).

    Aggregates: `text`, `image`, `group` overall; `<score>/<collapsed_tag>` (Object, Relation, Both),
    `<score>/tag/<tag>` and `<score>/main_preds_<n>` per group; `ties`, `n`.
    """

    name = "winoground"
    headline = SCORES
    description = "Winoground: text / image / group scores (%)"
    data_source = DataSource(
        home="https://huggingface.co/datasets/facebook/winoground",
        licence="research use only, by a click-through agreement; images licensed from Getty Images",
        size="400 items, 800 images: 364 MB",
        by_hand="accept the agreement on the dataset page, then huggingface-cli download --repo-type dataset "
                "facebook/winoground --local-dir <root> (data/test-*.parquet, or data/examples.jsonl with the "
                "unzipped data/images.zip)")
    published = published({"text": 31.25, "image": 11.0, "group": 8.75}, "vl_compo")
    outcome_fields = ("tag", "secondary_tag", "collapsed_tag", "num_main_preds")

    def __init__(self, root: str | Path, images: str | Path | None = None, source: str = "auto"):
        super().__init__(root)
        check_option(source in ("auto", "jsonl", "parquet"), f"source must be auto, jsonl or parquet, got {source!r}")
        if source == "auto":
            source = "parquet" if find_test_shards(self.root) else "jsonl"
        self.source = source
        self._check_source_files()
        self.images = Path(images) if images else self.root / "data" / "images"

    def required_files(self) -> list[str]:
        return [" | ".join((WINOGROUND_JSONL, *TEST_SHARD_PATTERNS))]

    def _check_source_files(self) -> None:
        # check_files accepts either layout; an explicit source needs its own.
        expected = " | ".join(TEST_SHARD_PATTERNS) if self.source == "parquet" else WINOGROUND_JSONL
        if not any(option_present(self.root, option) for option in expected.split("|")):
            raise MissingBenchmarkData(f"{self.name}: source={self.source!r} but {self.root} lacks {expected}; "
                                       f"expected files: {expected}")

    def read_items(self) -> list[Item]:
        return self._parquet_items() if self.source == "parquet" else self._jsonl_items()

    def _jsonl_items(self) -> list[Item]:
        path = self.root / WINOGROUND_JSONL
        items = []
        for _, record in read_jsonl(path):
            where = f"{path}: record {record.get('id')!r}"
            require_fields(record, {**WINOGROUND_FIELDS, "image_0": str, "image_1": str}, where)
            images = [ImageRef(str(self.images / f"{record[key]}.png")) for key in ("image_0", "image_1")]
            items.append(self._item(record, images, where))
        return items

    def _parquet_items(self) -> list[Item]:
        items = []
        for shard in find_test_shards(self.root):
            for row, record in enumerate(read_parquet_rows(shard, WINOGROUND_FIELDS, ("image_0", "image_1"))):
                require_fields(record, WINOGROUND_FIELDS, f"{shard}: row {row}")
                images = [ImageRef(str(shard), member=f"{column}:{row}") for column in ("image_0", "image_1")]
                items.append(self._item(record, images, f"{shard}: row {row}"))
        # Shards of two dataset revisions side by side in data/ would repeat every id.
        repeated = sorted(item_id for item_id, count in Counter(item.id for item in items).items() if count > 1)
        require(not repeated, f"{self.root}: ids repeat across the test shards (e.g. {repeated[:3]}); "
                              "keep one revision's shards")
        return items

    @staticmethod
    def _item(record: dict, images: list[ImageRef], where: str) -> Item:
        meta = {key: record[key] for key in Winoground.outcome_fields}
        return Item(id=str(record["id"]), images=images, texts=caption_pair(record, ("caption_0", "caption_1"), where),
                    meta=meta)

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        names = {score: score for score in SCORES}
        return {**overall_scores(outcomes, names),
                **grouped_scores(outcomes, lambda o: str(o["collapsed_tag"]), names),
                **grouped_scores(outcomes, lambda o: str(o["tag"]), names, "{score}/tag/{group}"),
                **grouped_scores(outcomes, lambda o: str(o["num_main_preds"]), names, "{score}/main_preds_{group}")}


# ---------------------------------------------------------------- BiVLC

BIVLC_TEXT_COLUMNS = ("caption", "negative_caption", "type", "subtype")
BIVLC_NAMES = {"text": "I2T", "image": "T2I", "group": "Group"}


class BiVLC(TwoByTwoBenchmark):
    """BiVLC (Miranda et al., 2024; 2,933 items) from the Hugging Face dataset `imirandam/BiVLC`.

    Files: `data/test-0000k-of-0000N.parquet` (two shards in the current release; older revisions add a hash
    to the name, so any `data/test-*.parquet` is read), or the hub's converted `<config>/test/*.parquet`
    (`default/test/0000.parquet`, ...); shards in name order (`find_test_shards`). Columns `image` and
    `negative_image` are embedded images; C0 = `caption`, C1 = `negative_caption`, I0 = `image`,
    I1 = `negative_image`. An item's id is its row in the concatenated shards. `image` is a COCO val2017
    photo, known to the leakage guard by the file name embedded with it (`000000397133.jpg`); `negative_image`
    is generated (SDXL), so in no training set of photos, whatever name it carries.

    Args:
        root: the dataset folder (holding `data/`, or `default/` for the converted parquet).

    Aggregates: `I2T` (= text), `T2I` (= image), `Group` overall; `<score>/<type>` (replace, swap, add) and
    `<score>/<type>_<subtype>`; `ties`, `n`.
    """

    name = "bivlc"
    headline = ("I2T", "T2I", "Group")
    description = "BiVLC: image-to-text, text-to-image and group scores (%)"
    data_source = DataSource(
        home="https://huggingface.co/datasets/imirandam/BiVLC", licence="MIT; COCO photos: Flickr terms",
        size="2,933 items with embedded images: 537 MB of parquet",
        by_hand="huggingface-cli download --repo-type dataset imirandam/BiVLC --local-dir <root> "
                "(data/test-*.parquet)")
    published = published({"I2T": 75.83, "T2I": 52.40, "Group": 49.06}, "bivlc")
    outcome_fields = ("type", "subtype")

    def required_files(self) -> list[str]:
        return [" | ".join(TEST_SHARD_PATTERNS)]

    def shards(self) -> list[Path]:
        return find_test_shards(self.root)

    def image_origin(self, ref: ImageRef) -> ImageOrigin:
        if ref.member is not None and ref.member.startswith("negative_image:"):
            return ImageOrigin(GENERATED)
        return super().image_origin(ref)

    def read_items(self) -> list[Item]:
        items: list[Item] = []
        for shard in self.shards():
            for row, record in enumerate(read_parquet_rows(shard, BIVLC_TEXT_COLUMNS, ("image", "negative_image"))):
                where = f"{shard}: row {row}"
                require_fields(record, dict.fromkeys(BIVLC_TEXT_COLUMNS, str), where)
                images = [ImageRef(str(shard), member=f"{column}:{row}") for column in ("image", "negative_image")]
                items.append(Item(id=str(len(items)), images=images,
                                  texts=caption_pair(record, ("caption", "negative_caption"), where),
                                  meta={"type": record["type"], "subtype": record["subtype"]}))
        return items

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        return {**overall_scores(outcomes, BIVLC_NAMES),
                **grouped_scores(outcomes, lambda o: str(o["type"]), BIVLC_NAMES),
                **grouped_scores(outcomes, lambda o: f"{o['type']}_{o['subtype']}", BIVLC_NAMES)}


# ---------------------------------------------------------------- BiSCoR-Ctrl

BISCOR_FIELDS = {"image_0": str, "image_1": str, "caption_0": str, "caption_1": str, "category": str}


class BiSCoRCtrl(TwoByTwoBenchmark):
    """BiSCoR-Ctrl (Miranda et al., arXiv 2604.11496): controlled CLEVR-like 2x2 items. NOT YET RELEASED.

    The file format here is our assumption until the authors release the data (docs/evaluation.md#biscor-ctrl): a JSONL
    file of `{"image_0", "image_1", "caption_0", "caption_1", "category"}` (an optional "id"; otherwise the
    line's position), image paths relative to the images folder. All numbers are unverified.

    Args:
        root: the dataset folder.
        annotations: the JSONL file, relative to root; default `biscor_ctrl.jsonl`.
        images: the images folder; default `<root>/images`.

    Aggregates: `text`, `image`, `group` (the paper's headline; chance 16.7) overall and
    `<score>/<category>`; `ties`, `n`.
    """

    name = "biscor_ctrl"
    headline = ("group",)
    description = "BiSCoR-Ctrl (format assumed until release): text / image / group scores (%)"
    data_source = DataSource(home="arXiv 2604.11496 (Miranda et al.)", licence="unknown: not released",
                        size="unknown: not released",
                        by_hand="not released yet; write <root>/biscor_ctrl.jsonl and images/ in the assumed "
                                "format (docs/evaluation.md, BiSCoR-Ctrl)")
    outcome_fields = ("category",)

    def __init__(self, root: str | Path, annotations: str = "biscor_ctrl.jsonl", images: str | Path | None = None):
        self.annotations = annotations  # read by required_files() during the base class's check
        super().__init__(root)
        self.images = Path(images) if images else self.root / "images"

    def required_files(self) -> list[str]:
        return [self.annotations]

    def read_items(self) -> list[Item]:
        path = self.root / self.annotations
        items = []
        for index, (_, record) in enumerate(read_jsonl(path)):
            where = f"{path}: record {index}"
            require_fields(record, BISCOR_FIELDS, where)
            images = [ImageRef(str(self.images / record[key])) for key in ("image_0", "image_1")]
            items.append(Item(id=str(record.get("id", index)), images=images,
                              texts=caption_pair(record, ("caption_0", "caption_1"), where),
                              meta={"category": record["category"]}))
        return items

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        names = {score: score for score in SCORES}
        return {**overall_scores(outcomes, names), **grouped_scores(outcomes, lambda o: str(o["category"]), names)}


# ---------------------------------------------------------------- shapes world

class ShapesSwap(TwoByTwoBenchmark):
    """The repository's shapes-world swap set (`datamodules/shapes/`, `annotations/swap_<split>.json`).

    Reports `text`, `image`, `group`, and `acc_<type>`, the
    2-way caption accuracy per swap type (attribute, relation, object) over both images of each item.

    Args:
        root: the shapes data root (holding `annotations/` and `images/`).
        split: "val" (default; the split for selection), "test" or "test_unseen" (held-out colour-shape
            combinations and colour pairs; both for reporting only), or "train".
    """

    name = "shapes_swap"
    headline = ("text", "image", "group")
    description = "Shapes-world swap set: text / image / group scores and 2-way caption accuracy per type (%)"
    data_source = DataSource(home="this repository (datamodules/shapes)", licence="MIT (generated)",
                        size="generated: 1 MB per 1,000 items at 64 px",
                        by_hand="python -m datamodules.shapes --out <root> (make demo writes data/study)")
    outcome_fields = ("type",)

    def __init__(self, root: str | Path, split: str = "val"):
        self.split = split  # read by required_files() during the base class's check
        super().__init__(root)

    def required_files(self) -> list[str]:
        return [f"annotations/swap_{self.split}.json"]

    def read_items(self) -> list[Item]:
        # the world's `load_swap_items`, reading through the checked reader: image paths are relative to the root
        path = self.root / self.required_files()[0]
        content = read_json(path)
        require(isinstance(content, dict) and isinstance(content.get("items"), list),
                f"{path}: expected {{\"items\": [...]}}")
        root = self.root.resolve()
        return [Item(id=str(item["id"]), images=[ImageRef(str(root / image)) for image in item["images"]],
                     texts=[required_text(text, f"{path}: item {item['id']!r}", f"captions[{k}]")
                            for k, text in enumerate(item["captions"])], meta={"type": item["type"]})
                for item in content["items"]]

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        result = overall_scores(outcomes, {score: score for score in SCORES})
        result.update({score: _share([bool(o[score]) for o in outcomes]) for score in SCORES})
        choices: dict[str, list[bool]] = defaultdict(list)
        for outcome in outcomes:
            choices[str(outcome["type"])] += [bool(outcome["text_i0"]), bool(outcome["text_i1"])]
        return {**result, **{f"acc_{swap_type}": _share(hits) for swap_type, hits in sorted(choices.items())}}


def _share(hits: list[bool]) -> float:
    """100 * hits / n."""
    return 100.0 * sum(hits) / len(hits) if hits else float("nan")


TWO_BY_TWO_BENCHMARKS = (Winoground, BiVLC, BiSCoRCtrl, ShapesSwap)

"""What every benchmark provides: items from its official files, a per-item rule, and aggregates.

Two kinds of benchmark share one base:
- `ItemBenchmark`: each item is a few images and a few texts scored as a small similarity matrix
  `[len(images), len(texts)]` (SugarCrepe, ARO, VALSE, Winoground, ...). The runner encodes every unique
  image and text once, then asks `outcome(item, similarity)` for the stored per-item result.
- Whole-set benchmarks (retrieval, zero-shot, STS) override `outcomes(scorer)` and score the full set.

Every aggregate is computed from the stored per-item outcomes, so a results folder can be re-aggregated and
audited. Every comparison is a strict `>`: a tie is wrong. (`np.argmax`, used by the ARO and What'sUp
reference code, breaks ties toward the first option, which makes a tie right on COCO-Order, whose gold index
is 0, and wrong on VG-Relation, whose gold index is 1. One rule for all avoids that.) A tie must also be a
tie exactly: every scorer scores an item's distinct images and texts once and indexes the result
(`Scorer.score`), so an item whose negative equals its positive (VL-CheckList has such items, ARO-Order
perturbations can equal the caption) gets two bit-identical scores and is wrong, whatever the float rounding of
a matrix product would have done to two identical columns. Texts are distinct when the model sees them differ
(`Scorer.text_keys`: the token ids for a tokenizing scorer), not when their strings do: ARO-Order perturbations
re-join words with spaces ("vegetables , chicken"), which CLIP's tokenizer maps to the caption's ids.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePath
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

# The annotation readers and the image reading import nothing of this package, so this module can import them
# without a circle; the benchmarks import ImageRef and the data errors from here as before.
from evaluation.benchmarks.annotations import MissingBenchmarkData, load_json_list, required_text
from evaluation.benchmarks.images import ImageRef, image_file_name
from evaluation.benchmarks.sources import DataSource, Published

Outcome = Dict[str, object]


@dataclass
class Item:
    """One benchmark item: its images and texts, scored as a similarity matrix [len(images), len(texts)]."""

    id: str
    images: List[ImageRef]
    texts: List[str]
    meta: Dict[str, object] = field(default_factory=dict)


# Where an image comes from, as far as its name tells (`Benchmark.image_origin`): the leakage guard matches COCO
# ids, maps Visual Genome ids to COCO ids when it has VG's id map, and can only compare the bytes of the rest.
COCO, VISUAL_GENOME, GENERATED, OTHER = "coco", "visual_genome", "generated", "other"


@dataclass(frozen=True)
class ImageOrigin:
    """An image's source dataset (`COCO`, `VISUAL_GENOME`, `GENERATED`: made for the benchmark, so in no photo
    collection; `OTHER`: a source without a COCO mapping, or an unrecognised name) and its id there, if any."""

    source: str
    id: Optional[int] = None


class Benchmark(ABC):
    """A benchmark over the files under `root` (its official layout).

    Subclasses set `name` (the registry key), `headline` (the aggregate keys a summary table shows),
    `description`, `data_source` (where the files come from: `sources.DataSource`) and `published` (headline numbers
    published for OpenAI CLIP ViT-B/32, by aggregate key), and implement `required_files`, `outcomes` and
    `aggregate`.
    """

    name: str = ""
    headline: Tuple[str, ...] = ()
    description: str = ""
    data_source: Optional[DataSource] = None
    published: Mapping[str, Published] = {}

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.check_files()

    @abstractmethod
    def required_files(self) -> List[str]:
        """Paths relative to `root` that must exist (an alternative is written `a | b`)."""

    @abstractmethod
    def outcomes(self, scorer: "Scorer", progress: bool = False) -> List[Outcome]:
        """Every per-item result (JSON-serialisable dicts with an "id"), scored by `scorer`."""

    @staticmethod
    @abstractmethod
    def aggregate(outcomes: Sequence[Outcome]) -> Dict[str, float]:
        """The published aggregates (percent unless stated), computed from per-item outcomes only."""

    def image_refs(self) -> List[ImageRef]:
        """Every image the benchmark reads (used by the leakage guard and the missing-image check)."""
        return []

    def read_annotations(self) -> None:
        """Read and check every annotation file the benchmark scores from (the result is cached), so that damaged
        input (`DamagedBenchmarkData`) stops a run before any model is built. The default reads what `image_refs`
        reads; a benchmark whose texts come from other files reads those too."""
        self.image_refs()

    # Whether the benchmark stores Visual Genome images under their bare ids (`<root>/images/2315375.jpg`: ARO's
    # VG sets, What'sUp's GQA sets). Elsewhere a bare number is not read as a VG id: Flickr30k names look alike.
    vg_images_by_id: bool = False

    def coco_image_ids(self) -> Set[int]:
        """COCO image ids among the benchmark's images, read from COCO-style file names (for an embedded image,
        the name recorded with it); Visual Genome images are not among them (see `image_origin`)."""
        return {origin.id for origin in map(self.image_origin, self.image_refs()) if origin.source == COCO}

    def image_origin(self, ref: ImageRef) -> ImageOrigin:
        """Where image `ref` comes from, read from the name it was published under: a COCO file name, a Visual
        Genome one (`VG_100K/<id>.jpg`, Visual7W's `v7w_<id>.jpg`, or `<id>.jpg` when `vg_images_by_id`), else
        `OTHER`."""
        name = image_file_name(ref)
        coco = coco_id_from_name(name)
        if coco is not None:
            return ImageOrigin(COCO, coco)
        vg = visual_genome_id_from_name(name, bare_ids=self.vg_images_by_id)
        return ImageOrigin(VISUAL_GENOME, vg) if vg is not None else ImageOrigin(OTHER)

    def check_files(self) -> None:
        missing = [name for name in self.required_files()
                   if not any((self.root / option.strip()).exists() for option in name.split("|"))]
        if missing:
            raise MissingBenchmarkData(f"{self.name}: {self.root} lacks {', '.join(missing)}; expected files: "
                                       f"{', '.join(self.required_files())}")


class ItemBenchmark(Benchmark):
    """A benchmark of independent items, each scored from its own small similarity matrix."""

    @abstractmethod
    def items(self) -> List[Item]:
        """Every item, read from the official files (cached after the first call)."""

    @abstractmethod
    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        """The per-item result from the item's similarity matrix [len(item.images), len(item.texts)]."""

    def image_refs(self) -> List[ImageRef]:
        return unique(ref for item in self.items() for ref in item.images)

    def read_annotations(self) -> None:
        self.checked_items()

    def checked_items(self) -> List[Item]:
        """`items()`, every text checked non-empty (`required_text`): the readers check the texts of their files
        where they read them, naming the record; this catches a text that a reader derives empty (a caption of
        punctuation only, cleaned) and any reader that forgets."""
        items = self.items()
        for item in items:
            for k, text in enumerate(item.texts):
                required_text(text, f"{self.name}: item {item.id} (read from {self.root})", f"text {k}")
        return items

    def outcomes(self, scorer: "Scorer", progress: bool = False) -> List[Outcome]:
        items = self.checked_items()
        scorer.prepare(unique(ref for item in items for ref in item.images),
                       unique(text for item in items for text in item.texts), progress=progress)
        return [self.outcome(item, scorer.score(item.images, item.texts)) for item in items]


class JsonListBenchmark(ItemBenchmark):
    """Items from one JSON list of records (`annotation_file` under root; ARO VG, What'sUp), one item each.

    Subclasses set `annotation_file` and `image_folder` (the default images folder under root) and implement
    `_item(path, index, record)`.
    """

    annotation_file: str = ""
    image_folder: str = "images"

    def __init__(self, root: str | Path, images: str | Path | None = None):
        super().__init__(root)
        self.images = Path(images) if images else self.root / self.image_folder

    def required_files(self) -> List[str]:
        return [self.annotation_file]

    def items(self) -> List[Item]:
        return self._items

    @cached_property
    def _items(self) -> List[Item]:
        path = self.root / self.annotation_file
        return [self._item(path, index, record) for index, record in enumerate(load_json_list(path))]

    @abstractmethod
    def _item(self, path: Path, index: int, record) -> Item:
        """The item of record `index` of the file `path` (malformed records: `DamagedBenchmarkData` naming both)."""


def unique(values: Iterable) -> list:
    """The distinct values in first-seen order (deterministic encoding order and output)."""
    return list(dict.fromkeys(values))


def unique_with_positions(values: Iterable) -> Tuple[list, np.ndarray]:
    """The distinct values in first-seen order, and for each input value its position among them.

    `[uniques[i] for i in positions]` gives the input back.
    """
    position: Dict[object, int] = {}
    positions = [position.setdefault(value, len(position)) for value in values]
    return list(position), np.asarray(positions, dtype=np.int64)


class Scorer(ABC):
    """Similarity of images and texts; larger means a better match.

    Identical candidates get bit-identical scores, so that a tie is a tie and the benchmarks' strict `>` rule
    scores it wrong: `score` and `score_groups` score each distinct image, text (and text group) once and index
    the result. (Two identical columns of one matrix product can differ in the last bit on the CPU, which once
    made identical VL-CheckList positives and negatives "correct".) Texts are identical when their `text_keys`
    are: what the model sees of them, which a tokenizing scorer makes the token ids. Subclasses implement
    `score_unique` (and may implement `score_unique_groups`), which are only ever called with distinct values.
    """

    def prepare(self, images: Sequence[ImageRef], texts: Sequence[str], progress: bool = False) -> None:
        """Precompute whatever `score` will need for these images and texts (optional)."""

    def text_keys(self, texts: Sequence[str]) -> list:
        """What the model sees of each text, as a hashable key: texts with equal keys score bit-identically.

        The default is the string itself. A scorer whose model reads token ids returns those, so that strings
        its tokenizer maps to the same ids ("vegetables , chicken" and "vegetables, chicken" for CLIP's, which
        splits punctuation off and collapses whitespace) tie exactly instead of by the luck of float rounding.
        """
        return list(texts)

    def score(self, images: Sequence[ImageRef], texts: Sequence[str]) -> np.ndarray:
        """Similarity matrix [len(images), len(texts)]; equal images (texts) give bit-identical rows (columns)."""
        unique_images, rows = unique_with_positions(images)
        unique_texts, columns = self.distinct_texts(texts)
        matrix = np.asarray(self.score_unique(unique_images, unique_texts))
        return matrix.reshape(len(unique_images), len(unique_texts))[np.ix_(rows, columns)]

    def distinct_texts(self, texts: Sequence[str]) -> Tuple[List[str], np.ndarray]:
        """One text per distinct key (the first seen, in first-seen order) and each text's position among them."""
        keys, positions = unique_with_positions(self.text_keys(texts))
        return _first_of_each(texts, positions, len(keys)), positions

    @abstractmethod
    def score_unique(self, images: Sequence[ImageRef], texts: Sequence[str]) -> np.ndarray:
        """Similarity matrix [len(images), len(texts)] of distinct images and distinct texts."""

    def score_groups(self, images: Sequence[ImageRef], text_groups: Sequence[Sequence[str]]) -> np.ndarray:
        """[len(images), len(groups)]: a group of texts (prompt templates of one class) as one column.

        Equal groups (a class list that repeats a name) give bit-identical columns.
        """
        unique_images, rows = unique_with_positions(images)
        groups = [tuple(group) for group in text_groups]
        keys = iter(self.text_keys([text for group in groups for text in group]))
        group_keys, columns = unique_with_positions(tuple(next(keys) for _ in group) for group in groups)
        unique_groups = _first_of_each(groups, columns, len(group_keys))
        matrix = np.asarray(self.score_unique_groups(unique_images, unique_groups))
        return matrix.reshape(len(unique_images), len(unique_groups))[np.ix_(rows, columns)]

    def score_unique_groups(self, images: Sequence[ImageRef], text_groups: Sequence[Sequence[str]]) -> np.ndarray:
        """`score_groups` of distinct images and groups; the default averages a group's similarities
        (embedding scorers average the embeddings instead)."""
        columns = [self.score(images, list(group)).mean(axis=1) for group in text_groups]
        return np.stack(columns, axis=1)

    def text_similarity(self, first: Sequence[str], second: Sequence[str]) -> np.ndarray:
        """Pairwise similarity of first[i] and second[i] (text-only probes such as STS)."""
        raise NotImplementedError(f"{type(self).__name__} has no text embedding; STS needs an embedding scorer")

    def describe(self) -> Dict[str, object]:
        """What produced the numbers, stored with the results."""
        return {"scorer": type(self).__name__}


def _first_of_each(values: Sequence, positions: np.ndarray, count: int) -> list:
    """For each of `count` distinct positions, the first of `values` at it (`positions[i]` is the position of
    `values[i]`; first-seen order, as `unique_with_positions` numbers them)."""
    first: Dict[int, object] = {}
    for value, position in zip(values, positions.tolist()):
        first.setdefault(position, value)
    return [first[position] for position in range(count)]


# COCO's own file names, matched against the whole base name: `COCO_<split>_<12 digits>.jpg` (2014 release) or
# `<12 digits>.jpg` (2017 release). Anchored on purpose: other datasets embed COCO-like digit runs in their names
# (VisDial's `VisualDialog_val2018_000000284024.jpg` is not COCO image 284024), and reading those as COCO ids
# would report overlap that is not there and exclude unrelated training images.
_COCO_NAME = re.compile(r"(?:COCO_(?:train|val|test)\d{4}_)?(\d{12})\.jpg")


def coco_id_from_name(path: str) -> Optional[int]:
    """The COCO id of a COCO-named image file (`000000391895.jpg`, `COCO_val2014_000000391895.jpg`), else None."""
    match = _COCO_NAME.fullmatch(PurePath(str(path)).name)
    return int(match.group(1)) if match else None


# Visual Genome's own folders (`VG_100K`, `VG_100K_2`) name an image by its VG id; Visual7W (VALSE existence and
# counting) names VG image <id> `v7w_<id>.jpg`.
_VG_FOLDERS = ("VG_100K", "VG_100K_2")
_VG_BARE_NAME = re.compile(r"(\d+)\.jpg")
_V7W_NAME = re.compile(r"v7w_(\d+)\.jpg")


def visual_genome_id_from_name(path: str, bare_ids: bool = False) -> Optional[int]:
    """The Visual Genome id of a VG-named image (`VG_100K/2354786.jpg`, `VG_100K_2/...`, `v7w_2354786.jpg`, and
    with `bare_ids` any `2354786.jpg`), else None."""
    pure = PurePath(str(path))
    v7w = _V7W_NAME.fullmatch(pure.name)
    if v7w:
        return int(v7w.group(1))
    bare = _VG_BARE_NAME.fullmatch(pure.name)
    return int(bare.group(1)) if bare and (bare_ids or pure.parent.name in _VG_FOLDERS) else None


def check_option(condition: bool, message: str) -> None:
    """A benchmark option out of its range is a ValueError (not a data error: `--all` must not pass over the
    benchmark as if its files were absent)."""
    if not condition:
        raise ValueError(message)


def percent(hits: Sequence[bool]) -> float:
    """100 x the mean of the booleans; NaN for an empty list (an empty subset is not 0 % correct)."""
    return 100.0 * float(np.mean(hits)) if len(hits) else float("nan")


def beats_all(similarity_row: np.ndarray, gold: int) -> bool:
    """Whether option `gold` scores strictly above every other option (a tie is wrong)."""
    others = np.delete(np.asarray(similarity_row), gold)
    return bool(np.all(similarity_row[gold] > others))


def grouped_percent(outcomes: Sequence[Outcome], key: str, value: str = "correct",
                    keep: Optional[Callable[[str, List[bool]], bool]] = None) -> Dict[str, float]:
    """Accuracy per group `outcome[key]`, in first-seen group order; `keep(group, hits)` filters groups."""
    groups: Dict[str, List[bool]] = {}
    for outcome in outcomes:
        groups.setdefault(str(outcome[key]), []).append(bool(outcome[value]))
    return {group: percent(hits) for group, hits in groups.items() if keep is None or keep(group, hits)}


def macro(values: Iterable[float]) -> float:
    """Unweighted mean of per-group accuracies (NaN groups are an error, not silently dropped)."""
    values = list(values)
    if not values:
        return float("nan")
    if any(np.isnan(v) for v in values):
        raise ValueError("macro average over a group with no items")
    return float(np.mean(values))

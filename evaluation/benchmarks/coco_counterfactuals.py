"""COCO-Counterfactuals (Le et al., NeurIPS 2023 Datasets and Benchmarks): image-text retrieval among synthetic
image-caption pairs that differ from their counterfactual in one noun.

Files, as the Hugging Face dataset `Intel/COCO-Counterfactuals` publishes them (revision 958a3e0; the data were
pushed in 6dbc6bd and have not changed since):
- `data/examples.jsonl`: one JSON object per line, `{"id", "caption_0", "caption_1", "image_0", "image_1"}`,
  17,410 examples. `id` is `<COCO val2017 image id>_<caption number>`; `caption_0` is that COCO caption (the
  original), `caption_1` the same caption with one noun replaced (the counterfactual); `image_k` names, without
  extension, the Stable Diffusion image generated for `caption_k` (always `<id>_img_<k>` in the release).
- `data/images.zip`: `images/<name>.jpg` (the dataset's loading script, `COCO-Counterfactuals.py`, joins the
  unzipped folder, `images` and the name plus `.jpg`). Unzipped in `data/`, an image is
  `<root>/data/images/<image_k>.jpg`; option `images` names another folder.
The authors' `huggingface/metadata.jsonl` (repository below) is the file they wrote for the dataset: 17,410
records in this schema, of the size the hub shows for `data/examples.jsonl` (3.75 MB); the counts below are its.

Rule: the authors' `coco-cfs-evaluation/CLIP_evaluation.py` (IntelLabs/multimodal_cognitive_ai, commit 860cd01,
under `COCO-Counterfactuals/coco-counterfactuals-src/`), which produced their CLIP numbers. The evaluated set is a
table of (image, caption) rows, two per example. Images are told apart by file and captions by string, and each
distinct one is a query:
- image to text: each image ranks every distinct caption; a hit at K when one of the K best is paired with it;
- text to image: each distinct caption ranks every image; a hit at K when one of the K best is paired with it;
R@K is 100 x the mean of the hits over images (I2T) or over distinct captions (T2I), K = 1, 5, 10. Captions do
repeat: 194 strings occur 504 times among the release's 34,820 captions, the same COCO caption under several
examples and its counterfactual with it (nine examples share "A man holding a tennis racquet on a tennis court."
and "A boy holding ..."). Such a caption is one T2I query whose correct images are all of its images, and a
single candidate in I2T. That is the authors' rule, and their numbers confirm it: their T2I recalls on the test
split below are whole counts of its 10,403 distinct captions, not of its 10,446 rows. Strings are compared as
they are: nine captions come in two spellings that differ only by a trailing space, which CLIP's tokenizer
drops; the spellings stay two captions, as in the authors' table, so each is a wrong candidate tying with the
other.

Ties: the authors sort each query's candidates with a stable descending sort, candidates in the order of a Python
set of paths or strings, which changes from run to run with string hashing, so their tie-break is arbitrary and
cannot be reproduced. Here, as in `retrieval.py`, a tie counts against: a query's rank is the number of wrong
candidates scoring at least as high as its best correct one, and R@K the share of ranks below K. `i2t_tied`,
`t2i_tied` and `ties` count the queries with a wrong candidate tied with the best correct one.

Two sets of examples: `coco_counterfactuals` scores the whole release (the dataset's only split, "test");
`coco_counterfactuals_test` scores the authors' test split, a random 30 % of the examples (5,223; drawn in
`Finetuning/finetune-data/DatasetPreparation.ipynb`) listed in `split-coco-cfs/test-coco-cfs.csv` of the same
commit, on which the authors evaluate their zero-shot and fine-tuned models. That file's rows are
`image_path, caption`: the path's folder, `synthetic-images-for-original-captions` or
`synthetic-images-for-counterfactual-captions`, and its file, `<id>.jpg`, name image 0 or 1 of example `id`, and
the caption is that example's `caption_0` or `caption_1` (checked).

Published numbers: for the test split, the zero-shot row ("clip-baseline", Hugging Face
`openai/clip-vit-base-patch32`) of `coco-cfs-evaluation/evaluate_coco_cfs_clip.csv` (the same values as
`coco-cfs-evaluation/test-coco-cfs/base-model/evaluate_clip-baseline.csv`). None is known for the whole release.
fsc-clip (ytaek-oh/fsc-clip 604015d, `src/training/eval_compo.py`) evaluates a `coco_counterfactual_retrieval`
with the unreleased vl_compo package and averages its I2T and T2I R@1 into its retrieval means; which examples it
scores is not public.

Scoring reuses `retrieval.retrieval_ranks` (chunked, strict, ties counted) on the transposed problem: distinct
captions are its rows and images its columns, each image belonging to its one caption and a caption owning one or
more images, so its row ranks are the T2I ranks (every image of a caption correct) and its column ranks the I2T
ranks. Its progress bars therefore say "image queries" for the caption pass and the reverse.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePosixPath

import numpy as np

from evaluation.benchmarks.annotations import read_csv_records, read_jsonl, require, required_text
from evaluation.benchmarks.base import (GENERATED, Benchmark, ImageOrigin, ImageRef, Outcome, Scorer, check_option,
                                        unique)
from evaluation.benchmarks.retrieval import RECALL_AT, CocoRetrieval, Ranks, retrieval_ranks
from evaluation.benchmarks.sources import DataSource, Download, published

EXAMPLES = "data/examples.jsonl"
TEST_SPLIT = "split-coco-cfs/test-coco-cfs.csv"
FIELDS = ("id", "caption_0", "caption_1", "image_0", "image_1")
SIDES = ("original", "counterfactual")  # caption / image 0 and 1 of an example
# The test split's image folders, for image 0 and image 1 of an example.
SPLIT_FOLDERS = {"synthetic-images-for-original-captions": 0, "synthetic-images-for-counterfactual-captions": 1}

HF_REVISION = "958a3e0b32421b9f07c4c3f78aecbf98019a3402"
AUTHORS_COMMIT = "860cd01059d1ec5ba15951fff4953a05a391886a"
AUTHORS_SOURCE = "COCO-Counterfactuals/coco-counterfactuals-src"

BY_HAND = (
    "The Hugging Face dataset Intel/COCO-Counterfactuals (its loading script asks for a Hugging Face token, so log "
    "in first: `huggingface-cli login`): `huggingface-cli download Intel/COCO-Counterfactuals data/examples.jsonl "
    f"data/images.zip --repo-type dataset --revision {HF_REVISION} --local-dir <root>`, then unzip "
    "<root>/data/images.zip inside <root>/data (it holds images/<id>_img_<k>.jpg, 34,820 files), giving "
    "<root>/data/images/.")
# The authors' test split at AUTHORS_COMMIT (sha256 and size of `git show <commit>:<path>`).
TEST_SPLIT_DOWNLOAD = Download(
    url=f"https://raw.githubusercontent.com/IntelLabs/multimodal_cognitive_ai/{AUTHORS_COMMIT}/{AUTHORS_SOURCE}/"
        f"Finetuning/finetune-data/{TEST_SPLIT}",
    target=TEST_SPLIT, sha256="6e25ca7699192eec5393b4d21a5c37fc181aedfd4b26b6bb594a29c1362f027c", size=1411828)
SIZE = "data/examples.jsonl 3.7 MB (17,410 examples); data/images.zip 6.4 GB (34,820 JPEGs)"
LICENCE = ("CC BY 4.0 (dataset card); images generated with Stable Diffusion from COCO val2017 captions "
           "(COCO annotations: CC BY 4.0)")


@dataclass(frozen=True)
class Pair:
    """One evaluated row: image `side` (0 original, 1 counterfactual) of example `item`, with its caption."""

    item: str
    side: int
    image: ImageRef
    caption: str


@dataclass
class PairTable:
    """Retrieval data from (image, caption) rows: the rows' images, the distinct captions in first-seen order,
    and for each image the position of its caption among them (each image has exactly one caption)."""

    pairs: list[Pair]
    captions: list[str]
    caption_of_image: np.ndarray

    @classmethod
    def from_pairs(cls, pairs: Sequence[Pair], where: Path) -> PairTable:
        """The table of `pairs`; an image listed twice is an error naming `where` (the file read)."""
        seen: set[ImageRef] = set()
        for pair in pairs:
            require(pair.image not in seen, f"{where}: image {pair.image.path} appears in two rows")
            seen.add(pair.image)
        require(bool(pairs), f"{where}: no (image, caption) rows to evaluate")
        position: dict[str, int] = {}
        caption_of_image = [position.setdefault(pair.caption, len(position)) for pair in pairs]
        return cls(list(pairs), list(position), np.asarray(caption_of_image, dtype=np.int64))

    @property
    def images(self) -> list[ImageRef]:
        return [pair.image for pair in self.pairs]

    def first_pair_of_caption(self) -> list[Pair]:
        """For each distinct caption, the first row holding it (names its T2I query)."""
        first: dict[int, Pair] = {}
        for pair, caption in zip(self.pairs, self.caption_of_image.tolist()):
            first.setdefault(caption, pair)
        return [first[caption] for caption in range(len(self.captions))]


# --- files ------------------------------------------------------------------------------------------------

def read_examples(path: Path) -> list[dict]:
    """The records of `data/examples.jsonl`, each checked for the five string fields (the captions non-empty); ids
    unique."""
    records, ids = [], set()
    for number, record in read_jsonl(path):
        for field in FIELDS:
            require(isinstance(record.get(field), str),
                    f"{path}: line {number} (id {record.get('id')!r}) lacks the string field {field!r}")
        for field in ("caption_0", "caption_1"):
            required_text(record[field], f"{path}: line {number} (id {record['id']!r})", field)
        require(record["id"] not in ids, f"{path}: line {number} repeats id {record['id']!r}")
        ids.add(record["id"])
        records.append(record)
    require(bool(records), f"{path}: no examples")
    return records


def example_pairs(records: Sequence[dict], images: Path) -> list[Pair]:
    """Both rows of every example, in file order (original, then counterfactual)."""
    return [Pair(record["id"], side, ImageRef(str(images / f"{record[f'image_{side}']}.jpg")),
                 record[f"caption_{side}"]) for record in records for side in (0, 1)]


def read_test_split(path: Path, records: Sequence[dict], images: Path) -> list[Pair]:
    """The rows of the authors' `test-coco-cfs.csv`, in file order, as pairs of the examples they name."""
    by_id = {record["id"]: record for record in records}
    return [_split_pair(row, by_id, images, f"{path}: line {line}")
            for line, row in read_csv_records(path, ("image_path", "caption"))]


def _split_pair(row: dict, by_id: dict, images: Path, where: str) -> Pair:
    """The pair a test-split row names: `<folder>/<id>.jpg` is image 0 or 1 of example `id`, with its caption."""
    image_path, caption = row["image_path"], required_text(row["caption"], where)
    parts = PurePosixPath(image_path).parts
    folder, name = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", image_path)
    require(folder in SPLIT_FOLDERS and name.endswith(".jpg"),
            f"{where}: image_path {image_path!r} is not <one of {sorted(SPLIT_FOLDERS)}>/<id>.jpg")
    item, side = name[: -len(".jpg")], SPLIT_FOLDERS[folder]
    require(item in by_id, f"{where}: example {item!r} is not in {EXAMPLES}")
    record = by_id[item]
    require(caption == record[f"caption_{side}"],
            f"{where}: caption {caption!r} is not caption_{side} of example {item!r} ({record[f'caption_{side}']!r})")
    return Pair(item, side, ImageRef(str(images / f"{record[f'image_{side}']}.jpg")), caption)


# --- ranks and outcomes -----------------------------------------------------------------------------------

def pair_ranks(table: PairTable, scorer: Scorer, chunk_size: int, progress: bool = False) -> tuple[Ranks, Ranks]:
    """Strict (I2T per image, T2I per distinct caption) ranks, from `retrieval_ranks` on the transposed problem
    (distinct captions as rows, images as columns; see the module docstring)."""
    images, captions = table.images, table.captions

    def caption_rows(start: int, stop: int) -> np.ndarray:
        return np.asarray(scorer.score(images, captions[start:stop])).T

    t2i, i2t = retrieval_ranks(caption_rows, table.caption_of_image, len(captions), chunk_size, progress)
    return i2t, t2i


def pair_outcomes(table: PairTable, i2t: Ranks, t2i: Ranks) -> list[Outcome]:
    """One outcome per image query (`i2t/<id>/<side>`) and per distinct caption (`t2i/<id>/<side>` of the first
    row holding it; `images` is how many images it is paired with)."""
    image_count = np.bincount(table.caption_of_image, minlength=len(table.captions))
    image_queries = [{"id": f"i2t/{pair.item}/{pair.side}", "direction": "i2t", "item": pair.item,
                      "side": SIDES[pair.side], "rank": int(rank), "ties": int(ties)}
                     for pair, rank, ties in zip(table.pairs, i2t.rank, i2t.ties)]
    caption_queries = [{"id": f"t2i/{pair.item}/{pair.side}", "direction": "t2i", "item": pair.item,
                        "side": SIDES[pair.side], "images": int(count), "rank": int(rank), "ties": int(ties)}
                       for pair, count, rank, ties in zip(table.first_pair_of_caption(), image_count, t2i.rank,
                                                          t2i.ties)]
    return image_queries + caption_queries


# --- benchmarks -------------------------------------------------------------------------------------------

class CocoCounterfactuals(Benchmark):
    """COCO-Counterfactuals retrieval over the whole release (17,410 examples: 34,820 images, 34,510 distinct
    captions).

    Args:
        root: the dataset folder, holding `data/examples.jsonl`.
        images: folder of the `<image_k>.jpg` files; default `<root>/data/images` (`data/images.zip` unzipped in
            `data/`).
        chunk_size: captions scored per `scorer.score` call.

    Aggregates (percent): `i2t_r1/5/10` (per image), `t2i_r1/5/10` (per distinct caption), `rsum`; counts
    `images`, `captions` (distinct), `n` (examples), `i2t_tied`, `t2i_tied` and `ties` (queries decided by a
    tie).
    """

    name = "coco_counterfactuals"
    headline = tuple(f"{direction}_r{k}" for direction in ("i2t", "t2i") for k in RECALL_AT) + ("rsum",)
    description = "COCO-Counterfactuals (all 17,410 examples) image-text retrieval: R@1/5/10 both ways (%)"
    data_source = DataSource(home="https://huggingface.co/datasets/Intel/COCO-Counterfactuals", licence=LICENCE,
                        size=SIZE, by_hand=BY_HAND)
    published = published({}, "coco_counterfactuals")
    rows_file = EXAMPLES  # the file listing the evaluated rows

    def __init__(self, root: str | Path, images: str | Path | None = None, chunk_size: int = 1024):
        super().__init__(root)
        check_option(chunk_size >= 1, f"chunk_size must be positive, got {chunk_size}")
        self.images = Path(images) if images else self.root / "data" / "images"
        self.chunk_size = chunk_size

    def required_files(self) -> list[str]:
        return [EXAMPLES]

    @cached_property
    def examples(self) -> list[dict]:
        """The records of `data/examples.jsonl`, in file order."""
        return read_examples(self.root / EXAMPLES)

    def evaluated_pairs(self) -> list[Pair]:
        """The (image, caption) rows scored: both of every example."""
        return example_pairs(self.examples, self.images)

    @cached_property
    def table(self) -> PairTable:
        return PairTable.from_pairs(self.evaluated_pairs(), self.root / self.rows_file)

    def image_refs(self) -> list[ImageRef]:
        return unique(self.table.images)

    def image_origin(self, ref: ImageRef) -> ImageOrigin:
        # Every image is generated from a caption; none is a COCO photo, whatever the COCO id in its name.
        return ImageOrigin(GENERATED)

    def outcomes(self, scorer: Scorer, progress: bool = False) -> list[Outcome]:
        table = self.table
        scorer.prepare(unique(table.images), table.captions, progress=progress)
        return pair_outcomes(table, *pair_ranks(table, scorer, self.chunk_size, progress))

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        """The Karpathy retrieval aggregates (same outcome fields), plus `ties` and `n` (examples)."""
        result = CocoRetrieval.aggregate(outcomes)
        result["ties"] = float(result["i2t_tied"] + result["t2i_tied"])
        result["n"] = float(len({o["item"] for o in outcomes if o["direction"] == "i2t"}))
        return result


class CocoCounterfactualsTest(CocoCounterfactuals):
    """COCO-Counterfactuals retrieval over the authors' test split (5,223 examples: 10,446 images, 10,403 distinct
    captions), listed in `<root>/split-coco-cfs/test-coco-cfs.csv`; arguments and aggregates as
    `CocoCounterfactuals`."""

    name = "coco_counterfactuals_test"
    description = "COCO-Counterfactuals (authors' 5,223-example test split) image-text retrieval: R@1/5/10 (%)"
    data_source = DataSource(
        home="https://huggingface.co/datasets/Intel/COCO-Counterfactuals", licence=LICENCE,
        size=f"{SIZE}; split-coco-cfs/test-coco-cfs.csv 1.4 MB",
        downloads=(TEST_SPLIT_DOWNLOAD,), by_hand=BY_HAND)
    # The authors' zero-shot OpenAI CLIP ViT-B/32 row (module docstring), rounded to two decimals.
    published = published({"i2t_r1": 50.96, "i2t_r5": 79.33, "i2t_r10": 86.45,
                           "t2i_r1": 47.89, "t2i_r5": 77.19, "t2i_r10": 85.73}, "coco_counterfactuals")
    rows_file = TEST_SPLIT

    def required_files(self) -> list[str]:
        return [EXAMPLES, TEST_SPLIT]

    def evaluated_pairs(self) -> list[Pair]:
        """The rows of the test split, in its file order."""
        return read_test_split(self.root / TEST_SPLIT, self.examples, self.images)

"""SVO-Probes (Hendricks and Nematzadeh, Findings of ACL 2021): subject, verb and object negatives.

Official file: `svo_probes.csv` of `deepmind/svo_probes` (commit 206219e), one row per (sentence, positive
image, negative image) with columns `sentence, pos_triplet, neg_triplet, pos_url, neg_url, pos_image_id,
neg_image_id, subj_neg, verb_neg, obj_neg` (the last three `True` / `False`: which part of the sentence's
subject-verb-object triplet the negative image contradicts). The images are web links (`pos_url`, `neg_url`;
all 14,102 listed in `image_urls.txt`), and many no longer resolve. They are read from a local folder as
`<images>/<image id>.jpg`, named by the CSV's integer ids whatever the downloaded format (decoding goes by
content, not by name).

Rule. The authors' notebook (`probing_image_text_models.ipynb`) scores models that say match / no match
for each (sentence, image) pair, so it does not apply to a similarity score as it stands; its item selection
does: a row counts for a negative type only when exactly that one of `subj_neg`, `verb_neg`, `obj_neg` is
true (`subj_neg & ~obj_neg & ~verb_neg`, ...), and "All" pools the three selections. For a contrastive
model we score each such row as the pair it is: right iff s(positive image, sentence) >
s(negative image, sentence), strictly (a tie is wrong and counted in `ties`). Accuracy is per negative type,
with the unweighted mean of the three as the headline (`mean`, the number vl_compo reports as `svo_probes`;
`ytaek-oh/vl_compo` commit 43e2eae publishes result tables only, so this rule is an assumption, not checked
against their code or their images: their per-type values are exact fractions over 1,864, 13,523 and 4,911
(or multiples), consistent with one right-or-wrong outcome per row over the rows whose images they had).
Rows outside the three selections (no flag, or several) are in no accuracy, as in the notebook; they are
reported, not scored.

Missing images. A row whose positive or negative image file is absent (or empty: a failed download) under the
images folder cannot be scored. It is not an item (so the runner neither encodes nor checks its images) but
still has an outcome, `scorable: false`, so that `scorable` and `unscorable` (per type too) say over how many
rows each accuracy is; a warning gives the counts. Accuracies are over scorable rows only, and depend on
which images a copy holds: compare models on the same images folder.

Reference numbers, OpenAI CLIP ViT-B/32 (vl_compo `individual_results.csv`, row ViT-B-32 / openai):
subj_neg 84.07, verb_neg 79.73, obj_neg 88.62, mean 84.14 (on the images vl_compo could download).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from evaluation.benchmarks.annotations import read_csv_records, require, required_text
from evaluation.benchmarks.base import OTHER, ImageOrigin, ImageRef, Item, ItemBenchmark, Outcome, Scorer, percent
from evaluation.benchmarks.sources import DataSource, github_file, published

log = logging.getLogger(__name__)

ANNOTATION_FILE = "svo_probes.csv"
NEGATIVE_TYPES = ("subj_neg", "verb_neg", "obj_neg")
COLUMNS = ("sentence", "pos_triplet", "neg_triplet", "pos_url", "neg_url", "pos_image_id", "neg_image_id",
           *NEGATIVE_TYPES)
OTHER_TYPE = "other"  # a row with no negative flag, or several
BOOLEANS = {"true": True, "false": False}
REPOSITORY, COMMIT = "deepmind/svo_probes", "206219e2afd9640b8bbe6ef95f49b52b0d4ed350"


@dataclass(frozen=True)
class SvoRow:
    """One CSV row: its position among the data rows, sentence, image ids and negative type."""

    index: int
    sentence: str
    pos_image_id: int
    neg_image_id: int
    negative: str  # one of NEGATIVE_TYPES, or OTHER_TYPE


def negative_type(flags: dict[str, bool]) -> str:
    """The single true flag among subj_neg / verb_neg / obj_neg, else `OTHER_TYPE` (the notebook's selection)."""
    true = [name for name in NEGATIVE_TYPES if flags[name]]
    return true[0] if len(true) == 1 else OTHER_TYPE


def _flag(value: str, where: str, column: str) -> bool:
    require(value.strip().lower() in BOOLEANS, f"{where}: {column} must be True or False, got {value!r}")
    return BOOLEANS[value.strip().lower()]


def _image_id(value: str, where: str, column: str) -> int:
    """An integer id, also when written as a whole float (`123.0`, as pandas writes an int column with a gap)."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    require(number.is_integer(), f"{where}: {column} must be an integer image id, got {value!r}")
    return int(number)


def read_rows(path: Path) -> list[SvoRow]:
    """Every data row of `svo_probes.csv`, in file order; malformed input (a row cut short, an empty sentence,
    scored or not) is a `DamagedBenchmarkData` naming the file and the row's line (the header being line 1). Extra
    columns (a pandas index) are ignored."""
    return [_row(record, index, f"{path}: line {line}")
            for index, (line, record) in enumerate(read_csv_records(path, COLUMNS))]


def _row(record: dict, index: int, where: str) -> SvoRow:
    flags = {name: _flag(record[name], where, name) for name in NEGATIVE_TYPES}
    return SvoRow(index=index, sentence=required_text(record["sentence"], where, "sentence"),
                  negative=negative_type(flags),
                  pos_image_id=_image_id(record["pos_image_id"], where, "pos_image_id"),
                  neg_image_id=_image_id(record["neg_image_id"], where, "neg_image_id"))


def _present(path: Path) -> bool:
    """A downloaded image: a file with content (a failed download can leave an empty one)."""
    return path.is_file() and path.stat().st_size > 0


class SVOProbes(ItemBenchmark):
    """SVO-Probes: for each row, does the sentence score its positive image above its negative image?

    Items are the scorable rows with one negative type: images (positive, negative), text (sentence),
    similarity [2, 1]; ids are the row's position among the CSV's data rows. `outcomes` adds an unscored
    outcome for every other row (missing image, or no single negative type).

    Args:
        root: the folder holding `svo_probes.csv`.
        images: the folder of downloaded images, `<image id>.jpg`; default `<root>/images`.

    Aggregates: `subj_neg`, `verb_neg`, `obj_neg` (accuracy over the scorable rows of each type), `mean` (their
    unweighted mean), `all` (pooled over the three types); `n` (rows scored) = `scorable`, `unscorable` (rows
    of the three types with an image missing), `scorable/<type>`, `unscorable/<type>`, `other_type_rows` (rows
    in no type, never scored), `rows` (all CSV rows), `ties`.
    """

    name = "svo_probes"
    headline = ("subj_neg", "verb_neg", "obj_neg", "mean")
    description = "SVO-Probes: positive vs negative image per sentence, accuracy per negative type (%)"
    data_source = DataSource(
        home="https://github.com/deepmind/svo_probes",
        licence="CC BY 4.0 (annotations); the images are third-party web images behind their URLs",
        size="svo_probes.csv about 14 MB; image_urls.txt 2 MB (14,102 image URLs, many dead)",
        downloads=(github_file(REPOSITORY, COMMIT, "image_urls.txt",
                               "c8b2513283dd3987aeb10adf48b9cd31a58a837c07664051d4133d3b78642438", 1988238),),
        by_hand=(
            f"svo_probes.csv: https://raw.githubusercontent.com/{REPOSITORY}/{COMMIT}/svo_probes.csv into "
            "the root (the same file as the notebook's https://storage.googleapis.com/dm-mmt-models/svo_probes.csv "
            "and the Hugging Face copy MichiganNLP/svo_probes); `git hash-object svo_probes.csv` must print "
            "2dbab46af1169c2d6feb8b2cee26fe7140ffda19, its blob id at that commit. Images: for every row, fetch "
            "pos_url and neg_url and save the bytes as <root>/images/<pos_image_id>.jpg and <neg_image_id>.jpg "
            "(whatever their format); delete anything that is not an image (error pages). Links that fail leave "
            "their rows unscored and counted (`unscorable`)."),
    )
    published = published({"subj_neg": 84.07, "verb_neg": 79.73, "obj_neg": 88.62, "mean": 84.14}, "vl_compo")

    def __init__(self, root: str | Path, images: str | Path | None = None):
        super().__init__(root)
        self.images = Path(images) if images else self.root / "images"

    def required_files(self) -> list[str]:
        return [ANNOTATION_FILE]

    def image_origin(self, ref: ImageRef) -> ImageOrigin:
        # The ids are the benchmark's own, not COCO or Visual Genome ids, whatever their digits look like.
        return ImageOrigin(OTHER)

    def image_path(self, image_id: int) -> Path:
        return self.images / f"{image_id}.jpg"

    @cached_property
    def rows(self) -> list[SvoRow]:
        return read_rows(self.root / ANNOTATION_FILE)

    def scorable(self, row: SvoRow) -> bool:
        return row.negative != OTHER_TYPE and all(
            _present(self.image_path(image_id)) for image_id in (row.pos_image_id, row.neg_image_id))

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        return [Item(id=str(row.index), texts=[row.sentence], meta={"negative": row.negative},
                     images=[ImageRef(str(self.image_path(row.pos_image_id))),
                             ImageRef(str(self.image_path(row.neg_image_id)))])
                for row in self.rows if self.scorable(row)]

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        positive, negative = float(similarity[0, 0]), float(similarity[1, 0])
        return {"id": item.id, "negative": item.meta["negative"], "scorable": True, "correct": positive > negative,
                "tie": positive == negative}

    def outcomes(self, scorer: Scorer, progress: bool = False) -> list[Outcome]:
        scored = {outcome["id"]: outcome for outcome in super().outcomes(scorer, progress=progress)}
        outcomes = [scored.get(str(row.index)) or self._unscored(row) for row in self.rows]
        counts = {key: int(value) for key, value in self.aggregate(outcomes).items() if "scorable" in key}
        if counts["unscorable"]:
            log.warning("%s: %d of %d rows of the three negative types lack an image under %s and are not scored "
                        "(subj_neg %d, verb_neg %d, obj_neg %d); accuracies are over the %d scorable rows",
                        self.name, counts["unscorable"], counts["unscorable"] + counts["scorable"], self.images,
                        *(counts[f"unscorable/{t}"] for t in NEGATIVE_TYPES), counts["scorable"])
        return outcomes

    def _unscored(self, row: SvoRow) -> Outcome:
        missing = [image_id for image_id in (row.pos_image_id, row.neg_image_id)
                   if not _present(self.image_path(image_id))]
        return {"id": str(row.index), "negative": row.negative, "scorable": False, "missing_images": missing}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        typed = [o for o in outcomes if o["negative"] in NEGATIVE_TYPES]
        scored = [o for o in typed if o["scorable"]]
        result = {t: percent([bool(o["correct"]) for o in scored if o["negative"] == t]) for t in NEGATIVE_TYPES}
        # NaN when a type has no scorable row: a mean over fewer types is another number.
        result["mean"] = float(np.mean([result[t] for t in NEGATIVE_TYPES]))
        result["all"] = percent([bool(o["correct"]) for o in scored])
        result["n"] = result["scorable"] = float(len(scored))
        result["unscorable"] = float(len(typed) - len(scored))
        for t in NEGATIVE_TYPES:
            result[f"scorable/{t}"] = float(sum(o["negative"] == t for o in scored))
            result[f"unscorable/{t}"] = float(sum(o["negative"] == t and not o["scorable"] for o in typed))
        result["other_type_rows"] = float(len(outcomes) - len(typed))
        result["rows"] = float(len(outcomes))
        result["ties"] = float(sum(bool(o["tie"]) for o in scored))
        return result

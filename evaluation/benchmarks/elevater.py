"""ELEVATER zero-shot image classification (Li et al., NeurIPS 2022), the 21 tasks vl_compo reports.

Tasks, named as vl_compo's result tables name them (each is the file name of the toolkit's dataset config,
`vision_benchmark/resources/datasets/<task>.yaml` of Computer-Vision-in-the-Wild/Elevater_Toolkit_IC, commit
00d0af7): the 20 ELEVATER datasets and imagenet-1k. What each task reads and how it is scored comes from that
commit, extracted by `data/elevater/extract.py` into `data/elevater/tasks.json` (see its README):
- class names: `vision_benchmark/datasets/prompts.py` `class_map[<dataset>]`, indexed by label; where an entry is
  a list of synonyms (fer-2013) only the first is used, as `vision_benchmark/evaluation/feature.py`
  `extract_text_features` does.
  The label maps shipped with the data (`labels.txt`) are not read: the toolkit does not read them either.
- templates: `template_map[<dataset>]` (`template.format(name)`), falling back to `['a photo of a {}']`. As
  shipped, cifar-10 uses the cifar-100 templates (`template_map['cifar-10'] = cifar100_templates`); they are the
  same 18 prompts. imagenet-1k has ELEVATER's own names and the 80 OpenAI templates; its names hold "missile" and
  "sunglasses" twice each (a warning says so; under the strict rule below those images are never top-1).
- metric: `TEST.METRIC` of the task's config, implemented as `vision_benchmark/evaluation/metric.py` computes it
  with vision-evaluation 0.2.9 (`vision_evaluation/evaluators.py`, microsoft/vision-evaluation 0f34dcb):
  `accuracy` (top-1; 15 tasks), `mean-per-class` (caltech101, fgvc-aircraft-2013b, flower102, oxford-iiit-pets:
  `BalancedAccuracyScoreEvaluator`, which drops the classes absent from the test split before its argmax, so they
  do not compete here either, then averages the recall of each class present), `11point_mAP`
  (voc2007classification: `MeanAveragePrecisionNPointsEvaluator(11)`, see `eleven_point_average_precision`) and
  `roc_auc` (hateful-memes: scikit-learn's `roc_auc_score` of the class-1 probability).

Files: the test split of each task in the layout of ELEVATER's dataset registry
(`vision_benchmark/resources/datasets/vision_datasets.json`, read through microsoft/vision-datasets 0.2.17, commit
264eb47), which is also the layout its downloaders write: `<root>/<root_folder>/<index>` beside the image archives
it names, e.g. `<root>/classification/caltech_101_20211007/test.txt` and `test.zip`. Two index formats
(`vision_datasets/common/data_manifest.py`):
- "iris" (17 tasks): one image per line, `<archive>.zip@<member> <label>[,<label>...]` (the path is everything
  before the last space; a multiclass image takes its first label; blank lines are skipped);
- "coco" (hateful-memes, imagenet-1k, kitti-distance, resisc45-clip): a COCO JSON whose `images` carry
  `file_name` and `zip_file`; images in order of id, classes in order of category id, an image's labels in the
  order of its annotations.
An image `<archive>.zip@<member>` is read from the archive (`ImageRef(archive, member=...)`), or, when the archive
has been unpacked into a folder of its name without `.zip` beside it (the layout vision-datasets reads from a
blob), from `<folder>/<member>`.

Scoring is the protocol of `zeroshot.py` and of the toolkit's `clip_zeroshot_evaluator`: each class is the
renormalised mean of its L2-normalised prompt embeddings (`Scorer.score_groups`); the toolkit then takes
`softmax(100 * cosine)`. Top-1 decisions are strict: an image is right iff its class scores above every competing
class (`zeroshot.class_ranks`; the toolkit's argmax credits a tie to the lowest index), and `ties` counts the
images whose class ties another. Where the metric ranks images rather than classes (mAP, ROC-AUC) it is computed
on that softmax (in float64, the sum taken exactly so that equal rows give equal probabilities), as the toolkit
does: for voc2007classification the ranking of images for a class depends on their other classes' scores too.
Ties between images there follow the metric's own definition (scikit-learn's thresholds: tied images enter
together; ROC-AUC counts a tied positive-negative pair as one half).

Aggregates: per task its metric in percent (key: the task name), `n/<task>` and `ties/<task>`; `average`, the
plain mean of the 21 (vl_compo's `21_tasks_avg`), only when every task was scored, else NaN, with
`missing/<task>` = 1.0 for each absent task and `missing_tasks` counting them; `tasks`, `n`, `ties`.

Known differences from the toolkit that no scorer-independent benchmark can remove: the toolkit resizes
kitti-distance images to 224x224 without cropping (`DATASET.CENTER_CROP: false`) where a scorer applies its own
preprocessing; it applies an image's EXIF orientation (vision-datasets' `PILImageLoader`); and it takes the
softmax in float32 (fp16 unless `MODEL.CLIP_FP32`), where large margins saturate to tied probabilities.
"""
from __future__ import annotations

import logging
import math
import re
import zipfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
from tqdm import tqdm

from evaluation.benchmarks.annotations import DamagedBenchmarkData, read_json, read_text, require, required_texts
from evaluation.benchmarks.base import OTHER, Benchmark, ImageOrigin, ImageRef, Outcome, Scorer, percent, unique
from evaluation.benchmarks.sources import DataSource, published
from evaluation.benchmarks.zeroshot import class_ranks

log = logging.getLogger(__name__)

TASKS_FILE = Path(__file__).resolve().parent / "data" / "elevater" / "tasks.json"
TASKS = ("caltech101", "cifar10", "cifar100", "country211", "dtd", "eurosat-clip", "fer2013", "fgvc-aircraft-2013b",
         "flower102", "food101", "gtsrb", "hateful-memes", "imagenet-1k", "kitti-distance", "mnist",
         "oxford-iiit-pets", "patchcamelyon", "rendered-sst2", "resisc45-clip", "stanfordcar",
         "voc2007classification")
# clip_zeroshot_evaluator: logits = (100. * image_features @ text_features).softmax(dim=-1)
LOGIT_SCALE = 100.0
# MeanAveragePrecisionNPointsEvaluator: recall_thresholds = np.linspace(1, 0, self.n_points, endpoint=True)
RECALL_POINTS = np.linspace(1, 0, 11, endpoint=True)
MULTILABEL = "classification_multilabel"
BLOB = "https://cvinthewildeus.blob.core.windows.net/datasets"
_LABELS = re.compile(r"[0-9]+(?:,[0-9]+)*")
# vl_compo's numbers for OpenAI CLIP ViT-B/32 (individual_results.csv, columns `elevator::<task>`), in percent.
VL_COMPO = {"caltech101": 88.2554870492184, "cifar10": 89.83, "cifar100": 65.08, "country211": 17.213270142180097,
            "dtd": 44.41489361702128, "eurosat-clip": 45.540000000000006, "fer2013": 42.2680412371134,
            "fgvc-aircraft-2013b": 19.646167557932262, "flower102": 66.68463489654084, "food101": 84.0079207920792,
            "gtsrb": 32.55740300870942, "hateful-memes": 55.87204557456273, "imagenet-1k": 63.336000000000006,
            "kitti-distance": 27.42616033755274, "mnist": 48.25, "oxford-iiit-pets": 87.13683179075112,
            "patchcamelyon": 60.6201171875, "rendered-sst2": 58.5941790225151, "resisc45-clip": 60.01587301587301,
            "stanfordcar": 59.64432284541724, "voc2007classification": 82.60588504593436}


@dataclass(frozen=True)
class Task:
    """One ELEVATER task as the toolkit defines it (a record of `tasks.json`)."""

    name: str
    dataset: str
    metric: str
    type: str
    format: str
    root_folder: str
    index: str
    archives: tuple[str, ...]
    num_images: int
    center_crop: bool
    classes: tuple[str, ...]
    templates: tuple[str, ...]
    labelmap: str | None = None  # the registry's label map file; the toolkit's zero-shot scoring does not read it

    @property
    def multilabel(self) -> bool:
        return self.type == MULTILABEL

    @property
    def index_path(self) -> str:
        """The index file, relative to the benchmark root."""
        return f"{self.root_folder}/{self.index}"

    def prompts(self) -> list[list[str]]:
        """Per class (label order), its filled-in templates."""
        return [[template.format(name) for template in self.templates] for name in self.classes]


@lru_cache(maxsize=1)
def load_tasks() -> dict[str, Task]:
    """The 21 tasks of `tasks.json`, in `TASKS` order."""
    records = read_json(TASKS_FILE)["tasks"]
    require(tuple(records) == TASKS, f"{TASKS_FILE}: tasks {list(records)} are not {list(TASKS)}")
    fields = ("dataset", "metric", "type", "format", "root_folder", "index", "num_images", "center_crop", "labelmap")
    return {name: Task(name=name, **{key: record[key] for key in fields}, archives=tuple(record["archives"]),
                       classes=tuple(required_texts(record["classes"], f"{TASKS_FILE}: {name}", "classes")),
                       templates=tuple(required_texts(record["templates"], f"{TASKS_FILE}: {name}", "templates")))
            for name, record in records.items()}


@dataclass(frozen=True)
class Sample:
    """One test image: its id (`<task>/<index path>`), where it is, and its label(s)."""

    id: str
    image: ImageRef
    labels: tuple[int, ...]


# ----- reading the official index files -----------------------------------------------------------------------

def read_iris_index(path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(image path, labels) per non-blank line of an iris classification index, in file order."""
    entries = []
    text = read_text(path).replace("\r\n", "\n").replace("\r", "\n")  # Python's universal newlines
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        image, space, labels = line.rpartition(" ")  # the image path may hold spaces, the labels may not
        if not space:  # a bare path: an image without labels (a multilabel negative)
            entries.append((line, ()))
            continue
        require(_LABELS.fullmatch(labels) is not None,
                f"{path}, line {number}: expected '<image> <label>[,<label>...]', got {line!r}")
        entries.append((image, tuple(int(part) for part in labels.split(","))))
    return entries


def read_coco_index(path: Path, n_classes: int) -> list[tuple[str, tuple[int, ...]]]:
    """(image path, labels) per image of a COCO classification file, in order of image id."""
    coco = read_json(path)
    require(isinstance(coco, dict) and all(isinstance(coco.get(key), list)
                                           for key in ("images", "annotations", "categories")),
            f"{path}: expected a COCO object with 'images', 'annotations' and 'categories' lists")
    category_ids = sorted(category["id"] for category in coco["categories"])
    require(len(category_ids) == n_classes, f"{path}: {len(category_ids)} categories, but ELEVATER names "
                                            f"{n_classes} classes for this task")
    position = {category_id: k for k, category_id in enumerate(category_ids)}
    images: dict[object, tuple[str, list[int]]] = {}
    for record in coco["images"]:
        require(isinstance(record, dict) and "id" in record and isinstance(record.get("file_name"), str),
                f"{path}: image record {record!r} lacks an id or a file_name")
        require(record["id"] not in images, f"{path}: image id {record['id']!r} occurs twice")
        archive = record.get("zip_file") or ""
        images[record["id"]] = (f"{archive}@{record['file_name']}" if archive else record["file_name"], [])
    for record in coco["annotations"]:
        require(isinstance(record, dict) and record.get("image_id") in images
                and record.get("category_id") in position,
                f"{path}: annotation {record!r} names an unknown image or category")
        images[record["image_id"]][1].append(position[record["category_id"]])
    return [(image, tuple(labels)) for _, (image, labels) in sorted(images.items(), key=lambda item: item[0])]


def image_ref(base: Path, entry: str) -> ImageRef:
    """Where image `entry` of an index under `base` is: `<archive>.zip@<member>` is a member of the archive, or a
    file of the archive's unpacked folder when that exists; anything else is a file under `base`."""
    entry = entry.replace("\\", "/")  # vision-datasets' ManifestDataset._load_image does the same
    archive, at, member = entry.partition("@")
    if not at:
        return ImageRef(str(base / entry))
    unpacked = base / (archive[:-len(".zip")] if archive.lower().endswith(".zip") else archive)
    if unpacked.is_dir():
        return ImageRef(str(unpacked / member))
    return ImageRef(str(base / archive), member=member)


def check_members(index: Path, samples: Sequence[Sample]) -> None:
    """Every archive member the index names is in its archive (archives that are absent are reported by the
    harness's missing-file check)."""
    by_archive: dict[str, list[Sample]] = {}
    for sample in samples:
        if sample.image.member is not None:
            by_archive.setdefault(sample.image.path, []).append(sample)
    for archive, members in by_archive.items():
        if not Path(archive).is_file():
            continue
        try:
            with zipfile.ZipFile(archive) as handle:
                names = set(handle.namelist())
        except zipfile.BadZipFile as err:
            raise DamagedBenchmarkData(f"{archive}: not a readable zip archive ({err}); download it again") from None
        absent = [sample.image.member for sample in members if sample.image.member not in names]
        require(not absent, f"{index}: {len(absent)} images are not in {archive}, e.g. {absent[:3]}")


# ----- metrics (fractions in [0, 1], as the toolkit computes them) ---------------------------------------------

def class_probabilities(scores: np.ndarray) -> np.ndarray:
    """softmax(100 * scores) per row, in float64. The normaliser is an exactly rounded sum (`math.fsum`), so two
    rows holding the same scores in any order give bit-identical probabilities: ties stay ties."""
    logits = LOGIT_SCALE * np.asarray(scores, dtype=np.float64)
    exps = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exps / np.array([[math.fsum(row)] for row in exps.tolist()])


def precision_recall_points(positives: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Precision and recall at each distinct score taken as threshold (`score >= threshold` is predicted positive),
    highest recall first, as scikit-learn's `precision_recall_curve` (without its final (recall 0, precision 1))."""
    order = np.argsort(-scores, kind="mergesort")
    sorted_scores, hits = scores[order], positives[order].astype(np.int64)
    last_of_each = np.r_[np.flatnonzero(np.diff(sorted_scores)), len(scores) - 1]
    true_positives = np.cumsum(hits)[last_of_each]
    predicted = last_of_each + 1
    return (true_positives / predicted)[::-1], (true_positives / true_positives[-1])[::-1]


def eleven_point_average_precision(positives: np.ndarray, scores: np.ndarray) -> float:
    """vision-evaluation's 11-point interpolated AP of one class (at least one positive).

    For each recall level t of `np.linspace(1, 0, 11)`, the highest precision among the curve's points with
    recall >= t, averaged. The curve is scikit-learn's, which ends in the point (recall 0, precision 1): the level
    t = 0 always contributes 1, unlike PASCAL VOC's own devkit. A level no point reaches contributes 0.
    """
    positives, scores = np.asarray(positives, dtype=bool), np.asarray(scores, dtype=np.float64)
    require(bool(positives.any()), "11-point AP of a class without a positive image")
    precision, recall = precision_recall_points(positives, scores)
    precision, recall = np.r_[precision, 1.0], np.r_[recall, 0.0]
    return float(sum(precision[recall >= level].max(initial=0.0) for level in RECALL_POINTS) / len(RECALL_POINTS))


def eleven_point_map(labels: np.ndarray, scores: np.ndarray) -> float:
    """Mean 11-point AP over the classes with a positive image (`labels`, `scores`: [images, classes])."""
    labels = np.asarray(labels, dtype=bool)
    present = np.flatnonzero(labels.any(axis=0))
    if not len(present):
        return float("nan")
    return float(np.mean([eleven_point_average_precision(labels[:, c], scores[:, c]) for c in present]))


def roc_auc(positives: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: the fraction of (positive, negative) pairs the score orders right, a tie counting
    one half (scikit-learn's `roc_auc_score`); NaN without both classes (scikit-learn raises)."""
    positives, scores = np.asarray(positives, dtype=bool), np.asarray(scores, dtype=np.float64)
    n_positive, n_negative = int(positives.sum()), int((~positives).sum())
    if not (n_positive and n_negative):
        return float("nan")
    return float((average_ranks(scores)[positives].sum() - n_positive * (n_positive + 1) / 2)
                 / (n_positive * n_negative))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing their mean rank (Mann-Whitney)."""
    order = np.argsort(values, kind="mergesort")
    ordered = values[order]
    starts = np.r_[0, np.flatnonzero(np.diff(ordered)) + 1]
    ends = np.r_[starts[1:], len(values)]
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.repeat((starts + ends + 1) / 2, ends - starts)
    return ranks


# ----- per-task aggregation of stored outcomes ---------------------------------------------------------------

def _top1(outcomes: Sequence[Outcome]) -> float:
    return percent([o["rank"] == 0 for o in outcomes])


def _mean_per_class(outcomes: Sequence[Outcome]) -> float:
    hits: dict[int, list[bool]] = {}
    for outcome in outcomes:
        hits.setdefault(int(outcome["label"]), []).append(outcome["rank"] == 0)
    return float(np.mean([percent(h) for h in hits.values()])) if hits else float("nan")


def _map_11(outcomes: Sequence[Outcome]) -> float:
    if not outcomes:
        return float("nan")
    probabilities = np.array([o["probabilities"] for o in outcomes], dtype=np.float64)
    labels = np.zeros(probabilities.shape, dtype=bool)
    for row, outcome in enumerate(outcomes):
        labels[row, outcome["labels"]] = True
    return 100.0 * eleven_point_map(labels, probabilities)


def _roc_auc(outcomes: Sequence[Outcome]) -> float:
    return 100.0 * roc_auc(np.array([o["label"] == 1 for o in outcomes]),
                           np.array([o["probability"] for o in outcomes], dtype=np.float64))


METRICS: dict[str, Callable[[Sequence[Outcome]], float]] = {
    "accuracy": _top1, "mean-per-class": _mean_per_class, "11point_mAP": _map_11, "roc_auc": _roc_auc}


def by_hand_instructions() -> str:
    """How to fetch the test splits, with each task's files (`DataSource.by_hand`)."""
    lines = [f"  {name}: {task.root_folder}/{{{', '.join((task.index,) + task.archives)}}}"
             for name, task in load_tasks().items()]
    return ("ELEVATER's test splits are served from an Azure blob container without a fixed revision, so no file is "
            "pinned by hash. Either run the official "
            "downloader (pip install vision-datasets==0.2.17; in a clone of "
            "https://github.com/Computer-Vision-in-the-Wild/DataDownload, `cd classification && python "
            "download_datasets.py --ds all --output_dir <root>`: the 20 datasets, every split), or fetch the "
            f"test files one by one from {BLOB}/<path>?<SAS>, where <SAS> is the read-only query string printed "
            "in that repository's README (and in the toolkit's vision_benchmark/common/constants.py), into "
            "<root>/<path>. imagenet-1k is in the toolkit's registry only (ImageNet's terms apply). Archives stay "
            "zipped, or may be unpacked into a folder of the same name without .zip beside them. The files, "
            "per task:\n" + "\n".join(lines))


class Elevater(Benchmark):
    """ELEVATER's 21 zero-shot classification tasks (vl_compo's recognition suite).

    Args:
        root: the folder ELEVATER's downloaders fill (`<root>/classification/<dataset folder>/...`).
        tasks: the task names to score (default: every task whose index file is under root; the absent ones are
            named in a warning and in the aggregates). A named task whose files are absent is an error.
        check_counts: require each index to list as many images as ELEVATER's registry says its test split has
            (default True: a shorter index is a truncated or different release).
        chunk_size: images per `scorer.score_groups` call.

    Aggregates: per task its metric (%), `n/<task>`, `ties/<task>`; `average` over the 21 (NaN unless all 21 were
    scored), `missing/<task>`, `missing_tasks`, `tasks`, `n`, `ties`.
    """

    name = "elevater"
    headline = ("average", "imagenet-1k", "missing_tasks")
    description = "ELEVATER zero-shot classification: 20 datasets + ImageNet-1k, each with its own metric (%)"
    data_source = DataSource(
        home="https://github.com/Computer-Vision-in-the-Wild/Elevater_Toolkit_IC",
        licence="toolkit, class names and templates: MIT; images: each source dataset's terms (research use)",
        size="21 test splits, 242,677 images in zip archives (several GB; imagenet-1k's 50,000 alone about 6.4 GB)",
        by_hand=by_hand_instructions())
    # individual_results.csv, row ViT-B-32 / openai; `average` is their plain mean, vl_compo's 21_tasks_avg (57.10)
    published = published({**VL_COMPO, "average": float(np.mean(list(VL_COMPO.values())))}, "vl_compo")

    def __init__(self, root: str | Path, tasks: Sequence[str] | None = None, check_counts: bool = True,
                 chunk_size: int = 1024):
        if isinstance(tasks, str):
            raise TypeError("elevater: option tasks is a list of task names, not a string")
        if tasks is not None:
            unknown = [task for task in tasks if task not in TASKS]
            if unknown or len(set(tasks)) != len(tasks) or not tasks:
                raise ValueError(f"elevater: tasks must be distinct names among {', '.join(TASKS)}; got {list(tasks)}")
        if not isinstance(check_counts, bool):
            raise TypeError(f"elevater: check_counts must be true or false, got {check_counts!r}")
        if chunk_size < 1:
            raise ValueError(f"elevater: chunk_size must be positive, got {chunk_size}")
        self.requested = tuple(tasks) if tasks is not None else None  # read by required_files in the base check
        super().__init__(root)
        self.check_counts, self.chunk_size = check_counts, chunk_size
        specs = load_tasks()
        names = self.requested or tuple(name for name in TASKS if (self.root / specs[name].index_path).is_file())
        self.tasks = [specs[name] for name in names]
        absent = [name for name in TASKS if name not in names]
        if absent and self.requested is None:
            log.warning("elevater: %d of the 21 tasks have no files under %s (%s); the 21-task average will be NaN",
                        len(absent), self.root, ", ".join(absent))

    def required_files(self) -> list[str]:
        specs = load_tasks()
        if self.requested is not None:
            return [specs[name].index_path for name in self.requested]
        return [" | ".join(specs[name].index_path for name in TASKS)]  # at least one task

    @cached_property
    def samples(self) -> dict[str, list[Sample]]:
        """Per task scored, its test images in the index's order."""
        return {task.name: self._read_samples(task) for task in self.tasks}

    def _read_samples(self, task: Task) -> list[Sample]:
        base = self.root / task.root_folder
        index = base / task.index
        entries = (read_coco_index(index, len(task.classes)) if task.format == "coco"
                   else read_iris_index(index))
        samples, seen = [], Counter()
        for image, labels in entries:
            require(all(0 <= label < len(task.classes) for label in labels),
                    f"{index}: image {image!r} has label(s) {list(labels)} outside 0..{len(task.classes) - 1}")
            # the toolkit takes a multiclass image's first label; an image without one would stop it
            require(task.multilabel or bool(labels), f"{index}: image {image!r} has no label")
            seen[image] += 1
            key = image if seen[image] == 1 else f"{image}#{seen[image]}"
            samples.append(Sample(f"{task.name}/{key}", image_ref(base, image), labels))
        require(len(samples) > 0, f"{index}: lists no image")
        if self.check_counts:
            require(len(samples) == task.num_images,
                    f"{index}: lists {len(samples)} images, ELEVATER's registry has {task.num_images} in the "
                    f"{task.name} test split (a truncated or different release; option check_counts=false scores "
                    f"it anyway)")
        check_members(index, samples)
        return samples

    def image_refs(self) -> list[ImageRef]:
        return unique(sample.image for samples in self.samples.values() for sample in samples)

    def image_origin(self, ref: ImageRef) -> ImageOrigin:
        """None of the 21 test splits draws on COCO or Visual Genome (an archive member has no parquet name)."""
        return ImageOrigin(OTHER)

    def outcomes(self, scorer: Scorer, progress: bool = False) -> list[Outcome]:
        outcomes = []
        for task in self.tasks:
            outcomes += self._task_outcomes(task, self.samples[task.name], scorer, progress)
        return outcomes

    def _task_outcomes(self, task: Task, samples: list[Sample], scorer: Scorer, progress: bool) -> list[Outcome]:
        prompts = task.prompts()
        _warn_repeated_names(task)
        scorer.prepare(unique(sample.image for sample in samples), unique(p for group in prompts for p in group),
                       progress=progress)
        # mean-per-class: the toolkit's argmax runs over the classes present in the split only
        competitors = (sorted({s.labels[0] for s in samples}) if task.metric == "mean-per-class"
                       else list(range(len(task.classes))))
        outcomes = []
        starts = range(0, len(samples), self.chunk_size)
        for start in tqdm(starts, desc=f"elevater {task.name}", unit="chunk", disable=not progress):
            chunk = samples[start:start + self.chunk_size]
            scores = np.asarray(scorer.score_groups([sample.image for sample in chunk], prompts), dtype=np.float64)
            if not np.isfinite(scores).all():
                raise ValueError("scorer returned non-finite class scores")
            build = _multilabel_outcomes if task.multilabel else _multiclass_outcomes
            outcomes += build(task, chunk, scores, competitors)
        return outcomes

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        by_task: dict[str, list[Outcome]] = {}
        for outcome in outcomes:
            by_task.setdefault(str(outcome["task"]), []).append(outcome)
        unknown = sorted(set(by_task) - set(TASKS))
        if unknown:
            raise ValueError(f"elevater: outcomes of unknown tasks {unknown}")
        specs = load_tasks()
        result: dict[str, float] = {}
        for name in (name for name in TASKS if name in by_task):
            result[name] = METRICS[specs[name].metric](by_task[name])
            result[f"n/{name}"] = len(by_task[name])
            result[f"ties/{name}"] = sum(1 for o in by_task[name] if o["ties"] > 0)
        missing = [name for name in TASKS if name not in by_task]
        result["average"] = float("nan") if missing else float(np.mean([result[name] for name in TASKS]))
        result.update({"tasks": len(by_task), "missing_tasks": len(missing), "n": len(outcomes),
                       "ties": sum(1 for o in outcomes if o["ties"] > 0)})
        result.update({f"missing/{name}": 1.0 for name in missing})
        return result


def _multiclass_outcomes(task: Task, samples: Sequence[Sample], scores: np.ndarray,
                         competitors: list[int]) -> list[Outcome]:
    """Rank of each image's class among the competing classes (strict: a tie counts against); for ROC-AUC also
    the class-1 probability the toolkit scores."""
    column = {label: k for k, label in enumerate(competitors)}
    labels = np.array([column[sample.labels[0]] for sample in samples])
    ranks, ties = class_ranks(scores[:, competitors], labels)
    outcomes = [{"id": sample.id, "task": task.name, "label": sample.labels[0], "rank": int(rank), "ties": int(tie),
                 "classes": len(competitors)} for sample, rank, tie in zip(samples, ranks, ties)]
    if task.metric == "roc_auc":
        for outcome, probability in zip(outcomes, class_probabilities(scores)[:, 1].tolist()):
            outcome["probability"] = probability
    return outcomes


def _multilabel_outcomes(task: Task, samples: Sequence[Sample], scores: np.ndarray,
                         competitors: list[int]) -> list[Outcome]:
    """Each image's labels and class probabilities (the mAP ranks images per class); `ties` counts the other
    classes scoring exactly as one of its own."""
    outcomes = []
    for sample, row, probabilities in zip(samples, scores, class_probabilities(scores).tolist()):
        gold = sorted(set(sample.labels))
        others = np.delete(row, np.array(gold, dtype=np.int64))
        outcomes.append({"id": sample.id, "task": task.name, "labels": gold, "probabilities": probabilities,
                         "ties": int(np.isin(others, row[gold]).sum())})
    return outcomes



def _warn_repeated_names(task: Task) -> None:
    repeated = sorted(name for name, count in Counter(task.classes).items() if count > 1)
    if repeated:
        log.warning("elevater %s: class names %s occur more than once; their prompts tie, so their images are "
                    "never strictly top-1", task.name, repeated)

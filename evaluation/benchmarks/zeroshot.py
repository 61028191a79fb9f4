"""Zero-shot classification of a folder-per-class image tree with clip_benchmark's class names and prompts.

Files under `root` (copied from `LAION-AI/CLIP_benchmark`, `clip_benchmark/datasets/`, MIT):
- `en_classnames.json`: `{"<dataset>": ["<class name>", ...]}`, in label order;
- `en_zeroshot_classification_templates.json`: `{"<dataset>": ["a photo of a {c}.", ...]}`, where `{c}` is
  the class name. As in clip_benchmark, a dataset without its own templates uses the "imagenet1k" ones
  (the 80 OpenAI prompts), and a dataset's entry may instead map each class name to its own full prompts.
Option `dataset` picks the key (default "imagenet1k"). A class name, template or prompt that is empty (or only
whitespace) is a damaged file, refused, except the one empty name clip_benchmark's own list holds
(`OFFICIAL_EMPTY_CLASS_NAMES`), which is scored as clip_benchmark scores it, with a warning.

Images: `<images>/<class folder>/**/<image>` (torchvision `ImageFolder`'s layout and extensions; default
`<root>/images`, e.g. ImageNet's `val/` with synset folders). Folders sorted by name take label 0, 1, ...,
and the i-th folder gets the i-th class name (the order of clip_benchmark's `imagenet1k-unverified`); option
`classes` lists the folders in label order instead. Folders and class names must be equally many.

Scoring follows clip_benchmark: each class is the renormalised mean of its L2-normalised prompt embeddings
(`scorer.score_groups`); an image's rank is the number of other classes scoring at least as high as its own
(strict: a tie counts against). clip_benchmark takes `argmax` / `topk`, which break ties by index, and
reports fractions; we report percent, and `tied` counts the images with a tie. Ties are not only
theoretical: clip_benchmark's "imagenet1k" names hold "missile" and "sunglasses" twice each, so those class
pairs get identical prompts and scores; strictly, none of their 200 validation images is top-1 correct,
where argmax credits the lower index of each pair (at most 0.2 points of ImageNet top-1; a warning names
the repeated names).

Aggregates: `top1`, `top5` (NaN with fewer than 5 classes, as clip_benchmark), `mean_per_class_recall`
(top-1 recall per class present, averaged: scikit-learn's balanced accuracy, as clip_benchmark), `images`,
`tied`.

`shapes_zeroshot` (`ShapesZeroShot`) is the same protocol on the shapes world's own classes: each object of a
split, cropped from its image, classified by shape and by colour (recognition beside the swap set's composition).
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
from tqdm import tqdm

from evaluation.benchmarks.annotations import read_json, require, required_text, required_texts
from evaluation.benchmarks.base import Benchmark, ImageRef, MissingBenchmarkData, Outcome, percent, Scorer, unique
from evaluation.benchmarks.sources import DataSource, github_file

log = logging.getLogger(__name__)

CLASSNAMES_FILE = "en_classnames.json"
TEMPLATES_FILE = "en_zeroshot_classification_templates.json"
DEFAULT_TEMPLATES = "imagenet1k"
# torchvision.datasets.folder.IMG_EXTENSIONS
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


# clip_benchmark's class names and prompts at the commit this loader was written against.
CLIP_BENCHMARK, CLIP_BENCHMARK_COMMIT = "LAION-AI/CLIP_benchmark", "48de38c1689fa6d8b4dd53e3370c669c3bb18117"
# Empty class names in clip_benchmark's own `en_classnames.json` at that commit, by dataset and label: VTAB's
# closest-object-distance bins, one of them unnamed ("very nearby", "nearby", "near", "", "distant", ...).
# clip_benchmark scores that class with its template filled with nothing (" shapes."), and so is it scored here,
# with a warning; an empty name anywhere else is not the benchmark's and is refused as a damaged file.
OFFICIAL_EMPTY_CLASS_NAMES = {"clevr_closest_object_distance": (3,)}


class ZeroShotClassification(Benchmark):
    """Args: root (the two clip_benchmark JSON files), images (class-folder tree; default `<root>/images`),
    dataset (key in both files; default "imagenet1k"), classes (class folders in label order; default sorted),
    chunk_size (images per `scorer.score_groups` call)."""

    name = "zeroshot"
    headline = ("top1", "top5", "mean_per_class_recall")
    description = "Zero-shot classification with clip_benchmark prompts: top-1 / top-5 / mean per-class recall (%)"
    data_source = DataSource(
        home="https://github.com/LAION-AI/CLIP_benchmark", licence="MIT (names and prompts); images: the dataset's",
        size="2 JSON files, 48 KB; images: the chosen dataset's (ImageNet val: 6.3 GB)",
        downloads=(github_file(CLIP_BENCHMARK, CLIP_BENCHMARK_COMMIT, f"clip_benchmark/datasets/{CLASSNAMES_FILE}",
                               "73d279021a4bc88059884d01fae66c35ec33793ede8bc9ae54c46632625c4993", 39429),
                   github_file(CLIP_BENCHMARK, CLIP_BENCHMARK_COMMIT, f"clip_benchmark/datasets/{TEMPLATES_FILE}",
                               "b78cc883ce1d6aefd304f180046ee25e778d627e099222fbcc57f01657c53c31", 8905)),
        by_hand="the images as one folder per class under <root>/images (ImageNet: its val/ with synset folders, "
                "after registering at image-net.org)")

    def __init__(self, root: str | Path, images: str | Path | None = None, dataset: str = DEFAULT_TEMPLATES,
                 classes: Sequence[str] | None = None, chunk_size: int = 1024):
        super().__init__(root)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.images = Path(images) if images is not None else self.root / "images"
        self.dataset, self.chunk_size = dataset, chunk_size
        if isinstance(classes, str):
            raise TypeError("option classes is a list of class folder names, not a string")
        self.classes = list(classes) if classes is not None else None

    def required_files(self) -> list[str]:
        return [CLASSNAMES_FILE, TEMPLATES_FILE]

    @cached_property
    def class_names(self) -> list[str]:
        """Class names in label order; each non-empty, but for the official empty ones (warned about)."""
        path = self.root / CLASSNAMES_FILE
        names = _load_json(path)
        require(self.dataset in names, f"{path} has no dataset {self.dataset!r}; it has {', '.join(sorted(names))}")
        require(isinstance(names[self.dataset], list), f"{path}: {self.dataset!r} is not a list of class names")
        official_empty = OFFICIAL_EMPTY_CLASS_NAMES.get(self.dataset, ())
        for label, name in enumerate(names[self.dataset]):
            if name == "" and label in official_empty:
                log.warning("%s: class %d of %r has an empty name in clip_benchmark's own list; it is scored as "
                            "clip_benchmark scores it, by its templates filled with nothing", path, label, self.dataset)
                continue
            required_text(name, f"{path}: {self.dataset!r} class {label}", "class name")
        return list(names[self.dataset])

    @cached_property
    def prompts(self) -> list[list[str]]:
        """Per class (label order), its filled-in prompts."""
        path = self.root / TEMPLATES_FILE
        templates = _load_json(path)
        chosen = templates.get(self.dataset, templates.get(DEFAULT_TEMPLATES))
        require(chosen is not None, f"{path} has neither {self.dataset!r} nor {DEFAULT_TEMPLATES!r} templates")
        _warn_duplicates(self.class_names, self.dataset)
        if isinstance(chosen, dict):  # class-specific prompts, used as they are
            missing = [name for name in self.class_names if name not in chosen]
            require(not missing, f"{path}: {self.dataset!r} lacks prompts for classes {missing[:5]}")
            return [required_texts(chosen[name], f"{path}: prompts of class {name!r}", "prompt")
                    for name in self.class_names]
        require(isinstance(chosen, list) and all(isinstance(template, str) for template in chosen),
                f"{path}: the templates are not a list of strings: {chosen!r:.120}")
        bad = [template for template in chosen if "{c}" not in template]
        require(not bad and bool(chosen), f"{path}: templates must each contain '{{c}}', got {bad[:3] or chosen}")
        return [[required_text(template.format(c=name), f"{path}: template {template!r} of class {label}", "prompt")
                 for template in chosen] for label, name in enumerate(self.class_names)]

    @cached_property
    def samples(self) -> list[tuple[ImageRef, int, str]]:
        """(image, label, path relative to the images folder) for every image, folder by folder."""
        folders = self._class_folders()
        samples = []
        for label, folder in enumerate(folders):
            files = sorted(p for p in (self.images / folder).rglob("*")
                           if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
            if not files:
                raise ValueError(f"class folder {self.images / folder} holds no image "
                                 f"({', '.join(IMAGE_EXTENSIONS)})")
            samples += [(ImageRef(str(p)), label, p.relative_to(self.images).as_posix()) for p in files]
        return samples

    def _class_folders(self) -> list[str]:
        if not self.images.is_dir():
            raise MissingBenchmarkData(f"{self.name}: image folder {self.images} does not exist (option `images`)")
        on_disk = sorted(p.name for p in self.images.iterdir() if p.is_dir())
        folders = on_disk if self.classes is None else self.classes
        if self.classes is not None and sorted(self.classes) != on_disk:
            raise ValueError(f"option classes does not list the class folders of {self.images}: missing "
                             f"{sorted(set(on_disk) - set(self.classes))[:5]}, absent "
                             f"{sorted(set(self.classes) - set(on_disk))[:5]}")
        if len(folders) != len(self.class_names):
            raise ValueError(f"{self.images} has {len(folders)} class folders but {self.root / CLASSNAMES_FILE} "
                             f"lists {len(self.class_names)} class names for {self.dataset!r}")
        return folders

    def image_refs(self) -> list[ImageRef]:
        return unique(ref for ref, _, _ in self.samples)

    def read_annotations(self) -> None:
        super().read_annotations()
        self.prompts  # the templates file, which the images do not need

    def outcomes(self, scorer: Scorer, progress: bool = False) -> list[Outcome]:
        samples, prompts = self.samples, self.prompts
        scorer.prepare(unique(ref for ref, _, _ in samples), unique(p for group in prompts for p in group),
                       progress=progress)
        outcomes = []
        starts = range(0, len(samples), self.chunk_size)
        for start in tqdm(starts, desc="zero-shot", unit="chunk", disable=not progress):
            chunk = samples[start:start + self.chunk_size]
            scores = np.asarray(scorer.score_groups([ref for ref, _, _ in chunk], prompts), dtype=np.float64)
            labels = np.array([label for _, label, _ in chunk])
            ranks, ties = class_ranks(scores, labels)
            outcomes += [{"id": rel, "label": int(label), "rank": int(r), "ties": int(t), "classes": len(prompts)}
                         for (_, label, rel), r, t in zip(chunk, ranks, ties)]
        return outcomes

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        """top-1 / top-5 accuracy and mean per-class top-1 recall (percent), image and tie counts."""
        hits = [o["rank"] == 0 for o in outcomes]
        few_classes = any(o["classes"] < 5 for o in outcomes)
        per_class: dict[int, list[bool]] = {}
        for outcome, hit in zip(outcomes, hits):
            per_class.setdefault(int(outcome["label"]), []).append(hit)
        return {"top1": percent(hits),
                "top5": float("nan") if few_classes else percent([o["rank"] < 5 for o in outcomes]),
                "mean_per_class_recall": float(np.mean([percent(h) for h in per_class.values()]))
                if per_class else float("nan"),
                "images": len(outcomes),
                "tied": sum(1 for o in outcomes if o["ties"] > 0)}


class ShapesZeroShot(Benchmark):
    """Zero-shot shape and colour classification of every object of a shapes-world split.

    Each object of `annotations/scene_graphs_<split>.json` is cut from its image as a square `CROP_SCALE` times
    its box's side, centred on the box and moved inside the image (so the object fills about half of it; a
    neighbour may reach into the crop, the same for every scorer). The classes are the world's shapes and its
    colours (`datamodules.shapes.SHAPES`, `COLORS`); each class is the prompt ensemble (`Scorer.score_groups`,
    as clip_benchmark's) of the world's plainest single-object caption (template "single", size unsaid) over
    every value of the other attribute: the class "square" averages "a red square", "a green square", ..., the
    class "red" "a red square", "a red circle", .... Few prompts, because an aligner scorer (TFLocal) runs a
    forward per crop and prompt. The rank of the gold class counts the classes scoring at least as high
    (`class_ranks`: a tie is wrong).

    Outcomes: one per object and attribute, `{"id": "<attribute>:<image id>:<object id>", "attribute", "label",
    "rank", "ties"}`. Aggregates: `shape_top1`, `color_top1` (%), `top1` (both attributes' decisions pooled),
    `objects`, `tied`.

    Args:
        root: the shapes data root. split: "val" (default), "test", "test_unseen" or "train".
    """

    name = "shapes_zeroshot"
    headline = ("shape_top1", "color_top1")
    description = "Shapes-world zero-shot recognition: each object's shape and colour from the world's captions (%)"
    data_source = DataSource(home="this repository (datamodules/shapes)", licence="MIT (generated)",
                        size="generated: 1 MB per 1,000 images at 64 px",
                        by_hand="python -m datamodules.shapes --out <root> (make demo writes data/study)")
    attributes = ("shape", "color")
    CROP_SCALE = 2.0

    def __init__(self, root: str | Path, split: str = "val"):
        self.split = split  # read by required_files() during the base class's check
        super().__init__(root)

    def required_files(self) -> list[str]:
        return [f"annotations/scene_graphs_{self.split}.json"]

    @cached_property
    def classes(self) -> dict[str, list[str]]:
        from datamodules.shapes import COLORS, SHAPES

        return {"shape": list(SHAPES), "color": list(COLORS)}

    @cached_property
    def prompts(self) -> dict[str, list[list[str]]]:
        """Per attribute, per class (label order), the captions naming it."""
        from datamodules.shapes import COLORS, SHAPES
        from datamodules.shapes.world import Caption, Description

        def caption(color: str, shape: str) -> str:
            return Caption("single", Description(color, shape)).text

        return {"shape": [[caption(color, shape) for color in COLORS] for shape in SHAPES],
                "color": [[caption(color, shape) for shape in SHAPES] for color in COLORS]}

    @cached_property
    def samples(self) -> list[tuple[str, ImageRef, dict[str, int]]]:
        """(image id:object id, the object's crop, its label per attribute), image by image."""
        path = self.root / self.required_files()[0]
        content = read_json(path)  # the world's `load_scene_graphs`, reading through the checked reader
        require(isinstance(content, dict) and isinstance(content.get("images"), list),
                f"{path}: expected {{\"images\": [...]}}")
        samples = []
        for record in content["images"]:
            image = str(self.root / "images" / self.split / record["file_name"])
            for obj in record["objects"]:
                box = crop_box(obj["bbox"], record["width"], self.CROP_SCALE)
                samples.append((f"{record['image_id']}:{obj['id']}", ImageRef(image, box=box),
                                self._labels(path, record, obj)))
        return samples

    def _labels(self, path: Path, record: dict, obj: dict) -> dict[str, int]:
        """The object's class index per attribute; a value outside the world's classes is a damaged file."""
        for attribute in self.attributes:
            require(obj.get(attribute) in self.classes[attribute],
                    f"{path}: image {record.get('image_id')!r} object {obj.get('id')!r} has {attribute} "
                    f"{obj.get(attribute)!r}, not one of {', '.join(self.classes[attribute])}")
        return {attribute: self.classes[attribute].index(obj[attribute]) for attribute in self.attributes}

    def image_refs(self) -> list[ImageRef]:
        return unique(ref for _, ref, _ in self.samples)

    def outcomes(self, scorer: Scorer, progress: bool = False) -> list[Outcome]:
        refs = [ref for _, ref, _ in self.samples]
        scorer.prepare(unique(refs), unique(p for groups in self.prompts.values() for group in groups for p in group),
                       progress=progress)
        outcomes = []
        for attribute in self.attributes:
            scores = np.asarray(scorer.score_groups(refs, self.prompts[attribute]), dtype=np.float64)
            labels = np.array([labels[attribute] for _, _, labels in self.samples])
            ranks, ties = class_ranks(scores, labels)
            outcomes += [{"id": f"{attribute}:{key}", "attribute": attribute, "label": int(label), "rank": int(rank),
                          "ties": int(tie)} for (key, _, _), label, rank, tie in zip(self.samples, labels, ranks, ties)]
        return outcomes

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        result = {f"{attribute}_top1": percent([o["rank"] == 0 for o in outcomes if o["attribute"] == attribute])
                  if any(o["attribute"] == attribute for o in outcomes) else float("nan")
                  for attribute in ShapesZeroShot.attributes}
        return {**result, "top1": percent([o["rank"] == 0 for o in outcomes]) if outcomes else float("nan"),
                "objects": len({o["id"].split(":", 1)[1] for o in outcomes}),
                "tied": sum(1 for o in outcomes if o["ties"] > 0)}


def crop_box(bbox: Sequence[float], image_size: int, scale: float) -> tuple[float, float, float, float]:
    """(x, y, w, h) of the square `scale` times the box's longer side, centred on the box, moved inside the image
    (the whole image when it is larger)."""
    x0, y0, x1, y1 = bbox
    side = min(float(image_size), scale * max(x1 - x0, y1 - y0))
    left = min(max((x0 + x1) / 2 - side / 2, 0.0), image_size - side)
    top = min(max((y0 + y1) / 2 - side / 2, 0.0), image_size - side)
    return (left, top, side, side)


def class_ranks(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `scores` [images, classes]: how many other classes score >= / == the gold class."""
    if not np.isfinite(scores).all():
        raise ValueError("scorer returned non-finite class scores")
    gold = scores[np.arange(len(labels)), labels][:, None]
    others = np.ones_like(scores, dtype=bool)
    others[np.arange(len(labels)), labels] = False
    return ((scores >= gold) & others).sum(axis=1), ((scores == gold) & others).sum(axis=1)


def _warn_duplicates(class_names: Sequence[str], dataset: str) -> None:
    repeated = sorted(name for name, count in Counter(class_names).items() if count > 1)
    if repeated:
        log.warning("%s: class names %s occur more than once; their prompts tie, so their images are never "
                    "strictly top-1 (see the module docstring)", dataset, repeated)


def _load_json(path: Path) -> dict:
    data = read_json(path)
    require(isinstance(data, dict), f"{path}: expected a JSON object keyed by dataset name")
    return data

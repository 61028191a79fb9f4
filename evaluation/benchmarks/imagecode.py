"""ImageCoDe (Krojer et al., ACL 2022): retrieve the one image a contextual description is about, among 10.

Official files and rules are those of `McGill-NLP/imagecode`, commit 609f076. The test split's labels are hidden
(`data/test_data_unlabeled.json`; scored by the authors on request), so the benchmark is the validation split:
`<root>/data/valid_data.json`, a JSON object `{<image set>: {<gold index>: <description>, ...}, ...}`, 1,039 sets
and 2,302 descriptions. An image set is a folder of 10 JPEGs from the Zenodo release `image-sets.zip`, named
`img<k>.jpg` where `k` is the frame number for sets cut from a video (`img0.jpg`, `img7.jpg`, ...), so the gold
index is a position, not a name: every baseline (`baselines/clip/zero_shot.py`, `evaluate_clip.py`, `dataset.py`)
globs `<set>/*.jpg` and sorts the files by the number after `img`, and index i is the i-th file of that order. We
do the same and require exactly 10 files named `img<k>.jpg` per set (another name would break the authors'
sort). Sets are read from `<images>/<set>/`, default `<root>/data/image-sets` (the README unzips the archive in
`data/`), or `<root>/data` itself when that has no `image-sets` folder (an archive whose sets unpack directly).

Rule (`baselines/clip/evaluate_clip.py`): the prediction is `torch.argmax` over the 10 image-description
similarities, which returns the first maximal index, and a description is correct iff the prediction is its gold
index; so a tie at the top is right when gold is the first of the tied images. `zero_shot.py`, which printed the
paper's zero-shot CLIP numbers, takes the first of `(-similarities).argsort()` instead, numpy's unstable default
sort: on the float16 similarities of its GPU CLIP this also gives the first maximal index (small arrays are
insertion-sorted), but numpy's vectorised sorts for float32/float64 do not promise it, so the argmax reading is
the one rule. `zero_shot.py` also strips the description (`text.strip()`); we do too (CLIP's tokenizer ignores
outer whitespace anyway). `tie` marks a description whose gold image shares the top score with another image (the
outcome then rests on the tie-break), and `strict` whether gold beats every other image strictly, so
`accuracy_strict` is the accuracy under this project's usual strict rule.

A set is static iff its name contains "open-images" (Open Images photos), else video (MSR-VTT, Video-Storytelling,
YouCook frames): the scripts' `'open-images' in img_dir`, giving 430 static and 1,872 video descriptions. The
headline is the accuracy pooled over all 2,302 descriptions, with `video` and `static` (the three numbers the
scripts print). vl_compo's OpenAI CLIP ViT-B/32 numbers are `imagecode::videos` 15.06 (282 of 1,872) and
`imagecode::static` 50.70 (218 of 430) in its `individual_results.csv`, and the pooled 21.72 (500 of 2,302) as
`imagecode` in `results.csv`.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import numpy as np

from evaluation.benchmarks.annotations import read_json, require, required_text
from evaluation.benchmarks.base import ImageRef, Item, ItemBenchmark, MissingBenchmarkData, Outcome, beats_all, percent
from evaluation.benchmarks.sources import DataSource, Download, published

COMMIT = "609f07611aed2599f946c30d730f40a41af1079b"
VALID_FILE = "data/valid_data.json"
VALID_SHA256 = "cb4b8482354ba9bac62b6e101f145f9e59722dcf3b3fd42583f5b6de12bc698a"
VALID_SIZE = 321098
IMAGES_PER_SET = 10
GOLD_KEYS = {str(index) for index in range(IMAGES_PER_SET)}
IMAGE_NAME = re.compile(r"img(\d+)\.jpg")
KINDS = ("video", "static")
MISSING_SETS_SHOWN = 3


def set_kind(set_name: str) -> str:
    """A set's kind: static for Open Images photos, video for video frames (the authors' `'open-images' in
    img_dir`)."""
    return "static" if "open-images" in set_name else "video"


def set_images(folder: Path) -> list[Path]:
    """A set's images in the authors' order: `img<k>.jpg` sorted by the number k."""
    files = list(folder.glob("*.jpg"))
    odd = sorted(path.name for path in files if not IMAGE_NAME.fullmatch(path.name))
    require(not odd, f"{folder}: image names must be img<number>.jpg, found {', '.join(odd[:3])}")
    require(len(files) == IMAGES_PER_SET, f"{folder}: an image set holds {IMAGES_PER_SET} images, found {len(files)}")
    return sorted(files, key=lambda path: int(IMAGE_NAME.fullmatch(path.name).group(1)))


def first_argmax_scores(scores: np.ndarray, gold: int) -> dict[str, object]:
    """The prediction (first maximal index, as `torch.argmax`), whether it is gold, whether gold wins strictly,
    and whether gold shares the top score with another image."""
    scores = np.asarray(scores, dtype=np.float64)
    predicted = int(np.argmax(scores))
    top = scores == scores[predicted]
    return {"predicted": predicted, "correct": predicted == gold, "strict": beats_all(scores, gold),
            "tie": bool(top[gold] and top.sum() > 1)}


class ImageCoDe(ItemBenchmark):
    """ImageCoDe validation split: each description against its set's 10 images (2,302 descriptions).

    Args:
        root: the folder holding `data/valid_data.json` (the repository layout).
        images: the folder holding one folder per image set (`<set>/img<k>.jpg`); default
            `<root>/data/image-sets`, or `<root>/data` when that has no `image-sets` folder.

    Aggregates (percent): `accuracy` (pooled), `video`, `static`, `accuracy_strict` (gold strictly above every
    other image); counts `n`, `n_video`, `n_static`, `ties`.
    """

    name = "imagecode"
    headline = ("accuracy", "video", "static")
    description = "ImageCoDe (validation): the described image among 10 near-identical ones, accuracy (%)"
    data_source = DataSource(
        home="https://github.com/McGill-NLP/imagecode",
        licence="MIT (repository LICENSE, which covers its data per the README); images: frames of MSR-VTT, "
                "Video-Storytelling and YouCook videos and Open Images photos, each under its own terms",
        size="one JSON file, 321 KB (2,302 descriptions of 1,039 sets); image-sets.zip holds every split's sets, "
             "10 JPEGs each (several GB)",
        downloads=(Download(url=f"https://raw.githubusercontent.com/McGill-NLP/imagecode/{COMMIT}/{VALID_FILE}",
                            target=VALID_FILE, sha256=VALID_SHA256, size=VALID_SIZE),),
        by_hand="Images: wget https://zenodo.org/record/6518944/files/image-sets.zip (or the Google Drive copy "
                "https://drive.google.com/file/d/1OIKNyU0F9lThbaZZ3Jvm7AlF94n1MzDk) and unzip it in <root>/data/, "
                "so that a set is <root>/data/image-sets/<set>/img<k>.jpg (sets unpacked straight into "
                "<root>/data/ are found too); or pass the folder of set folders as the `images` option. Its bytes "
                "are not pinned.",
    )
    published = published({"accuracy": 21.72024327, "video": 15.064102564102564, "static": 50.697674418604656},
                           "vl_compo")

    def __init__(self, root: str | Path, images: str | Path | None = None):
        super().__init__(root)
        if images:
            self.images = Path(images)
        else:
            image_sets = self.root / "data" / "image-sets"
            self.images = image_sets if image_sets.is_dir() else self.root / "data"

    def required_files(self) -> list[str]:
        return [VALID_FILE]

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        sets = self._read_sets()
        self._check_sets_present(list(sets))
        items = []
        for set_name, descriptions in sets.items():
            images = [ImageRef(str(path)) for path in set_images(self.images / set_name)]
            items += [Item(id=f"{set_name}/{gold}", images=images, texts=[text.strip()],
                           meta={"set": set_name, "gold": gold, "kind": set_kind(set_name)})
                      for gold, text in descriptions.items()]
        return items

    def _read_sets(self) -> dict[str, dict[int, str]]:
        """{set: {gold index: description}} from the annotation file, checked."""
        path = self.root / VALID_FILE
        content = read_json(path)
        require(isinstance(content, dict), f"{path}: expected a JSON object of image sets, found "
                                           f"{type(content).__name__}")
        sets = {}
        for set_name, descriptions in content.items():
            where = f"{path}: set {set_name!r}"
            require(isinstance(descriptions, dict) and descriptions, f"{where}: expected {{gold index: description}}")
            for key, text in descriptions.items():
                require(key in GOLD_KEYS, f"{where}: gold index must be 0..{IMAGES_PER_SET - 1}, found {key!r}")
                required_text(text, f"{where}, index {key}", "description")
            sets[set_name] = {int(key): text for key, text in descriptions.items()}
        return sets

    def _check_sets_present(self, set_names: list[str]) -> None:
        """Every set folder is there (its image names are only known from the folder, so a missing one is
        reported here rather than by the harness's missing-image check)."""
        missing = [name for name in set_names if not (self.images / name).is_dir()]
        if missing:
            raise MissingBenchmarkData(
                f"{self.name}: {len(missing)} of {len(set_names)} image sets are missing under {self.images} (e.g. "
                f"{', '.join(missing[:MISSING_SETS_SHOWN])}); unzip image-sets.zip in <root>/data/ or pass the "
                f"folder of set folders as the images option (options.{self.name}.images=DIR)")

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        scores = np.asarray(similarity, dtype=np.float64)[:, 0]
        return {"id": item.id, "set": item.meta["set"], "kind": item.meta["kind"], "gold": item.meta["gold"],
                **first_argmax_scores(scores, int(item.meta["gold"]))}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        result = {"accuracy": percent([bool(o["correct"]) for o in outcomes])}
        for kind in KINDS:
            result[kind] = percent([bool(o["correct"]) for o in outcomes if o["kind"] == kind])
        result["accuracy_strict"] = percent([bool(o["strict"]) for o in outcomes])
        result["ties"] = float(sum(bool(o["tie"]) for o in outcomes))
        result["n"] = float(len(outcomes))
        for kind in KINDS:
            result[f"n_{kind}"] = float(sum(o["kind"] == kind for o in outcomes))
        return result

"""Stand-in Cola files in the authors' formats (`arijitray1993/COLA`), with generated images.

Multi-object: `data/COLA_multiobjects_matching_benchmark.json`, a JSON list of `[image 0 URL, caption 0, image 1
URL, caption 1]` whose URLs end in Visual Genome ids, the images saved as `images/<id>.jpg`. Images are reused
across items (the real file has 218 images for 210 items), never both of one item.

Single-object: the three `data/COLA_singleobjects_benchmark_<subset>.json` files in each form the loader reads (the
README's `{"labels", "data"}` for GQA, `eval.py`'s `[labels, data]` for CLEVR, records without the annotation for
PACO; labels as captions and as `[[attribute, ...], object]` pairs), images under `images/<subset>/`. The labels
include each case the official evaluation treats apart: one no image has, one without hard images (both skipped),
and in GQA one whose hard images are all negatives (no AP).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from testkit.standin.imagecode import PooledFiles
from testkit.standin.images import encoded_pool
from testkit.standin.two_by_two import swapped_captions

URL = "https://cs-people.bu.edu/array/data/vg_gqa_images/{}.jpg"
FIRST_VG_ID = 2300000
MAX_IMAGES = 40
LABELS = ([["square", "white"], "plate"], "red round table", [["tall"], "green tree"], "brown wooden chair",
          [["black", "shiny"], "car"], "small blue cube")
ABSENT, NO_HARD, NO_POSITIVE_HARD = 0, 1, 2  # label indices of the cases the official evaluation treats apart
FIRST_USUAL_LABEL = 3
USUAL_LABELS = len(LABELS) - FIRST_USUAL_LABEL


def write_cola_multi_object(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`n_items` records over up to 40 images; caption i describes image i (the swapped captions of one item)."""
    root, pool = Path(root), encoded_pool(seed, ".jpg")
    n_images = min(MAX_IMAGES, 2 * max(1, n_items))
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    for k in range(n_images):
        (images / f"{FIRST_VG_ID + k}.jpg").write_bytes(pool[k % len(pool)])
    records = []
    for index in range(n_items):
        first, second = (FIRST_VG_ID + (2 * index + which) % n_images for which in (0, 1))
        caption_0, caption_1 = swapped_captions(index)
        records.append([URL.format(first), caption_0, URL.format(second), caption_1])
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "COLA_multiobjects_matching_benchmark.json").write_text(json.dumps(records))
    return {"images": str(images)}


def _image_file(subset: str, index: int) -> tuple[str, str]:
    """(the record's `image_file`, somewhere in the authors' storage; the file's name)."""
    name = {"GQA": f"{FIRST_VG_ID + index}.jpg", "CLEVR": f"CLEVR_val_{index:06d}.png",
            "PACO": f"{100000 + index:012d}.jpg"}[subset]
    folder = {"GQA": "/data/gqa/images", "CLEVR": "CLEVR_v1.0/images/val", "PACO": "coco/val2017"}[subset]
    return f"{folder}/{name}", name


def _label_rows(subset: str, n_images: int, rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """Per image, 0/1 presence and 0/1 hard-set membership for each label."""
    present = [[0] * len(LABELS) for _ in range(n_images)]
    hard = [[0] * len(LABELS) for _ in range(n_images)]
    for i in range(n_images):
        for k in range(len(LABELS)):
            if k == ABSENT:
                hard[i][k] = int(rng.random() < 0.5)
            elif k == NO_HARD:
                present[i][k] = int(rng.random() < 0.5)
            elif k == NO_POSITIVE_HARD and subset == "GQA":
                present[i][k] = int(i % 2 == 0)
                hard[i][k] = 1 - present[i][k]
            else:
                present[i][k] = int(rng.random() < 0.3 or k == FIRST_USUAL_LABEL + i % USUAL_LABELS)
                hard[i][k] = int(present[i][k] or rng.random() < 0.6)
    return present, hard


def write_cola_single_object(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """The three subsets, `n_items` images each (at least 3, so that every usual label has a positive), every
    image scored against 6 labels."""
    root, rng = Path(root), random.Random(seed)
    n_images = max(USUAL_LABELS, n_items)
    for subset in ("GQA", "CLEVR", "PACO"):
        files = PooledFiles(encoded_pool(seed, ".png" if subset == "CLEVR" else ".jpg"))
        folder = root / "images" / subset
        folder.mkdir(parents=True, exist_ok=True)
        present, hard = _label_rows(subset, n_images, rng)
        records = []
        for i in range(n_images):
            image_file, name = _image_file(subset, i)
            files.write(folder / name, i)
            annotation = {"objects": [[["white"], "plate"]]}
            records.append([image_file, present[i], hard[i]] if subset == "PACO" else
                           [image_file, annotation, present[i], hard[i]])
        labels = list(LABELS) if subset != "CLEVR" else [_caption(label) for label in LABELS]
        content = [labels, records] if subset == "CLEVR" else {"labels": labels, "data": records}
        (root / "data").mkdir(parents=True, exist_ok=True)
        (root / "data" / f"COLA_singleobjects_benchmark_{subset}.json").write_text(json.dumps(content))
    return {"images": str(root / "images")}


def _caption(label) -> str:
    return label if isinstance(label, str) else " ".join([*label[0], label[1]])

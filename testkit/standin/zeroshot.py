"""Stand-in zero-shot classification: clip_benchmark's two JSON files and a folder-per-class image tree.

Six classes (fewer for fewer items) with synset-style folder names (`n0000000<k>`), whose sorted order is
the label order, and images spread round-robin over them (`images/<folder>/ILSVRC2012_val_<n>.JPEG`). The
JSON files hold the stand-in dataset "standin" next to a 2-template "imagenet1k" entry, as the real files
hold many datasets.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from testkit.standin.images import write_image

CLASS_NAMES = ("red square", "green circle", "blue triangle", "yellow star", "purple ring", "black cross")
TEMPLATES = ("a photo of a {c}.", "a drawing of the {c}.", "itap of a {c}.")
DISTINCT_IMAGES = 64


def class_folder(label: int) -> str:
    return f"n{label:08d}"


def write_zeroshot(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`n_items` images over six classes (fewer when n_items < 6, so no folder is empty); returns the options
    (`images`, `dataset`)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    n_classes = max(1, min(len(CLASS_NAMES), n_items))
    (root / "en_classnames.json").write_text(json.dumps(
        {"imagenet1k": ["tench", "goldfish"], "standin": list(CLASS_NAMES[:n_classes])}, indent=4))
    (root / "en_zeroshot_classification_templates.json").write_text(json.dumps(
        {"imagenet1k": ["a bad photo of a {c}.", "a photo of many {c}."], "standin": list(TEMPLATES)}, indent=4))
    images = root / "images"
    for label in range(n_classes):
        (images / class_folder(label)).mkdir(parents=True, exist_ok=True)
    written = []
    for n in range(n_items):
        path = images / class_folder(n % n_classes) / f"ILSVRC2012_val_{n + 1:08d}.JPEG"
        if n < DISTINCT_IMAGES:
            write_image(path, seed=seed * 100003 + n)
        else:
            shutil.copyfile(written[n % DISTINCT_IMAGES], path)
        written.append(path)
    return {"images": str(images), "dataset": "standin"}


def write_shapes_zeroshot(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """A shapes-world split from its generator (images, captions, scene graphs): about `n_items` objects."""
    from datamodules.shapes import write_caption_split

    (Path(root) / "annotations").mkdir(parents=True, exist_ok=True)
    write_caption_split(Path(root), "val", max(1, n_items // 2), image_size=32, seed=seed, captions_per_image=1)
    return {"split": "val"}

"""Stand-in ELEVATER test splits: every task's index file and image archive in the toolkit's layout.

Each of the 21 tasks gets `<root>/<root_folder>/<index>` and its zip archive (stored, members reused from a small
pool of generated images), plus the label map file the registry names (not read by the benchmark). Iris tasks
write `<archive>@<member> <label>[,<label>...]` lines (stanfordcar's members hold spaces, as paths may);
voc2007classification lists one to three labels per image; COCO tasks list their images in decreasing id and
their categories in decreasing id, and give one image a second annotation after its first, so that the loader's
orderings are exercised. hateful-memes alternates its two labels (ROC-AUC needs both).
"""
from __future__ import annotations

import json
import math
import random
import zipfile
from pathlib import Path

from evaluation.benchmarks.elevater import Task, load_tasks
from testkit.standin.images import encoded_pool

MIN_PER_TASK = 4


def images_per_task(n_items: int) -> int:
    """How many images each of the 21 tasks gets for `n_items` in all (at least `MIN_PER_TASK`)."""
    return max(MIN_PER_TASK, math.ceil(n_items / len(load_tasks())))


def write_elevater(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """About `n_items` images spread over the 21 tasks; returns the options (`check_counts`: the stand-in splits
    are smaller than ELEVATER's)."""
    root = Path(root)
    rng = random.Random(seed)
    pool = encoded_pool(seed, ".png")
    for task in load_tasks().values():
        labels = [_labels(task, k, rng) for k in range(images_per_task(n_items))]
        members = [_member(task, k) for k in range(len(labels))]
        base = root / task.root_folder
        base.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(base / task.archives[0], "w", compression=zipfile.ZIP_STORED) as archive:
            for k, member in enumerate(members):
                archive.writestr(member, pool[k % len(pool)])
        if task.format == "coco":
            _write_coco(base / task.index, task, members, labels)
        else:
            lines = [f"{task.archives[0]}@{member} {','.join(map(str, tags))}" for member, tags in zip(members, labels)]
            (base / task.index).write_text("\n".join(lines) + "\n", encoding="utf-8")
        if task.labelmap:
            (base / task.labelmap).write_text("\n".join(task.classes) + "\n", encoding="utf-8")
    return {"check_counts": False}


def _labels(task: Task, k: int, rng: random.Random) -> list[int]:
    if task.name == "hateful-memes":
        return [k % 2]
    if task.multilabel:
        return sorted(rng.sample(range(len(task.classes)), rng.randint(1, 3)))
    return [rng.randrange(len(task.classes))]


def _member(task: Task, k: int) -> str:
    folder = "Audi TT Coupe 2011" if task.name == "stanfordcar" else "images"
    return f"{folder}/{k:05d}.png"


def _write_coco(path: Path, task: Task, members: list[str], labels: list[list[int]]) -> None:
    """A COCO classification file: ids from 1, images and categories listed in decreasing id."""
    images = [{"id": k + 1, "width": 48, "height": 40, "file_name": member, "zip_file": task.archives[0]}
              for k, member in enumerate(members)]
    annotations = [{"id": k + 1, "image_id": k + 1, "category_id": tags[0] + 1} for k, tags in enumerate(labels)]
    # a second label for the first image, annotated after its first: a multiclass image takes its first
    annotations.append({"id": len(annotations) + 1, "image_id": 1,
                        "category_id": (labels[0][0] + 1) % len(task.classes) + 1})
    categories = [{"id": c + 1, "name": name} for c, name in enumerate(task.classes)]
    path.write_text(json.dumps({"images": images[::-1], "annotations": annotations, "categories": categories[::-1]}),
                    encoding="utf-8")

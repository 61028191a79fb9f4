"""Stand-in SugarCrepe: the 7 official JSON files (string keys, one key skipped as upstream) and COCO images.

Two writers:
- `write_sugarcrepe`: generated captions over a few templates and small images (loader and CLI tests).
- `write_sugarcrepe_sample`: the real annotation files restricted to a seeded sample of their images, every
  item of a sampled image kept (in every subset, under its own key), with generated COCO-sized JPEGs under the
  real file names. The sample keeps what throughput depends on: the real captions (their token lengths), the
  items per image (7,511 items over 1,560 images in the full set) and the captions shared between subsets
  (11,844 distinct texts among 15,022). `perf.evaluate --clip-benchmark` times both harnesses on it.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Dict, Tuple

from PIL import Image, ImageDraw

from evaluation.benchmarks.sugarcrepe import SUBSETS
from testkit.standin.images import PALETTE, write_image

SUBJECTS = ("a man", "a woman", "a dog", "a cat", "a child", "a horse")
PLACES = ("on a beach", "in a kitchen", "next to a car", "under a tree", "on a red couch")
COCO_SIZE = (640, 480)  # the most common COCO val2017 size
JPEG_QUALITY = 90


def write_sugarcrepe(root: Path, n_items: int = 21, seed: int = 0) -> dict:
    """`n_items` spread over the 7 subsets; about one image per 3 items, as captions share COCO images."""
    rng = random.Random(seed)
    root = Path(root)
    n_images = max(1, n_items // 3)
    names = [f"{100000 + i:012d}.jpg" for i in range(n_images)]
    for i, name in enumerate(names):
        write_image(root / "val2017" / name, seed=seed * 100003 + i)
    for index, subset in enumerate(SUBSETS):
        count = n_items // len(SUBSETS) + (index < n_items % len(SUBSETS))
        entries = {}
        for key in range(count + (subset == "swap_obj")):
            if subset == "swap_obj" and key == 1:
                continue  # keys are not contiguous upstream ("108" is missing)
            subject, place = rng.choice(SUBJECTS), rng.choice(PLACES)
            entries[str(key)] = {"filename": rng.choice(names), "caption": f"{subject} sitting {place}.",
                                 "negative_caption": f"{subject} standing {place}."}
        root.mkdir(parents=True, exist_ok=True)
        (root / f"{subset}.json").write_text(json.dumps(entries, indent=1))
    return {}


def write_coco_like_jpeg(path: Path, seed: int, size: Tuple[int, int] = COCO_SIZE) -> Path:
    """A JPEG of COCO's size (decoding and resizing cost as much as a real photo's) with random shapes."""
    rng = random.Random(seed)
    width, height = size
    image = Image.new("RGB", size, rng.choice(PALETTE))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randrange(width - 40), rng.randrange(height - 40)
        box = (x0, y0, rng.randrange(x0 + 20, width), rng.randrange(y0 + 20, height))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=tuple(rng.randrange(256) for _ in "rgb"))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, quality=JPEG_QUALITY)
    return path


def write_sugarcrepe_sample(root: Path, annotations: Path, n_images: int, seed: int = 0,
                            image_size: Tuple[int, int] = COCO_SIZE) -> dict:
    """The official files under `annotations` restricted to `n_images` of their images (seeded), into `root`.

    Args:
        root: output folder (the 7 JSON files and `val2017/`; the layout of both our loader and
            clip_benchmark's `sugar_crepe/<subset>` builder).
        annotations: folder holding the 7 official `<subset>.json` files.
        n_images: distinct images to keep (every item of each is kept); at most the files' image count.
        seed: sampling seed.
        image_size: (width, height) of the generated JPEGs.

    Returns:
        The `build_benchmark` options (none: the images are at `<root>/val2017`).
    """
    files: Dict[str, dict] = {s: json.loads((Path(annotations) / f"{s}.json").read_text()) for s in SUBSETS}
    names = sorted({entry["filename"] for entries in files.values() for entry in entries.values()})
    if not 0 < n_images <= len(names):
        raise ValueError(f"n_images must lie in 1..{len(names)} (the images of {annotations}), got {n_images}")
    chosen = set(random.Random(seed).sample(names, n_images))
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for subset, entries in files.items():
        kept = {key: entry for key, entry in entries.items() if entry["filename"] in chosen}
        (root / f"{subset}.json").write_text(json.dumps(kept, indent=1))
    for index, name in enumerate(sorted(chosen)):
        write_coco_like_jpeg(root / "val2017" / name, seed=seed * 100003 + index, size=image_size)
    return {}

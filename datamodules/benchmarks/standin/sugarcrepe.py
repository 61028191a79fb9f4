"""Stand-in SugarCrepe: the 7 official JSON files (string keys, one key skipped as upstream) and COCO images."""
from __future__ import annotations

import json
import random
from pathlib import Path

from datamodules.benchmarks.standin.images import write_image
from datamodules.benchmarks.sugarcrepe import SUBSETS

SUBJECTS = ("a man", "a woman", "a dog", "a cat", "a child", "a horse")
PLACES = ("on a beach", "in a kitchen", "next to a car", "under a tree", "on a red couch")


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

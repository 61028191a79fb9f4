"""Stand-in SugarCrepe++: the five official JSON lists under `data/` and COCO-named images under `images/`.

Records carry the official keys (`id`, `filename`, `caption`, `caption2`, `negative_caption`), ids 0 .. n-1 per
file, written in the release's formatting. Two records reproduce the release's degenerate triplets: in
`swap_obj` record 1 the negative equals P1 (upstream ids 2 and 8), in `replace_att` record 1 P2 equals P1
(upstream id 14).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from evaluation.benchmarks.sugarcrepe_pp import SUBSETS, annotation_file
from testkit.standin.images import write_image

SUBJECTS = ("a man", "a woman", "a dog", "a cat", "a child", "a horse")
PLACES = ("on a beach", "in a kitchen", "next to a car", "under a tree", "on a red couch")


def _record(rng: random.Random, subset: str, key: int, names: list[str]) -> dict:
    subject, place = rng.choice(SUBJECTS), rng.choice(PLACES)
    caption = f"{subject.capitalize()} sitting {place}."
    record = {"id": key, "filename": rng.choice(names), "caption": caption,
              "caption2": f"{place.capitalize()}, {subject} is sitting.",
              "negative_caption": f"{subject.capitalize()} standing {place}."}
    if key == 1 and subset == "swap_obj":
        record["negative_caption"] = caption
    if key == 1 and subset == "replace_att":
        record["caption2"] = caption
    return record


def write_sugarcrepe_pp(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`n_items` spread over the five subsets, about one image per 3 items (captions share COCO images).

    Returns:
        The `build_benchmark` options (none: the files and images are in the default layout).
    """
    rng = random.Random(seed)
    root = Path(root)
    names = [f"{200000 + i:012d}.jpg" for i in range(max(1, n_items // 3))]
    for i, name in enumerate(names):
        write_image(root / "images" / name, seed=seed * 100003 + i)
    for index, subset in enumerate(SUBSETS):
        count = n_items // len(SUBSETS) + (index < n_items % len(SUBSETS))
        records = [_record(rng, subset, key, names) for key in range(count)]
        path = root / annotation_file(subset)
        path.parent.mkdir(parents=True, exist_ok=True)
        # The release's formatting: one-space indent, no space after ':' (pandas' JSON writer).
        path.write_text(json.dumps(records, indent=1, separators=(",", ":")))
    return {}

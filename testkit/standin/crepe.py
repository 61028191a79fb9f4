"""Stand-in CREPE productivity files in the authors' layout (`RAIVNLab/CREPE`, `data/prod_hard_negatives.zip`).

`prod_hard_negatives/<type>/prod_vg_hard_negs_<type>_complexity_<c>.csv` for the three types and complexities
4-12, columns `image_id, caption, hard_negs, x, y, width, height`, `hard_negs` a Python list literal as pandas
writes a list cell. Item i goes to type `TYPES[i % 3]` and complexity `4 + (i // 3) % 9`, so a small `n_items`
leaves the highest complexities with a header-only file. Images are Visual Genome-named JPEGs, half in `VG_100K/`
and half in `VG_100K_2/` (the loader looks in that order), reused across items. Regions lie inside the 48 x 40
images except every seventh, which reaches past the right border (PIL fills the outside with black).
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

from evaluation.benchmarks.crepe import COLUMNS, COMPLEXITIES, TYPES, ZIP_FOLDER, csv_name
from testkit.standin.images import encoded_pool
from testkit.standin.two_by_two import COLOURS, NOUNS, RELATIONS

FIRST_VG_ID = 2310000
N_IMAGES = 24
IMAGE_SIZE = (48, 40)


def _caption(index: int, complexity: int) -> list[str]:
    """The caption's words: `complexity` objects chained by relations, unique per index."""
    words = [f"{COLOURS[index % len(COLOURS)]} {NOUNS[index % len(NOUNS)]} {index}"]
    for k in range(1, complexity // 2):
        words += [RELATIONS[(index + k) % len(RELATIONS)], f"a {NOUNS[(index + 3 * k) % len(NOUNS)]}"]
    return words


def _negatives(index: int, negative_type: str, words: list[str]) -> list[str]:
    """2 to 10 hard negatives; the first one of every eleventh swap item equals the caption (an exact tie)."""
    caption, count = " ".join(words), 2 + index % 9
    if negative_type == "negate":
        variants = [caption.replace(" a ", f" no {k} ", 1) + " not" * (k + 1) for k in range(count)]
    elif negative_type == "swap":
        variants = [" ".join(words[::-1]) + "," * k for k in range(count)]
        if index % 11 == 1:
            variants[0] = caption
    else:
        variants = [caption.replace(NOUNS[index % len(NOUNS)], NOUNS[(index + k + 1) % len(NOUNS)], 1) + f" ({k})"
                    for k in range(count)]
    return variants


def _region(index: int) -> tuple[int, int, int, int]:
    x, y = index % 12, index % 9
    width = IMAGE_SIZE[0] - x + 5 if index % 7 == 0 else 14 + index % 20
    return x, y, width, 12 + index % 16


def _image_folder(image_id: int) -> str:
    return "VG_100K" if image_id % 2 == 0 else "VG_100K_2"


def write_crepe(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """The 27 CSV files under `root/prod_hard_negatives/` and the images under `root/VG_100K*/`."""
    root, pool = Path(root), encoded_pool(seed, ".jpg")
    for k in range(N_IMAGES):
        image_id = FIRST_VG_ID + k
        path = root / _image_folder(image_id) / f"{image_id}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pool[k % len(pool)])
    rows: dict[tuple[str, int], list[dict]] = {(t, c): [] for t in TYPES for c in COMPLEXITIES}
    for index in range(n_items):
        negative_type, complexity = TYPES[index % 3], COMPLEXITIES[(index // 3) % len(COMPLEXITIES)]
        words = _caption(index, complexity)
        x, y, width, height = _region(index)
        rows[negative_type, complexity].append({
            "image_id": FIRST_VG_ID + index % N_IMAGES, "caption": " ".join(words),
            "hard_negs": repr(_negatives(index, negative_type, words)), "x": x, "y": y, "width": width,
            "height": height})
    for (negative_type, complexity), records in rows.items():
        path = root / ZIP_FOLDER / csv_name(negative_type, complexity)
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(records)
        path.write_text(buffer.getvalue(), encoding="utf-8")
    return {}

"""Stand-in VALSE: the 11 official `<piece>.json` files with their key patterns, `dataset` values and image names.

Every fifth record of a piece (index 4, 9, ...) gets `mturk.caption` 1 and is therefore invalid. Images are
written outside the root, one folder per origin dataset, and reused across records (a pool of at most 8 per
folder) so that thousands of items stay cheap. The VisDial value maps to two folders (COCO 2014 for the
standard piece, VisualDialog val2018 for the hard one), as a real setup needs.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from testkit.standin.images import write_image

POOL = 8
INVALID_EVERY = 5

# piece -> (dataset value, key pattern, image file pattern, image folder); patterns take the record index.
PIECES: dict[str, tuple] = {
    "existence": ("visual7w", "existence_visual7w_{n}", "v7w_{n}.jpg", "visual7w"),
    "plurals": ("coco2017", "plurals:coco2017:{n}", "{n:012d}.jpg", "val2017"),
    "counting-hard": ("visual7w", "counting_visual7w_{n}", "v7w_{n}.jpg", "visual7w"),
    "counting-small-quant": ("visual7w", "counting_visual7w_{n}", "v7w_{n}.jpg", "visual7w"),
    "counting-adversarial": ("visual7w", "counting_visual7w_{n}", "v7w_{n}.jpg", "visual7w"),
    "relations": ("coco_2017", "relations:coco_2017:{n}", "{n:012d}.jpg", "val2017"),
    "action-replacement": ("SWiG", "actions_test_{n}", "exercising_{n}.jpg", "swig"),
    "actant-swap": ("SWiG", "actions_test_{n}", "exercising_{n}.jpg", "swig"),
    "coreference-standard": ("VisDial_v1.0", "coref_train_{n}", "COCO_train2014_{n:012d}.jpg", "coco2014"),
    "coreference-hard": ("VisDial_v1.0", "coref_test_{n}", "VisualDialog_val2018_{n:012d}.jpg", "visdial_val2018"),
    "foil-it": ("FOIL dataset", "{n}", "COCO_val2014_{n:012d}.jpg", "coco2014"),
}


def write_valse(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """Writes the 11 piece files (n_items records each) and their images; returns the `images` option."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    image_root = root.parent / f"{root.name}_images"
    rng = random.Random(seed)
    for piece, (dataset, key_pattern, file_pattern, folder) in PIECES.items():
        records = {key_pattern.format(n=i): _record(piece, dataset, file_pattern.format(n=i % POOL), i, rng)
                   for i in range(n_items)}
        (root / f"{piece}.json").write_text(json.dumps(records, indent=4))
        _write_pool(image_root / folder, file_pattern, min(n_items, POOL), seed)
    folders = {dataset: str(image_root / folder) for dataset, _, _, folder in PIECES.values()}
    folders["VisDial_v1.0"] = [str(image_root / "coco2014"), str(image_root / "visdial_val2018")]
    return {"images": folders}


def _record(piece: str, dataset: str, image_file: str, index: int, rng: random.Random) -> dict:
    """One record in the official field order (the common fields; piece-specific extras are not read)."""
    caption_votes = 1 if index % INVALID_EVERY == INVALID_EVERY - 1 else rng.choice((2, 3))
    return {"dataset": dataset, "original_split": "test", "dataset_idx": str(index),
            "linguistic_phenomena": piece.split("-")[0], "image_file": image_file,
            "caption": f"{piece} caption {index}", "classes": "man", "classes_foil": "torso",
            "mturk": {"foil": 3 - caption_votes, "caption": caption_votes, "other": 0},
            "foil": f"{piece} foil {index}"}


def _write_pool(folder: Path, file_pattern: str, count: int, seed: int) -> list[Path]:
    """Images 0..count-1 of one piece; pieces sharing a folder and a pattern reuse the files already there."""
    names = [file_pattern.format(n=i) for i in range(count)]
    return [write_image(folder / name, seed=seed * 1000 + i) for i, name in enumerate(names)
            if not (folder / name).exists()]

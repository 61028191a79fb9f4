"""Stand-in ARO files in the official layouts (see `evaluation/benchmarks/aro.py` for the schemas).

- VG-Relation / VG-Attribution: a JSON list of records with `image_id`, `image_path`, `bbox_x/y/w/h` (a box
  inside the generated image), `true_caption`, `false_caption`, and `relation_name` or `attributes`. Three
  records share each image, each with its own box, so every (image, box) is distinct.
- COCO-Order / Flickr30k-Order: BLIP's Karpathy test JSON, `[{"image": "<folder>/<file>.jpg", "caption":
  [5 captions]}]`, with COCO-like captions ("A man riding a horse on a beach."). `n_items` counts captions:
  `ceil(n_items / 5)` images with 5 captions each, the last one holding the remainder.

Only `_POOL` distinct images are drawn; further image files are hard links to them (copies where linking
fails), so thousands of items are written in a second while each file still has its own path.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

from testkit.standin.images import write_image

_POOL = 16
_VG_IMAGE_SIZE = (96, 72)
_RECORDS_PER_VG_IMAGE = 3
_CAPTIONS_PER_IMAGE = 5

# VG-Relation: record i has relation RELATIONS[i % 6]. The first three are kept by the ARO macro; the last
# three are in its exclusion list (`symmetric` in the ARO notebook).
RELATIONS = ("on", "wearing", "holding", "next to", "near", "with")
KEPT_RELATIONS = RELATIONS[:3]
_SUBJECTS = ("man", "woman", "boy", "girl", "dog", "cat")
_OBJECTS = ("shirt", "table", "umbrella", "bench", "hat", "car")

# VG-Attribution: even records use COMMON_PAIR; odd records cycle over the five RARE_PAIRS. With n_items
# records the common pair has ceil(n_items / 2) items, so it passes ARO's >= 25 filter once n_items >= 49,
# and each rare pair has about n_items / 10, so they all stay below 25 until n_items reaches ~250.
COMMON_PAIR = ("white", "black")
RARE_PAIRS = (("red", "wooden"), ("small", "large"), ("green", "metal"), ("blue", "striped"), ("brown", "open"))
_ATTRIBUTE_NOUNS = ("dog", "cat", "car", "house", "plate", "table")

_CAPTION_TEMPLATES = (
    "A {person} riding a {vehicle} on a {place}.",
    "Two {animal}s playing with a {color} frisbee in the {place}.",
    "A {person} in a {color} shirt is holding an umbrella.",
    "The kitchen has {color} cabinets and a {size} refrigerator.",
    "A {size} {animal} sitting next to a {color} {vehicle}.",
    "a {person} standing on the {place} near a {size} {vehicle}",
    "A plate of food with broccoli, rice and chicken.",
    "{count} {animal}s are lying on a {color} couch in a living room.",
)
_WORDS = {
    "person": ("man", "woman", "young boy", "little girl", "skier", "surfer"),
    "vehicle": ("horse", "bicycle", "motorcycle", "skateboard", "bus"),
    "place": ("beach", "street", "park", "field", "sidewalk"),
    "animal": ("dog", "cat", "giraffe", "zebra", "elephant"),
    "color": ("red", "blue", "white", "black", "green"),
    "size": ("large", "small", "tall", "old"),
    "count": ("Two", "Three", "Several"),
}


def write_aro_vg_relation(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`visual_genome_relation.json` and its images under `<root>/images`; relations cycle over RELATIONS."""
    rng = random.Random(seed)
    records = []
    for index in range(n_items):
        subject, obj = rng.choice(_SUBJECTS), rng.choice(_OBJECTS)
        relation = RELATIONS[index % len(RELATIONS)]
        records.append({**_vg_image_fields(index, rng), "relation_name": relation,
                        "true_caption": f"the {subject} is {relation} the {obj}",
                        "false_caption": f"the {obj} is {relation} the {subject}"})
    return _write_vg(Path(root), "visual_genome_relation.json", records, seed)


def write_aro_vg_attribution(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`visual_genome_attribution.json` and its images; see COMMON_PAIR / RARE_PAIRS for the pair counts."""
    rng = random.Random(seed)
    records = []
    for index in range(n_items):
        first, second = COMMON_PAIR if index % 2 == 0 else RARE_PAIRS[(index // 2) % len(RARE_PAIRS)]
        noun, other_noun = rng.sample(_ATTRIBUTE_NOUNS, 2)
        records.append({**_vg_image_fields(index, rng), "attributes": [first, second],
                        "true_caption": f"the {first} {noun} and the {second} {other_noun}",
                        "false_caption": f"the {second} {noun} and the {first} {other_noun}"})
    return _write_vg(Path(root), "visual_genome_attribution.json", records, seed)


def write_aro_coco_order(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`coco_karpathy_test.json` with `val2014/COCO_val2014_<12 digits>.jpg` images under root."""
    names = [f"val2014/COCO_val2014_{391895 + 7 * k:012d}.jpg" for k in range(_order_image_count(n_items))]
    return _write_order(Path(root), "coco_karpathy_test.json", names, n_items, seed)


def write_aro_flickr_order(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`flickr30k_test.json` with `flickr30k-images/<id>.jpg` images under root."""
    names = [f"flickr30k-images/{1000092795 + 13 * k}.jpg" for k in range(_order_image_count(n_items))]
    return _write_order(Path(root), "flickr30k_test.json", names, n_items, seed)


def _vg_image_fields(index: int, rng: random.Random) -> dict:
    """Image id, path and a box inside the image; record i uses image i // 3 and the box band i % 3."""
    image_id = 2315375 + index // _RECORDS_PER_VG_IMAGE
    width, height = _VG_IMAGE_SIZE
    # Disjoint x ranges per band make every (image, box) pair distinct.
    x = 8 * (index % _RECORDS_PER_VG_IMAGE) + rng.randrange(8)
    y = rng.randrange(height // 3)
    return {"image_id": str(image_id), "image_path": f"{image_id}.jpg", "bbox_x": x, "bbox_y": y,
            "bbox_w": rng.randrange(16, width - x), "bbox_h": rng.randrange(16, height - y)}


def _write_vg(root: Path, file_name: str, records: list, seed: int) -> dict:
    images = root / "images"
    _write_images([images / name for name in dict.fromkeys(r["image_path"] for r in records)], seed, _VG_IMAGE_SIZE)
    root.mkdir(parents=True, exist_ok=True)
    (root / file_name).write_text(json.dumps(records))
    return {"images": str(images)}


def _order_image_count(n_items: int) -> int:
    return -(-n_items // _CAPTIONS_PER_IMAGE)


def _write_order(root: Path, file_name: str, image_names: Sequence[str], n_items: int, seed: int) -> dict:
    rng = random.Random(seed)
    records = []
    for k, name in enumerate(image_names):
        count = min(_CAPTIONS_PER_IMAGE, n_items - k * _CAPTIONS_PER_IMAGE)
        records.append({"image": name, "caption": [_caption(rng) for _ in range(count)]})
    _write_images([root / name for name in image_names], seed, (64, 48))
    (root / file_name).write_text(json.dumps(records))
    return {"images": str(root)}


def _caption(rng: random.Random) -> str:
    template = rng.choice(_CAPTION_TEMPLATES)
    return template.format(**{slot: rng.choice(words) for slot, words in _WORDS.items()})


def _write_images(paths: Sequence[Path], seed: int, size: tuple) -> None:
    """Draw the first `_POOL` images; link the rest to them (copy where the filesystem cannot link)."""
    for index, path in enumerate(paths):
        path.unlink(missing_ok=True)  # an old hard link would otherwise be overwritten through its twin
        if index < _POOL:
            write_image(path, seed * 1000 + index, size)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(paths[index % _POOL], path)
        except OSError:
            shutil.copyfile(paths[index % _POOL], path)

"""Stand-in What'sUp files in the authors' schema (`amitakamath/whatsup_vlms`), with generated images.

Controlled A/B: a JSON list of `{"image_path": "data/<folder>/<obj1>_<prep>_<obj2>.jpeg", "caption_options":
[gold, d1, d2, d3]}`, object pair by object pair, the four prepositions each (a count that is not a multiple
of 4 leaves the last set incomplete). COCO/GQA-spatial: a JSON list of `[image_id, gold, wrong]`, two items
per image. Images go to `<root>/images` (passed back as the `images` option); a few encoded images are
reused, so thousands of items are written quickly.
"""
from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from testkit.standin.images import encoded_pool

OBJECTS = ("mug", "plate", "beer-bottle", "armchair", "scarf", "table", "cap", "chair", "wineglass", "laptop",
           "book", "remote-control")
CONTROLLED_CAPTIONS = {"on": "A {0} on a {1}", "under": "A {0} under a {1}", "left_of": "A {0} to the left of a {1}",
                       "right_of": "A {0} to the right of a {1}", "in-front_of": "A {0} in front of a {1}",
                       "behind": "A {0} behind a {1}"}
ONE_OBJECT_OPPOSITES = (("left", "right"), ("right", "left"), ("top", "bottom"), ("bottom", "top"))
COCO_TWO_OBJECT = (("to the left of", "to the right of"), ("to the right of", "to the left of"),
                   ("above", "below"), ("below", "above"))
GQA_TWO_OBJECT = (("to the left of", "to the right of"), ("to the right of", "to the left of"),
                  ("in front of", "behind"), ("behind", "in front of"))


def _object_pair(index: int) -> tuple[str, str]:
    """The index-th ordered object pair; past the list's pairs, objects get a numbered variant."""
    pairs = list(itertools.permutations(OBJECTS, 2))
    first, second = pairs[index % len(pairs)]
    variant = index // len(pairs)
    return (first, second) if variant == 0 else (f"{first}-v{variant}", f"{second}-v{variant}")


def _words(name: str) -> str:
    return name.replace("-", " ")


def _write_controlled(root: Path, n_items: int, seed: int, annotation: str, folder: str,
                      prepositions: tuple[str, ...]) -> dict:
    rng, pool = random.Random(seed), encoded_pool(seed, ".jpeg")
    images, records = root / "images", []
    images.mkdir(parents=True, exist_ok=True)
    for index in range(n_items):
        first, second = _object_pair(index // len(prepositions))
        gold = prepositions[index % len(prepositions)]
        distractors = rng.sample([p for p in prepositions if p != gold], len(prepositions) - 1)
        name = f"{first}_{gold}_{second}.jpeg"
        (images / name).write_bytes(pool[index % len(pool)])
        records.append({"image_path": f"data/{folder}/{name}",
                        "caption_options": [CONTROLLED_CAPTIONS[p].format(_words(first), _words(second))
                                            for p in (gold, *distractors)]})
    (root / annotation).write_text(json.dumps(records))
    return {"images": str(images)}


def write_whatsup_a(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`controlled_images_dataset.json` (on / under / left_of / right_of) and its images."""
    return _write_controlled(Path(root), n_items, seed, "controlled_images_dataset.json", "controlled_images",
                             ("on", "under", "left_of", "right_of"))


def write_whatsup_b(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`controlled_clevr_dataset.json` (left_of / right_of / in-front_of / behind) and its images."""
    return _write_controlled(Path(root), n_items, seed, "controlled_clevr_dataset.json", "controlled_clevr",
                             ("left_of", "right_of", "in-front_of", "behind"))


def _one_object(index: int) -> tuple[str, str]:
    obj = _words(OBJECTS[index % len(OBJECTS)])
    gold, wrong = ONE_OBJECT_OPPOSITES[index % len(ONE_OBJECT_OPPOSITES)]
    return f"A {obj} on the {gold}", f"A {obj} on the {wrong}"


def _two_objects(phrases: tuple[tuple[str, str], ...]):
    def captions(index: int) -> tuple[str, str]:
        first, second = (_words(o) for o in _object_pair(index))
        gold, wrong = phrases[index % len(phrases)]
        return f"A {first} {gold} a {second}", f"A {first} {wrong} a {second}"
    return captions


def _write_spatial(root: Path, n_items: int, seed: int, annotation: str, file_name, captions) -> dict:
    pool = encoded_pool(seed, ".jpg")
    images, records = root / "images", []
    images.mkdir(parents=True, exist_ok=True)
    for index in range(n_items):
        image_id = 100000 + index // 2  # two items per image, as images carry several objects
        if index % 2 == 0:
            (images / file_name(image_id)).write_bytes(pool[(index // 2) % len(pool)])
        records.append([image_id, *captions(index)])
    (root / annotation).write_text(json.dumps(records))
    return {"images": str(images)}


def _coco_name(image_id: int) -> str:
    return f"{image_id:012d}.jpg"


def _gqa_name(image_id: int) -> str:
    return f"{image_id}.jpg"


def write_whatsup_coco_one(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`coco_qa_one_obj.json` and `{id:012d}.jpg` images."""
    return _write_spatial(Path(root), n_items, seed, "coco_qa_one_obj.json", _coco_name, _one_object)


def write_whatsup_coco_two(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`coco_qa_two_obj.json` (left / right / above / below) and `{id:012d}.jpg` images."""
    return _write_spatial(Path(root), n_items, seed, "coco_qa_two_obj.json", _coco_name,
                          _two_objects(COCO_TWO_OBJECT))


def write_whatsup_gqa_one(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`vg_qa_one_obj.json` and `{id}.jpg` images."""
    return _write_spatial(Path(root), n_items, seed, "vg_qa_one_obj.json", _gqa_name, _one_object)


def write_whatsup_gqa_two(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`vg_qa_two_obj.json` (left / right / front / behind) and `{id}.jpg` images."""
    return _write_spatial(Path(root), n_items, seed, "vg_qa_two_obj.json", _gqa_name,
                          _two_objects(GQA_TWO_OBJECT))

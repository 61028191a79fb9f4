"""Stand-in COCO-Counterfactuals files: the Hugging Face layout (`data/examples.jsonl` and the unzipped
`data/images/<id>_img_<k>.jpg`) and the authors' test-split CSV (`split-coco-cfs/test-coco-cfs.csv`).

Example `i` has the id `<coco id>_<caption number>`; `caption_0` reads "A <colour> <noun> <verb> <place>." and
`caption_1` the same with the noun replaced by its counterfactual noun, so captions are distinct for the first
4,608 examples, except where the release's quirks are copied on purpose: every seventh example (i % 7 == 6)
repeats both captions of the one before (one COCO caption under two examples), and examples with i % 11 == 5 end
`caption_0` with a space. Images are copies of a few encoded JPEGs, never one for both images of an example.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from testkit.standin.images import encoded_pool
from testkit.standin.two_by_two import pool_index

COLOURS = ("red", "green", "blue", "yellow", "purple", "black")
NOUNS = ("man", "woman", "dog", "cat", "child", "horse", "bird", "boy", "girl", "cow", "bear", "sheep")
COUNTERFACTUAL_NOUNS = ("robot", "statue", "teddy bear", "giraffe", "zebra", "elephant", "kite", "clock", "vase",
                        "pizza", "train", "umbrella")
VERBS = ("standing", "sitting", "running", "sleeping", "eating", "waiting", "jumping", "looking")
PLACES = ("on a beach", "in a kitchen", "near a fence", "by a lake", "under a tree", "in a field", "on a street",
          "in a room")
SPLIT_FOLDER = {0: "synthetic-images-for-original-captions", 1: "synthetic-images-for-counterfactual-captions"}


def example_id(index: int) -> str:
    return f"{100000 + 37 * index}_{index % 5}"


def captions(index: int) -> tuple[str, str]:
    """The original and counterfactual caption of example `index`."""
    if index % 7 == 6:
        return captions(index - 1)
    colour = COLOURS[index % len(COLOURS)]
    noun = (index // len(COLOURS)) % len(NOUNS)
    verb = VERBS[(index // (len(COLOURS) * len(NOUNS))) % len(VERBS)]
    place = PLACES[(index // (len(COLOURS) * len(NOUNS) * len(VERBS))) % len(PLACES)]
    original = f"A {colour} {NOUNS[noun]} {verb} {place}." + (" " if index % 11 == 5 else "")
    return original, f"A {colour} {COUNTERFACTUAL_NOUNS[noun]} {verb} {place}."


def example(index: int) -> dict:
    identifier = example_id(index)
    original, counterfactual = captions(index)
    return {"id": identifier, "caption_0": original, "caption_1": counterfactual,
            "image_0": f"{identifier}_img_0", "image_1": f"{identifier}_img_1"}


def in_test_split(index: int) -> bool:
    """30 % of the examples (index ending in 0, 3 or 6), the first always among them."""
    return index % 10 in (0, 3, 6)


def write_coco_counterfactuals(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`n_items` examples in `<root>/data/examples.jsonl` and their images in `<root>/data/images/`."""
    root, pool = Path(root), encoded_pool(seed, ".jpg")
    records = [example(index) for index in range(n_items)]
    images = root / "data" / "images"
    images.mkdir(parents=True, exist_ok=True)
    for index, record in enumerate(records):
        for side in (0, 1):
            (images / f"{record[f'image_{side}']}.jpg").write_bytes(pool[pool_index(index, side, len(pool))])
    # The release's separators (", ", ": ") and a last line without a newline.
    (root / "data" / "examples.jsonl").write_text("\n".join(json.dumps(record) for record in records),
                                                 encoding="utf-8")
    return {}


def write_coco_counterfactuals_test(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """As `write_coco_counterfactuals`, plus `<root>/split-coco-cfs/test-coco-cfs.csv` listing 30 % of the
    examples as the authors' file does: every original row, then every counterfactual row."""
    write_coco_counterfactuals(root, n_items, seed)
    chosen = [example(index) for index in range(n_items) if in_test_split(index)]
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["image_path", "caption"])
    for side in (0, 1):
        writer.writerows([f"../../coco-counterfactuals/{SPLIT_FOLDER[side]}/{record['id']}.jpg",
                          record[f"caption_{side}"]] for record in chosen)
    path = Path(root) / "split-coco-cfs" / "test-coco-cfs.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue(), encoding="utf-8")
    return {}

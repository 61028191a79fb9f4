"""Stand-in SVO-Probes: `svo_probes.csv` in the official columns and downloaded images `images/<id>.jpg`.

Rows cycle through the subject, verb and object negatives (one flag true each, written `True` / `False` as
pandas writes booleans). Some downloads are missing on purpose, as many of the real links are dead: the negative
image of every `missing_every`-th row is not written, so those rows are unscorable.
"""
from __future__ import annotations

import csv
from pathlib import Path

from evaluation.benchmarks.svo_probes import ANNOTATION_FILE, COLUMNS, NEGATIVE_TYPES
from testkit.standin.images import encoded_pool

SUBJECTS = ("man", "woman", "child", "dog", "girl", "boy")
VERBS = ("ride", "kick", "hold", "throw", "catch", "eat", "push", "carry")
THIRD_PERSON = dict(zip(VERBS, ("rides", "kicks", "holds", "throws", "catches", "eats", "pushes", "carries")))
OBJECTS = ("ball", "bike", "horse", "apple", "cart", "box", "kite")
FIRST_ID = 20000  # image ids are plain integers


def _triplets(index: int, negative: str) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    """The sentence's triplet and the negative image's, differing in the part `negative` names."""
    subject, verb, obj = SUBJECTS[index % 6], VERBS[(index // 6) % 8], OBJECTS[(index // 48) % 7]
    positive = (subject, verb, obj)
    part = NEGATIVE_TYPES.index(negative)
    choices = (SUBJECTS, VERBS, OBJECTS)[part]
    swapped = list(positive)
    swapped[part] = choices[(choices.index(positive[part]) + 1) % len(choices)]
    return positive, (swapped[0], swapped[1], swapped[2])


def write_svo_probes(root: Path, n_items: int = 20, seed: int = 0, missing_every: int = 7) -> dict:
    """`n_items` rows; rows k with k % missing_every == missing_every - 1 lack their negative image
    (`missing_every=0`: every image present)."""
    root, pool = Path(root), encoded_pool(seed, ".jpg")
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(n_items):
        negative = NEGATIVE_TYPES[index % 3]
        positive, contrast = _triplets(index, negative)
        pos_id, neg_id = FIRST_ID + 2 * index, FIRST_ID + 2 * index + 1
        (images / f"{pos_id}.jpg").write_bytes(pool[(2 * index) % len(pool)])
        if not (missing_every and index % missing_every == missing_every - 1):
            (images / f"{neg_id}.jpg").write_bytes(pool[(2 * index + 1) % len(pool)])
        rows.append({"sentence": f"A {positive[0]} {THIRD_PERSON[positive[1]]} a {positive[2]}.",
                     "pos_triplet": ",".join(positive), "neg_triplet": ",".join(contrast),
                     "pos_url": f"https://images.example.org/{pos_id}.jpg",
                     "neg_url": f"https://images.example.org/{neg_id}.jpg",
                     "pos_image_id": pos_id, "neg_image_id": neg_id,
                     **{name: str(name == negative) for name in NEGATIVE_TYPES}})
    with open(root / ANNOTATION_FILE, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return {"images": str(images)}

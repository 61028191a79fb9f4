"""Stand-in SPEC: the six subset folders of the extracted `data.zip`, each with `image2text.json`,
`text2image.json` and small generated JPEGs under `images/`.

Records are `{"query", "keys", "label"}` as the official files are; image paths are relative to the subset
folder. The candidate counts per subset (3 sizes, 9 grid cells, 4 relations, 2 existence options, 9 counts)
are our choice for the stand-in. Labels cycle over the candidates, so the gold is not always first.
"""
from __future__ import annotations

import json
from pathlib import Path

from evaluation.benchmarks.spec import ANNOTATION_FILES, DIRECTIONS, SUBSETS
from testkit.standin.images import encoded_pool

NOUNS = ("dog", "cat", "apple", "chair", "kite", "clock", "bus", "vase", "horse", "cup", "boat", "lamp")
CANDIDATES = {
    "absolute_size": ("a small {noun}", "a medium-sized {noun}", "a large {noun}"),
    "relative_size": ("the {noun} is smaller than the box", "the {noun} is as big as the box",
                      "the {noun} is bigger than the box"),
    "absolute_spatial": tuple(f"a {{noun}} in the {row} {column} of the image" for row in ("top", "middle", "bottom")
                              for column in ("left", "centre", "right")),
    "relative_spatial": ("the {noun} is left of the box", "the {noun} is right of the box",
                         "the {noun} is above the box", "the {noun} is below the box"),
    "existence": ("there is a {noun} and a box", "there is only a box"),
    "count": tuple(f"{count} {{noun}}s" for count in ("one", "two", "three", "four", "five", "six", "seven", "eight",
                                                       "nine")),
}
POOL = 12  # distinct encoded images, more than the largest candidate set


def _counts(n_items: int) -> dict[tuple[str, str], int]:
    """`n_items` records spread over the 12 files, at least one each."""
    files = [(subset, direction) for subset in SUBSETS for direction in DIRECTIONS]
    total = max(n_items, len(files))
    return {key: total // len(files) + (position < total % len(files)) for position, key in enumerate(files)}


def _texts(subset: str, index: int) -> list[str]:
    noun = NOUNS[index % len(NOUNS)]
    return [template.format(noun=noun) for template in CANDIDATES[subset]]


def write_spec(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """The six subset folders directly under `root` (the authors' layout), `n_items` records in all."""
    root, pool = Path(root), encoded_pool(seed, ".jpg", count=POOL)
    written: set[Path] = set()

    def image(subset: str, number: int) -> str:
        relative = f"images/{subset}_{number:05d}.jpg"
        path = root / subset / relative
        if path not in written:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(pool[number % POOL])
            written.add(path)
        return relative

    for (subset, direction), count in _counts(n_items).items():
        records = []
        for index in range(count):
            texts = _texts(subset, index)
            label = index % len(texts)
            if direction == "i2t":
                records.append({"query": image(subset, index), "keys": texts, "label": label})
            else:
                keys = [image(subset, index * len(texts) + k) for k in range(len(texts))]
                records.append({"query": texts[label], "keys": keys, "label": label})
        path = root / subset / ANNOTATION_FILES[direction]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(records, indent=1))
    return {}

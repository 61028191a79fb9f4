"""Stand-in files for ColorSwap's test split: the hub's parquet (`data/test-00000-of-00001.parquet`, images
embedded) or the authors' archive layout (`data/test.json` + `data/images/img_<id>_<k>.png`); same records.

Captions swap two colour words between two objects; ids skip numbers, as the release's test ids do (its 300 test
items are a subset of ids 0-999). Captions repeat across items, which the scorers handle.
"""
from __future__ import annotations

import json
from pathlib import Path

from testkit.standin.images import encoded_pool
from testkit.standin.two_by_two import COLOURS, NOUNS, _image_struct, _write_parquet, pool_index

FEATURES = {"id": "int64", "image_1": "Image", "image_2": "Image", "caption_1": "string", "caption_2": "string",
            "image_source": "string", "caption_source": "string"}
IMAGE_SOURCES = ("midjourney", "dalle3", "stable_diffusion")
CAPTION_SOURCES = ("human", "gpt4")


def colour_swapped_captions(index: int) -> tuple[str, str]:
    """"a <c1> <n1> next to a <c2> <n2>" and the same with the two colours swapped (c1 != c2)."""
    first, second = NOUNS[index % len(NOUNS)], NOUNS[(index + 1) % len(NOUNS)]
    offset = 1 + (index // len(COLOURS)) % (len(COLOURS) - 1)
    c1, c2 = COLOURS[index % len(COLOURS)], COLOURS[(index + offset) % len(COLOURS)]
    return f"a {c1} {first} next to a {c2} {second}", f"a {c2} {first} next to a {c1} {second}"


def _record(index: int) -> dict:
    caption_1, caption_2 = colour_swapped_captions(index)
    item_id = 3 * index + 1
    return {"id": item_id, "caption_1": caption_1, "caption_2": caption_2,
            "image_1": f"images/img_{item_id}_1.png", "image_2": f"images/img_{item_id}_2.png",
            "image_source": IMAGE_SOURCES[index % len(IMAGE_SOURCES)],
            "caption_source": CAPTION_SOURCES[index % len(CAPTION_SOURCES)]}


def write_colorswap(root: Path, n_items: int = 20, seed: int = 0, layout: str = "parquet") -> dict:
    """The test split in the hub's parquet layout (default) or the archive's JSON layout."""
    if layout not in ("parquet", "json"):
        raise ValueError(f"layout must be 'parquet' or 'json', got {layout!r}")
    root, pool = Path(root), encoded_pool(seed, ".png")
    records = [_record(index) for index in range(n_items)]
    image_bytes = {(r["id"], k): pool[pool_index(index, k - 1, len(pool))]
                   for index, r in enumerate(records) for k in (1, 2)}
    if layout == "parquet":
        columns = {name: [r[name] for r in records] for name in FEATURES}
        for k in (1, 2):
            columns[f"image_{k}"] = [_image_struct(image_bytes[r["id"], k], Path(r[f"image_{k}"]).name)
                                     for r in records]
        _write_parquet(root / "data" / "test-00000-of-00001.parquet", columns, FEATURES)
        return {"layout": "parquet"}
    (root / "data" / "images").mkdir(parents=True, exist_ok=True)
    for r in records:
        for k in (1, 2):
            (root / "data" / r[f"image_{k}"]).write_bytes(image_bytes[r["id"], k])
    (root / "data" / "test.json").write_text(json.dumps(records, indent=4))
    return {"layout": "json"}

"""Stand-in EqBen files in the authors' formats (`Wangt-CN/EqBen`), with generated images.

Item i belongs to source `SOURCES[i % 7]`; its captions are the swapped pair `swapped_captions(i)`, its two images
two of a per-source pool of `POOL` files (`<source>/<folder>/<frame>.png`, YouCook2 frames as `.npy` arrays in BGR
order, as the release stores them). Three layouts:
- "full": the shuffled single-pair annotation `ann_json_finegrained_random.json` (`{"image", "caption"}`), with
  `src_file/private_random_idx.json` and `src_file/private_info.json` as the scoring server reads them (records in
  source blocks, `sample_cnt` counting items over all sources, pair j described by record `idx[j]`);
- "global": the same pairs carrying their record inline as `private_info` (`private_info_global.json`);
- "subset": the 10 % subset's `eqben_subset_10percent_final.json`, `{"image0", "image1", "caption0", "caption1"}`
  records in a shuffled order, images under `image_subset/`.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from evaluation.benchmarks.eqben import (FULL_ANNOTATIONS, NPY_SOURCE, PAIRS, PRIVATE_INDEX, PRIVATE_INFO, SOURCES,
                                         SUBSET_ANNOTATIONS)
from parsers.images import read_rgb_bytes
from testkit.standin.images import encoded_pool
from testkit.standin.two_by_two import swapped_captions

POOL = 6
GLOBAL_ANNOTATIONS = "private_info_global.json"


def image_name(source: str, k: int) -> str:
    """The path of pooled image `k` of a source, relative to the image folder."""
    return f"{source}/clip_{k // 2:03d}/frame_{k:05d}.{'npy' if source == NPY_SOURCE else 'png'}"


def _write_images(folder: Path, seed: int) -> None:
    pool = encoded_pool(seed, ".png", count=POOL)
    for source in SOURCES:
        for k in range(POOL):
            path = folder / image_name(source, k)
            path.parent.mkdir(parents=True, exist_ok=True)
            data = pool[(k + SOURCES.index(source)) % POOL]
            if source == NPY_SOURCE:
                rgb = np.asarray(read_rgb_bytes(data))
                np.save(path, np.ascontiguousarray(rgb[:, :, ::-1]))  # stored BGR
            else:
                path.write_bytes(data)


def _items(n_items: int) -> list[dict]:
    """Per item: source, images, captions, in item order."""
    items = []
    for index in range(n_items):
        source = SOURCES[index % len(SOURCES)]
        first = (2 * (index // len(SOURCES))) % POOL
        items.append({"source": source, "images": (image_name(source, first), image_name(source, first + 1)),
                      "captions": swapped_captions(index)})
    return items


def _pairs(items: list[dict]) -> tuple[list[dict], list[dict]]:
    """The four pairs of every item, and their private records, with items in source blocks (the server's order)."""
    ordered = [item for source in SOURCES for item in items if item["source"] == source]
    pairs, infos = [], []
    for count, item in enumerate(ordered):
        for name, (image, caption) in PAIRS.items():
            pairs.append({"image": item["images"][image], "caption": item["captions"][caption]})
            infos.append({"dataset": item["source"], "name": name, "sample_cnt": count})
    return pairs, infos


def write_eqben(root: Path, n_items: int = 20, seed: int = 0, layout: str = "full") -> dict:
    """EqBen's files under `root` in the given layout; returns the loader's options."""
    if layout not in ("full", "global", "subset"):
        raise ValueError(f"layout must be 'full', 'global' or 'subset', got {layout!r}")
    root, rng = Path(root), random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    items = _items(n_items)
    if layout == "subset":
        _write_images(root / "image_subset", seed)
        rng.shuffle(items)
        records = [{"image0": i["images"][0], "image1": i["images"][1], "caption0": i["captions"][0],
                    "caption1": i["captions"][1]} for i in items]
        (root / SUBSET_ANNOTATIONS).write_text(json.dumps(records))
        return {"subset": True}
    _write_images(root / "image", seed)
    pairs, infos = _pairs(items)
    order = list(range(len(pairs)))
    rng.shuffle(order)  # order[j]: the record shown as pair j
    shuffled = [pairs[k] for k in order]
    if layout == "global":
        inline = [{**pair, "private_info": infos[k]} for pair, k in zip(shuffled, order)]
        (root / GLOBAL_ANNOTATIONS).write_text(json.dumps(inline))
        return {"annotations": GLOBAL_ANNOTATIONS}
    (root / FULL_ANNOTATIONS).write_text(json.dumps(shuffled))
    (root / PRIVATE_INDEX).parent.mkdir(parents=True, exist_ok=True)
    (root / PRIVATE_INDEX).write_text(json.dumps(order))
    (root / PRIVATE_INFO).write_text(json.dumps(infos))
    return {}

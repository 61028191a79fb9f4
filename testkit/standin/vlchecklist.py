"""Stand-in VL-CheckList checkout: `corpus/v1/.../<source>.yaml` files, TUPLE_JSON annotations and images.

The YAMLs carry the official `ANNO_PATH` / `IMG_ROOT` values (relative `vg/`, `hake/`, `swig/`; `vg` for VAW)
and the images go to a folder outside the checkout, returned as the `images` option. Two sources exercise the
sampling rule: `Attribute/color/vaw` names a missing image in every third entry (index 1, 4, 7, ...), and
`Relation/spatial/vg` holds `max(2 * n_items, 1000 + n_items)` entries, more than the default cap of 1,000.
Object negatives start with a space, like the official " customers".
"""
from __future__ import annotations

import json
from pathlib import Path

from evaluation.benchmarks.vlchecklist import CORPUS, MAX_ITEMS, TAXONOMY
from testkit.standin.images import write_image

POOL = 8
MISSING_SOURCE = "Attribute/color/vaw"
BIG_SOURCE = "Relation/spatial/vg"
MISSING_EVERY = 3
# IMG_ROOT -> image names relative to it, in the style of the official files (index -> relative path).
IMAGE_NAMES = {
    "vg/": lambda i: f"VG_100K{'_2' if i % 2 else ''}/{2361911 + i}.jpg",
    "vg": lambda i: f"VG_100K/{2317897 + i}.jpg",
    "hake/": lambda i: f"openimages/{i:016x}.jpg",
    "swig/": lambda i: f"calling_{i}.jpg",
}


def write_vl_checklist(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """Writes the 56 YAMLs, their annotation files and a pool of images; returns the `images` option."""
    root = Path(root)
    image_root = root.parent / f"{root.name}_images"
    for subtype, names in TAXONOMY.items():
        for name in names:
            anno_path, img_root = official_paths(subtype, name)
            (root / CORPUS / subtype).mkdir(parents=True, exist_ok=True)
            (root / CORPUS / subtype / f"{name}.yaml").write_text(
                f'ANNO_PATH: "{anno_path}"\nIMG_ROOT: "{img_root}"\nTYPE: "TUPLE_JSON"\n')
            entries = _entries(f"{subtype}/{name}", img_root, _count(f"{subtype}/{name}", n_items))
            (root / anno_path).parent.mkdir(parents=True, exist_ok=True)
            (root / anno_path).write_text(json.dumps(entries))
    for img_root, name in IMAGE_NAMES.items():
        for i in range(POOL):
            if not (image_root / img_root / name(i)).exists():
                write_image(image_root / img_root / name(i), seed=seed * 1000 + i)
    return {"images": str(image_root)}


def official_paths(subtype: str, name: str) -> tuple[str, str]:
    """`(ANNO_PATH, IMG_ROOT)` as the official `corpus/v1` YAML of this (type, source) has them."""
    img_root = {"hake": "hake/", "vaw": "vg", "swig": "swig/"}.get(name.split("_")[0], "vg/")
    if subtype.startswith("Object/"):
        _, kind, value = subtype.split("/")  # Location/center, Size/large
        folder = f"data/Object/{kind}/{name.split('_')[0]}_{kind.lower()}"
        if name.startswith("swig_"):
            return f"{folder}/{name}/{name}_{value}.json", img_root
        return f"{folder}/{'hake_obj' if name == 'hake' else name}_{value}.json", img_root
    if subtype.startswith("Attribute/"):
        return f"data/Attribute/{name}/{subtype.split('/')[1]}.json", img_root
    if name in ("hake", "swig"):
        return f"data/Relation/{name}_action.json", img_root
    return f"data/Relation/vg/{subtype.split('/')[1]}.json", img_root


def _count(key: str, n_items: int) -> int:
    return max(2 * n_items, MAX_ITEMS + n_items) if key == BIG_SOURCE else n_items


def _entries(key: str, img_root: str, count: int) -> list[list]:
    """TUPLE_JSON entries; in the missing-image source every third one names an image that is never written."""
    leading = " " if key.startswith("Object/") else ""
    entries: list[list] = []
    for i in range(count):
        image = IMAGE_NAMES[img_root](i % POOL)
        if key == MISSING_SOURCE and i % MISSING_EVERY == 1:
            image = f"VG_100K/missing_{i}.jpg"
        texts: dict[str, list] = {"POS": [f"{key} positive {i}", f"{key} other positive {i}"],
                                  "NEG": [f"{leading}{key} negative {i}"]}
        entries.append([image, texts])
    return entries

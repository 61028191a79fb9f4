"""Stand-in files for the 2x2 family: Winoground, BiVLC, BiSCoR-Ctrl and the shapes-world swap set.

Parquet stand-ins are written with pyarrow, images embedded as PNG bytes in Hugging Face image structs
`{"bytes", "path"}` (plus the `huggingface` schema metadata that `datasets` writes). A few encoded images
are reused across items (never the same one for both images of an item), so thousands of items are
written quickly. Captions are unique per item up to a few thousand items.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

from testkit.standin.images import encoded_pool

NOUNS = ("dog", "cat", "child", "adult", "cup", "plate", "horse", "bird", "tree", "car", "boat", "chair")
RELATIONS = ("left of", "right of", "above", "below", "behind", "in front of", "next to", "on")
COLOURS = ("red", "green", "blue", "yellow", "purple", "black")
WINOGROUND_TAGS = (("Noun", "Object", 1), ("Adjective-Color", "Object", 1), ("Verb", "Relation", 1),
                   ("Preposition", "Relation", 2), ("Scope, Preposition", "Both", 2))
BIVLC_TYPES = (("replace", "obj"), ("replace", "att"), ("replace", "rel"), ("swap", "obj"), ("swap", "att"),
               ("add", "obj"), ("add", "att"))
BISCOR_CATEGORIES = ("Color", "Material", "Size", "Quantity")


def swapped_captions(index: int) -> tuple[str, str]:
    """Two captions with the same words, the nouns swapped; distinct for the first ~3,000 indices."""
    pairs = list(itertools.combinations(NOUNS, 2))
    first, second = pairs[index % len(pairs)]
    relation = RELATIONS[(index // len(pairs)) % len(RELATIONS)]
    colour = COLOURS[(index // (len(pairs) * len(RELATIONS))) % len(COLOURS)]
    return f"a {colour} {first} {relation} a {second}", f"a {colour} {second} {relation} a {first}"


def pool_index(index: int, which: int, pool_size: int) -> int:
    """The pooled image of image `which` (0 or 1) of item `index`; the two of an item always differ."""
    return (2 * index + which) % pool_size


def _image_struct(data: bytes, name: str | None) -> dict:
    return {"bytes": data, "path": name}


def _write_parquet(path: Path, columns: dict, features: dict) -> None:
    """A parquet file as `datasets` writes it; `features` maps a column to "Image", "string" or "int64"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = {"Image": pa.struct([("bytes", pa.binary()), ("path", pa.string())]), "string": pa.string(),
             "int64": pa.int64()}
    hf_features = {name: {"_type": "Image"} if kind == "Image" else {"dtype": kind, "_type": "Value"}
                   for name, kind in features.items()}
    schema = pa.schema([pa.field(name, types[kind]) for name, kind in features.items()],
                       metadata={"huggingface": json.dumps({"info": {"features": hf_features}})})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)


# ---------------------------------------------------------------- Winoground

WINOGROUND_FEATURES = {"id": "int64", "image_0": "Image", "image_1": "Image", "caption_0": "string",
                       "caption_1": "string", "tag": "string", "secondary_tag": "string", "num_main_preds": "int64",
                       "collapsed_tag": "string"}


def _winoground_record(index: int) -> dict:
    caption_0, caption_1 = swapped_captions(index)
    tag, collapsed, preds = WINOGROUND_TAGS[index % len(WINOGROUND_TAGS)]
    return {"id": index, "image_0": f"ex_{index}_img_0", "image_1": f"ex_{index}_img_1", "caption_0": caption_0,
            "caption_1": caption_1, "tag": tag, "secondary_tag": "Symbolic" if index % 7 == 3 else "",
            "num_main_preds": preds, "collapsed_tag": collapsed}


def write_winoground(root: Path, n_items: int = 20, seed: int = 0, layout: str = "jsonl") -> dict:
    """`data/examples.jsonl` + `data/images/ex_<id>_img_<k>.png` (layout "jsonl"), or the parquet
    `data/test-00000-of-00001.parquet` with embedded images (layout "parquet"); same items either way."""
    root, pool = Path(root), encoded_pool(seed, ".png")
    records = [_winoground_record(index) for index in range(n_items)]
    image_bytes = {(r["id"], k): pool[pool_index(r["id"], k, len(pool))] for r in records for k in (0, 1)}
    if layout == "parquet":
        columns = {name: [r[name] for r in records] for name in WINOGROUND_FEATURES}
        for k in (0, 1):
            columns[f"image_{k}"] = [_image_struct(image_bytes[r["id"], k], f"{r[f'image_{k}']}.png") for r in records]
        _write_parquet(root / "data" / "test-00000-of-00001.parquet", columns, WINOGROUND_FEATURES)
        return {"source": "parquet"}
    if layout != "jsonl":
        raise ValueError(f"layout must be 'jsonl' or 'parquet', got {layout!r}")
    images = root / "data" / "images"
    images.mkdir(parents=True, exist_ok=True)
    for r in records:
        for k in (0, 1):
            (images / f"{r[f'image_{k}']}.png").write_bytes(image_bytes[r["id"], k])
    (root / "data" / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"source": "jsonl", "images": str(images)}


# ---------------------------------------------------------------- BiVLC

BIVLC_FEATURES = {"image": "Image", "caption": "string", "negative_caption": "string", "negative_image": "Image",
                  "type": "string", "subtype": "string"}


def write_bivlc(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`data/test-0000k-of-00002.parquet`: the rows split over two shards, as the current release is."""
    root, pool = Path(root), encoded_pool(seed, ".png")
    half = (n_items + 1) // 2
    for shard, rows in enumerate((range(half), range(half, n_items))):
        columns: dict[str, list] = {name: [] for name in BIVLC_FEATURES}
        for index in rows:
            caption, negative = swapped_captions(index)
            kind, subtype = BIVLC_TYPES[index % len(BIVLC_TYPES)]
            row = {"image": _image_struct(pool[pool_index(index, 0, len(pool))], f"{index:012d}.jpg"),
                   "caption": caption, "negative_caption": negative, "type": kind, "subtype": subtype,
                   "negative_image": _image_struct(pool[pool_index(index, 1, len(pool))], None)}
            for name, value in row.items():
                columns[name].append(value)
        _write_parquet(root / "data" / f"test-{shard:05d}-of-00002.parquet", columns, BIVLC_FEATURES)
    return {}


# ---------------------------------------------------------------- BiSCoR-Ctrl

def write_biscor_ctrl(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`biscor_ctrl.jsonl` (our assumed format; the data is unreleased) and pooled PNGs in `images/`."""
    root, pool = Path(root), encoded_pool(seed, ".png")
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    for k, data in enumerate(pool):
        (images / f"scene_{k:05d}.png").write_bytes(data)
    lines = []
    for index in range(n_items):
        caption_0, caption_1 = swapped_captions(index)
        lines.append(json.dumps({"id": f"ctrl-{index}", "image_0": f"scene_{pool_index(index, 0, len(pool)):05d}.png",
                                 "image_1": f"scene_{pool_index(index, 1, len(pool)):05d}.png",
                                 "caption_0": caption_0, "caption_1": caption_1,
                                 "category": BISCOR_CATEGORIES[index % len(BISCOR_CATEGORIES)]}))
    (root / "biscor_ctrl.jsonl").write_text("".join(line + "\n" for line in lines))
    return {"annotations": "biscor_ctrl.jsonl", "images": str(images)}


# ---------------------------------------------------------------- shapes world

def write_shapes_swap(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """The shapes world's own swap split (`annotations/swap_val.json` + images) from its generator."""
    from datamodules.shapes import write_swap_split

    (Path(root) / "annotations").mkdir(parents=True, exist_ok=True)
    write_swap_split(Path(root), "val", n_items, image_size=32, seed=seed)
    return {"split": "val"}

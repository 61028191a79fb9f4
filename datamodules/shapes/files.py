"""The files of a shapes world: one split's images, COCO captions, scene graphs and swap set; `generate`; readers."""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path
from typing import Any

from datamodules.files import atomic_write_bytes
from datamodules.shapes.records import caption_to_dict, scene_to_dict
from datamodules.shapes.render import caption_phrases, draw_scene
from datamodules.shapes.scenes import sample_example
from datamodules.shapes.swap import sample_swap_pair
from datamodules.shapes.world import MIN_IMAGE_SIZE, SPLITS, SWAP_TYPES, ImageExample, Scene, scene_relations

def _write_json(path: Path, payload: dict[str, Any]) -> None:
    atomic_write_bytes(path, json.dumps(payload, sort_keys=True).encode("utf-8"))


def _write_png(path: Path, scene: Scene) -> None:
    buffer = io.BytesIO()
    draw_scene(scene).save(buffer, format="PNG")
    atomic_write_bytes(path, buffer.getvalue())


def _split_rng(seed: int, split: str, stream: str) -> random.Random:
    # A string seed is hashed with SHA-512, so it is stable across runs and Python processes.
    return random.Random(f"shapes:{seed}:{split}:{stream}")


def _image_file_name(image_id: int) -> str:
    return f"{image_id:012d}.png"


def _caption_id(example: ImageExample, index: int) -> int:
    return (example.image_id - 1) * len(example.captions) + index + 1


def _coco_captions(split: str, seed: int, image_size: int, examples: list[ImageExample]) -> dict[str, Any]:
    info = {
        "description": "shapes world synthetic captions",
        "version": "1.0",
        "split": split,
        "seed": seed,
        "image_size": image_size,
    }
    images = [
        {"id": ex.image_id, "file_name": _image_file_name(ex.image_id), "width": image_size,
         "height": image_size}
        for ex in examples
    ]
    annotations = [
        {"id": _caption_id(ex, index), "image_id": ex.image_id, "caption": caption.text,
         "neg_captions": [negative.text for negative in ex.negatives[index]]}
        for ex in examples
        for index, caption in enumerate(ex.captions)
    ]
    return {"info": info, "images": images, "annotations": annotations}


def _scene_graph_record(example: ImageExample) -> dict[str, Any]:
    relations = [
        {"subject": subject.id, "predicate": relation, "object": obj.id}
        for subject, relation, obj in scene_relations(example.scene)
    ]
    captions = [
        {"caption_id": _caption_id(example, index), "caption": caption.text,
         "structure": caption_to_dict(caption),
         "neg_structures": [caption_to_dict(negative) for negative in example.negatives[index]],
         "phrases": caption_phrases(example.scene, caption)}
        for index, caption in enumerate(example.captions)
    ]
    record = {"image_id": example.image_id, "file_name": _image_file_name(example.image_id)}
    return {**record, **scene_to_dict(example.scene), "relations": relations, "captions": captions}


def write_caption_split(root: Path, split: str, n_images: int, image_size: int, seed: int,
                        captions_per_image: int) -> None:
    """Write one split's images, COCO captions and scene graphs.

    Args:
        root: Dataset directory.
        split: "train" or "val".
        n_images: Number of images.
        image_size: Image side in pixels.
        seed: Base seed.
        captions_per_image: Captions per image.
    """
    rng = _split_rng(seed, split, "captions")
    image_dir = root / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    examples = []
    for image_id in range(1, n_images + 1):
        example = sample_example(rng, image_id, image_size, captions_per_image)
        _write_png(image_dir / _image_file_name(image_id), example.scene)
        examples.append(example)
    # Annotations are written after the images, so their presence means the split is complete.
    annotation_dir = root / "annotations"
    _write_json(annotation_dir / f"captions_{split}.json", _coco_captions(split, seed, image_size, examples))
    scene_graphs = {"images": [_scene_graph_record(example) for example in examples]}
    _write_json(annotation_dir / f"scene_graphs_{split}.json", scene_graphs)


def _swap_item(
    root: Path, split: str, item_id: int, swap_type: str, rng: random.Random, image_size: int
) -> dict[str, Any]:
    scenes, captions = sample_swap_pair(rng, image_size, swap_type)
    image_paths = [f"images/swap_{split}/{item_id:06d}_{index}.png" for index in (0, 1)]
    for path, scene in zip(image_paths, scenes):
        _write_png(root / path, scene)
    return {
        "id": item_id,
        "type": swap_type,
        "images": image_paths,
        "captions": [caption.text for caption in captions],
        "structures": [caption_to_dict(caption) for caption in captions],
        "scenes": [scene_to_dict(scene) for scene in scenes],
    }


def write_swap_split(root: Path, split: str, n_items: int, image_size: int, seed: int) -> None:
    """Write one split's swap benchmark: image pairs and `annotations/swap_<split>.json`.

    Args:
        root: Dataset directory.
        split: "train" or "val".
        n_items: Number of items; types go round robin so they stay balanced.
        image_size: Image side in pixels.
        seed: Base seed.
    """
    rng = _split_rng(seed, split, "swap")
    (root / "images" / f"swap_{split}").mkdir(parents=True, exist_ok=True)
    items = [
        _swap_item(root, split, item_id, SWAP_TYPES[(item_id - 1) % len(SWAP_TYPES)], rng, image_size)
        for item_id in range(1, n_items + 1)
    ]
    _write_json(root / "annotations" / f"swap_{split}.json", {"items": items})


def default_n_swap(split: str, n_train: int, n_val: int) -> int:
    """Swap items per split when not given: n_val for val, a tenth of n_train (at least 1) for train."""
    return n_val if split == "val" else max(1, n_train // 10)


def _check_arguments(
    n_train: int, n_val: int, image_size: int, captions_per_image: int, n_swap: int | None
) -> None:
    if min(n_train, n_val) < 0 or (n_swap is not None and n_swap < 0):
        raise ValueError("n_train, n_val and n_swap must be non-negative")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be at least {MIN_IMAGE_SIZE}, got {image_size}")
    if captions_per_image < 1:
        raise ValueError(f"captions_per_image must be at least 1, got {captions_per_image}")


def generate(out_dir: str | os.PathLike, n_train: int, n_val: int, image_size: int = 64, seed: int = 0,
             captions_per_image: int = 2, n_swap: int | None = None) -> dict[str, dict[str, int]]:
    """Generate the shapes world under `out_dir`; the same arguments give byte-identical files.

    Args:
        out_dir: Dataset directory (created if missing).
        n_train: Number of training images.
        n_val: Number of validation images.
        image_size: Image side in pixels (at least `MIN_IMAGE_SIZE`).
        seed: Base seed.
        captions_per_image: Different captions per image.
        n_swap: Swap items per split; default `default_n_swap`.

    Returns:
        Counts per split: {"train": {"images", "captions", "swap_items"}, "val": {...}}.

    Raises:
        ValueError: On a negative count, too small an image or fewer than one caption per image.
    """
    _check_arguments(n_train, n_val, image_size, captions_per_image, n_swap)
    root = Path(out_dir)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, n_images in zip(SPLITS, (n_train, n_val)):
        n_items = default_n_swap(split, n_train, n_val) if n_swap is None else n_swap
        write_caption_split(root, split, n_images, image_size, seed, captions_per_image)
        write_swap_split(root, split, n_items, image_size, seed)
        counts[split] = {"images": n_images, "captions": n_images * captions_per_image, "swap_items": n_items}
    return counts


def load_scene_graphs(root: str | os.PathLike, split: str) -> list[dict[str, Any]]:
    """Read `annotations/scene_graphs_<split>.json`.

    Args:
        root: Dataset directory.
        split: "train" or "val".

    Returns:
        One record per image (see the module's writer for the keys); `scene_from_dict` and
        `caption_from_dict` turn its parts back into structured data.
    """
    path = Path(root) / "annotations" / f"scene_graphs_{split}.json"
    return json.loads(path.read_text(encoding="utf-8"))["images"]


def load_swap_items(root: str | os.PathLike, split: str) -> list[dict[str, Any]]:
    """Read `annotations/swap_<split>.json` with image paths made absolute.

    Args:
        root: Dataset directory.
        split: "train" or "val".

    Returns:
        The swap items; "images" holds two absolute paths.
    """
    root = Path(root).resolve()
    items = json.loads((root / "annotations" / f"swap_{split}.json").read_text(encoding="utf-8"))["items"]
    return [{**item, "images": [str(root / path) for path in item["images"]]} for item in items]

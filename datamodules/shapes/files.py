"""The files of a shapes world: one split's images, COCO captions, scene graphs and swap set; `generate`; readers.

A world holds, per split of `SPLITS`, `images/<split>/`, `annotations/captions_<split>.json` (COCO format, three
hard negatives per caption in "neg_captions"), `annotations/scene_graphs_<split>.json`, `images/swap_<split>/` and
`annotations/swap_<split>.json`; and `annotations/heldout.json`, the held-out combinations and colour pairs
(`datamodules.shapes.heldout`), written last, so its presence means the world is complete.
"""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path
from typing import Any

from core.files import atomic_write_bytes
from datamodules.shapes.heldout import (HeldOut, SplitRule, choose_heldout, heldout_from_dict, heldout_to_dict,
                                        split_rule)
from datamodules.shapes.records import caption_to_dict, scene_to_dict
from datamodules.shapes.render import caption_phrases, draw_scene
from datamodules.shapes.scenes import sample_example
from datamodules.shapes.swap import sample_swap_pair
from datamodules.shapes.world import (CAPTION_RELATIONS, DEFAULT_CAPTION_RELATIONS, MIN_IMAGE_SIZE, SWAP_TYPES,
                                      UNSEEN_SPLIT, ImageExample, Scene, scene_relations)

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


def _coco_captions(split: str, seed: int, image_size: int, relations: str, examples: list[ImageExample]
                   ) -> dict[str, Any]:
    info = {
        "description": "shapes world synthetic captions",
        "version": "1.0",
        "split": split,
        "seed": seed,
        "image_size": image_size,
        "relations": relations,
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
                        captions_per_image: int, relations: str = DEFAULT_CAPTION_RELATIONS) -> None:
    """Write one split's images, COCO captions and scene graphs.

    Args:
        root: Dataset directory.
        split: One of `SPLITS`; its rule about held-out combinations comes from `split_rule(seed, split)`.
        n_images: Number of images.
        image_size: Image side in pixels.
        seed: Base seed.
        captions_per_image: Captions per image.
        relations: A key of `CAPTION_RELATIONS`: the relations captions and hard negatives state.
    """
    rule = split_rule(seed, split)
    rng = _split_rng(seed, split, "captions")
    image_dir = root / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    examples = []
    for image_id in range(1, n_images + 1):
        example = sample_example(rng, image_id, image_size, captions_per_image, rule, CAPTION_RELATIONS[relations])
        _write_png(image_dir / _image_file_name(image_id), example.scene)
        examples.append(example)
    # Annotations are written after the images, so their presence means the split is complete.
    annotation_dir = root / "annotations"
    _write_json(annotation_dir / f"captions_{split}.json", _coco_captions(split, seed, image_size, relations, examples))
    scene_graphs = {"images": [_scene_graph_record(example) for example in examples]}
    _write_json(annotation_dir / f"scene_graphs_{split}.json", scene_graphs)


def _swap_item(
    root: Path, split: str, item_id: int, swap_type: str, rng: random.Random, image_size: int, rule: SplitRule,
    relations: tuple[str, ...],
) -> dict[str, Any]:
    scenes, captions = sample_swap_pair(rng, image_size, swap_type, rule, relations)
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


def write_swap_split(root: Path, split: str, n_items: int, image_size: int, seed: int,
                     relations: str = DEFAULT_CAPTION_RELATIONS) -> None:
    """Write one split's swap benchmark: image pairs and `annotations/swap_<split>.json`.

    Args:
        root: Dataset directory.
        split: One of `SPLITS`; its rule about held-out combinations comes from `split_rule(seed, split)`.
        n_items: Number of items; types go round robin so they stay balanced.
        image_size: Image side in pixels.
        seed: Base seed.
        relations: A key of `CAPTION_RELATIONS`: the relations the captions state.
    """
    rule = split_rule(seed, split)
    rng = _split_rng(seed, split, "swap")
    (root / "images" / f"swap_{split}").mkdir(parents=True, exist_ok=True)
    items = [
        _swap_item(root, split, item_id, SWAP_TYPES[(item_id - 1) % len(SWAP_TYPES)], rng, image_size, rule,
                   CAPTION_RELATIONS[relations])
        for item_id in range(1, n_items + 1)
    ]
    _write_json(root / "annotations" / f"swap_{split}.json", {"items": items})


def default_n_swap(split: str, n_images: int) -> int:
    """Swap items of a split of `n_images` images when not given: a tenth (at least 1) for train, else as many."""
    return max(1, n_images // 10) if split == "train" else n_images


def _check_arguments(
    n_images: dict[str, int], image_size: int, captions_per_image: int, n_swap: int | None, relations: str
) -> None:
    if min(n_images.values()) < 0 or (n_swap is not None and n_swap < 0):
        raise ValueError("the numbers of images and n_swap must be non-negative")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be at least {MIN_IMAGE_SIZE}, got {image_size}")
    if captions_per_image < 1:
        raise ValueError(f"captions_per_image must be at least 1, got {captions_per_image}")
    if relations not in CAPTION_RELATIONS:
        raise ValueError(f"relations must be one of {sorted(CAPTION_RELATIONS)}, got {relations!r}")


def generate(out_dir: str | os.PathLike, n_train: int, n_val: int, image_size: int = 64, seed: int = 0,
             captions_per_image: int = 2, n_swap: int | None = None, n_test: int | None = None,
             n_test_unseen: int | None = None, relations: str = DEFAULT_CAPTION_RELATIONS
             ) -> dict[str, dict[str, int]]:
    """Generate the shapes world under `out_dir`; the same arguments give byte-identical files.

    Args:
        out_dir: Dataset directory (created if missing).
        n_train: Number of training images.
        n_val: Number of validation images (the split for all selection).
        image_size: Image side in pixels (at least `MIN_IMAGE_SIZE`).
        seed: Base seed; it also chooses the held-out combinations and colour pairs.
        captions_per_image: Different captions per image.
        n_swap: Swap items per split; default `default_n_swap`.
        n_test: Number of in-distribution test images; default `n_val`.
        n_test_unseen: Number of test images showing held-out combinations or pairs; default `n_val`.
        relations: A key of `CAPTION_RELATIONS`: "both" states a pair either way ("X left of Y", "Y right of X"),
            "one-way" only as "left of" and "above".

    Returns:
        Counts per split of `SPLITS`: {"train": {"images", "captions", "swap_items"}, "val": {...}, ...}.

    Raises:
        ValueError: On a negative count, too small an image, fewer than one caption per image or unknown
            relations.
    """
    n_images = {"train": n_train, "val": n_val, "test": n_val if n_test is None else n_test,
                UNSEEN_SPLIT: n_val if n_test_unseen is None else n_test_unseen}
    _check_arguments(n_images, image_size, captions_per_image, n_swap, relations)
    root = Path(out_dir)
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, n in n_images.items():
        n_items = default_n_swap(split, n) if n_swap is None else n_swap
        write_caption_split(root, split, n, image_size, seed, captions_per_image, relations)
        write_swap_split(root, split, n_items, image_size, seed, relations)
        counts[split] = {"images": n, "captions": n * captions_per_image, "swap_items": n_items}
    _write_json(root / "annotations" / "heldout.json", {"seed": seed, **heldout_to_dict(choose_heldout(seed))})
    return counts


def load_scene_graphs(root: str | os.PathLike, split: str) -> list[dict[str, Any]]:
    """Read `annotations/scene_graphs_<split>.json`.

    Args:
        root: Dataset directory.
        split: One of `SPLITS`.

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
        split: One of `SPLITS`.

    Returns:
        The swap items; "images" holds two absolute paths.
    """
    root = Path(root).resolve()
    items = json.loads((root / "annotations" / f"swap_{split}.json").read_text(encoding="utf-8"))["items"]
    return [{**item, "images": [str(root / path) for path in item["images"]]} for item in items]


def load_heldout(root: str | os.PathLike) -> HeldOut:
    """Read `annotations/heldout.json`: the combinations and colour pairs that only `test_unseen` shows.

    Args:
        root: Dataset directory.

    Returns:
        The held-out sets.
    """
    path = Path(root) / "annotations" / "heldout.json"
    return heldout_from_dict(json.loads(path.read_text(encoding="utf-8")))

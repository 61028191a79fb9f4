"""Stand-in COCO / Flickr30k Karpathy-test retrieval files in the three accepted annotation formats.

Each image gets 5 captions, the sixth image (index 5) a sixth one (COCO's test split has 25,010 captions
for 5,000 images). Caption `j` of image `i` reads `"<colour> scene <i> view <j>"` with stray surrounding
whitespace and punctuation on some, so a test can recover the image and check stripping. Two `train` images
precede the test images in the Karpathy file so the split filter is exercised. At most `DISTINCT_IMAGES`
image files are drawn; the rest are byte copies, so thousands of items are written quickly.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from testkit.standin.images import write_image

DISTINCT_IMAGES = 64
COLOURS = ("red", "green", "blue", "yellow", "purple", "black")
FORMATS = ("karpathy", "blip", "coco")
TRAIN_CAPTIONS = ["a train split caption"] * 5  # the two train images, which the test split must skip


def caption_text(image: int, caption: int, rng: random.Random) -> str:
    """The stand-in caption: image and caption numbers in words a test can parse back."""
    text = f"{rng.choice(COLOURS)} scene {image} view {caption}"
    return f"  {text.capitalize()}.\n" if caption == 0 else text


def write_coco_retrieval(root: Path, n_items: int = 20, seed: int = 0, annotation_format: str = "karpathy") -> dict:
    """`n_items` Karpathy-test images under `root/val2014` and captions in `annotation_format`.

    Returns the benchmark options (`images`, and `annotation_file` for the COCO-captions format).
    """
    root = Path(root)
    names = [f"COCO_val2014_{391895 + i:012d}.jpg" for i in range(n_items)]
    _write_images([root / "val2014" / name for name in names], seed)
    captions = _captions(n_items, seed)
    if annotation_format == "karpathy":
        train = [_karpathy_entry(k, f"COCO_train2014_{k + 9:012d}.jpg", "train2014", "train", TRAIN_CAPTIONS,
                                 cocoid=k + 9) for k in range(2)]
        entries = train + [_karpathy_entry(2 + i, name, "val2014", "test", caps, cocoid=391895 + i)
                           for i, (name, caps) in enumerate(zip(names, captions))]
        _write_json(root / "dataset_coco.json", {"images": entries, "dataset": "coco"})
    elif annotation_format == "blip":
        _write_json(root / "coco_karpathy_test.json",
                    [{"image": f"val2014/{name}", "caption": caps} for name, caps in zip(names, captions)])
    elif annotation_format == "coco":
        _write_coco_captions(root / "coco_test_karpathy.json", names, captions, first_id=391895)
        return {"images": str(root / "val2014"), "annotation_file": "coco_test_karpathy.json"}
    else:
        raise ValueError(f"annotation_format must be one of {FORMATS}, got {annotation_format!r}")
    return {"images": str(root)}


def write_flickr30k_retrieval(root: Path, n_items: int = 20, seed: int = 0,
                              annotation_format: str = "karpathy") -> dict:
    """`n_items` Karpathy-test images under `root/flickr30k-images` and captions in `annotation_format`."""
    root = Path(root)
    names = [f"{1000092795 + i}.jpg" for i in range(n_items)]
    images = root / "flickr30k-images"
    _write_images([images / name for name in names], seed)
    captions = _captions(n_items, seed)
    if annotation_format == "karpathy":
        train = [_karpathy_entry(k, f"{k + 10}.jpg", None, "train", TRAIN_CAPTIONS) for k in range(2)]
        entries = train + [_karpathy_entry(2 + i, name, None, "test", caps)
                           for i, (name, caps) in enumerate(zip(names, captions))]
        _write_json(root / "dataset_flickr30k.json", {"images": entries, "dataset": "flickr30k"})
        return {"images": str(images)}
    if annotation_format == "blip":
        _write_json(root / "flickr30k_test.json",
                    [{"image": f"flickr30k-images/{name}", "caption": caps} for name, caps in zip(names, captions)])
        return {"images": str(root)}
    if annotation_format == "coco":
        _write_coco_captions(root / "flickr30k_test_karpathy.json", names, captions, first_id=1)
        return {"images": str(images), "annotation_file": "flickr30k_test_karpathy.json"}
    raise ValueError(f"annotation_format must be one of {FORMATS}, got {annotation_format!r}")


def _captions(n_images: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [[caption_text(i, j, rng) for j in range(6 if i == 5 else 5)] for i in range(n_images)]


def _karpathy_entry(index: int, filename: str, filepath: str | None, split: str, captions: list[str],
                    cocoid: int | None = None) -> dict:
    sentids = list(range(index * 10, index * 10 + len(captions)))
    sentences = [{"tokens": text.lower().strip(" .\n").split(), "raw": text, "imgid": index, "sentid": sid}
                 for text, sid in zip(captions, sentids)]
    entry = {"sentids": sentids, "imgid": index, "sentences": sentences, "split": split, "filename": filename}
    if filepath is not None:  # COCO only, as upstream
        entry = {"filepath": filepath, **entry, "cocoid": cocoid}
    return entry


def _write_coco_captions(path: Path, names: list[str], captions: list[list[str]], first_id: int) -> None:
    images = [{"id": first_id + i, "file_name": name, "height": 40, "width": 48} for i, name in enumerate(names)]
    annotations = [{"image_id": first_id + i, "id": 10 * i + j, "caption": text}
                   for i, texts in enumerate(captions) for j, text in enumerate(texts)]
    _write_json(path, {"images": images, "annotations": annotations})


def _write_images(paths: list[Path], seed: int) -> None:
    for index, path in enumerate(paths):
        if index < DISTINCT_IMAGES:
            write_image(path, seed=seed * 100003 + index)
        else:
            shutil.copyfile(paths[index % DISTINCT_IMAGES], path)


def _write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))

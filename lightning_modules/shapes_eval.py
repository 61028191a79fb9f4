"""A small evaluator for the shapes world: 2x2 swap scores and retrieval R@1 of an exported model.

Scores are computed from per-item outcomes with a strict `>` (a tie is wrong). The evaluation issue's
harness generalises this to every benchmark; this module is what `make demo` prints.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

from datamodules.shapes import load_swap_items
from lightning_modules.export import load_export

SWAP_TYPES = ("attribute", "relation", "object")


@torch.no_grad()
def encode_texts(model: nn.Module, tokenizer: Callable, texts: Sequence[str], batch_size: int = 256) -> Tensor:
    """L2-normalised global text features [N, D], each unique text encoded once."""
    chunks = [model.encode_text(tokenizer(list(texts[i:i + batch_size])))
              for i in range(0, len(texts), batch_size)]
    return F.normalize(torch.cat(chunks).float(), dim=-1)


@torch.no_grad()
def encode_images(model: nn.Module, preprocess: Callable, paths: Sequence[Path], batch_size: int = 128) -> Tensor:
    """L2-normalised global image features [N, D]."""
    chunks = []
    for i in range(0, len(paths), batch_size):
        pixels = torch.stack([preprocess(_rgb(p)) for p in paths[i:i + batch_size]])
        chunks.append(model.encode_image(pixels))
    return F.normalize(torch.cat(chunks).float(), dim=-1)


def _rgb(path: Path) -> Image.Image:
    with Image.open(path) as image:  # closed at once: thousands of images per evaluation
        return image.convert("RGB")


def swap_outcomes(sim: Tensor) -> Dict[str, bool]:
    """Per-item outcomes of a 2x2 item; sim[i, j] = similarity(image i, caption j)."""
    text = bool(sim[0, 0] > sim[0, 1]) and bool(sim[1, 1] > sim[1, 0])
    image = bool(sim[0, 0] > sim[1, 0]) and bool(sim[1, 1] > sim[0, 1])
    return {"text": text, "image": image, "group": text and image,
            "caption_choices": [bool(sim[0, 0] > sim[0, 1]), bool(sim[1, 1] > sim[1, 0])]}


def aggregate_swap(per_item: List[dict]) -> Dict[str, float]:
    """Text / image / group scores overall and 2-way caption accuracy per swap type, in percent."""
    result = {key: 100.0 * sum(item[key] for item in per_item) / len(per_item) for key in ("text", "image", "group")}
    choices = defaultdict(list)
    for item in per_item:
        choices[item["type"]].extend(item["caption_choices"])
    for swap_type, outcomes in sorted(choices.items()):
        result[f"acc_{swap_type}"] = 100.0 * sum(outcomes) / len(outcomes)
    return result


def evaluate_swap(model: nn.Module, tokenizer: Callable, preprocess: Callable, items: List[dict]) -> List[dict]:
    """Per-item outcomes of the shapes swap set."""
    image_paths = sorted({path for item in items for path in item["images"]})
    captions = sorted({text for item in items for text in item["captions"]})
    image_index = {p: i for i, p in enumerate(image_paths)}
    caption_index = {c: i for i, c in enumerate(captions)}
    sims = encode_images(model, preprocess, image_paths) @ encode_texts(model, tokenizer, captions).T
    per_item = []
    for item in items:
        rows = [image_index[p] for p in item["images"]]
        cols = [caption_index[c] for c in item["captions"]]
        per_item.append({"id": item["id"], "type": item["type"], **swap_outcomes(sims[rows][:, cols])})
    return per_item


def retrieval_r1(model: nn.Module, tokenizer: Callable, preprocess: Callable, captions_json: Path,
                 image_dir: Path) -> Dict[str, float]:
    """Image->text and text->image R@1 (percent); an image query hits if any of its captions ranks first."""
    coco = json.loads(Path(captions_json).read_text())
    images = sorted(coco["images"], key=lambda im: im["id"])
    row_of_image = {im["id"]: row for row, im in enumerate(images)}
    captions = [ann["caption"].strip() for ann in coco["annotations"]]
    caption_image = torch.tensor([row_of_image[ann["image_id"]] for ann in coco["annotations"]])
    sims = encode_images(model, preprocess, [Path(image_dir) / im["file_name"] for im in images]) \
        @ encode_texts(model, tokenizer, captions).T
    t2i = (sims.argmax(dim=0) == caption_image).float().mean()
    i2t = (caption_image[sims.argmax(dim=1)] == torch.arange(len(images))).float().mean()
    return {"i2t_r1": 100.0 * float(i2t), "t2i_r1": 100.0 * float(t2i)}


def evaluate_export(export_dir: Path, data_root: Path, split: str = "val") -> Dict[str, float]:
    """All demo numbers of one exported model on the shapes world."""
    built = load_export(export_dir)
    model = built.model.eval()
    per_item = evaluate_swap(model, built.tokenizer, built.preprocess_val, load_swap_items(data_root, split))
    retrieval = retrieval_r1(model, built.tokenizer, built.preprocess_val,
                             Path(data_root) / "annotations" / f"captions_{split}.json",
                             Path(data_root) / "images" / split)
    return {**aggregate_swap(per_item), **retrieval}

"""Image transforms that know their geometry: crop (in original pixels) then resize, so boxes can follow.

`CropResize` reproduces open_clip's transforms as "crop a region of the original image, resize it to
size x size (bicubic), normalise", and returns the crop so that grounding boxes can be mapped onto ViT
patches (`parsers.grounding.boxes_to_patch_mask`). Training: a RandomResizedCrop region (scale 0.9-1.0 by
default, no flip, so boxes stay valid), re-drawn a few times when it would cut away every box of the sampled
phrase (box-aware). Evaluation: the centred square of side min(width, height), which is what open_clip's
resize-shortest-side + centre-crop shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torchvision.transforms import InterpolationMode, RandomResizedCrop

Crop = Tuple[int, int, int, int]  # top, left, height, width in original pixels
BOX_AWARE_TRIES = 10


@dataclass
class CropResize:
    size: int
    mean: Sequence[float]
    std: Sequence[float]
    train: bool = False
    scale: Tuple[float, float] = (0.9, 1.0)
    ratio: Tuple[float, float] = (3 / 4, 4 / 3)

    @classmethod
    def from_open_clip(cls, preprocess_cfg: dict, train: bool, scale: Sequence[float] = (0.9, 1.0)) -> "CropResize":
        """From an open_clip model's `visual.preprocess_cfg` (size, mean, std)."""
        size = preprocess_cfg["size"]
        size = size[0] if isinstance(size, (tuple, list)) else size
        return cls(int(size), preprocess_cfg["mean"], preprocess_cfg["std"], train, tuple(scale))

    def sample_crop(self, image: Image.Image, boxes: Sequence[Sequence[float]] = ()) -> Crop:
        """The region to keep; in training, re-drawn while it would cut away every box given."""
        if not self.train:
            return center_square(image.width, image.height)
        for _ in range(BOX_AWARE_TRIES):
            crop = tuple(RandomResizedCrop.get_params(image, list(self.scale), list(self.ratio)))
            if len(boxes) == 0 or any(box_overlaps_crop(box, crop) for box in boxes):
                return crop
        return crop

    def apply(self, image: Image.Image, crop: Crop) -> torch.Tensor:
        top, left, height, width = crop
        resized = TF.resized_crop(image, top, left, height, width, [self.size, self.size],
                                  interpolation=InterpolationMode.BICUBIC, antialias=True)
        return TF.normalize(TF.to_tensor(resized), list(self.mean), list(self.std))

    def __call__(self, image: Image.Image, boxes: Sequence[Sequence[float]] = ()) -> Tuple[torch.Tensor, Crop]:
        crop = self.sample_crop(image, boxes)
        return self.apply(image, crop), crop


def center_square(width: int, height: int) -> Crop:
    side = min(width, height)
    return (height - side) // 2, (width - side) // 2, side, side


def box_overlaps_crop(box: Sequence[float], crop: Optional[Crop]) -> bool:
    top, left, height, width = crop
    x0, y0, x1, y1 = box[:4]
    return min(x1, left + width) > max(x0, left) and min(y1, top + height) > max(y0, top)

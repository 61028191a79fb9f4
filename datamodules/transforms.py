"""Image transforms that know their geometry: crop (in original pixels) then resize, so boxes can follow.

`CropResize` reproduces open_clip's transforms as "crop a region of the original image, resize it to
size x size (bicubic), normalise", and returns the crop so that grounding boxes can be mapped onto ViT
patches (`datamodules.masks`). Training: one torchvision `RandomResizedCrop.get_params` draw (scale 0.9-1.0 by
default, ratio 3/4-4/3; torchvision itself tries 10 times for a region of that scale and ratio inside the image,
then falls back to a centre crop), no flip, so boxes stay valid: MACCO's training transform. With `box_aware`
[ours] the whole draw is repeated, up to `BOX_AWARE_TRIES` times, while the region would cut away every box of
the sampled phrase. Evaluation: the centred square of side min(width, height), which is what open_clip's
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
BOX_AWARE_TRIES = 10  # [ours] draws of a box-aware training crop; the last one is kept if none keeps a box


@dataclass
class CropResize:
    size: int
    mean: Sequence[float]
    std: Sequence[float]
    train: bool = False
    scale: Tuple[float, float] = (0.9, 1.0)
    ratio: Tuple[float, float] = (3 / 4, 4 / 3)
    box_aware: bool = False

    @classmethod
    def from_open_clip(cls, preprocess_cfg: dict, train: bool, scale: Sequence[float] = (0.9, 1.0),
                       box_aware: bool = False) -> "CropResize":
        """From an open_clip model's `visual.preprocess_cfg` (size, mean, std)."""
        size = preprocess_cfg["size"]
        size = size[0] if isinstance(size, (tuple, list)) else size
        return cls(int(size), preprocess_cfg["mean"], preprocess_cfg["std"], train, tuple(scale), box_aware=box_aware)

    def sample_crop(self, image: Image.Image, boxes: Sequence[Sequence[float]] = ()) -> Crop:
        """The region to keep; in training one RandomResizedCrop draw, re-drawn with `box_aware` while it would
        cut away every box given."""
        if not self.train:
            return center_square(image.width, image.height)
        if not self.box_aware or len(boxes) == 0:
            return self._random_resized_crop(image)
        for _ in range(BOX_AWARE_TRIES):
            crop = self._random_resized_crop(image)
            if any(box_overlaps_crop(box, crop) for box in boxes):
                return crop
        return crop

    def _random_resized_crop(self, image: Image.Image) -> Crop:
        """torchvision's RandomResizedCrop region (from torch's global generator, as the transform draws it)."""
        return tuple(RandomResizedCrop.get_params(image, list(self.scale), list(self.ratio)))

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

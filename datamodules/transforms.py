"""Image transforms that know their geometry: crop (in original pixels) then resize, so boxes can follow.

`CropResize` reproduces open_clip's transforms as "crop a region of the original image, resize it to
size x size (bicubic), normalise", and returns the crop so that grounding boxes can be mapped onto ViT
patches (`datamodules.masks`). Training: one torchvision `RandomResizedCrop.get_params` draw (scale 0.9-1.0 by
default, ratio 3/4-4/3; torchvision itself tries 10 times for a region of that scale and ratio inside the image,
then falls back to a centre crop), no flip, so boxes stay valid: MACCO's training transform. With `box_aware`
[ours] the whole draw is repeated, up to `BOX_AWARE_TRIES` times, while the region would cut away every box of
the sampled phrase. Evaluation: the centred square of side min(width, height), which is what open_clip's
resize-shortest-side + centre-crop shows.

Random draws come from a `torch.Generator` the caller seeds per sample (`seeded_generator`), never from torch's
global generators: re-seeding those per sample cost about half a millisecond and, in a process that uses CUDA,
re-seeded the CUDA generator too. A generator seeded with s gives the draws of the global generator after
`torch.manual_seed(s)`, so the crops are those of torchvision's own transform under that seed.
`with_generator` gives open_clip's image transforms (a torchvision `Compose`) the same interface.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
import torchvision.transforms.functional as TF
from open_clip.transform import MaybeConvertMode, MaybeToTensor
from PIL import Image
from torchvision.transforms import (CenterCrop, Compose, InterpolationMode, Normalize, RandomResizedCrop, Resize,
                                    ToTensor)

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

    def sample_crop(self, image: Image.Image, boxes: Sequence[Sequence[float]] = (),
                    generator: Optional[torch.Generator] = None) -> Crop:
        """The region to keep; in training one RandomResizedCrop draw from `generator` (torch's global one when
        None), re-drawn with `box_aware` while it would cut away every box given."""
        if not self.train:
            return center_square(image.width, image.height)
        if not self.box_aware or len(boxes) == 0:
            return self._random_resized_crop(image, generator)
        for _ in range(BOX_AWARE_TRIES):
            crop = self._random_resized_crop(image, generator)
            if any(box_overlaps_crop(box, crop) for box in boxes):
                return crop
        return crop

    def _random_resized_crop(self, image: Image.Image, generator: Optional[torch.Generator]) -> Crop:
        return random_resized_crop(image.width, image.height, self.scale, self.ratio, generator)

    def apply(self, image: Image.Image, crop: Crop) -> torch.Tensor:
        top, left, height, width = crop
        resized = TF.resized_crop(image, top, left, height, width, [self.size, self.size],
                                  interpolation=InterpolationMode.BICUBIC, antialias=True)
        return TF.normalize(TF.to_tensor(resized), list(self.mean), list(self.std))

    def __call__(self, image: Image.Image, boxes: Sequence[Sequence[float]] = (),
                 generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, Crop]:
        crop = self.sample_crop(image, boxes, generator)
        return self.apply(image, crop), crop


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator in the state torch's global one has after `torch.manual_seed(seed)`."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def random_resized_crop(width: int, height: int, scale: Sequence[float], ratio: Sequence[float],
                        generator: Optional[torch.Generator] = None) -> Crop:
    """torchvision's `RandomResizedCrop.get_params` region of a width x height image, drawn from `generator` (torch's
    global generator when None): the same draws in the same order, so the same region for a generator in the
    same state. Up to 10 tries for a region of that scale and ratio inside the image, then a centre crop."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, size=(1,), generator=generator).item()
            left = torch.randint(0, width - w + 1, size=(1,), generator=generator).item()
            return top, left, h, w
    return _fallback_crop(width, height, ratio)


def _fallback_crop(width: int, height: int, ratio: Sequence[float]) -> Crop:
    """torchvision's centre crop after 10 failed draws: the image clipped to the allowed aspect ratios."""
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


GeneratorTransform = Callable[[Image.Image, Optional[torch.Generator]], torch.Tensor]
# open_clip's image transform steps that draw nothing (its train transform adds RandomResizedCrop to them).
DETERMINISTIC_STEPS = (Resize, CenterCrop, Normalize, ToTensor, MaybeToTensor, MaybeConvertMode)


def with_generator(transform: Callable[[Image.Image], torch.Tensor]) -> GeneratorTransform:
    """`transform` as a function of (image, generator) whose randomness comes from the generator.

    open_clip's transforms (a `Compose` of `RandomResizedCrop` and `DETERMINISTIC_STEPS`) draw their crop from it.
    Any other transform runs on torch's global CPU generator set to the generator's state and restored after
    (the same draws; the CUDA generators are never touched)."""
    steps = transform.transforms if isinstance(transform, Compose) else None
    if steps is not None and all(isinstance(step, (RandomResizedCrop, *DETERMINISTIC_STEPS)) for step in steps):
        return CropFromGenerator(steps)
    return GlobalStateFromGenerator(transform)


@dataclass
class CropFromGenerator:
    """open_clip's transform steps, run in order, with each RandomResizedCrop's region from the generator."""

    steps: Sequence[Callable]

    def __call__(self, image: Image.Image, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        for step in self.steps:
            image = _random_resized(step, image, generator) if isinstance(step, RandomResizedCrop) else step(image)
        return image


def _random_resized(step: RandomResizedCrop, image: Image.Image, generator: Optional[torch.Generator]):
    """`step(image)` with its region drawn from `generator` (RandomResizedCrop.forward otherwise)."""
    width, height = TF.get_image_size(image)
    top, left, h, w = random_resized_crop(width, height, step.scale, step.ratio, generator)
    return TF.resized_crop(image, top, left, h, w, step.size, step.interpolation, antialias=step.antialias)


@dataclass
class GlobalStateFromGenerator:
    """A transform that draws from torch's global CPU generator, run with it in the generator's state."""

    transform: Callable[[Image.Image], torch.Tensor]

    def __call__(self, image: Image.Image, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        if generator is None:
            return self.transform(image)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.set_state(generator.get_state())
            return self.transform(image)


def center_square(width: int, height: int) -> Crop:
    side = min(width, height)
    return (height - side) // 2, (width - side) // 2, side, side


def box_overlaps_crop(box: Sequence[float], crop: Optional[Crop]) -> bool:
    top, left, height, width = crop
    x0, y0, x1, y1 = box[:4]
    return min(x1, left + width) > max(x0, left) and min(y1, top + height) > max(y0, top)

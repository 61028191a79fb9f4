"""Image files -> 8-bit RGB, decoded one way everywhere, and the images boxes cannot be drawn on.

This module is the project's one image decoder: grounding, training (the COCO datamodule, the frozen-feature
cache), the benchmarks (files, crops, zip members, parquet cells, video frames) and the explanation CLI all read
pixels through `read_rgb_file`, `read_rgb_bytes` or `read_npy_frame`, so a file decodes to the same pixels
whichever of them reads it (tests/test_images.py holds every path to that).

`Image.convert("RGB")` is right for every 8-bit mode (L, P, LA, RGBA, CMYK, YCbCr, 1) but not for integer
grayscale: PIL clips a 16-bit value to 255 instead of scaling it, so a 16-bit PNG becomes almost pure white
(mode "I;16" in current Pillow, "I" in older ones). `rgb_image` scales those to 8 bits (v / 257, rounded: a
16-bit image written from an 8-bit one by v * 257 decodes to exactly that 8-bit image). A float image ("F")
has no agreed value range and is refused. (16-bit RGB, RGBA and LA PNGs are read by PIL as 8-bit RGB(A).)

`image_shape_problem` names the images whose geometry makes boxes meaningless on the network's input: sides
shorter than the patch grid (a patch would see less than one pixel), an annotated size that is not the
file's (its boxes are in another frame), and extreme aspect ratios. The crop shows a square (evaluation) or
at most a 4:3 window (training) of the image, so at `MAX_ASPECT_RATIO` 10 at most 13 % of the long side is
seen and most phrase boxes fall outside it; GroundingDINO, which resizes the long side to 1333 px, is left
with a short side under 133 px (at about 40:1 too few tokens remain for its 900 queries and it fails).
"""
from __future__ import annotations

import io
import os
from typing import Optional, Tuple, Union

import numpy as np
from PIL import Image

# How PIL reports a broken file: OSError (truncated data, unidentified format), SyntaxError (broken PNG
# chunks), ValueError (impossible header values, and `rgb_image`'s refusals), DecompressionBombError (absurd
# sizes).
IMAGE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
MAX_ASPECT_RATIO = 10.0
# Names `rgb_image`'s decoding in the settings of grounders that look at pixels (their cache key): boxes found on
# the pixels of an older decoding (16-bit grayscale clipped to white) must not be reused.
IMAGE_DECODING = "rgb8, integer grayscale scaled from 16 bits"
_SIXTEEN_BIT_MAX = 65535
_SIXTEEN_TO_EIGHT = 257  # 65535 / 255


def _is_integer_grayscale(mode: str) -> bool:
    """16-bit ("I;16", "I;16B", ...) and 32-bit ("I") integer grayscale: what PIL clips instead of scaling."""
    return mode == "I" or mode.startswith("I;16")


def _integer_grayscale_to_rgb(image: Image.Image) -> Image.Image:
    """A 16-bit grayscale image (mode "I" holds one in older Pillow) scaled to 8 bits, as RGB."""
    values = np.asarray(image).astype(np.int64)
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    if low < 0 or high > _SIXTEEN_BIT_MAX:
        raise ValueError(f"integer grayscale values {low}..{high} lie outside the 16-bit range 0..65535, so "
                         f"their brightness scale is unknown; convert the file to 8 or 16 bits")
    eight_bit = ((values + _SIXTEEN_TO_EIGHT // 2) // _SIXTEEN_TO_EIGHT).astype(np.uint8)
    return Image.fromarray(eight_bit).convert("RGB")


def rgb_image(image: Image.Image) -> Image.Image:
    """The decoded 8-bit RGB version of an open image, whatever its mode and bit depth.

    Decodes every byte, so a truncated file raises here. Raises ValueError for float images ("F") and
    integer images outside the 16-bit range.
    """
    if _is_integer_grayscale(image.mode):
        return _integer_grayscale_to_rgb(image)
    if image.mode == "F":
        raise ValueError("a 32-bit float image has no agreed brightness range; convert the file to 8 or 16 bits")
    return image.convert("RGB")


def read_rgb_file(path: Union[str, os.PathLike]) -> Image.Image:
    """The 8-bit RGB image of a file; raises one of `IMAGE_ERRORS` when it cannot be decoded."""
    with Image.open(path) as image:  # closed at once: an evaluation or a feature job opens thousands of files
        return rgb_image(image)


def read_rgb_bytes(data: bytes) -> Image.Image:
    """The 8-bit RGB image of an encoded image file's bytes (a zip member, a parquet image cell), decoded as
    `read_rgb_file` decodes the file; raises one of `IMAGE_ERRORS` when they cannot be decoded."""
    with Image.open(io.BytesIO(data)) as image:
        return rgb_image(image)


def read_npy_frame(path: Union[str, os.PathLike]) -> Image.Image:
    """A video frame stored as a numpy array [H, W, 3] of uint8 in BGR order (EqBen's YouCook2 frames, read as its
    `process_img_npy` reads them), as an 8-bit RGB image; anything else raises OSError naming the file."""
    try:
        array = np.load(path)
    except (ValueError, EOFError) as error:  # not an .npy file, a pickled object array, a truncated file
        raise OSError(f"{path}: not a numpy array file ({error})") from error
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise OSError(f"{path}: expected a [H, W, 3] uint8 array, found {array.dtype} {array.shape}")
    return Image.fromarray(np.ascontiguousarray(array[:, :, [2, 1, 0]]), "RGB")


def image_shape_problem(size: Tuple[int, int], annotated_size: Optional[Tuple[int, int]] = None,
                        min_side: int = 1) -> Optional[str]:
    """Why boxes on an image of `size` (width, height) would be meaningless, or None.

    Args:
        size: the decoded file's (width, height).
        annotated_size: (width, height) recorded in the annotations (COCO `images[].width/height`), the
            frame of their boxes; None when the annotations do not record it.
        min_side: the shortest usable side in pixels (the patch grid's side where patch masks are drawn).
    """
    width, height = size
    if annotated_size is not None and tuple(annotated_size) != (width, height):
        return (f"the file is {width}x{height} but the annotations record {annotated_size[0]}x{annotated_size[1]} "
                f"(boxes would be in the wrong frame; is it the right file?)")
    if min(width, height) < min_side:
        return f"{width}x{height} has a side shorter than {min_side} px, the patch grid's side"
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        return (f"{width}x{height} has an aspect ratio over {MAX_ASPECT_RATIO:g}:1 (the crop would show a "
                f"sliver of it and miss most boxes)")
    return None

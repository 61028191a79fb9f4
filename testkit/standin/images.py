"""Small generated images for stand-in benchmark data."""
from __future__ import annotations

import random
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import List, Tuple

from PIL import Image, ImageDraw

PALETTE = ((220, 40, 40), (40, 160, 60), (40, 80, 220), (230, 200, 40), (150, 60, 180), (30, 30, 30))
POOL_SIZE = 8


def write_image(path: Path, seed: int, size: Tuple[int, int] = (48, 40)) -> Path:
    """A small image with a coloured background and one rectangle, different per seed."""
    rng = random.Random(seed)
    image = Image.new("RGB", size, rng.choice(PALETTE))
    draw = ImageDraw.Draw(image)
    x0, y0 = rng.randrange(size[0] // 2), rng.randrange(size[1] // 2)
    draw.rectangle((x0, y0, x0 + size[0] // 3, y0 + size[1] // 3), fill=rng.choice(PALETTE))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def encoded_pool(seed: int, suffix: str, count: int = POOL_SIZE) -> List[bytes]:
    """`count` distinct small encoded images (format from `suffix`), to be copied under many names."""
    with TemporaryDirectory() as tmp:
        return [write_image(Path(tmp) / f"{k}{suffix}", seed=seed * 1000 + k).read_bytes() for k in range(count)]

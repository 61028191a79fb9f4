"""Generated stand-in data in each benchmark's exact official file format (tests and `perf.evaluate`).

The real benchmark files are not redistributable (or not reachable from here); these writers produce the
same schema with small generated images, so loaders, scorers and the CLI run end to end. Each family module
exposes `write_<benchmark>(root, n_items, seed) -> options`, where `options` are the keyword arguments
`build_benchmark(name, root, **options)` needs (for example an images folder outside the root).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Tuple

from PIL import Image, ImageDraw

PALETTE = ((220, 40, 40), (40, 160, 60), (40, 80, 220), (230, 200, 40), (150, 60, 180), (30, 30, 30))


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

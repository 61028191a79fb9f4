"""Stand-in ImageCoDe validation files in the authors' format (`McGill-NLP/imagecode`), with generated images.

`data/valid_data.json` maps an image set's folder name to `{gold index: description}` (1 to 3 descriptions per
set, as in the release); every set is a folder `data/image-sets/<set>/` of 10 JPEGs. Set names follow the four
sources of the release (Open Images sets are static, the three video sources video), and video sets are named by
frame number (`img0.jpg`, `img4.jpg`, `img11.jpg`, ...), so that a name's number and its position differ, as
the authors' sort by number expects. Ten encoded images are reused across sets (hard
links to one written copy each), all ten in each set.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

from testkit.standin.images import encoded_pool

IMAGES_PER_SET = 10
SET_NAMES = ("open-images-{k}_{hex}", "MSR-VTT-videoTestVideo_video{k}-shot1_0",
             "video-storytelling-videocamping_{hex}-shot{k}_2", "YouCook-video{k:04d}-shot3_0")
SUBJECTS = ("a man", "a woman", "the dog", "a child", "the car", "two girls", "a bird", "the chef")
DETAILS = ("is turned to the left", "holds a cup in the right hand", "is half out of the frame",
           "has both arms raised", "stands behind the table", "looks straight at the camera")


def frame_names(set_name: str, rng: random.Random) -> list[str]:
    """Ten image names: `img0..img9` for a static set, increasing frame numbers with gaps for a video set."""
    if "open-images" in set_name:
        return [f"img{k}.jpg" for k in range(IMAGES_PER_SET)]
    frames = sorted(rng.sample(range(3 * IMAGES_PER_SET), IMAGES_PER_SET))
    return [f"img{frame}.jpg" for frame in frames]


def description(index: int) -> str:
    """A description, distinct for the first few thousand indices; some with the outer spaces of real ones."""
    subject = SUBJECTS[index % len(SUBJECTS)]
    detail = DETAILS[(index // len(SUBJECTS)) % len(DETAILS)]
    text = f"{subject} {detail}, seen in shot {index // (len(SUBJECTS) * len(DETAILS))}."
    return text + " " if index % 5 == 4 else text


class PooledFiles:
    """Writes each pooled image once and hard-links later copies to it: creating thousands of files is then
    cheap, since no data is written again (a copy where links are not supported)."""

    def __init__(self, pool: list[bytes]):
        self.pool = pool
        self.first: dict[int, Path] = {}

    def write(self, path: Path, index: int) -> None:
        index %= len(self.pool)
        path.unlink(missing_ok=True)  # never write through a link made by an earlier run into the same root
        if index not in self.first:
            path.write_bytes(self.pool[index])
            self.first[index] = path
            return
        try:
            os.link(self.first[index], path)
        except OSError:
            shutil.copyfile(self.first[index], path)


def write_imagecode(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`n_items` descriptions over about n_items / 2 sets, cycling through the four sources."""
    root, rng = Path(root), random.Random(seed)
    files = PooledFiles(encoded_pool(seed, ".jpg", count=IMAGES_PER_SET))
    sets: dict[str, dict[str, str]] = {}
    written = 0
    while written < n_items:
        k = len(sets)
        name = SET_NAMES[k % len(SET_NAMES)].format(k=k, hex=f"{rng.getrandbits(64):016x}")
        count = min(1 + k % 3, n_items - written)
        golds = rng.sample(range(IMAGES_PER_SET), count)
        sets[name] = {str(gold): description(written + j) for j, gold in enumerate(golds)}
        written += count
        folder = root / "data" / "image-sets" / name
        folder.mkdir(parents=True, exist_ok=True)
        for position, image_name in enumerate(frame_names(name, rng)):
            files.write(folder / image_name, k + position)
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "data" / "valid_data.json").write_text(json.dumps(sets, indent=2))
    return {"images": str(root / "data" / "image-sets")}

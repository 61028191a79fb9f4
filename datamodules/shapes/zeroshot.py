"""`python -m datamodules.shapes.zeroshot --data-root WORLD`: the world's zero-shot classification sets.

Recognition in the shapes world: an image holds one object, its class is its colour and shape ("red square"),
and a model names it among the classes of its split, prompted with the world's own single-object captions
("a red square", "there is a red square", "a picture of a red square"; ensembled as clip_benchmark does). The
classes follow each split's rule about held-out combinations (`datamodules.shapes.heldout`): `val` and `test`
have the combinations training saw, `test_unseen` the held-out ones. Sizes and positions are drawn as in the
world's scenes.

Files, in the layout of the `zeroshot` benchmark (`evaluation/benchmarks/zeroshot.py`, dataset `shapes`), under
`WORLD/zeroshot_<split>/`: `en_classnames.json`, `en_zeroshot_classification_templates.json` (each class's own
prompts) and `images/<colour>_<shape>/<n>.png`, the prompts written last (their presence means the split is
complete). The world's seed and image size are read from the world itself, and the same world and
`--per-class` give byte-identical files; rerunning rewrites them.
"""
from __future__ import annotations

import argparse
import io
import json
import random
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from core.cli import add_data_root
from core.files import atomic_write_bytes
from datamodules.shapes.heldout import split_rule
from datamodules.shapes.render import draw_scene
from datamodules.shapes.scenes import place
from datamodules.shapes.world import COLORS, SHAPES, SINGLE_TEMPLATES, SIZES, Caption, Description, SPLITS

DATASET = "shapes"  # the key of both JSON files (the benchmark's `dataset` option)
SPLITS_SCORED = tuple(split for split in SPLITS if split != "train")
CLASSNAMES_FILE = "en_classnames.json"
TEMPLATES_FILE = "en_zeroshot_classification_templates.json"
DEFAULT_PER_CLASS = 10


def zeroshot_root(world: Path, split: str) -> Path:
    return Path(world) / f"zeroshot_{split}"


def split_classes(seed: int, split: str) -> List[Tuple[str, str]]:
    """(colour, shape) classes of `split`, sorted by folder name (the benchmark's label order)."""
    rule = split_rule(seed, split)
    combos = [(colour, shape) for colour in COLORS for shape in SHAPES
              if ((colour, shape) in rule.heldout.combos) == rule.unseen]
    return sorted(combos, key=class_folder)


def class_folder(combo: Tuple[str, str]) -> str:
    return f"{combo[0]}_{combo[1]}"


def class_prompts(colour: str, shape: str) -> List[str]:
    """The world's single-object captions of the class, one per single template."""
    return [Caption(template, Description(colour, shape)).text for template in SINGLE_TEMPLATES]


def world_settings(world: Path) -> Tuple[int, int]:
    """(seed, image size) of a generated world, read from its annotations."""
    annotations = Path(world) / "annotations"
    if not (annotations / "heldout.json").is_file():
        raise FileNotFoundError(f"{world} is not a shapes world (no annotations/heldout.json): generate it with "
                                f"python -m datamodules.shapes")
    seed = json.loads((annotations / "heldout.json").read_text())["seed"]
    image_size = json.loads((annotations / "captions_val.json").read_text())["info"]["image_size"]
    return int(seed), int(image_size)


def write_zeroshot_split(world: Path, split: str, per_class: int = DEFAULT_PER_CLASS) -> Path:
    """Write `WORLD/zeroshot_<split>/` (module docstring); returns the folder."""
    seed, image_size = world_settings(world)
    out = zeroshot_root(world, split)
    rng = random.Random(f"shapes:{seed}:{split}:zeroshot")
    classes = split_classes(seed, split)
    for colour, shape in classes:
        folder = out / "images" / class_folder((colour, shape))
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            scene = place(rng, image_size, [(rng.choice(sorted(SIZES)), colour, shape)])
            buffer = io.BytesIO()
            draw_scene(scene).save(buffer, format="PNG")
            atomic_write_bytes(folder / f"{index:04d}.png", buffer.getvalue())
    names = [f"{colour} {shape}" for colour, shape in classes]
    prompts: Dict[str, List[str]] = {name: class_prompts(*combo) for name, combo in zip(names, classes)}
    _write_json(out / CLASSNAMES_FILE, {DATASET: names})
    _write_json(out / TEMPLATES_FILE, {DATASET: prompts})
    return out


def _write_json(path: Path, payload: dict) -> None:
    atomic_write_bytes(path, json.dumps(payload, indent=2, sort_keys=True).encode("utf-8"))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_root(parser, required=True, help="the shapes world")
    parser.add_argument("--per-class", type=int, default=DEFAULT_PER_CLASS, help="images per class and split")
    parser.add_argument("--splits", default=",".join(SPLITS_SCORED), help="comma-separated splits")
    args = parser.parse_args(argv)
    if args.per_class < 1:
        parser.error("--per-class must be at least 1")
    splits = [split.strip() for split in args.splits.split(",") if split.strip()]
    unknown = [split for split in splits if split not in SPLITS]
    if unknown:
        parser.error(f"unknown split(s) {', '.join(unknown)}; the splits are {', '.join(SPLITS)}")
    try:
        for split in splits:
            print(write_zeroshot_split(args.data_root, split, args.per_class), flush=True)
    except FileNotFoundError as err:
        raise SystemExit(str(err)) from None


if __name__ == "__main__":
    main()

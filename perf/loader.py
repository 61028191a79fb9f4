"""`python -m perf.loader`: training DataModule throughput (samples/s) by worker count, with and without masks.

Default data: a shapes world generated under runs/perf_loader/ (preprocessed with the `annotations`
grounder), read through the same COCO DataModule as real COCO. Pass `--config` files and overrides to
measure real data instead. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import List, Optional, Sequence

from core.cli import add_key_values, add_output
from lightning_modules import load_run_config
from modeling.encoders import CLIPEncoders, build_model
from datamodules.coco import CocoDataModule
from datamodules.preprocess import run as run_preprocess
from datamodules.shapes import generate

DEFAULT_ROOT = Path("runs/perf_loader")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[], help="experiment YAML(s), as for fit")
    parser.add_argument("--workers", default="0,1,2", help="comma list of num_workers values")
    parser.add_argument("--batches", type=int, default=30, help="timed batches per setting (after 2 warm-up)")
    add_output(parser, "file", default=Path("runs/perf_loader.json"), help="the JSON report")
    add_key_values(parser, help="config overrides (as fit), e.g. data.batch_size=32")
    # Options and overrides may interleave (`--config a.yaml k=v --config b.yaml k2=v2`); every --config file
    # still merges before every override, each in the order given.
    return parser.parse_intermixed_args(argv)


def shapes_overrides(root: Path) -> List[str]:
    return [f"data.root={root}", "data.train_annotations=annotations/captions_train.json",
            "data.train_images=images/train", "data.val_annotations=annotations/captions_val.json",
            "data.val_images=images/val", "preprocess.grounder=annotations",
            "preprocess.train_scene_graphs=annotations/scene_graphs_train.json",
            "preprocess.val_scene_graphs=annotations/scene_graphs_val.json", f"preprocess.cache_root={root}/cache",
            "model.name=ViT-B-32", "data.batch_size=64"]


def default_data() -> List[str]:
    if not (DEFAULT_ROOT / "annotations" / "captions_val.json").is_file():
        generate(DEFAULT_ROOT, n_train=2000, n_val=100, image_size=224, seed=0)
    return shapes_overrides(DEFAULT_ROOT)


def samples_per_second(datamodule: CocoDataModule, batches: int) -> float:
    loader = iter(datamodule.train_dataloader())
    for _ in range(2):  # worker start-up and first batches are not throughput
        next(loader)
    start, samples = time.perf_counter(), 0
    for _ in range(batches):
        samples += len(next(loader)["text"])
    return samples / (time.perf_counter() - start)


def measure(cfg, workers: Sequence[int], batches: int) -> List[dict]:
    built = build_model(cfg.model.name, None, cfg.model.config_dir)
    grid = CLIPEncoders(built.model).grid_size[0]
    rows = []
    for masks in (False, True):
        for num_workers in workers:
            cfg.data.masks, cfg.data.num_workers = masks, num_workers
            datamodule = CocoDataModule(cfg.data, built.tokenizer, built.preprocess_train, built.preprocess_val,
                                        preprocess=cfg.preprocess, image_config=built.model.visual.preprocess_cfg,
                                        grid_size=grid)
            datamodule.setup("fit")
            rate = samples_per_second(datamodule, batches)
            rows.append({"masks": masks, "num_workers": num_workers, "samples_per_s": rate,
                         "samples_per_s_per_worker": rate / max(1, num_workers)})
            print(f"masks={masks!s:<5} workers={num_workers}: {rate:8.1f} samples/s "
                  f"({rate / max(1, num_workers):.1f} per worker)", flush=True)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> List[dict]:
    args = parse_args(argv)
    overrides = ([] if args.config else default_data()) + list(args.overrides)
    cfg = load_run_config(args.config, overrides)
    run_preprocess(cfg)
    rows = measure(cfg, [int(w) for w in args.workers.split(",")], args.batches)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"data_root": cfg.data.root, "model": cfg.model.name, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()

"""`python -m lightning_modules.leakage`: which evaluation images are also training images?

COCO train2017 = train2014 + val2014 - val2017, so it holds most of the Karpathy test images (retrieval,
COCO-Order); Karpathy train+restval can hold val2017 images (SugarCrepe, BiVLC, What'sUp COCO-spatial, VALSE
plurals/relations). COCO ids are shared between the 2014 and 2017 releases, so the overlap is an
intersection of ids. The guard reads the training annotations of a config (or `--train FILE`), intersects
them with each benchmark's COCO image ids, prints the overlap, and can write the union of benchmark ids as a
`data.exclude_image_ids` file, so that a retrain is disjoint from the evaluation sets by construction.

Example:
    python -m lightning_modules.leakage --config configs/negclip.yaml --benchmarks coco_retrieval,sugarcrepe \
        --data-root /data/benchmarks --write-exclusions data/eval_image_ids.json --fail-on-overlap
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Set

from datamodules.annotations import read_annotation_file
from datamodules.benchmarks import Benchmark
from datamodules.files import atomic_write_text
from lightning_modules.config import load_config_or_exit
from lightning_modules.evaluate import add_benchmark_arguments, select_benchmarks


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", action="append", help="training config(s); reads data.train_annotations")
    source.add_argument("--train", action="append", type=Path, help="a training annotation file (repeatable)")
    parser.add_argument("--karpathy-splits", default="train,restval", help="splits read from a Karpathy --train")
    add_benchmark_arguments(parser)
    parser.add_argument("--write-exclusions", type=Path, help="write the benchmarks' COCO ids (JSON list) here")
    parser.add_argument("--report", type=Path, help="write the overlap report as JSON here")
    parser.add_argument("--fail-on-overlap", action="store_true", help="exit with status 1 on any overlap")
    return parser.parse_args(argv)


def training_image_ids(paths: Sequence[Path], karpathy_splits: Sequence[str]) -> Set[int]:
    return {record.image_id for path in paths for record in read_annotation_file(str(path), karpathy_splits)}


def config_training_files(config_files: Sequence[str]) -> tuple[list[Path], list[str]]:
    cfg = load_config_or_exit(config_files, [])
    return [Path(cfg.data.root) / cfg.data.train_annotations], list(cfg.data.train_karpathy_splits)


def leakage_report(train_ids: Set[int], benchmarks: Mapping[str, Benchmark]) -> Dict[str, Dict[str, object]]:
    """Per benchmark: its COCO images, how many are training images, and a few of them."""
    report = {}
    for name, benchmark in benchmarks.items():
        ids = benchmark.coco_image_ids()
        overlap = sorted(ids & train_ids)
        report[name] = {"coco_images": len(ids), "overlap": len(overlap),
                        "overlap_percent": 100.0 * len(overlap) / len(ids) if ids else 0.0,
                        "examples": overlap[:5]}
    return report


def format_report(report: Mapping[str, Mapping[str, object]], train_images: int) -> str:
    lines = [f"training images: {train_images}", "", "| benchmark | COCO images | in training | % |",
             "|---|---:|---:|---:|"]
    lines += [f"| {name} | {row['coco_images']} | {row['overlap']} | {row['overlap_percent']:.1f} |"
              for name, row in report.items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, object]]:
    args = parse_args(argv)
    if args.config:
        paths, splits = config_training_files(args.config)
    else:
        paths, splits = args.train, args.karpathy_splits.split(",")
    train_ids = training_image_ids(paths, splits)
    benchmarks = select_benchmarks(args)
    report = leakage_report(train_ids, benchmarks)
    print(format_report(report, len(train_ids)))
    if args.report:
        atomic_write_text(args.report, json.dumps(report, indent=2))
    if args.write_exclusions:
        excluded = sorted(set().union(*(b.coco_image_ids() for b in benchmarks.values())))
        atomic_write_text(args.write_exclusions, json.dumps(excluded))
        print(f"wrote {len(excluded)} evaluation image ids to {args.write_exclusions} "
              f"(use data.exclude_image_ids={args.write_exclusions})")
    if args.fail_on_overlap and any(row["overlap"] for row in report.values()):
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()

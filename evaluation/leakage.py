"""`python -m evaluation.leakage`: which evaluation images are also training images?

COCO train2017 = train2014 + val2014 - val2017, so it holds most of the Karpathy test images (retrieval,
COCO-Order); Karpathy train+restval can hold val2017 images (SugarCrepe, BiVLC, What'sUp COCO-spatial, VALSE
plurals/relations). COCO ids are shared between the 2014 and 2017 releases, so the overlap is an
intersection of ids. The guard reads the training annotations of a config (or `--train FILE`), intersects
them with each benchmark's COCO image ids, prints the overlap, and can write the union of benchmark ids as a
`data.exclude_image_ids` file, so that a retrain is disjoint from the evaluation sets by construction. A
config's training set is what the run reads: the first `data.max_train_samples` records, less
`data.exclude_image_ids`. Training images count by the benchmarks' rule: files named as COCO names them.

`fit` runs the same check (`check_training_overlap`) on the benchmarks it scores during training and refuses
to start on any overlap unless `evaluation.allow_train_overlap=true`.

Example:
    python -m evaluation.leakage --config configs/negclip.yaml --benchmarks coco_retrieval,sugarcrepe \
        --data-root /data/benchmarks --write-exclusions data/eval_image_ids.json --fail-on-overlap
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Set

from core.config import load_config_or_exit
from core.files import atomic_write_text
from datamodules.annotations import CaptionRecord, read_annotation_file
from datamodules.coco import read_image_ids
from evaluation.benchmarks import Benchmark
from evaluation.benchmarks.base import coco_id_from_name
from evaluation.evaluate import add_benchmark_arguments, select_benchmarks

log = logging.getLogger(__name__)


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


class TrainingOverlapError(ValueError):
    """Benchmarks scored during training share images with the training set; the message gives the counts."""


def coco_ids_of(records: Sequence[CaptionRecord]) -> Set[int]:
    """COCO ids of the records' images, by the benchmarks' rule (a COCO-named file; other names are not COCO)."""
    ids = (coco_id_from_name(record.file_name) for record in records)
    return {i for i in ids if i is not None}


def training_image_ids(paths: Sequence[Path], karpathy_splits: Sequence[str]) -> Set[int]:
    return {i for path in paths for i in coco_ids_of(read_annotation_file(str(path), karpathy_splits))}


def config_training_image_ids(data) -> Set[int]:
    """COCO ids of the images a run with the `data` config section trains on, selected as the COCO dataset
    selects them: the train split's first `max_train_samples` records, less `exclude_image_ids`."""
    path = Path(data.root) / data.train_annotations
    records = read_annotation_file(str(path), list(data.train_karpathy_splits))[:data.max_train_samples]
    return coco_ids_of(records) - read_image_ids(data.exclude_image_ids)


def shared_images(train_ids: Set[int], benchmarks: Mapping[str, Benchmark]) -> Set[int]:
    """The distinct training images that are images of any of the benchmarks."""
    return set().union(*(benchmark.coco_image_ids() & train_ids for benchmark in benchmarks.values()))


def check_training_overlap(train_ids: Set[int], benchmarks: Mapping[str, Benchmark], allow: bool,
                           train_source: str) -> Dict[str, Dict[str, object]]:
    """fit's guard: raise `TrainingOverlapError` when `benchmarks` share images with the training set, unless
    `allow` (then the overlap is logged as a warning). Returns the per-benchmark report.

    Args:
        train_ids: COCO ids of the training images (`config_training_image_ids`).
        benchmarks: the benchmarks scored during training, by name.
        allow: `evaluation.allow_train_overlap`.
        train_source: what the training set is, for the message (the annotation file).
    """
    report = leakage_report(train_ids, benchmarks)
    overlapping = {name: row for name, row in report.items() if row["overlap"]}
    if not overlapping:
        return report
    per_benchmark = "; ".join(f"{name}: {row['overlap']} of its {row['coco_images']} COCO images"
                              for name, row in overlapping.items())
    message = (f"{len(shared_images(train_ids, benchmarks))} training images ({train_source}) are images of the "
               f"evaluation benchmarks ({per_benchmark}), so their scores would be partly scores on training "
               f"images")
    if allow:
        log.warning("%s (evaluation.allow_train_overlap=true)", message)
        return report
    raise TrainingOverlapError(
        f"{message}. Train on data without them (the Karpathy train + restval split of dataset_coco.json, or "
        f"data.exclude_image_ids=FILE written by python -m evaluation.leakage --config ... "
        f"--write-exclusions FILE), drop those benchmarks from evaluation.benchmarks, or set "
        f"evaluation.allow_train_overlap=true to train anyway")


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
        train_ids = config_training_image_ids(load_config_or_exit(args.config, []).data)
    else:
        train_ids = training_image_ids(args.train, args.karpathy_splits.split(","))
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

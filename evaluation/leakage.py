"""`python -m evaluation.leakage`: which evaluation images are also training images?

COCO train2017 = train2014 + val2014 - val2017, so it holds most of the Karpathy test images (retrieval,
COCO-Order); Karpathy train+restval can hold val2017 images (SugarCrepe, BiVLC, What'sUp COCO-spatial, VALSE
plurals/relations). COCO ids are shared between the 2014 and 2017 releases, so the overlap is an
intersection of ids. The guard reads the training annotations of a config (`--config FILE`, with fit's key=value
overrides) or of `--train FILE`, intersects them with each benchmark's COCO image ids, prints the overlap, and
with `--out DIR` writes the overlap report (`DIR/overlap_report.json`) and the union of benchmark ids as a
`data.exclude_image_ids` file (`DIR/exclude_image_ids.json`), so that a retrain is disjoint from the evaluation
sets by construction. A config's training set is what the run reads: the first `data.max_train_samples` records,
less `data.exclude_image_ids`. Training images count by the benchmarks' rule: files named as COCO names them.

How a benchmark image is known to be a COCO image:
- by its COCO file name (`000000391895.jpg`, `COCO_val2014_000000391895.jpg`); BiVLC's embedded photos by the
  file name recorded with each one (its parquet `image.path`);
- a Visual Genome image (`VG_100K/<id>.jpg`, Visual7W's `v7w_<id>.jpg`, ARO VG-Relation / VG-Attribution's and
  What'sUp GQA-spatial's `<id>.jpg`) by VG's own `coco_id`, read from `--vg-image-data`: Visual Genome's
  `image_data.json` (records with `image_id` (or `id`) and `coco_id`), or a JSON object `{"<vg id>": coco_id}`;
- with `--hash-images`, any image whose bytes equal a training image file's (SHA-256 of both, the training
  files read from the config's image folder or `--train-images`; `--hash-cache FILE` keeps the digests by path,
  size and modification time, so that hashing COCO's 118k training files, ~19 GB, is paid once).

What it cannot see, and says so in its report (`not checked`):
- without `--vg-image-data`, every Visual Genome image: ARO VG-Relation and VG-Attribution, What'sUp
  GQA-spatial (one and two objects), VALSE existence and counting (Visual7W), VL-CheckList's vg and vaw sources.
  About half of Visual Genome's images are COCO images;
- by id, images named by neither COCO nor Visual Genome: VALSE's action pieces (SWiG) and coreference-hard
  (VisDial val2018), VL-CheckList's swig and hake sources (HAKE's COCO-named images are checked), Flickr30k
  (retrieval, Flickr30k-Order), What'sUp controlled A/B, Winoground, the zero-shot sets, the shapes world, and
  BiVLC photos of a release that records no file name. `--hash-images` compares their bytes with the training
  files, which finds identical files only, not a re-encoded or resized copy (so it does not replace the VG map);
- generated images (BiVLC's `negative_image`) are in no training set of photos and are only counted.

`fit` runs the same check (`check_training_overlap`) on the benchmarks it scores during training and refuses
to start on any overlap unless `evaluation.allow_train_overlap=true`; it logs what it could not check.

Example:
    python -m evaluation.leakage --config configs/negclip.yaml --benchmarks coco_retrieval,sugarcrepe \
        --data-root /data/benchmarks --out data/leakage --fail-on-overlap
    python -m evaluation.leakage --config configs/negclip.yaml --all --data-root /data/benchmarks \
        --vg-image-data /data/visual_genome/image_data.json --hash-images --hash-cache runs/image_hashes.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Set

from tqdm import tqdm

from core.cli import add_key_values, add_output, key_value_sections, refuse_renamed
from core.config import load_config_or_exit
from core.files import atomic_write_text
from datamodules.annotations import CaptionRecord, existing_path, image_path_candidates, read_annotation_file
from datamodules.coco import read_image_ids
from evaluation.benchmarks import Benchmark
from evaluation.benchmarks.base import COCO, GENERATED, VISUAL_GENOME, ImageRef, coco_id_from_name
from evaluation.evaluate import (BENCHMARK_SETTINGS, RENAMED_BENCHMARK_FLAGS, add_benchmark_arguments,
                                 benchmark_settings, select_benchmarks)

log = logging.getLogger(__name__)

# What `--out DIR` holds.
REPORT_FILE = "overlap_report.json"
EXCLUSIONS_FILE = "exclude_image_ids.json"
VG_MAP_HELP = ("Visual Genome's image_data.json (records with image_id or id, and coco_id), or a JSON object "
               "{\"<vg id>\": coco_id}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", action="append", help="training config(s); reads data.train_annotations")
    source.add_argument("--train", action="append", type=Path, help="a training annotation file (repeatable)")
    parser.add_argument("--karpathy-splits", default="train,restval", help="splits read from a Karpathy --train")
    add_benchmark_arguments(parser)
    add_key_values(parser, dest="settings", help="roots.NAME=DIR (one benchmark's folder), options.NAME.OPTION=VALUE "
                   "(a benchmark constructor option, read as YAML), as for evaluate; with --config, any other "
                   "key=value overrides the config as for fit, e.g. data.exclude_image_ids=FILE")
    parser.add_argument("--vg-image-data", type=Path, metavar="FILE",
                        help=f"map Visual Genome images to COCO ids: {VG_MAP_HELP}; without it they are not checked")
    parser.add_argument("--hash-images", action="store_true",
                        help="also compare image bytes (SHA-256) of benchmark and training files: finds identical "
                             "files under any name; reads every training image (slow once, see --hash-cache)")
    parser.add_argument("--train-images", type=Path, metavar="DIR",
                        help="the folder --train file names are relative to (needed by --hash-images with --train)")
    parser.add_argument("--hash-cache", type=Path, metavar="FILE",
                        help="JSON cache of image digests by path, size and mtime, read and updated")
    add_output(parser, "folder", help=f"write the overlap report ({REPORT_FILE}) and the benchmarks' COCO ids as "
               f"a data.exclude_image_ids file ({EXCLUSIONS_FILE}) into this folder")
    parser.add_argument("--fail-on-overlap", action="store_true", help="exit with status 1 on any overlap")
    refuse_renamed(parser, {**RENAMED_BENCHMARK_FLAGS,
                            "--write-exclusions": f"--out DIR (writes DIR/{EXCLUSIONS_FILE})",
                            "--report": f"--out DIR (writes DIR/{REPORT_FILE})"})
    args = parser.parse_intermixed_args(argv)
    settings, args.overrides = config_overrides(parser, args)
    args.roots, args.options = benchmark_settings(key_value_sections(parser, settings, BENCHMARK_SETTINGS))
    return args


def config_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[List[str], List[str]]:
    """The key=value arguments split into the benchmarks' settings (`roots.`, `options.`) and, with --config,
    the config overrides (every other key, as fit takes them); without --config an override is an error."""
    settings = [item for item in args.settings if item.partition(".")[0] in BENCHMARK_SETTINGS]
    overrides = [item for item in args.settings if item.partition(".")[0] not in BENCHMARK_SETTINGS]
    if overrides and not args.config:
        parser.error(f"{overrides[0]!r}: config overrides need --config (with --train the key=value arguments are "
                     f"{', '.join(BENCHMARK_SETTINGS.values())})")
    return settings, overrides


class TrainingOverlapError(ValueError):
    """Benchmarks scored during training share images with the training set; the message gives the counts."""


# ----- the training side ------------------------------------------------------------------------------------
@dataclass
class TrainingSet:
    """The training records and the folder their file names are relative to (None: not known)."""

    records: List[CaptionRecord]
    image_dir: Optional[Path] = None

    @property
    def coco_ids(self) -> Set[int]:
        return coco_ids_of(self.records)


def coco_ids_of(records: Sequence[CaptionRecord]) -> Set[int]:
    """COCO ids of the records' images, by the benchmarks' rule (a COCO-named file; other names are not COCO)."""
    ids = (coco_id_from_name(record.file_name) for record in records)
    return {i for i in ids if i is not None}


def config_training_set(data) -> TrainingSet:
    """The records a run with the `data` config section trains on, selected as the COCO dataset selects them:
    the train split's first `max_train_samples` records, less `exclude_image_ids`."""
    path = Path(data.root) / data.train_annotations
    records = read_annotation_file(str(path), list(data.train_karpathy_splits))[:data.max_train_samples]
    excluded = read_image_ids(data.exclude_image_ids)
    return TrainingSet([record for record in records if record.image_id not in excluded],
                       Path(data.root) / data.train_images)


def config_training_image_ids(data) -> Set[int]:
    """COCO ids of the images a run with the `data` config section trains on (`config_training_set`)."""
    return config_training_set(data).coco_ids


# ----- Visual Genome -> COCO ----------------------------------------------------------------------------------
def read_vg_coco_map(path: Path) -> Dict[int, Optional[int]]:
    """VG id -> COCO id (None: a VG image that is not a COCO image) from `path` (see `VG_MAP_HELP`).

    Raises:
        ValueError: a file in neither form (one line naming the file and the expected forms).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--vg-image-data: no such file {path}")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(document, dict):
            return {int(vg): None if coco is None else int(coco) for vg, coco in document.items()}
        if isinstance(document, list):
            return {int(record.get("image_id", record.get("id"))): _optional_int(record["coco_id"])
                    for record in document}
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(f"--vg-image-data {path}: not a Visual Genome id map ({type(error).__name__}: {error}); "
                         f"expected {VG_MAP_HELP}") from None
    raise ValueError(f"--vg-image-data {path}: a JSON {type(document).__name__}; expected {VG_MAP_HELP}")


def _optional_int(value) -> Optional[int]:
    return None if value is None else int(value)


# ----- image contents -----------------------------------------------------------------------------------------
class ContentHashes:
    """SHA-256 digests of image bytes (files, or images embedded in parquet files), optionally cached in a JSON
    file by path, size and modification time (a changed file is hashed again)."""

    def __init__(self, cache: Optional[Path] = None):
        self.cache_path = Path(cache) if cache else None
        self.cache: Dict[str, list] = {}
        if self.cache_path is not None and self.cache_path.is_file():
            self.cache = json.loads(self.cache_path.read_text(encoding="utf-8"))
        self.hashed = 0  # digests computed (not read from the cache) in this process

    def of_file(self, path: str) -> Optional[str]:
        """The digest of the file at `path`; None when it does not exist."""
        return self._cached(path, path, lambda: _file_digest(path))

    def of_ref(self, ref: ImageRef) -> Optional[str]:
        """The digest of the bytes image `ref` decodes (a crop: its whole file)."""
        if ref.member is None:
            return self.of_file(ref.path)
        from evaluation.benchmarks.images import member_bytes

        return self._cached(f"{ref.path}#{ref.member}", ref.path,
                            lambda: hashlib.sha256(member_bytes(ref.path, ref.member)).hexdigest())

    def _cached(self, key: str, path: str, digest) -> Optional[str]:
        try:
            stat = os.stat(path)
        except OSError:
            return None
        entry = self.cache.get(key)
        if entry and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
            return entry[2]
        value = digest()
        self.cache[key] = [stat.st_size, stat.st_mtime_ns, value]
        self.hashed += 1
        return value

    def save(self) -> None:
        if self.cache_path is not None and self.hashed:
            self.cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.cache_path, json.dumps(self.cache))


def _file_digest(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


@dataclass
class TrainingContents:
    """Digests of the training image files on disk -> the training image ids with those bytes."""

    ids_by_digest: Dict[str, Set[int]] = field(default_factory=dict)
    hashed: int = 0
    missing: List[str] = field(default_factory=list)  # training image files not found (not hashed)


def training_contents(training: TrainingSet, hashes: ContentHashes, progress: bool = True) -> TrainingContents:
    """Hash every distinct training image file (the records' file names under `training.image_dir`)."""
    if training.image_dir is None:
        raise ValueError("content hashing needs the training images' folder (--train-images DIR with --train)")
    files: Dict[str, Set[int]] = {}
    for record in training.records:
        files.setdefault(record.file_name, set()).add(record.image_id)
    contents = TrainingContents()
    for name, ids in tqdm(files.items(), desc="hash training images", unit="image", disable=not progress):
        path = existing_path(image_path_candidates(str(training.image_dir), name))
        digest = hashes.of_file(path) if path else None
        if digest is None:
            contents.missing.append(name)
            continue
        contents.ids_by_digest.setdefault(digest, set()).update(ids)
        contents.hashed += 1
    return contents


# ----- the report ---------------------------------------------------------------------------------------------
@dataclass
class ImageCensus:
    """A benchmark's distinct images by origin (a crop counts as its file)."""

    coco: Set[int] = field(default_factory=set)
    visual_genome: Dict[int, ImageRef] = field(default_factory=dict)  # VG id -> one of its refs
    generated: List[ImageRef] = field(default_factory=list)
    other: List[ImageRef] = field(default_factory=list)
    files: List[ImageRef] = field(default_factory=list)  # every distinct file (or embedded image)


def image_census(benchmark: Benchmark) -> ImageCensus:
    census = ImageCensus()
    seen: Set[tuple] = set()
    for ref in benchmark.image_refs():
        if (ref.path, ref.member) in seen:
            continue
        seen.add((ref.path, ref.member))
        census.files.append(ImageRef(ref.path, member=ref.member))
        origin = benchmark.image_origin(ref)
        if origin.source == COCO:
            census.coco.add(origin.id)
        elif origin.source == VISUAL_GENOME:
            census.visual_genome.setdefault(origin.id, ref)
        elif origin.source == GENERATED:
            census.generated.append(ref)
        else:
            census.other.append(ref)
    return census


def benchmark_coco_ids(census: ImageCensus, vg_to_coco: Optional[Mapping[int, Optional[int]]]) -> Set[int]:
    """COCO ids of a benchmark's images: COCO-named ones, and Visual Genome ones that the map gives a COCO id."""
    mapped = {vg_to_coco.get(vg) for vg in census.visual_genome} if vg_to_coco else set()
    return census.coco | (mapped - {None})


def leakage_report(train_ids: Set[int], benchmarks: Mapping[str, Benchmark],
                   vg_to_coco: Optional[Mapping[int, Optional[int]]] = None,
                   contents: Optional[TrainingContents] = None,
                   hashes: Optional[ContentHashes] = None) -> Dict[str, Dict[str, object]]:
    """Per benchmark: its COCO images (named, or Visual Genome images mapped by `vg_to_coco`), how many are
    training images and a few of them; its Visual Genome, generated and other images, and how many of them
    could not be checked (`unchecked`; examples of each kind). With `contents` (training image digests) and `hashes`,
    also how many of its images have the bytes of a training image (`content_overlap`)."""
    report = {}
    for name, benchmark in benchmarks.items():
        census = image_census(benchmark)
        ids = benchmark_coco_ids(census, vg_to_coco)
        overlap = sorted(ids & train_ids)
        vg_map = vg_to_coco or {}
        unmapped = [ref for vg, ref in census.visual_genome.items() if vg not in vg_map]
        row: Dict[str, object] = {
            "coco_images": len(ids), "overlap": len(overlap),
            "overlap_percent": 100.0 * len(overlap) / len(ids) if ids else 0.0, "examples": overlap[:5],
            "coco_named_images": len(census.coco), "visual_genome_images": len(census.visual_genome),
            "visual_genome_coco": sum(vg_map.get(vg) is not None for vg in census.visual_genome),
            "visual_genome_unmapped": len(unmapped), "generated_images": len(census.generated),
            "other_images": len(census.other), "unchecked": len(unmapped) + len(census.other),
            "visual_genome_unmapped_examples": [_describe(ref) for ref in unmapped[:3]],
            "other_examples": [_describe(ref) for ref in census.other[:3]]}
        if contents is not None and hashes is not None:
            row.update(_content_overlap(census, contents, hashes))
        report[name] = row
    return report


def _content_overlap(census: ImageCensus, contents: TrainingContents, hashes: ContentHashes) -> Dict[str, object]:
    digests = {_describe(ref): hashes.of_ref(ref) for ref in census.files}
    shared = sorted(name for name, digest in digests.items() if digest in contents.ids_by_digest)
    training_ids = set().union(*(contents.ids_by_digest[digests[name]] for name in shared))
    return {"content_hashed": sum(d is not None for d in digests.values()),
            "content_missing": sum(d is None for d in digests.values()),
            "content_overlap": len(shared), "content_examples": shared[:5],
            "content_training_ids": sorted(training_ids)}


def _describe(ref: ImageRef) -> str:
    return f"{ref.path}#{ref.member}" if ref.member else ref.path


def has_overlap(row: Mapping[str, object]) -> bool:
    return bool(row["overlap"] or row.get("content_overlap"))


def unchecked_lines(report: Mapping[str, Mapping[str, object]], vg_map: Optional[Path] = None,
                    hashing: bool = False) -> List[str]:
    """What the report could not check, one line per benchmark and kind of image."""
    lines = []
    for name, row in report.items():
        if row["visual_genome_unmapped"]:
            why = (f"absent from {vg_map}" if vg_map else
                   f"their COCO ids are unknown without --vg-image-data ({VG_MAP_HELP})")
            lines.append(f"- {name}: {row['visual_genome_unmapped']} Visual Genome images, {why}")
            lines.append(f"  e.g. {', '.join(row['visual_genome_unmapped_examples'])}")
        if row["other_images"]:
            how = ("compared by bytes only (identical files; not re-encoded copies)" if hashing else
                   "not compared (--hash-images compares their bytes with the training files)")
            lines.append(f"- {name}: {row['other_images']} images named by neither COCO nor Visual Genome, {how}")
            lines.append(f"  e.g. {', '.join(row['other_examples'])}")
    return lines


def format_report(report: Mapping[str, Mapping[str, object]], train_images: int, vg_map: Optional[Path] = None,
                  hashing: bool = False) -> str:
    content = hashing and any("content_overlap" in row for row in report.values())
    header = "| benchmark | COCO images | in training | % | VG images | not checked |"
    rule = "|---|---:|---:|---:|---:|---:|"
    if content:
        header, rule = header + " same bytes as training |", rule + "---:|"
    lines = [f"training images: {train_images}", "", header, rule]
    for name, row in report.items():
        cells = [name, row["coco_images"], row["overlap"], f"{row['overlap_percent']:.1f}",
                 row["visual_genome_images"], row["unchecked"]]
        if content:
            cells.append(row.get("content_overlap", ""))
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    unchecked = unchecked_lines(report, vg_map, hashing)
    if unchecked:
        lines += ["", "not checked (overlap among these images cannot be seen):"] + unchecked
    return "\n".join(lines)


# ----- fit's guard ----------------------------------------------------------------------------------------------
def check_training_overlap(train_ids: Set[int], benchmarks: Mapping[str, Benchmark], allow: bool,
                           train_source: str, vg_to_coco: Optional[Mapping[int, Optional[int]]] = None
                           ) -> Dict[str, Dict[str, object]]:
    """fit's guard: raise `TrainingOverlapError` when `benchmarks` share images with the training set, unless
    `allow` (then the overlap is logged as a warning). Returns the per-benchmark report; what it could not check
    is logged (a warning for Visual Genome images, which may well be COCO images).

    Args:
        train_ids: COCO ids of the training images (`config_training_image_ids`).
        benchmarks: the benchmarks scored during training, by name.
        allow: `evaluation.allow_train_overlap`.
        train_source: what the training set is, for the message (the annotation file).
        vg_to_coco: Visual Genome id -> COCO id (`read_vg_coco_map`); None: VG images are not checked.
    """
    report = leakage_report(train_ids, benchmarks, vg_to_coco)
    _log_unchecked(report)
    overlapping = {name: row for name, row in report.items() if row["overlap"]}
    if not overlapping:
        return report
    per_benchmark = "; ".join(f"{name}: {row['overlap']} of its {row['coco_images']} COCO images"
                              for name, row in overlapping.items())
    shared = len(shared_images(train_ids, benchmarks, vg_to_coco))
    message = (f"{shared} training images ({train_source}) are images of the evaluation benchmarks "
               f"({per_benchmark}), so their scores would be partly scores on training images")
    if allow:
        log.warning("%s (evaluation.allow_train_overlap=true)", message)
        return report
    raise TrainingOverlapError(
        f"{message}. Train on data without them (the Karpathy train + restval split of dataset_coco.json, or "
        f"data.exclude_image_ids=DIR/{EXCLUSIONS_FILE} written by python -m evaluation.leakage --config ... "
        f"--out DIR), drop those benchmarks from evaluation.benchmarks, or set "
        f"evaluation.allow_train_overlap=true to train anyway")


def _log_unchecked(report: Mapping[str, Mapping[str, object]]) -> None:
    for name, row in report.items():
        if row["visual_genome_unmapped"]:
            log.warning("leakage guard: %s has %d Visual Genome images whose COCO ids it does not know; overlap "
                        "among them is not checked (python -m evaluation.leakage --vg-image-data FILE checks them)",
                        name, row["visual_genome_unmapped"])
        if row["other_images"]:
            log.info("leakage guard: %s has %d images named by neither COCO nor Visual Genome; not checked",
                     name, row["other_images"])


def shared_images(train_ids: Set[int], benchmarks: Mapping[str, Benchmark],
                  vg_to_coco: Optional[Mapping[int, Optional[int]]] = None) -> Set[int]:
    """The distinct training images that are COCO images of any of the benchmarks (named, or mapped from VG)."""
    return set().union(*(benchmark_coco_ids(image_census(b), vg_to_coco) & train_ids for b in benchmarks.values()))


def write_outputs(out: Path, report: Mapping[str, Mapping[str, object]], benchmarks: Mapping[str, Benchmark],
                  vg_to_coco: Optional[Mapping[int, Optional[int]]]) -> None:
    """`out/REPORT_FILE` and `out/EXCLUSIONS_FILE`: every benchmark COCO id (named, mapped from VG, or a training
    image whose bytes a benchmark image has)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / REPORT_FILE, json.dumps(report, indent=2))
    excluded = set().union(*(benchmark_coco_ids(image_census(b), vg_to_coco) for b in benchmarks.values()))
    excluded |= {i for row in report.values() for i in row.get("content_training_ids", [])}
    atomic_write_text(out / EXCLUSIONS_FILE, json.dumps(sorted(excluded)))
    print(f"wrote the overlap report to {out / REPORT_FILE} and {len(excluded)} evaluation image ids to "
          f"{out / EXCLUSIONS_FILE} (use data.exclude_image_ids={out / EXCLUSIONS_FILE})")


# ----- the command ----------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, object]]:
    args = parse_args(argv)
    if args.hash_images and args.train and args.train_images is None:
        raise SystemExit("--hash-images with --train needs --train-images DIR (the folder the file names of the "
                         "training annotations are relative to)")
    try:
        vg_to_coco = read_vg_coco_map(args.vg_image_data) if args.vg_image_data else None
    except (OSError, ValueError) as error:
        raise SystemExit(str(error)) from None
    if args.config:
        training = config_training_set(load_config_or_exit(args.config, args.overrides).data)
    else:
        records = [r for path in args.train for r in read_annotation_file(str(path), args.karpathy_splits.split(","))]
        training = TrainingSet(records, args.train_images)
    benchmarks = select_benchmarks(args)
    train_ids = training.coco_ids
    contents = hashes = None
    if args.hash_images:
        hashes = ContentHashes(args.hash_cache)
        contents = training_contents(training, hashes)
        if contents.missing:
            print(f"{len(contents.missing)} training image files are not on disk and were not hashed, e.g. "
                  f"{', '.join(contents.missing[:3])}", file=sys.stderr)
    report = leakage_report(train_ids, benchmarks, vg_to_coco, contents, hashes)
    if hashes is not None:
        hashes.save()
    print(format_report(report, len(train_ids), args.vg_image_data, args.hash_images))
    if args.out:
        write_outputs(args.out, report, benchmarks, vg_to_coco)
    if args.fail_on_overlap and any(has_overlap(row) for row in report.values()):
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()

"""`python -m perf.table`: the whole results table's time against the unique-embedding floor (and clip_benchmark).

What a researcher waits for is the whole table (`evaluate --all`), not one benchmark. Its cost has a floor: each
distinct image and each distinct text of the whole table embedded once, in full batches, and nothing else. This
measures, side by side in one run and with the same model object:

- **floor**: a fresh scorer embeds one image per distinct image content and one text per distinct token sequence
  of the whole table (as the table run below asked for them), and nothing is scored;
- **table**: every benchmark through the harness with one scorer, as `evaluate --all` runs them (an image or text
  shared by several benchmarks is embedded once);
- **separately**: every benchmark with a fresh scorer (what a harness run benchmark by benchmark pays; each still
  embeds its own images and texts once);
- with `--clip-benchmark`: SugarCrepe, the benchmark of the table LAION's clip_benchmark runs offline (it also has
  Winoground, which it loads from the Hugging Face hub), by clip_benchmark and by the harness on the same files.

The data are the stand-ins (`testkit/standin`, `--items` per benchmark), with every image file rewritten as a
distinct `--image-size` JPEG keyed by what the image is: a COCO image by its id modulo 5,000 (COCO val2017's size)
and a Visual Genome image by its id modulo 2,000, so that SugarCrepe, SugarCrepe++ and What'sUp draw on one COCO
pool and ARO, Cola and CREPE on one Visual Genome pool, as the real benchmarks do; every other file is its own
image. Images embedded in parquet or zip files are kept as written. Random weights: the cost does not depend on
them. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import numpy as np
import torch
from PIL import Image

from core.cli import add_data_root, add_output, add_precision
from evaluation.benchmarks import BENCHMARKS, build_benchmark
from evaluation.benchmarks.base import COCO, VISUAL_GENOME, Benchmark, ImageRef
from evaluation.harness import run_benchmark
from evaluation.scorers import PRECISIONS, ClipScorer
from perf import versus_clip_benchmark
from testkit.standin import STANDINS

DEFAULT_ROOT = Path("runs/perf_table")
COCO_POOL, VG_POOL = 5000, 2000


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS), help="comma-separated registry names "
                        "(default: all)")
    parser.add_argument("--items", type=int, default=40, help="stand-in items per benchmark (default 40)")
    parser.add_argument("--image-size", type=int, default=256, help="side of the rewritten JPEGs (default 256)")
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--num-workers", type=int, default=2)
    add_precision(parser, list(PRECISIONS), default="32-true")
    parser.add_argument("--clip-benchmark", action="store_true",
                        help="also time clip_benchmark on SugarCrepe (installed for that only: see perf.evaluate)")
    add_data_root(parser, default=DEFAULT_ROOT, help=f"where the stand-ins are written (default {DEFAULT_ROOT})")
    add_output(parser, "file", help="JSON report (default runs/perf_table.json)", default=Path("runs/perf_table.json"))
    args = parser.parse_args(argv)
    args.names = [name.strip() for name in args.benchmarks.split(",") if name.strip()]
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}")
    return args


# ---------------------------------------------------------------- the data

def pooled_key(benchmark: Benchmark, path: str) -> str:
    """What an image file stands for: a COCO or Visual Genome image of the shared pools, else the file itself."""
    origin = benchmark.image_origin(ImageRef(path))
    if origin.source == COCO and origin.id is not None:
        return f"coco:{origin.id % COCO_POOL}"
    if origin.source == VISUAL_GENOME and origin.id is not None:
        return f"vg:{origin.id % VG_POOL}"
    return f"file:{path}"


def generated_jpeg(key: str, size: int) -> bytes:
    """A distinct `size` x `size` JPEG for `key` (smooth noise, so that decoding costs what a photo's does)."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))
    small = rng.integers(0, 256, size=(size // 8, size // 8, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((size, size), Image.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def rewrite_images(benchmark: Benchmark, size: int) -> int:
    """Rewrite every plain image file of `benchmark` by what it stands for; returns how many files."""
    paths = sorted({ref.path for ref in benchmark.image_refs()
                    if ref.member is None and not ref.path.endswith(".npy")})
    for path in paths:
        Path(path).write_bytes(generated_jpeg(pooled_key(benchmark, path), size))
    return len(paths)


def prepare_data(args: argparse.Namespace) -> Dict[str, Benchmark]:
    """The stand-ins of the chosen benchmarks, written once per (items, image size) and rebuilt from disk."""
    benchmarks = {}
    for name in args.names:
        root = args.data_root / name
        marker = root / f".table-{args.items}-{args.image_size}.json"
        if not marker.is_file():
            options = STANDINS[name](root, n_items=args.items, seed=0)
            rewrite_images(build_benchmark(name, root, **options), args.image_size)
            marker.write_text(json.dumps(options, default=str))
        benchmarks[name] = build_benchmark(name, root, **json.loads(marker.read_text()))
    return benchmarks


# ---------------------------------------------------------------- the measurements

def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def table_run(benchmarks: Dict[str, Benchmark], scorer: ClipScorer) -> Dict[str, float]:
    """Seconds per benchmark with one scorer for all, in registry order."""
    return {name: run_benchmark(benchmark, scorer).seconds for name, benchmark in benchmarks.items()}


def floor_run(table_scorer: ClipScorer, scorer: ClipScorer) -> float:
    """Seconds for `scorer` to embed one image per distinct content and one text per distinct token sequence that
    the table's scorer embedded, in full batches."""
    images = list({key: ref for ref, key in table_scorer.image_keys._keys.items()}.values())
    texts = list({key: text for text, key in table_scorer.token_keys._keys.items()}.values())
    return timed(lambda: (scorer.embed_images(images, False), scorer.embed_texts(texts, False)))


def measure(benchmarks: Dict[str, Benchmark], make_scorer: Callable[[], ClipScorer]) -> Dict[str, object]:
    table_scorer = make_scorer()
    start = time.perf_counter()
    per_benchmark = table_run(benchmarks, table_scorer)
    table = time.perf_counter() - start
    separately = {name: run_benchmark(benchmark, make_scorer()).seconds for name, benchmark in benchmarks.items()}
    floor = floor_run(table_scorer, make_scorer())
    return {"floor_seconds": floor, "table_seconds": table, "separately_seconds": sum(separately.values()),
            "per_benchmark_table": per_benchmark, "per_benchmark_separately": separately,
            "image_refs": table_scorer.embedded["image_refs"], "images_embedded": table_scorer.embedded["images"],
            "texts_embedded": table_scorer.embedded["texts"]}


def clip_benchmark_side(benchmarks: Dict[str, Benchmark], make_scorer: Callable[[], ClipScorer],
                        args: argparse.Namespace) -> Dict[str, object]:
    """SugarCrepe by clip_benchmark and by the harness, same files and model, alternating (after a warm-up)."""
    cb = versus_clip_benchmark.import_clip_benchmark()
    root = benchmarks["sugarcrepe"].root
    amp = args.precision != "32-true"
    versus_clip_benchmark.clip_benchmark_run(cb, root, make_scorer(), args.batch_size, args.num_workers, amp)
    ours = timed(lambda: run_benchmark(benchmarks["sugarcrepe"], make_scorer()))
    scorer = make_scorer()
    theirs = timed(lambda: versus_clip_benchmark.clip_benchmark_run(cb, root, scorer, args.batch_size,
                                                                    args.num_workers, amp))
    return {"benchmark": "sugarcrepe", "ours_seconds": ours, "clip_benchmark_seconds": theirs,
            "clip_benchmark_version": cb.version}


def format_report(report: Dict[str, object]) -> str:
    floor = report["floor_seconds"]
    rows = [("unique-embedding floor (each distinct image and text once, nothing scored)", floor),
            ("whole table, one scorer (`evaluate --all`)", report["table_seconds"]),
            ("each benchmark with a fresh scorer", report["separately_seconds"])]
    lines = [f"{report['setting']}", "",
             f"{report['benchmarks']} benchmarks; {report['image_refs']} image references, "
             f"{report['images_embedded']} distinct images and {report['texts_embedded']} distinct texts embedded",
             "", "| run | seconds | / floor |", "|---|---:|---:|"]
    lines += [f"| {label} | {seconds:.1f} | {seconds / floor:.2f} |" for label, seconds in rows]
    versus = report.get("clip_benchmark")
    if versus:
        lines += ["", "| SugarCrepe | seconds |", "|---|---:|",
                  f"| ours (`run_benchmark`, fresh scorer) | {versus['ours_seconds']:.1f} |",
                  f"| clip_benchmark {versus['clip_benchmark_version']} | {versus['clip_benchmark_seconds']:.1f} |",
                  "", f"clip_benchmark / ours: {versus['clip_benchmark_seconds'] / versus['ours_seconds']:.2f}x"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    args = parse_args(argv)
    if args.clip_benchmark:
        versus_clip_benchmark.import_clip_benchmark()  # refuse before any work
        if "sugarcrepe" not in args.names:
            raise SystemExit("--clip-benchmark compares on SugarCrepe: keep it among --benchmarks")
    benchmarks = prepare_data(args)
    torch.manual_seed(0)
    base = ClipScorer.from_pretrained(args.model, None, precision=args.precision, batch_size=args.batch_size,
                                      num_workers=args.num_workers)

    def make_scorer() -> ClipScorer:  # same weights, empty embedding caches
        return ClipScorer(base.model, base.tokenizer, base.preprocess, precision=args.precision,
                          batch_size=args.batch_size, num_workers=args.num_workers)

    run_benchmark(next(iter(benchmarks.values())), make_scorer())  # warm-up: first-call costs out of the timings
    report: Dict[str, object] = measure(benchmarks, make_scorer)
    if args.clip_benchmark:
        report["clip_benchmark"] = clip_benchmark_side(benchmarks, make_scorer, args)
    report.update({"benchmarks": len(benchmarks), "items": args.items, "image_size": args.image_size,
                   "setting": f"{args.model} (random weights), {args.precision}, CPU threads "
                              f"{torch.get_num_threads()}, batch {args.batch_size}, {args.num_workers} workers, "
                              f"{args.items} stand-in items per benchmark, {args.image_size}px JPEGs"})
    print(format_report(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""`python -m perf.evaluate`: evaluation throughput (items/s) per benchmark on generated stand-in data.

For each benchmark, stand-in files in the official format are written under `runs/perf_evaluate/<name>/`
and the harness runs end to end with a fresh scorer (so every image and text is encoded). For item
benchmarks the same first `--compare-items` items are also scored the way the reference scripts do (each
item's images and texts encoded on their own, nothing reused), alternating with the harness, and the
ratio of the two medians is printed. With `--sgi paper,paper_overlap,ours18` the first `--sgi-items` items of
each item benchmark are also scored by SGI with each of those crop sets, alternating with the global cosine of
the same model (each scorer fresh, caption parsing included), and the seconds per item of each, their ratio and
the image encodes per image are printed. Random weights: throughput does not depend on them. A benchmark, not a
test.

With `--clip-benchmark`, only SugarCrepe is measured, against LAION's clip_benchmark (installed for that run
only; the command says how when it is absent) on one stand-in, same model and machine, in interleaved rounds,
after checking that both compute the same cosines: see `perf.versus_clip_benchmark`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from core.cli import add_data_root, add_output, add_precision, refuse_renamed
from evaluation.benchmarks import build_benchmark
from evaluation.benchmarks.base import ItemBenchmark, unique
from testkit.standin import STANDINS
from evaluation.harness import run_benchmark
from evaluation.scorers import PRECISIONS, ClipScorer, Scorer
from evaluation.sgi import CROP_SETS, SGIScorer, crops_per_image, parse_grids
from parsers.scene_graph import SceneGraphParser
from perf import versus_clip_benchmark
from perf.versus_clip_benchmark import SUGARCREPE_FIXTURE

DEFAULT_ROOT = Path("runs/perf_evaluate")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmarks", default=",".join(STANDINS), help="comma-separated registry names")
    parser.add_argument("--items", type=int, default=400, help="stand-in items per benchmark")
    parser.add_argument("--compare-items", type=int, default=60, help="items in the side-by-side comparison")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the comparison")
    parser.add_argument("--sgi", default="", help=f"SGI crop sets to time beside the global cosine "
                                                  f"(comma list of {', '.join(CROP_SETS)}; default none)")
    parser.add_argument("--sgi-items", type=int, default=20, help="items in the SGI comparison")
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--num-workers", type=int, default=2)
    add_data_root(parser, default=DEFAULT_ROOT, help=f"where the stand-in data is written and read (default "
                  f"{DEFAULT_ROOT})")
    add_output(parser, "file", help="JSON report (default runs/perf_evaluate.json, or "
                                    "runs/perf_evaluate_clip_benchmark.json with --clip-benchmark)")
    versus = parser.add_argument_group("--clip-benchmark: SugarCrepe, ours against LAION's clip_benchmark")
    versus.add_argument("--clip-benchmark", action="store_true", help="run the comparison (and nothing else)")
    versus.add_argument("--cb-images", type=int, default=40,
                        help="distinct images of the stand-in; every SugarCrepe item of each is kept (~4.8 per image)")
    versus.add_argument("--annotations", type=Path,
                        help="folder of the 7 official SugarCrepe JSON files (default: the fixture "
                             f"tests/data/{SUGARCREPE_FIXTURE}; a path that is not a folder: generated captions)")
    add_precision(versus, list(PRECISIONS), default="32-true",
                  help="ours: ClipScorer precision; clip_benchmark: autocast on unless 32-true (its --no_amp)")
    versus.add_argument("--device", default="cpu")
    versus.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    refuse_renamed(parser, {"--root": "--data-root DIR"})
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = Path("runs/perf_evaluate_clip_benchmark.json" if args.clip_benchmark else "runs/perf_evaluate.json")
    return args


class PerItemScorer(Scorer):
    """The reference scripts' way: encode each item's images and texts every time, batch size = one item."""

    def __init__(self, scorer: ClipScorer):
        self.scorer = scorer

    def score_unique(self, images, texts) -> np.ndarray:
        image = F.normalize(self.scorer.embed_images(images, False), dim=-1)
        text = F.normalize(self.scorer.embed_texts(texts, False), dim=-1)
        return (image @ text.T).numpy()


def write_standin(name: str, root: Path, items: int) -> dict:
    marker = root / name / f".standin-{items}.json"
    if not marker.is_file():
        options = STANDINS[name](root / name, n_items=items, seed=0)
        marker.write_text(json.dumps(options, default=str))  # paths as strings; mappings stay mappings
    return json.loads(marker.read_text())


def harness_seconds(benchmark: ItemBenchmark, items: list, make_scorer) -> float:
    return timed_run(benchmark, items, make_scorer())


def timed_run(benchmark: ItemBenchmark, items: list, scorer: Scorer) -> float:
    """Seconds for `scorer` (fresh) to prepare and score `items` as the harness does."""
    start = time.perf_counter()
    scorer.prepare(unique(r for item in items for r in item.images), unique(t for item in items for t in item.texts))
    for item in items:
        benchmark.outcome(item, scorer.score(item.images, item.texts))
    return time.perf_counter() - start


def per_item_seconds(benchmark: ItemBenchmark, items: list, make_scorer) -> float:
    scorer = PerItemScorer(make_scorer())
    start = time.perf_counter()
    for item in items:
        benchmark.outcome(item, scorer.score(item.images, item.texts))
    return time.perf_counter() - start


def compare(benchmark: ItemBenchmark, count: int, rounds: int, make_scorer) -> Dict[str, float]:
    items = benchmark.items()[:count]
    harness, per_item = [], []
    for _ in range(rounds):  # alternate, so drift in machine load hits both sides alike
        harness.append(harness_seconds(benchmark, items, make_scorer))
        per_item.append(per_item_seconds(benchmark, items, make_scorer))
    h, p = statistics.median(harness), statistics.median(per_item)
    return {"compare_items": len(items), "harness_items_per_s": len(items) / h,
            "per_item_items_per_s": len(items) / p, "speedup": p / h}


def compare_sgi(benchmark: ItemBenchmark, count: int, rounds: int, make_scorer, crop_sets: Sequence[str],
                parser: SceneGraphParser) -> Dict[str, float]:
    """Seconds per item of SGI with each crop set and of the global cosine of the same model on the same items,
    alternating (medians of `rounds`), and the image encodes per image of each."""
    items = benchmark.items()[:count]
    seconds: Dict[str, List[float]] = {"global": [], **{name: [] for name in crop_sets}}
    encodes: Dict[str, float] = {"global": 1.0}
    for _ in range(rounds):
        seconds["global"].append(timed_run(benchmark, items, make_scorer()))
        for name in crop_sets:
            scorer = SGIScorer(make_scorer(), grids=name, parser=parser)
            seconds[name].append(timed_run(benchmark, items, scorer))
            encodes[name] = scorer.describe()["sgi_image_encodes_per_image"]
    per_item = {label: statistics.median(values) / len(items) for label, values in seconds.items()}
    row = {"sgi_items": len(items), "global_s_per_item": per_item["global"]}
    for name in crop_sets:
        row.update({f"sgi_{name}_s_per_item": per_item[name], f"sgi_{name}_ratio": per_item[name] / per_item["global"],
                    f"sgi_{name}_crops": crops_per_image(parse_grids(name)),
                    f"sgi_{name}_image_encodes_per_image": encodes[name]})
    return row


def measure(name: str, args: argparse.Namespace, make_scorer) -> Dict[str, float]:
    options = write_standin(name, args.data_root, args.items)
    benchmark = build_benchmark(name, args.data_root / name, **options)
    result = run_benchmark(benchmark, make_scorer())
    row = {"items": len(result.outcomes), "seconds": result.seconds,
           "items_per_s": len(result.outcomes) / result.seconds}
    if isinstance(benchmark, ItemBenchmark) and args.compare_items:
        row.update(compare(benchmark, args.compare_items, args.rounds, make_scorer))
    if isinstance(benchmark, ItemBenchmark) and args.sgi_sets:
        row.update(compare_sgi(benchmark, args.sgi_items, args.rounds, make_scorer, args.sgi_sets, args.parser))
    return row


def format_table(rows: Dict[str, Dict[str, float]]) -> str:
    lines = ["| benchmark | items | items/s | per-item items/s | speedup |", "|---|---:|---:|---:|---:|"]
    for name, row in rows.items():
        per_item = f"{row['per_item_items_per_s']:.1f}" if "speedup" in row else "-"
        speedup = f"{row['speedup']:.2f}x" if "speedup" in row else "-"
        lines.append(f"| {name} | {row['items']} | {row['items_per_s']:.1f} | {per_item} | {speedup} |")
    return "\n".join(lines)


def format_sgi_table(rows: Dict[str, Dict[str, float]], crop_sets: Sequence[str]) -> str:
    """Seconds per item of SGI beside the global cosine (ratio; image encodes per image)."""
    header = "| benchmark | items | global cosine s/item | " + " | ".join(f"SGI {n} s/item" for n in crop_sets) + " |"
    lines = [header, "|---|---:|---:|" + "---:|" * len(crop_sets)]
    for name, row in rows.items():
        if "sgi_items" not in row:
            continue
        cells = [f"{row[f'sgi_{n}_s_per_item']:.4f} ({row[f'sgi_{n}_ratio']:.1f}x; "
                 f"{row[f'sgi_{n}_image_encodes_per_image']} encodes/image)" for n in crop_sets]
        lines.append(f"| {name} | {row['sgi_items']} | {row['global_s_per_item']:.4f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, float]]:
    args = parse_args(argv)
    if args.clip_benchmark:
        return versus_clip_benchmark.main(args)
    args.sgi_sets = [n.strip() for n in args.sgi.split(",") if n.strip()]
    for crop_set in args.sgi_sets:
        parse_grids(crop_set)  # a bad name fails before any work
    args.parser = SceneGraphParser() if args.sgi_sets else None
    if args.parser is not None:
        args.parser.parse(["a red cube"])  # load spaCy before any timing
    torch.manual_seed(0)
    scorer = ClipScorer.from_pretrained(args.model, None, batch_size=args.batch_size, num_workers=args.num_workers)

    def make_scorer() -> ClipScorer:  # same weights, empty embedding caches
        return ClipScorer(scorer.model, scorer.tokenizer, scorer.preprocess, batch_size=args.batch_size,
                          num_workers=args.num_workers)

    names: List[str] = [n.strip() for n in args.benchmarks.split(",") if n.strip()]
    rows = {}
    for name in names:
        rows[name] = measure(name, args, make_scorer)
        shown = {k: v if isinstance(v, int) else float(f"{v:.4g}") for k, v in rows[name].items()}
        print(f"{name}: {json.dumps(shown)}", flush=True)
    print(f"\n{args.model} (random weights), CPU threads {torch.get_num_threads()}, "
          f"{args.items} stand-in items per benchmark\n")
    print(format_table(rows))
    if args.sgi_sets:
        print(f"\nSGI beside the global cosine (first {args.sgi_items} items, medians of {args.rounds} rounds)\n")
        print(format_sgi_table(rows, args.sgi_sets))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()

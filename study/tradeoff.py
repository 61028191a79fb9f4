"""`python -m study.tradeoff --data-root WORLD --alphas 0,0.25,0.5,0.75,1 --out DIR runs.LABEL=RUN_DIR ...`:
what a method's gain in composition costs in recognition, along its weight interpolation (docs/tradeoff.md).

A curve is a training run (`runs.LABEL=RUN_DIR`) or a published checkpoint (`runs.negclip=zoo:negclip:FILE`, read
by its format from `core/zoo.py`, its pretrained end the model it was fine-tuned from), so a method can be put
beside NegCLIP and DAC on one plot; `bases.LABEL=TAG_OR_PATH` gives a curve another pretrained end.

Each run is scored at theta(alpha) = (1 - alpha) theta_pretrained + alpha theta_finetuned for every alpha (WiSE-FT
with the backbone it started from, in memory: evaluation/interpolation.py), on the world's `--split`:

- composition: the swap set (`shapes_swap`), its `--composition-metric` (default the group score);
- recognition: zero-shot classification of single objects among the split's colour-shape classes (`zeroshot` on
  `WORLD/zeroshot_<split>/`, top-1; `python -m datamodules.shapes.zeroshot` writes it) and image-text retrieval
  over the split's captions (`coco_retrieval`, R@1 averaged over both directions).

Alpha 0 is the pretrained model (the origin of every curve), alpha 1 the run's own export. Written to `--out`:
`<label>/alpha-<alpha>/` per run and alpha, an evaluation results folder with every benchmark's per-item
outcomes (as `python -m evaluation.evaluate` writes them); `tradeoff.md`, `tradeoff.csv` and `tradeoff.json`
(one row per run and alpha: the scores and their change from alpha 0) and `tradeoff.png` (per recognition
measure, composition change against recognition change, one curve per run). Every run's export, the world's
files and both ends of every interpolation (same architecture) are checked before the first model is scored.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from core.cli import add_data_root, add_key_values, add_output, add_precision, key_value_sections
from modeling.encoders import ZOO_PREFIX
from modeling.published import zoo_spec
from core.files import atomic_write_bytes, atomic_write_text
from datamodules.shapes.zeroshot import DATASET, zeroshot_root
from evaluation.benchmarks import MissingBenchmarkData
from evaluation.benchmarks.base import Benchmark
from evaluation.benchmarks.retrieval import CocoRetrieval
from evaluation.benchmarks.two_by_two import ShapesSwap
from evaluation.benchmarks.zeroshot import ZeroShotClassification
from evaluation.harness import BenchmarkResult, check_all_images, run_benchmark, write_results
from evaluation.interpolation import (Endpoints, InterpolationError, alpha_folder, interpolated_model, load_endpoints,
                                      parse_alphas, wise_ft_record, zoo_endpoints)
from evaluation.provenance import ProvenanceError, export_provenance, pretrained_provenance, run_export_dir
from evaluation.scorers import PRECISIONS, ClipScorer

RUN_SETTINGS = {"runs": "runs.LABEL=RUN_DIR|zoo:NAME:FILE", "bases": "bases.LABEL=TAG_OR_PATH"}
DEFAULT_ALPHAS = "0,0.25,0.5,0.75,1"
COMPOSITION_METRICS = ("group", "text", "image", "acc_attribute", "acc_relation", "acc_object")
# The recognition measures: (benchmark, how a score is read from its aggregates, axis title).
RECOGNITION = {
    "zeroshot_top1": ("zeroshot", lambda a: a["top1"], "zero-shot top-1"),
    "retrieval_r1": ("coco_retrieval", lambda a: (a["i2t_r1"] + a["t2i_r1"]) / 2, "retrieval R@1 (mean of both ways)"),
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_data_root(parser, required=True, help="the shapes world (with zeroshot_<split>/)")
    add_key_values(parser, dest="rows", help="runs.LABEL=RUN_DIR (a training run) or runs.LABEL=zoo:NAME:FILE (a "
                   "published checkpoint, core/zoo.py): one curve each, in the order given; bases.LABEL=TAG_OR_PATH: "
                   "that curve's pretrained end instead of the one it started from")
    parser.add_argument("--alphas", type=parse_alphas, default=parse_alphas(DEFAULT_ALPHAS),
                        help=f"weights of the fine-tuned end, in [0, 1] (default {DEFAULT_ALPHAS})")
    parser.add_argument("--split", default="test", help="the world's split scored (default test)")
    parser.add_argument("--composition-metric", choices=COMPOSITION_METRICS, default="group",
                        help="the swap set's score on the composition axis (default group)")
    add_output(parser, "folder", required=True, help="results folder (per-run results, tables and the plot)")
    parser.add_argument("--device", default="cpu")
    add_precision(parser, list(PRECISIONS), default="32-true")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_intermixed_args(argv)
    settings = key_value_sections(parser, args.rows, RUN_SETTINGS)
    args.runs, args.bases = dict(settings["runs"]), dict(settings["bases"])
    unknown = sorted(set(args.bases) - set(args.runs))
    if unknown:
        parser.error(f"bases.{unknown[0]}: no runs.{unknown[0]} to give a base to")
    if not args.runs:
        parser.error(f"give the runs to trace: {RUN_SETTINGS['runs']} ...")
    if 0.0 not in args.alphas:
        parser.error("--alphas must hold 0: the pretrained model is every curve's origin")
    return args


# ----- inputs, checked before any model is scored ------------------------------------------------------------------
def world_benchmarks(world: Path, split: str) -> Dict[str, Benchmark]:
    """The swap set, the zero-shot set and the caption retrieval of one split of a shapes world."""
    world = Path(world)
    zeroshot = zeroshot_root(world, split)
    if not (zeroshot / "en_zeroshot_classification_templates.json").is_file():
        raise MissingBenchmarkData(f"{world} has no zero-shot set for split {split} ({zeroshot}): write it with "
                                   f"python -m datamodules.shapes.zeroshot --data-root {world}")
    return {"shapes_swap": ShapesSwap(world, split=split),
            "zeroshot": ZeroShotClassification(zeroshot, dataset=DATASET),
            "coco_retrieval": CocoRetrieval(world, annotation_file=f"annotations/captions_{split}.json",
                                            images=world / "images" / split)}


def row_endpoints(source: str, base: Optional[str] = None) -> Tuple[Endpoints, Dict[str, object]]:
    """Both ends of one curve and what identifies its fine-tuned end: a training run's export with the backbone it
    started from, or a published checkpoint (`zoo:NAME:FILE`) with the model it was fine-tuned from; `base` (a tag
    or a path) replaces that pretrained end."""
    if source.startswith(ZOO_PREFIX):
        name, weights = zoo_spec("", source)
        provenance = pretrained_provenance(weights).record
        return zoo_endpoints(name, weights, base), {"zoo": name, **provenance}
    export_dir = run_export_dir(Path(source))
    provenance = export_provenance(export_dir).record
    return load_endpoints(export_dir, base), {"run": source, **provenance}


def check_runs(runs: Dict[str, str], bases: Dict[str, str]) -> None:
    """Every curve's ends load and match (each loaded once, let go): a run has an export, a zoo file is there and
    reads by its format."""
    problems = []
    for label, source in runs.items():
        try:
            row_endpoints(source, bases.get(label))
        except (ProvenanceError, InterpolationError, FileNotFoundError, ValueError, KeyError) as err:
            problems.append(f"runs.{label}={source}: {err}")
    if problems:
        raise SystemExit("the trade-off cannot start:\n  - " + "\n  - ".join(problems))


def check_inputs(args: argparse.Namespace) -> Dict[str, Benchmark]:
    if not Path(args.data_root).is_dir():
        raise SystemExit(f"--data-root {args.data_root}: no such folder")
    try:
        benchmarks = world_benchmarks(args.data_root, args.split)
        check_all_images(benchmarks)
    except MissingBenchmarkData as err:
        raise SystemExit(str(err)) from None
    check_runs(args.runs, args.bases)
    return benchmarks


# ----- scoring ---------------------------------------------------------------------------------------------------
@dataclass
class Point:
    """One run at one alpha: its scores and their change from the run's alpha 0 (the pretrained model)."""

    run: str
    alpha: float
    composition: float
    zeroshot_top1: float
    retrieval_r1: float
    d_composition: float = 0.0
    d_zeroshot_top1: float = 0.0
    d_retrieval_r1: float = 0.0


def score_alpha(endpoints: Endpoints, alpha: float, benchmarks: Dict[str, Benchmark], out: Path,
                args: argparse.Namespace, provenance: Dict[str, object]) -> Dict[str, BenchmarkResult]:
    """Every benchmark on theta(alpha), its per-item outcomes written to `out` as evaluate writes them."""
    record = wise_ft_record(endpoints, alpha)
    scorer = ClipScorer.from_built(interpolated_model(endpoints, alpha), record, device=args.device,
                                   precision=args.precision, batch_size=args.batch_size)
    results = {name: run_benchmark(benchmark, scorer) for name, benchmark in benchmarks.items()}
    metadata = {**scorer.describe(), **provenance, **record, "benchmarks": ",".join(benchmarks)}
    write_results(out, list(results.values()), metadata)
    return results


def point(label: str, alpha: float, results: Dict[str, BenchmarkResult], composition_metric: str) -> Point:
    recognition = {key: read(results[name].aggregates) for key, (name, read, _) in RECOGNITION.items()}
    return Point(label, alpha, results["shapes_swap"].aggregates[composition_metric], **recognition)


def trace_run(label: str, source: str, benchmarks: Dict[str, Benchmark], args: argparse.Namespace) -> List[Point]:
    """The curve's points at every alpha, each as a change from its alpha 0."""
    endpoints, provenance = row_endpoints(source, args.bases.get(label))
    points = []
    for alpha in args.alphas:
        start = time.perf_counter()
        results = score_alpha(endpoints, alpha, benchmarks, args.out / label / alpha_folder(alpha), args, provenance)
        points.append(point(label, alpha, results, args.composition_metric))
        print(f"{label} alpha {alpha:g}: {format_point(points[-1])} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    origin = next(p for p in points if p.alpha == 0.0)
    for p in points:
        p.d_composition = p.composition - origin.composition
        p.d_zeroshot_top1 = p.zeroshot_top1 - origin.zeroshot_top1
        p.d_retrieval_r1 = p.retrieval_r1 - origin.retrieval_r1
    return points


def format_point(p: Point) -> str:
    return f"composition {p.composition:.1f}, zero-shot {p.zeroshot_top1:.1f}, retrieval R@1 {p.retrieval_r1:.1f}"


# ----- the table and the plot --------------------------------------------------------------------------------------
def markdown_table(points: Sequence[Point], composition_metric: str, split: str) -> str:
    header = (f"| run | alpha | swap {composition_metric} | change | zero-shot top-1 | change | retrieval R@1 "
              f"| change |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = [f"| {p.run} | {p.alpha:g} | {p.composition:.1f} | {p.d_composition:+.1f} | {p.zeroshot_top1:.1f} | "
            f"{p.d_zeroshot_top1:+.1f} | {p.retrieval_r1:.1f} | {p.d_retrieval_r1:+.1f} |" for p in points]
    intro = (f"Split `{split}`; alpha 0 is the pretrained model, 1 the run's export; changes are from alpha 0, in "
             f"points.")
    return "\n".join([intro, "", header, *rows]) + "\n"


def csv_text(points: Sequence[Point]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(asdict(points[0])))
    writer.writeheader()
    writer.writerows(asdict(p) for p in points)
    return buffer.getvalue()


def plot(points: Sequence[Point], composition_metric: str, split: str) -> bytes:
    """PNG: per recognition measure, composition change (y) against recognition change (x), one curve per run
    through its alphas, the pretrained model at the origin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(RECOGNITION), figsize=(6 * len(RECOGNITION), 5), squeeze=False)
    runs = list(dict.fromkeys(p.run for p in points))
    for axis, (key, (_, _, title)) in zip(axes[0], RECOGNITION.items()):
        for run in runs:
            curve = sorted((p for p in points if p.run == run), key=lambda p: p.alpha)
            xs, ys = [getattr(p, f"d_{key}") for p in curve], [p.d_composition for p in curve]
            axis.plot(xs, ys, marker="o", label=run)
            axis.annotate(f"alpha {curve[-1].alpha:g}", (xs[-1], ys[-1]), textcoords="offset points",
                          xytext=(4, 4), fontsize=7)
        axis.scatter([0], [0], marker="*", s=150, color="black", zorder=5, label="pretrained")
        axis.axhline(0, color="grey", linewidth=0.5)
        axis.axvline(0, color="grey", linewidth=0.5)
        axis.set_xlabel(f"change in {title} (points)")
        axis.set_ylabel(f"change in swap {composition_metric} score (points)")
        alphas = ", ".join(f"{alpha:g}" for alpha in sorted({p.alpha for p in points}))
        axis.set_title(f"{split}: composition against {title.split(' (')[0]}\n(alpha {alphas} along each curve)",
                       fontsize=10)
        axis.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    plt.close(figure)
    return buffer.getvalue()


def write_outputs(out: Path, points: Sequence[Point], args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "tradeoff.md", markdown_table(points, args.composition_metric, args.split))
    atomic_write_text(out / "tradeoff.csv", csv_text(points))
    document = {"split": args.split, "composition_metric": args.composition_metric,
                "runs": dict(args.runs), "bases": dict(args.bases), "alphas": args.alphas,
                "points": [asdict(p) for p in points]}
    atomic_write_text(out / "tradeoff.json", json.dumps(document, indent=2))
    atomic_write_bytes(out / "tradeoff.png", plot(points, args.composition_metric, args.split))


def main(argv: Optional[Sequence[str]] = None) -> List[Point]:
    args = parse_args(argv)
    benchmarks = check_inputs(args)
    points: List[Point] = []
    for label, source in args.runs.items():
        points += trace_run(label, source, benchmarks, args)
    write_outputs(args.out, points, args)
    print()
    print(markdown_table(points, args.composition_metric, args.split))
    print(f"per-item outcomes in {args.out}/<run>/alpha-<alpha>/; plot {args.out / 'tradeoff.png'}")
    return points


if __name__ == "__main__":
    main()

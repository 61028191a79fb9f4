"""`python -m evaluation.evaluate`: score a model on compositional benchmarks, retrieval, zero-shot, STS.

Examples:
    python -m evaluation.evaluate --run runs/negclip --benchmarks sugarcrepe,aro_vg_relation \
        --data-root /data/benchmarks options.sugarcrepe.images=/data/coco/val2017
    python -m evaluation.evaluate --model ViT-B-32 --pretrained openai --all --data-root /data/benchmarks
    python -m evaluation.evaluate --list
    python -m evaluation.evaluate --run runs/negclip --scorer sgi scorer.global_weight=0.5 \
        --benchmarks sugarcrepe --data-root /data/benchmarks
    python -m evaluation.evaluate --run runs/negclip --alphas 0,0.5,1 --benchmarks sugarcrepe \
        --data-root /data/benchmarks

Each benchmark reads `<data-root>/<name>/` unless `roots.NAME=DIR` says otherwise; `options.NAME.OPTION=VALUE`
passes a constructor option (image folders, splits); both are the keys of a training config's `evaluation:`
section. `--scorer` picks how a model scores an image and a text (`clip`: global cosine, the default; `sgi`:
structure-guided inference), `scorer.OPTION=VALUE` sets one of its options (sgi:
`grids=paper|paper_overlap|ours18|<spec>`, `resize=stretch|pad`, `global_weight=W`). Values are read as YAML. A
scorer that is not the global cosine (sgi) is followed by the global cosine of the same model on the same
benchmarks, timed only (fresh caches, outcomes not written): the seconds per item of both go into the metadata
(`cost_vs_global_cosine`) and the printout, unless `--no-cost-comparison`. Results go to `--out` (default
`<run>/eval`, or `eval/<model>-<pretrained>`, with `-<scorer>` appended for a scorer other than clip): per-item
`<name>/outcomes.jsonl` and `<name>/metadata.json`, `aggregates.json`, `results.md`, `results.csv`, written as
each benchmark finishes: a benchmark that fails is reported by name with its error, the others still run and
are kept, and the exit status is 1. Bad input stops before any model is built, in one line: a `--run` without
an export yet, missing or empty (0-byte) benchmark images; an image that is there but does not decode fails
its benchmark, naming the file (never a skip: a partial benchmark is a wrong number). When a run holds every
part of a registered combined aggregate (`evaluation.benchmarks.COMBINED`, e.g. What'sUp's Table 1 means:
`whatsup_ab` = mean of whatsup_a and whatsup_b), its numbers are written beside the benchmarks' own, and
`--reaggregate` prints them too.

`--alphas A,B,...` (with `--run`) scores the run's weight interpolations (WiSE-FT, `evaluation/interpolation.py`):
theta = (1 - alpha) theta_pretrained + alpha theta_finetuned, the pretrained end being the backbone the run
started from (recorded in its export) or `--pretrained` (an export folder, checkpoint or tag). The interpolated
models are held in memory, never written (`python -m evaluation.interpolation` writes them); each alpha's results
go to `<out>/alpha-<alpha>/` and record the alpha and both ends (`wise_ft`). Two ends of different architectures
are refused before anything is scored.

Every result records what was scored: for `--run` (or `--pretrained` naming an export) the export's training
step (`global_step`) and the sha256 of its weights file (`weights_sha256`), for a local checkpoint its sha256,
for a pretrained tag the tag. A results folder accumulates evaluations; when its benchmarks of one run were
scored from different weights (the run was exported again between two evaluations), every row keeps its own
step and hash (results.csv columns, the results.md weights column), results.md opens with a "mixed weights"
warning listing which benchmarks go with which weights (also printed), `aggregates.json` lists them under
`mixed_weights`, and no combined aggregate averages across them. Nothing is deleted: re-evaluate the stale
benchmarks, or pass a fresh `--out`, to get one table of one set of weights. `--tensorboard` logs the
aggregates at the export's training step (0 without one) and prints the folder it wrote.
"""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

import yaml

from core.cli import (add_data_root, add_key_values, add_output, add_precision, key_value_sections,
                      refuse_renamed)
from modeling.encoders import ZOO_PREFIX
from evaluation.aligner import AlignerScorer, is_aligner_export
from evaluation.benchmarks import BENCHMARKS, COMBINED, MissingBenchmarkData, build_benchmark
from evaluation.benchmarks.base import Benchmark
from evaluation.benchmarks.sources import DataSource
from evaluation.harness import (AGGREGATES_FILE, BenchmarkResult, available_benchmarks, build_benchmarks,
                                check_all_images, combined_aggregates, default_roots, folder_results,
                                log_to_tensorboard, markdown_tables, mixed_weights_message, reaggregate,
                                rewrite_tables, run_benchmark, run_each, write_results)
from evaluation.interpolation import (InterpolationError, alpha_folder, interpolated_model, load_endpoints,
                                      parse_alphas, wise_ft_record, zoo_endpoints)
from evaluation.provenance import Provenance, ProvenanceError, export_provenance, pretrained_provenance, run_export_dir
from evaluation.scorers import PRECISIONS, ClipScorer, Scorer
from evaluation.sgi import SGIScorer

log = logging.getLogger("evaluation.evaluate")

# How a model scores an image and a text. Each class builds from `from_pretrained(name, pretrained, **kwargs)`
# and `from_export(export_dir, **kwargs)`; its `OPTIONS` (none when absent) are the names that
# `--scorer-option` may set. The registry lives here, the composer, because `sgi` imports `scorers`.
SCORERS: Dict[str, Type[Scorer]] = {
    "clip": ClipScorer,
    "sgi": SGIScorer,
}
DEFAULT_SCORER = "clip"


# The key=value settings of evaluate (the leakage guard takes the first two).
BENCHMARK_SETTINGS = {"roots": "roots.NAME=DIR", "options": "options.NAME.OPTION=VALUE"}
SCORER_SETTINGS = {"scorer": "scorer.OPTION=VALUE"}
# Spellings these commands no longer take, and what to write instead.
RENAMED_BENCHMARK_FLAGS = {"--root": "roots.NAME=DIR (a key=value argument)",
                           "--set": "options.NAME.OPTION=VALUE (a key=value argument)"}
RENAMED_SCORER_FLAGS = {"--scorer-option": "scorer.OPTION=VALUE (a key=value argument)"}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--run", type=Path, help="a training run directory (evaluates its export/)")
    model.add_argument("--model", help="open_clip model name (with --pretrained)")
    parser.add_argument("--pretrained", help="open_clip pretrained tag or checkpoint path (with --run --alphas: the "
                        "pretrained end instead of the run's own backbone)")
    parser.add_argument("--alphas", type=parse_alphas, help="with --run: score the weight interpolations (1 - alpha) "
                        "pretrained + alpha fine-tuned for these alphas in [0, 1], e.g. 0,0.5,1 (in memory; results "
                        "in <out>/alpha-<alpha>/)")
    parser.add_argument("--scorer", default=DEFAULT_SCORER, choices=list(SCORERS),
                        help=f"how an image and a text are scored (default {DEFAULT_SCORER})")
    parser.add_argument("--no-cost-comparison", action="store_true",
                        help="do not time the global cosine of the same model beside a non-clip scorer")
    add_benchmark_arguments(parser)
    add_key_values(parser, dest="settings", help="roots.NAME=DIR (one benchmark's folder), "
                   "options.NAME.OPTION=VALUE (a benchmark constructor option), scorer.OPTION=VALUE (sgi: "
                   "grids=paper|paper_overlap|ours18|1,2,3,halves, resize=stretch|pad, global_weight=0.5); "
                   "values read as YAML")
    add_output(parser, "folder", help="results folder (default <run>/eval, or eval/<model>-<pretrained>)")
    parser.add_argument("--tensorboard", type=tensorboard_argument, nargs="?", const=True, default=None,
                        help="also log the aggregates as TensorBoard scalars at the export's training step; prints "
                             "the folder (default: <run>/tb/eval)")
    parser.add_argument("--device", default="cpu")
    add_precision(parser, list(PRECISIONS), default="32-true")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and the files each expects")
    parser.add_argument("--reaggregate", type=Path, metavar="DIR",
                        help="recompute aggregates from a results folder's per-item outcomes and print them")
    refuse_renamed(parser, {**RENAMED_BENCHMARK_FLAGS, **RENAMED_SCORER_FLAGS})
    args = parser.parse_intermixed_args(argv)
    settings = key_value_sections(parser, args.settings, {**BENCHMARK_SETTINGS, **SCORER_SETTINGS})
    args.roots, args.options = benchmark_settings(settings)
    args.scorer_options = {key: yaml.safe_load(value) for key, value in settings["scorer"].items()}
    return args


def tensorboard_argument(value: str) -> Path:
    """--tensorboard's optional folder: a key=value argument after a bare --tensorboard is not one."""
    if "=" in value:
        raise argparse.ArgumentTypeError(f"{value!r} is a key=value argument, not a folder: put it before "
                                         f"--tensorboard, or give --tensorboard a folder")
    return Path(value)


def add_benchmark_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark-selection flags shared with the leakage guard (with `BENCHMARK_SETTINGS` as key=value
    arguments, read by `benchmark_settings`)."""
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--benchmarks", help="comma-separated registry names")
    chosen.add_argument("--all", action="store_true", help="every benchmark whose files are present")
    add_data_root(parser, help="folder holding one sub-folder per benchmark (default data/benchmarks)")


def benchmark_settings(settings: Dict[str, Dict[str, str]]) -> Tuple[Dict[str, Path], Dict[str, Dict[str, object]]]:
    """`roots.sugarcrepe=/data/sc options.sugarcrepe.images=/coco/val2017` -> ({"sugarcrepe": Path("/data/sc")},
    {"sugarcrepe": {"images": "/coco/val2017"}}), option values read as YAML; unknown benchmarks end the program."""
    roots = {name: Path(value) for name, value in settings["roots"].items()}
    options: Dict[str, Dict[str, object]] = {}
    for key, value in settings["options"].items():
        name, dot, option = key.partition(".")
        if not dot or not option:
            raise SystemExit(f"options.{key}={value}: expected options.NAME.OPTION=VALUE")
        options.setdefault(name, {})[option] = yaml.safe_load(value)
    check_names(list(roots) + list(options))
    return roots, options


def check_names(names: Sequence[str]) -> None:
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {', '.join(unknown)}; registered: {', '.join(BENCHMARKS)}")


def list_benchmarks() -> str:
    """Each benchmark's description, the files it expects, where they come from and how large they are, then the
    combined numbers and what each averages."""
    lines = []
    for name, cls in BENCHMARKS.items():
        lines += [f"{name}: {cls.description}", f"    expects under its root: {expected_files(name)}"]
        lines += [f"    {line}" for line in source_lines(name, cls.data_source)]
    lines += ["", "combined numbers (computed from the benchmarks above when they are in one run):"]
    for name, combined in COMBINED.items():
        lines.append(f"{name}: {combined.description}; averages {', '.join(combined.parts)}")
    return "\n".join(lines)


def expected_files(name: str) -> str:
    """The files a benchmark expects under its root (from the error a root without them raises)."""
    try:
        build_benchmark(name, Path("<root>"))
    except MissingBenchmarkData as err:
        return str(err).partition("expected files: ")[2]
    return ""


def source_lines(name: str, source: DataSource) -> List[str]:
    """Where a benchmark's files come from, their licence and size, and how to get them."""
    lines = [f"from: {source.home}", f"licence: {source.licence}", f"size: {source.size}"]
    if source.downloads:
        lines.append(f"fetch: python -m evaluation.fetch {name} ({len(source.downloads)} pinned files, "
                     f"{source.download_bytes / 1e6:.1f} MB)")
    if source.by_hand:
        lines.append(f"by hand: {source.by_hand}")
    return lines


def scorer_options(scorer: str, options: Dict[str, object]) -> Dict[str, object]:
    """The `scorer.OPTION=VALUE` settings ({"global_weight": 0.5}), checked against the scorer's OPTIONS."""
    accepted = getattr(SCORERS[scorer], "OPTIONS", ())
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise SystemExit(f"--scorer {scorer} has no option(s) {', '.join(unknown)}; "
                         f"it accepts: {', '.join(accepted) or 'none'}")
    return options


def build_scorer(args: argparse.Namespace) -> Scorer:
    scorer_class = SCORERS[args.scorer]
    kwargs = dict(device=args.device, precision=args.precision, batch_size=args.batch_size,
                  num_workers=args.num_workers, **scorer_options(args.scorer, args.scorer_options))
    if args.run and args.scorer == DEFAULT_SCORER and is_aligner_export(args.run / "export"):
        # a TFLocal / TFGlobal run: its aligner re-ranks the frozen CLIP (method.rerank_k of the run)
        return AlignerScorer.from_export(args.run / "export", **kwargs)
    if args.run:
        return scorer_class.from_export(args.run / "export", **kwargs)
    if not args.model:
        raise SystemExit("give --run RUN_DIR or --model NAME --pretrained TAG_OR_PATH")
    return scorer_class.from_pretrained(args.model, args.pretrained, **kwargs)


def scorer_suffix(args: argparse.Namespace) -> str:
    """Default folders of a non-default scorer get its name, so they never overwrite the global-cosine ones."""
    return "" if args.scorer == DEFAULT_SCORER else f"-{args.scorer}"


def output_dir(args: argparse.Namespace) -> Path:
    if args.out:
        return args.out
    if args.run:
        return args.run / f"eval{scorer_suffix(args)}"
    weights = Path(str(args.pretrained).split(":", 1)[-1]).stem if args.pretrained else "random"
    label = f"{args.model.replace(':', '-')}-{weights}"
    return Path("eval") / f"{label}{scorer_suffix(args)}"


def weights_provenance(args: argparse.Namespace) -> Provenance:
    """What will be scored (training step, weights hash), read before anything is built; a run without an
    export stops here in one line."""
    if args.run:
        provenance = export_provenance(run_export_dir(args.run))
        provenance.record = {"run": str(args.run), **provenance.record}
        return provenance
    if not args.model:
        raise SystemExit("give --run RUN_DIR or --model NAME --pretrained TAG_OR_PATH")
    provenance = pretrained_provenance(args.pretrained)
    if args.model.startswith(ZOO_PREFIX):  # a published checkpoint: which one, beside its file's hash
        provenance.record = {"zoo": args.model[len(ZOO_PREFIX):], **provenance.record}
    return provenance


def tensorboard_dir(args: argparse.Namespace, out: Path) -> Path:
    if args.tensorboard is not True:
        return args.tensorboard
    return args.run / "tb" / f"eval{scorer_suffix(args)}" if args.run else out / "tb"


def select_benchmarks(args: argparse.Namespace):
    roots, options = default_roots(args.data_root, args.roots), args.options
    if args.all:
        built, skipped = available_benchmarks(roots, options)
        for message in skipped:
            print(f"skipped: {message}", file=sys.stderr)
        if not built:
            raise SystemExit("--all found no benchmark files; see the messages above for what each expects")
        return built
    if not args.benchmarks:
        raise SystemExit("give --benchmarks a,b,c or --all (see --list)")
    names = [name.strip() for name in args.benchmarks.split(",") if name.strip()]
    check_names(names)
    try:
        return build_benchmarks(names, roots, options)
    except MissingBenchmarkData as err:
        raise SystemExit(f"missing benchmark data:\n{err}") from None


def cost_against_global_cosine(benchmarks: Dict[str, Benchmark], results: Sequence[BenchmarkResult],
                               scorer: Scorer, progress: bool = False) -> Dict[str, Dict[str, object]]:
    """Per benchmark, seconds per item of `scorer` beside those of the global cosine of the same model,
    measured in this run: the scorer's `global_cosine_twin()` (same model, device, precision and batching,
    empty caches) scores the same benchmarks right after it, as the scorer did, keeping its caches across
    benchmarks. Empty for a scorer without one (the global cosine itself)."""
    twin = getattr(scorer, "global_cosine_twin", None)
    if twin is None:
        return {}
    baseline = twin()
    cost = {}
    for result in results:
        seconds = run_benchmark(benchmarks[result.name], baseline, progress=progress).seconds
        items = len(result.outcomes)
        cost[result.name] = {"items": items, "seconds_per_item": round(result.seconds / max(items, 1), 6),
                             "global_cosine_seconds_per_item": round(seconds / max(items, 1), 6),
                             "ratio": round(result.seconds / seconds, 2) if seconds > 0 else None}
    return cost


def cost_table(cost: Dict[str, Dict[str, object]]) -> str:
    """The cost comparison as Markdown."""
    lines = ["| benchmark | items | s/item | global cosine s/item | ratio |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {row['items']} | {row['seconds_per_item']:.4f} | "
              f"{row['global_cosine_seconds_per_item']:.4f} | {row['ratio']} |" for name, row in cost.items()]
    return "\n".join(lines)


def print_reaggregated(folder: Path) -> None:
    """Each benchmark's aggregates recomputed from its stored outcomes, then the combined aggregates of those;
    the folder's aggregates.json, results.md and results.csv are written again from them."""
    aggregates = reaggregate(folder)
    for name, values in {**aggregates, **combined_aggregates(aggregates)}.items():
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()})
    rewrite_tables(folder)
    print(f"rewrote {AGGREGATES_FILE}, results.md and results.csv in {folder}")


@dataclass
class Evaluation:
    """One model to score: its scorer (built on demand), its results folder and what its results record."""

    scorer: Callable[[], Scorer]
    out: Path
    record: Dict[str, object]
    step_label: str = ""


def prepare(args: argparse.Namespace) -> Tuple[Provenance, Dict[str, Benchmark], List[Evaluation]]:
    """What is checked before the first benchmark is scored, in one-line errors: the weights (a run without an
    export stops before anything is built), every benchmark's files and images, then the scorer, built from the
    weights that were hashed (with --alphas both ends, refused when their architectures differ)."""
    try:
        provenance = weights_provenance(args)
        benchmarks = select_benchmarks(args)
        check_all_images(benchmarks)
        evaluations = interpolations(args) if args.alphas else [single_evaluation(args)]
        provenance.check_unchanged()
    except (ProvenanceError, MissingBenchmarkData, InterpolationError) as err:
        raise SystemExit(str(err)) from None
    return provenance, benchmarks, evaluations


def single_evaluation(args: argparse.Namespace) -> Evaluation:
    scorer = build_scorer(args)
    return Evaluation(lambda: scorer, output_dir(args), {})


def interpolations(args: argparse.Namespace) -> List[Evaluation]:
    """One evaluation per alpha of the weight interpolation of a run (with the backbone it started from) or of a
    published checkpoint (`--model zoo:NAME --pretrained FILE`, with the model it was fine-tuned from), each scorer
    built when its turn comes."""
    if args.run:
        endpoints = load_endpoints(run_export_dir(args.run), args.pretrained)
    elif (args.model or "").startswith(ZOO_PREFIX):
        endpoints = zoo_endpoints(args.model[len(ZOO_PREFIX):], args.pretrained)
    else:
        raise SystemExit("--alphas interpolates a fine-tuned model with the one it started from: give --run RUN_DIR "
                         "or --model zoo:NAME --pretrained FILE")
    scorer_class = SCORERS[args.scorer]
    kwargs = dict(device=args.device, precision=args.precision, batch_size=args.batch_size,
                  num_workers=args.num_workers, **scorer_options(args.scorer, args.scorer_options))

    def evaluation(alpha: float) -> Evaluation:
        record = wise_ft_record(endpoints, alpha)
        return Evaluation(lambda: scorer_class.from_built(interpolated_model(endpoints, alpha), record, **kwargs),
                          output_dir(args) / alpha_folder(alpha), record, alpha_folder(alpha))

    return [evaluation(alpha) for alpha in args.alphas]


def main(argv: Optional[Sequence[str]] = None) -> List:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.list:
        print(list_benchmarks())
        return []
    if args.reaggregate:
        print_reaggregated(args.reaggregate)
        return []
    provenance, benchmarks, evaluations = prepare(args)
    results, failures = [], []
    for evaluation in evaluations:
        if len(evaluations) > 1:
            print(f"\n{evaluation.step_label}: {evaluation.out}", flush=True)
        scored, failed = evaluate(args, provenance, benchmarks, evaluation)
        results += scored
        failures += [(evaluation, failure) for failure in failed]
    if failures:
        for evaluation, failure in failures:
            print(f"failed: {evaluation.step_label + ' ' if evaluation.step_label else ''}{failure.summary()}",
                  file=sys.stderr)
        kept = f"; the results of the others are in {output_dir(args)}" if results else ""
        raise SystemExit(f"{len(failures)} of {len(benchmarks) * len(evaluations)} benchmarks failed "
                         f"({', '.join(f.name for _, f in failures)}){kept}")
    return results


def evaluate(args: argparse.Namespace, provenance: Provenance, benchmarks: Dict[str, Benchmark],
             evaluation: Evaluation) -> Tuple[List[BenchmarkResult], List]:
    """Score one model on every benchmark, writing each result as it comes, then the tables and the cost."""
    scorer, out = evaluation.scorer(), evaluation.out

    def run_metadata() -> Dict[str, object]:  # a scorer's description counts what it has done so far (sgi)
        return {**scorer.describe(), **provenance.record, **evaluation.record, "benchmarks": ",".join(benchmarks)}

    results, failures = run_each(benchmarks, scorer, lambda result: write_results(out, [result], run_metadata()),
                                 progress=not args.no_progress)
    cost = {} if args.no_cost_comparison else cost_against_global_cosine(benchmarks, results, scorer,
                                                                         progress=not args.no_progress)
    metadata = run_metadata()
    if cost:
        metadata["cost_vs_global_cosine"] = cost
    if results:  # this run's benchmarks again under one final description (the scorer's counts, the cost)
        write_results(out, results, metadata)
    report(out, results, metadata, cost)
    if args.tensorboard is not None and results:
        log_dir = tensorboard_dir(args, output_dir(args)) / evaluation.step_label
        log_to_tensorboard(results, log_dir, step=provenance.record.get("global_step") or 0)
        print(f"TensorBoard events in {log_dir}")
    return results, failures


def report(out: Path, results: Sequence[BenchmarkResult], metadata: Dict[str, object],
           cost: Dict[str, Dict[str, object]]) -> None:
    """This run's tables, then what else the results folder holds and whether it mixes weights."""
    if results:
        print(markdown_tables(results, metadata))
    if cost:
        print(cost_table(cost))
    if not (out / AGGREGATES_FILE).is_file():
        return
    folder, scored_by = folder_results(out, [], {})
    earlier = sorted({r.name for r in folder} - {r.name for r in results})
    if earlier:
        print(f"{out} also holds earlier results of {', '.join(earlier)}; its tables list them all")
    mixed = mixed_weights_message(scored_by)
    if mixed:
        print(mixed, file=sys.stderr)
    print(f"per-item outcomes and {AGGREGATES_FILE} in {out}")


if __name__ == "__main__":
    main()

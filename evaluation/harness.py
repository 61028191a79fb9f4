"""The evaluation harness: run benchmarks with a scorer, store per-item outcomes, aggregate, write tables.

A results folder holds, per benchmark, `<name>/outcomes.jsonl` (one JSON object per item) and, for the run,
`aggregates.json` (every aggregate plus what produced it), `results.md` and `results.csv`. The aggregates
are a pure function of the outcomes: `reaggregate(folder)` recomputes them from the JSONL files. Beside the
benchmarks' own aggregates, the tables carry the registered cross-benchmark aggregates (`COMBINED`, e.g.
What'sUp's A + B mean) whose parts are all in the run; they are a function of the parts' aggregates.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from core.files import atomic_write_text
from evaluation.benchmarks import BENCHMARKS, COMBINED, Benchmark, MissingBenchmarkData, build_benchmark
from evaluation.benchmarks.base import Outcome
from evaluation.benchmarks.base import Scorer
from evaluation.benchmarks.images import missing_files

log = logging.getLogger(__name__)

OUTCOMES_FILE = "outcomes.jsonl"
AGGREGATES_FILE = "aggregates.json"
NAMES_IN_ERROR = 5


@dataclass
class BenchmarkResult:
    name: str
    outcomes: List[Outcome]
    aggregates: Dict[str, float]
    seconds: float


def check_images(benchmark: Benchmark) -> None:
    """Fail before any encoding when images are missing: a partial benchmark gives a silently wrong number."""
    missing = missing_files(benchmark.image_refs())
    if missing:
        shown = ", ".join(missing[:NAMES_IN_ERROR])
        raise MissingBenchmarkData(f"{benchmark.name}: {len(missing)} image files are missing under "
                                   f"{Path(missing[0]).parent} (e.g. {shown}); point the benchmark's images "
                                   f"option at the right folder (--set {benchmark.name}.images=DIR)")


def run_benchmark(benchmark: Benchmark, scorer: Scorer, progress: bool = False) -> BenchmarkResult:
    """Per-item outcomes of `benchmark` under `scorer`, and the aggregates computed from them."""
    check_images(benchmark)
    start = time.perf_counter()
    outcomes = benchmark.outcomes(scorer, progress=progress)
    seconds = time.perf_counter() - start
    return BenchmarkResult(benchmark.name, outcomes, benchmark.aggregate(outcomes), seconds)


def build_benchmarks(names: Sequence[str], roots: Mapping[str, Path],
                     options: Mapping[str, Mapping[str, object]]) -> Dict[str, Benchmark]:
    """Every requested benchmark, or one error listing each that cannot be read (and what it expects)."""
    built, problems = {}, []
    for name in names:
        try:
            built[name] = build_benchmark(name, roots[name], **options.get(name, {}))
        except MissingBenchmarkData as err:
            problems.append(str(err))
    if problems:
        raise MissingBenchmarkData("\n".join(problems))
    return built


def available_benchmarks(roots: Mapping[str, Path], options: Mapping[str, Mapping[str, object]]
                         ) -> tuple[Dict[str, Benchmark], List[str]]:
    """For `--all`: the registered benchmarks whose files exist, and messages for those skipped."""
    built, skipped = {}, []
    for name in BENCHMARKS:
        try:
            built[name] = build_benchmark(name, roots[name], **options.get(name, {}))
        except MissingBenchmarkData as err:
            skipped.append(str(err))
    return built, skipped


def write_results(out_dir: Path, results: Sequence[BenchmarkResult], metadata: Mapping[str, object]
                  ) -> List[BenchmarkResult]:
    """Outcomes JSONL per benchmark of this run, then aggregates JSON, Markdown and CSV of the whole folder.

    A folder accumulates: this run adds or replaces its own benchmarks, and the tables list every benchmark
    whose outcomes are in the folder (earlier ones recomputed from their stored outcomes), each with the
    metadata of the run that scored it. Returns the folder's results, in registry order.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for result in results:
        (out_dir / result.name).mkdir(exist_ok=True)
        lines = "".join(json.dumps(outcome, sort_keys=True) + "\n" for outcome in result.outcomes)
        atomic_write_text(out_dir / result.name / OUTCOMES_FILE, lines)
    folder, scored_by = folder_results(out_dir, results, metadata)
    write_tables(out_dir, folder, scored_by, metadata)
    return folder


def stored_document(out_dir: Path) -> dict:
    """The folder's aggregates.json as written by an earlier run ({} when there is none)."""
    path = Path(out_dir) / AGGREGATES_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def folder_results(out_dir: Path, results: Sequence[BenchmarkResult], metadata: Mapping[str, object]
                   ) -> tuple[List[BenchmarkResult], Dict[str, Mapping[str, object]]]:
    """This run's results plus every other benchmark stored in the folder, and who scored each."""
    stored = stored_document(out_dir)
    earlier = stored.get("benchmarks", {})
    new = {result.name: result for result in results}
    scored_by: Dict[str, Mapping[str, object]] = {name: dict(metadata) for name in new}
    folder = dict(new)
    for name, aggregates in reaggregate(out_dir).items():
        if name in new:
            continue
        entry = earlier.get(name, {})
        folder[name] = BenchmarkResult(name, read_outcomes(out_dir / name / OUTCOMES_FILE), aggregates,
                                       float(entry.get("seconds", 0.0)))
        scored_by[name] = entry.get("metadata", stored.get("metadata", {}))
    order = list(BENCHMARKS)
    names = sorted(folder, key=order.index)
    return [folder[name] for name in names], {name: scored_by[name] for name in names}


def write_tables(out_dir: Path, results: Sequence[BenchmarkResult], scored_by: Mapping[str, Mapping[str, object]],
                 metadata: Mapping[str, object]) -> None:
    """aggregates.json, results.md and results.csv of `results` (atomic writes)."""
    document = {"metadata": dict(metadata),
                "benchmarks": {r.name: {"aggregates": r.aggregates, "items": len(r.outcomes),
                                        "seconds": round(r.seconds, 3), "metadata": dict(scored_by[r.name])}
                               for r in results},
                "combined": {name: {"aggregates": aggregates, "parts": list(COMBINED[name].parts)}
                             for name, aggregates in results_combined(results, scored_by).items()}}
    atomic_write_text(out_dir / AGGREGATES_FILE, json.dumps(_finite(document), indent=2, sort_keys=True))
    atomic_write_text(out_dir / "results.md", markdown_tables(results, metadata, scored_by))
    atomic_write_text(out_dir / "results.csv", csv_table(results, scored_by))


def rewrite_tables(out_dir: Path) -> List[BenchmarkResult]:
    """`--reaggregate`: the folder's tables recomputed from its stored outcomes and written again."""
    folder, scored_by = folder_results(out_dir, [], {})
    write_tables(out_dir, folder, scored_by, stored_document(out_dir).get("metadata", {}))
    return folder


def combined_aggregates(aggregates: Mapping[str, Mapping[str, object]]) -> Dict[str, Dict[str, float]]:
    """Every registered cross-benchmark aggregate whose parts are all among `aggregates` (benchmark -> values)."""
    return {name: combined.compute(aggregates) for name, combined in COMBINED.items()
            if combined.applies_to(aggregates)}


def results_combined(results: Iterable[BenchmarkResult],
                     scored_by: Optional[Mapping[str, Mapping[str, object]]] = None) -> Dict[str, Dict[str, float]]:
    """The combined aggregates of the results; with `scored_by` (a folder holding several runs' benchmarks),
    only those whose parts were all scored by one run: a mean never mixes two models."""
    combined = combined_aggregates({result.name: result.aggregates for result in results})
    if scored_by is None:
        return combined
    return {name: values for name, values in combined.items() if _one_run(COMBINED[name].parts, scored_by)}


def _one_run(parts: Sequence[str], scored_by: Mapping[str, Mapping[str, object]]) -> bool:
    return all(dict(scored_by.get(part, {})) == dict(scored_by.get(parts[0], {})) for part in parts)


def named_aggregates(results: Sequence[BenchmarkResult],
                     scored_by: Optional[Mapping[str, Mapping[str, object]]] = None) -> Dict[str, Mapping[str, object]]:
    """Each benchmark's aggregates, then each applicable combined aggregate's, by name (names never collide)."""
    return {**{result.name: result.aggregates for result in results}, **results_combined(results, scored_by)}


def _finite(value):
    """JSON has no NaN: an empty group's accuracy is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.2f}"
    return str(value)


def markdown_tables(results: Sequence[BenchmarkResult], metadata: Mapping[str, object],
                    scored_by: Optional[Mapping[str, Mapping[str, object]]] = None) -> str:
    """A headline table (one row per benchmark, then one per combined aggregate) and a full table for each.
    Benchmarks scored by a run with other metadata (an earlier evaluation into the same folder) say so."""
    combined = results_combined(results, scored_by)
    items = {result.name: len(result.outcomes) for result in results}
    lines = ["# Evaluation results", "", _describe(metadata), ""]
    others = {name: meta for name, meta in (scored_by or {}).items() if dict(meta) != dict(metadata)}
    lines += [f"- {name} was scored by an earlier run: {_describe(meta)}" for name, meta in others.items()]
    lines += [""] if others else []
    lines += ["| benchmark | items | headline |", "|---|---:|---|"]
    for result in results:
        lines.append(_headline_row(result.name, items[result.name], BENCHMARKS[result.name].headline,
                                   result.aggregates))
    for name, aggregates in combined.items():
        parts = COMBINED[name].parts
        lines.append(_headline_row(f"{name} = mean({', '.join(parts)})", sum(items[part] for part in parts),
                                   COMBINED[name].headline, aggregates))
    for result in results:
        lines += _full_table(result.name, BENCHMARKS[result.name].description, result.aggregates)
    for name, aggregates in combined.items():
        lines += _full_table(name, COMBINED[name].description, aggregates)
    return "\n".join(lines) + "\n"


def _describe(metadata: Mapping[str, object]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in metadata.items())


def _headline_row(name: str, items: int, headline: Sequence[str], aggregates: Mapping[str, object]) -> str:
    shown = ", ".join(f"{key} {_fmt(aggregates.get(key, float('nan')))}" for key in headline or tuple(aggregates))
    return f"| {name} | {items} | {shown} |"


def _full_table(name: str, description: str, aggregates: Mapping[str, object]) -> List[str]:
    return (["", f"## {name}", "", description, "", "| metric | value |", "|---|---:|"]
            + [f"| {key} | {_fmt(value)} |" for key, value in aggregates.items()])


def csv_table(results: Sequence[BenchmarkResult],
              scored_by: Optional[Mapping[str, Mapping[str, object]]] = None) -> str:
    """Long format: benchmark (or combined aggregate), metric, value (empty for an undefined value)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["benchmark", "metric", "value"])
    for name, aggregates in named_aggregates(results, scored_by).items():
        for key, value in aggregates.items():
            finite = not isinstance(value, float) or math.isfinite(value)
            writer.writerow([name, key, value if finite else ""])
    return buffer.getvalue()


def read_outcomes(path: Path) -> List[Outcome]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def reaggregate(out_dir: Path) -> Dict[str, Dict[str, float]]:
    """The aggregates recomputed from each benchmark's stored per-item outcomes."""
    return {path.parent.name: BENCHMARKS[path.parent.name].aggregate(read_outcomes(path))
            for path in sorted(Path(out_dir).glob(f"*/{OUTCOMES_FILE}")) if path.parent.name in BENCHMARKS}


def flat_scalars(results: Iterable[BenchmarkResult], prefix: str = "eval") -> Dict[str, float]:
    """`eval/<benchmark or combined aggregate>/<metric>` -> value, finite numbers only (for loggers)."""
    return {f"{prefix}/{name}/{key}": float(value) for name, aggregates in named_aggregates(list(results)).items()
            for key, value in aggregates.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}


def log_to_tensorboard(results: Sequence[BenchmarkResult], log_dir: Path, step: int = 0) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(log_dir)) as writer:
        for tag, value in flat_scalars(results).items():
            writer.add_scalar(tag, value, global_step=step)


def default_roots(data_root: Optional[Path], overrides: Mapping[str, Path]) -> Dict[str, Path]:
    """Each benchmark's root: an explicit override, else `<data_root>/<name>`."""
    base = Path(data_root) if data_root else Path("data/benchmarks")
    return {name: Path(overrides.get(name, base / name)) for name in BENCHMARKS}


def run_all(benchmarks: Mapping[str, Benchmark], scorer: Scorer, progress: bool = False) -> List[BenchmarkResult]:
    results = []
    for name, benchmark in benchmarks.items():
        log.info("evaluating %s", name)
        results.append(run_benchmark(benchmark, scorer, progress=progress))
        log.info("%s: %d items in %.1f s", name, len(results[-1].outcomes), results[-1].seconds)
    return results

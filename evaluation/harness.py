"""The evaluation harness: run benchmarks with a scorer, store per-item outcomes, aggregate, write tables.

A results folder holds, per benchmark, `<name>/outcomes.jsonl` (one JSON object per item) and
`<name>/metadata.json` (what scored them: model, weights hash and training step, scorer; with the sha256 of
the outcomes file it describes), and, for the folder, `aggregates.json` (every aggregate plus what produced
it), `results.md` and `results.csv`. The aggregates are a pure function of the outcomes: `reaggregate(folder)`
recomputes them from the JSONL files. Beside the benchmarks' own aggregates, the tables carry the registered
cross-benchmark aggregates (`COMBINED`, e.g. What'sUp's A + B mean) whose parts are all in the run; they are a
function of the parts' aggregates.

A folder accumulates evaluations. When the benchmarks of one weights source (a run, export, checkpoint or tag)
in it were scored from different weights (a run exported again after some of them were scored), the tables
keep every row, each with its own step and hash, and say so at the top (`mixed_weights` in aggregates.json);
no combined aggregate mixes them.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from core.files import atomic_write_text
from evaluation.benchmarks import BENCHMARKS, COMBINED, Benchmark, MissingBenchmarkData, build_benchmark
from evaluation.benchmarks.base import Outcome
from evaluation.benchmarks.base import Scorer
from evaluation.benchmarks.images import UnreadableImageError, missing_files
from evaluation.benchmarks.sources import REFERENCE_MODEL, Published
from evaluation.provenance import mixed_weights, weights_label

log = logging.getLogger(__name__)

OUTCOMES_FILE = "outcomes.jsonl"
BENCHMARK_METADATA_FILE = "metadata.json"
AGGREGATES_FILE = "aggregates.json"
NAMES_IN_ERROR = 5
# Errors of a benchmark's input (its files, its images): reported in one line, without a traceback.
INPUT_ERRORS = (MissingBenchmarkData, UnreadableImageError)


@dataclass
class BenchmarkResult:
    name: str
    outcomes: List[Outcome]
    aggregates: Dict[str, float]
    seconds: float


@dataclass
class BenchmarkFailure:
    name: str
    error: BaseException

    def summary(self) -> str:
        return f"{self.name}: {error_line(self.error)}"


def error_line(error: BaseException) -> str:
    """The error in one line. An error re-raised from a DataLoader worker carries the worker's traceback in its
    message; its last line is the original error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if "Original Traceback" in str(error) and lines:
        return re.sub(r"^(?:\w+\.)+(?=\w+: )", "", lines[-1])  # `pkg.module.Error: message` -> `Error: message`
    return f"{type(error).__name__}: {'; '.join(lines)}" if lines else type(error).__name__


def check_images(benchmark: Benchmark) -> None:
    """Fail before any encoding when images are missing or empty: a partial benchmark gives a silently wrong
    number (an image that exists but does not decode stops its benchmark when it is read, naming the file). The
    annotation files are read first: a damaged one (`DamagedBenchmarkData`) stops the run here too."""
    benchmark.read_annotations()
    refs = benchmark.image_refs()
    missing = missing_files(refs)
    if missing:
        shown = ", ".join(missing[:NAMES_IN_ERROR])
        raise MissingBenchmarkData(f"{benchmark.name}: {len(missing)} image files are missing under "
                                   f"{Path(missing[0]).parent} (e.g. {shown}); point the benchmark's images "
                                   f"option at the right folder (options.{benchmark.name}.images=DIR; "
                                   f"evaluation.options.{benchmark.name}.images in a training config)")
    empty = sorted(path for path in {ref.path for ref in refs} if Path(path).stat().st_size == 0)
    if empty:
        shown = ", ".join(empty[:NAMES_IN_ERROR])
        raise MissingBenchmarkData(f"{benchmark.name}: {len(empty)} image files are empty (0 bytes): {shown}; "
                                   f"copy them again from the benchmark's release")


def check_all_images(benchmarks: Mapping[str, Benchmark]) -> None:
    """`check_images` of every benchmark before the first is scored; one error lists every problem."""
    problems = []
    for benchmark in benchmarks.values():
        try:
            check_images(benchmark)
        except MissingBenchmarkData as err:
            problems.append(str(err))
    if problems:
        raise MissingBenchmarkData("\n".join(problems))


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
    """Outcomes JSONL and metadata per benchmark of this run, then aggregates JSON, Markdown and CSV of the
    whole folder (each file written atomically).

    A folder accumulates: this run adds or replaces its own benchmarks, and the tables list every benchmark
    whose outcomes are in the folder (earlier ones recomputed from their stored outcomes), each with the
    metadata of the run that scored it. Returns the folder's results, in registry order.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = plain(metadata)
    for result in results:
        (out_dir / result.name).mkdir(exist_ok=True)
        lines = "".join(json.dumps(outcome, sort_keys=True) + "\n" for outcome in result.outcomes)
        # metadata first: a crash between the two writes leaves a metadata file whose hash does not match the
        # outcomes, read as "scored by an unknown run", never old metadata over new outcomes
        record = {"metadata": metadata, "items": len(result.outcomes), "seconds": round(result.seconds, 3),
                  "outcomes_sha256": hashlib.sha256(lines.encode("utf-8")).hexdigest()}
        atomic_write_text(out_dir / result.name / BENCHMARK_METADATA_FILE, json.dumps(record, indent=2, sort_keys=True))
        atomic_write_text(out_dir / result.name / OUTCOMES_FILE, lines)
    folder, scored_by = folder_results(out_dir, results, metadata)
    write_tables(out_dir, folder, scored_by, metadata)
    return folder


def plain(metadata: Mapping[str, object]) -> Dict[str, object]:
    """`metadata` as it reads back from JSON (tuples become lists), so that stored and fresh records compare."""
    return json.loads(json.dumps(dict(metadata), default=str))


def stored_document(out_dir: Path) -> dict:
    """The folder's aggregates.json as written by an earlier run ({} when there is none)."""
    path = Path(out_dir) / AGGREGATES_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


UNKNOWN_SCORER = {"scored_by": "unknown: its metadata.json does not describe its outcomes.jsonl"}


def stored_scored_by(out_dir: Path, name: str, stored: Mapping[str, object]) -> Tuple[Mapping[str, object], float]:
    """Who scored the stored outcomes of `name` and in how many seconds: its metadata.json when that describes
    the outcomes file as it is now; a folder written before metadata.json existed falls back to aggregates.json."""
    folder = Path(out_dir) / name
    path = folder / BENCHMARK_METADATA_FILE
    if path.is_file():
        record = json.loads(path.read_text())
        outcomes_hash = hashlib.sha256((folder / OUTCOMES_FILE).read_bytes()).hexdigest()
        if record.get("outcomes_sha256") != outcomes_hash:
            return UNKNOWN_SCORER, float(record.get("seconds", 0.0))
        return record.get("metadata", {}), float(record.get("seconds", 0.0))
    entry = stored.get("benchmarks", {}).get(name, {})
    return entry.get("metadata", stored.get("metadata", {})), float(entry.get("seconds", 0.0))


def folder_results(out_dir: Path, results: Sequence[BenchmarkResult], metadata: Mapping[str, object]
                   ) -> tuple[List[BenchmarkResult], Dict[str, Mapping[str, object]]]:
    """This run's results plus every other benchmark stored in the folder, and who scored each."""
    stored = stored_document(out_dir)
    new = {result.name: result for result in results}
    scored_by: Dict[str, Mapping[str, object]] = {name: plain(metadata) for name in new}
    folder = dict(new)
    for name, aggregates in reaggregate(out_dir).items():
        if name in new:
            continue
        scored_by[name], seconds = stored_scored_by(out_dir, name, stored)
        folder[name] = BenchmarkResult(name, read_outcomes(out_dir / name / OUTCOMES_FILE), aggregates, seconds)
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
                "combined": {name: {"aggregates": aggregates, "parts": list(COMBINED[name].parts),
                                    "missing": missing_benchmarks(name, [r.name for r in results])}
                             for name, aggregates in results_combined(results, scored_by).items()},
                "mixed_weights": mixed_weights(scored_by)}
    atomic_write_text(out_dir / AGGREGATES_FILE, json.dumps(_finite(document), indent=2, sort_keys=True))
    atomic_write_text(out_dir / "results.md", markdown_tables(results, metadata, scored_by))
    atomic_write_text(out_dir / "results.csv", csv_table(results, scored_by))


def rewrite_tables(out_dir: Path) -> List[BenchmarkResult]:
    """`--reaggregate`: the folder's tables recomputed from its stored outcomes and written again."""
    folder, scored_by = folder_results(out_dir, [], {})
    write_tables(out_dir, folder, scored_by, stored_document(out_dir).get("metadata", {}))
    return folder


def combined_aggregates(aggregates: Mapping[str, Mapping[str, object]]) -> Dict[str, Dict[str, float]]:
    """Every registered combined number that applies to `aggregates` (benchmark -> values), in registry order, so
    that a composite can average earlier combined numbers (vl_compo's `comp_avg` takes ARO's mean of four)."""
    available: Dict[str, Mapping[str, object]] = dict(aggregates)
    combined: Dict[str, Dict[str, float]] = {}
    for name, aggregate in COMBINED.items():
        if aggregate.applies_to(available):
            combined[name] = available[name] = aggregate.compute(available)
    return combined


def benchmark_parts(name: str) -> List[str]:
    """The registry benchmarks a benchmark or combined name stands on (a composite's composites resolved)."""
    if name in BENCHMARKS:
        return [name]
    return list(dict.fromkeys(leaf for part in COMBINED[name].parts for leaf in benchmark_parts(part)))


def missing_benchmarks(name: str, present: Iterable[str]) -> List[str]:
    """The benchmarks under combined number `name` that are not among `present`: what its mean lacks."""
    present = set(present)
    return [leaf for leaf in benchmark_parts(name) if leaf not in present]


def results_combined(results: Iterable[BenchmarkResult],
                     scored_by: Optional[Mapping[str, Mapping[str, object]]] = None) -> Dict[str, Dict[str, float]]:
    """The combined aggregates of the results; with `scored_by` (a folder holding several runs' benchmarks),
    only those whose parts present were all scored by one run: a mean never mixes two models."""
    results = list(results)
    combined = combined_aggregates({result.name: result.aggregates for result in results})
    if scored_by is None:
        return combined
    present = {result.name for result in results}
    return {name: values for name, values in combined.items()
            if _one_run([leaf for leaf in benchmark_parts(name) if leaf in present], scored_by)}


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
    """A headline table (one row per benchmark with the weights that scored it, then one per combined
    aggregate) and a full table for each. Benchmarks scored by a run with other metadata (an earlier evaluation
    into the same folder) say so; benchmarks of one weights source scored from different weights are listed
    first, under a warning."""
    combined = results_combined(results, scored_by)
    items = {result.name: len(result.outcomes) for result in results}
    weights = {result.name: weights_label((scored_by or {}).get(result.name, metadata)) for result in results}
    lines = ["# Evaluation results", "", _describe(metadata), ""]
    lines += _mixed_weights_warning(scored_by or {})
    others = {name: meta for name, meta in (scored_by or {}).items() if plain(meta) != plain(metadata)}
    lines += [f"- {name} was scored by an earlier run: {_describe(meta)}" for name, meta in others.items()]
    lines += [""] if others else []
    lines += [f"| benchmark | items | headline | {REFERENCE_MODEL}, published | weights |", "|---|---:|---|---|---|"]
    for result in results:
        benchmark = BENCHMARKS[result.name]
        lines.append(_headline_row(result.name, items[result.name], benchmark.headline, result.aggregates,
                                   benchmark.published, weights[result.name]))
    for name, aggregates in combined.items():
        leaves = [leaf for leaf in benchmark_parts(name) if leaf in items]
        label = f"{name} = mean({', '.join(COMBINED[name].parts)})"
        lacking = missing_benchmarks(name, items)
        if lacking:
            label += f"; lacks {', '.join(lacking)}"
        lines.append(_headline_row(label, sum(items[leaf] for leaf in leaves), COMBINED[name].headline, aggregates,
                                   COMBINED[name].published, weights[leaves[0]]))
    if any(BENCHMARKS[r.name].published for r in results) or any(COMBINED[n].published for n in combined):
        lines += ["", f"Published numbers are for {REFERENCE_MODEL} (sources: docs/evaluation.md, "
                      "\"Reference numbers\"); a setup that reproduces them scores that model within a point."]
    for result in results:
        benchmark = BENCHMARKS[result.name]
        lines += _full_table(result.name, benchmark.description, result.aggregates, benchmark.published)
    for name, aggregates in combined.items():
        lines += _full_table(name, COMBINED[name].description, aggregates, COMBINED[name].published)
    return "\n".join(lines) + "\n"


def _mixed_weights_warning(scored_by: Mapping[str, Mapping[str, object]]) -> List[str]:
    lines = []
    for source, weights in mixed_weights(scored_by).items():
        lines.append(f"**Mixed weights**: the benchmarks of {source} in this folder were scored from "
                     f"{len(weights)} different weights; compare them only within one:")
        lines += [f"- {label}: {', '.join(names)}" for label, names in weights.items()]
        lines.append("")
    return lines


def mixed_weights_message(scored_by: Mapping[str, Mapping[str, object]]) -> str:
    """One line per weights source scored from several weights ('' when none): for the CLI's printout."""
    return "\n".join(f"warning: {source} was scored from {len(weights)} different weights in this folder: "
                     + "; ".join(f"{label}: {', '.join(names)}" for label, names in weights.items())
                     for source, weights in mixed_weights(scored_by).items())


def _describe(metadata: Mapping[str, object]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in metadata.items())


def _headline_row(name: str, items: int, headline: Sequence[str], aggregates: Mapping[str, object],
                  published: Mapping[str, Published], weights: str) -> str:
    shown = ", ".join(f"{key} {_fmt(aggregates.get(key, float('nan')))}" for key in headline or tuple(aggregates))
    return f"| {name} | {items} | {shown} | {_published_cell(headline, published)} | {weights} |"


def _published_cell(headline: Sequence[str], published: Mapping[str, Published]) -> str:
    """The published numbers of the headline keys, each with its source ("-" when none is published)."""
    shown = [f"{key} {published[key].value:.2f} ({published[key].source})" for key in headline if key in published]
    return ", ".join(shown) or "-"


def _full_table(name: str, description: str, aggregates: Mapping[str, object],
                published: Mapping[str, Published]) -> List[str]:
    def reference(key: str) -> str:
        return f"{published[key].value:.2f} ({published[key].source})" if key in published else ""

    return (["", f"## {name}", "", description, "", "| metric | value | published |", "|---|---:|---:|"]
            + [f"| {key} | {_fmt(value)} | {reference(key)} |" for key, value in aggregates.items()])


def csv_table(results: Sequence[BenchmarkResult],
              scored_by: Optional[Mapping[str, Mapping[str, object]]] = None) -> str:
    """Long format: benchmark (or combined aggregate), metric, value (empty for an undefined value), and the
    training step and weights sha256 that scored the row (empty when not recorded: a tag, random init)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["benchmark", "metric", "value", "global_step", "weights_sha256"])
    for name, aggregates in named_aggregates(results, scored_by).items():
        present = [leaf for leaf in benchmark_parts(name) if leaf in (scored_by or {})] or [name]
        meta = (scored_by or {}).get(present[0], {})  # a combined row's parts present share one scorer
        scored = [_blank_none(meta.get("global_step")), _blank_none(meta.get("weights_sha256"))]
        for key, value in aggregates.items():
            finite = not isinstance(value, float) or math.isfinite(value)
            writer.writerow([name, key, value if finite else "", *scored])
    return buffer.getvalue()


def _blank_none(value: object) -> object:
    return "" if value is None else value


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


def run_each(benchmarks: Mapping[str, Benchmark], scorer: Scorer, on_result: Callable[[BenchmarkResult], None],
             progress: bool = False) -> Tuple[List[BenchmarkResult], List[BenchmarkFailure]]:
    """`run_all` that survives a failing benchmark: `on_result` gets each result as soon as it is scored (the
    CLI writes it then, so a later failure loses nothing), a failure is logged and recorded, and the remaining
    benchmarks still run. An input error (missing or unreadable files) is logged in one line; anything else
    with its traceback, as a bug to look into."""
    results, failures = [], []
    for name, benchmark in benchmarks.items():
        log.info("evaluating %s", name)
        try:
            result = run_benchmark(benchmark, scorer, progress=progress)
        except Exception as err:  # noqa: BLE001 - every benchmark gets its chance; the failure is reported
            failures.append(BenchmarkFailure(name, err))
            log.error("%s failed: %s", name, error_line(err), exc_info=not isinstance(err, INPUT_ERRORS))
            continue
        log.info("%s: %d items in %.1f s", name, len(result.outcomes), result.seconds)
        on_result(result)
        results.append(result)
    return results, failures

"""The study's analysis: scoring runs (cached with their per-item outcomes), choosing each method's setting on
the validation split, and the summaries and paired differences over seeds (steps 1-4 of `study/cli.py`), the
checks beside each row and the composition / recognition trade-off.

Three readings keep the numbers honest about what they can show:
- a selection flags its chosen setting `edge` when it is the smallest or largest of its grid (the grid does not
  bracket the optimum) and `flat` when the validation curve over the grid is flat within seed noise
  (`selection_flags`);
- a paired difference carries, beside its items x seeds bootstrap, the seed-level paired t (`stats.paired_seed_t`),
  and a claim is read only where both intervals exclude 0 on the same side (`claims`);
- a row whose own term changed no outcome of any of its runs against the baseline's paired runs is inactive
  (`row_activity`): it is shown as such and never read as a result.
"""
from __future__ import annotations

import json
import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from core.files import atomic_write_text
from slurm.runs import RUN_LOG, export_complete
from study.settings import (
    CACHE_FILE,
    CACHE_VERSION,
    FROZEN_DIR,
    NO_CONDITION,
    NO_SEED,
    OUTCOME_FLAGS,
    PAIRED_METRICS,
    RECOGNITION_METRICS,
    RETRIEVAL_METRICS,
    SWAP_METRICS,
    TRADEOFF_METRICS,
    Evaluator,
    GridRun,
    Mechanisms,
    Progress,
    SplitEval,
    Study,
    StudyError,
    StudySettings,
    unique_values,
)
from study.stats import Interval, SeedTest, paired_bootstrap, paired_seed_t, seed_interval


# ----- scoring and its cache --------------------------------------------------------------------------------
def score_splits(export_dir: Path, scorer_name: str, data: Path, splits: Sequence[str]) -> Dict[str, SplitEval]:
    """The real evaluator, the export loaded once: per split the swap set's outcomes (composition), retrieval over
    the split's captions and zero-shot shape and colour classification of its objects (recognition)."""
    from evaluation.benchmarks.retrieval import CocoRetrieval
    from evaluation.benchmarks.two_by_two import ShapesSwap
    from evaluation.benchmarks.zeroshot import ShapesZeroShot
    from evaluation.harness import run_benchmark
    from study.demo import build_scorer

    scorer = build_scorer(Path(export_dir), scorer_name)
    scored = {}
    for split in splits:
        swap = run_benchmark(ShapesSwap(data, split=split), scorer)
        retrieval = run_benchmark(CocoRetrieval(data, annotation_file=f"annotations/captions_{split}.json",
                                                images=Path(data) / "images" / split), scorer)
        zeroshot = run_benchmark(ShapesZeroShot(data, split=split), scorer)
        scored[split] = {"swap_outcomes": [compact_outcome(o) for o in swap.outcomes], "swap": swap.aggregates,
                         "retrieval_outcomes": [[o["direction"], o["rank"], o["ties"]] for o in retrieval.outcomes],
                         "retrieval": retrieval.aggregates,
                         "zeroshot_outcomes": [[o["id"], o["label"], o["rank"], o["ties"]] for o in zeroshot.outcomes],
                         "zeroshot": zeroshot.aggregates}
    return scored


def compact_outcome(outcome: Mapping[str, object]) -> dict:
    """A swap item's outcome as stored: id, type and the comparisons as 0/1."""
    return {"id": str(outcome["id"]), "type": str(outcome["type"]),
            **{flag: int(bool(outcome[flag])) for flag in OUTCOME_FLAGS}}


def files_fingerprint(paths: Sequence[Path], base: Path) -> Dict[str, List[int]]:
    """{relative path: [size, mtime_ns]} of the files that exist (a missing file is simply absent)."""
    return {str(p.relative_to(base)): [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(paths) if p.is_file()}


def export_fingerprint(export_dir: Path) -> Dict[str, List[int]]:
    return files_fingerprint(list(Path(export_dir).rglob("*")), Path(export_dir))


def split_fingerprint(data: Path, split: str) -> dict:
    """What a split's scores depend on in the world: its root and its annotation files (the generator writes
    them after the images, so regenerated images change them too)."""
    files = [Path(data) / "annotations" / f"{kind}_{split}.json" for kind in ("captions", "swap")]
    return {"root": str(Path(data).resolve()), "files": files_fingerprint(files, Path(data))}


@dataclass
class RunScores:
    """A run's (or frozen row's) cached scores per split, and what went wrong while scoring it."""

    splits: Dict[str, SplitEval] = field(default_factory=dict)
    errors: List[str] = field(default_factory=list)
    scored: bool = False  # a split was scored now (not read from the cache)
    measured: bool = False  # mechanism metrics were measured now

    def describe(self, seconds: float) -> str:
        if self.scored:
            return f"scored in {seconds:.1f} s"
        return f"cached, mechanisms measured in {seconds:.1f} s" if self.measured else "cached"


def read_cache(path: Path, export_dir: Path, scorer: str) -> Dict[str, SplitEval]:
    """The cached splits of `path` when it belongs to this export and scorer; {} otherwise."""
    if not path.is_file():
        return {}
    try:
        cache = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}  # a cache written by a killed process: score again
    valid = (cache.get("version") == CACHE_VERSION and cache.get("scorer") == scorer
             and cache.get("export") == export_fingerprint(export_dir))
    return dict(cache.get("splits", {})) if valid else {}


def write_cache(path: Path, export_dir: Path, scorer: str, splits: Mapping[str, SplitEval]) -> None:
    document = {"version": CACHE_VERSION, "scorer": scorer, "export": export_fingerprint(export_dir),
                "splits": dict(splits)}
    atomic_write_text(path, json.dumps(json_safe(document)))


def json_safe(value):
    """JSON has no NaN: an undefined aggregate is stored as null (and read back as NaN by `metric_values`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def cached_scores(cache_path: Path, export_dir: Path, scorer: str, data: Path, splits: Sequence[str],
                  evaluator: Evaluator, mechanisms: Optional[Mechanisms] = None, run_dir: Optional[Path] = None,
                  recompute: bool = False) -> RunScores:
    """The run's scores on `splits`, from its cache where still valid, else scored (and cached).

    With `mechanisms` and `run_dir`, each split also gets the run's mechanism metrics (once; a failure is
    recorded in `errors` and tried again next time, never cached).
    """
    cached = {} if recompute else read_cache(cache_path, export_dir, scorer)
    fingerprints = {split: split_fingerprint(data, split) for split in splits}
    stale = [split for split in splits if cached.get(split, {}).get("data") != fingerprints[split]]
    result = RunScores({split: cached[split] for split in splits if split not in stale}, scored=bool(stale))
    if stale:
        for split, scores in evaluator(export_dir, scorer, data, stale).items():
            result.splits[split] = {"data": fingerprints[split], **scores, "mechanisms": None}
    if mechanisms is not None and run_dir is not None:
        result.measured = add_mechanisms(result, mechanisms, run_dir, data)
    if result.scored or result.measured:
        write_cache(cache_path, export_dir, scorer, {**cached, **result.splits})
    return result


def add_mechanisms(result: RunScores, mechanisms: Mechanisms, run_dir: Path, data: Path) -> bool:
    """Measure the mechanism metrics of every split that lacks them; True when any were measured."""
    measured = False
    for split, scores in result.splits.items():
        if scores.get("mechanisms") is not None:
            continue
        try:
            values = mechanisms(run_dir, data, split)
        except Exception as err:  # a mechanism check must not cost the whole report; it is listed there
            result.errors.append(f"mechanisms on {split}: {type(err).__name__}: {err}")
            continue
        scores["mechanisms"] = {str(key): float(value) for key, value in values.items()}
        measured = True
    return measured


# ----- scoring the study ------------------------------------------------------------------------------------
Curves = Dict[str, Tuple[List[int], List[float]]]  # metric -> (steps, values)
CURVE_PREFIX = "eval/shapes_swap/"
CURVE_METRICS = ("group", "acc_relation", "acc_attribute", "acc_object", "text", "image")


@dataclass
class Evaluations:
    """Everything scored for the report, keyed by grid run name (check runs too) or frozen row label."""

    scores: Dict[str, Dict[str, SplitEval]] = field(default_factory=dict)
    missing: Dict[str, str] = field(default_factory=dict)  # grid run name -> why it has no scores
    errors: Dict[str, List[str]] = field(default_factory=dict)  # run or row -> problems (mechanisms, scoring)
    curves: Dict[str, Curves] = field(default_factory=dict)  # grid run name -> its validation curves

    def metric(self, name: str, split: str, metric: str) -> Optional[float]:
        scores = self.scores.get(name, {}).get(split)
        return None if scores is None else metric_values(scores).get(metric)


def metric_values(scores: SplitEval) -> Dict[str, float]:
    """The report's metrics of one run on one split (NaN where undefined, e.g. no item of a type, or a split
    scored before recognition was)."""
    zeroshot = scores.get("zeroshot") or {}
    values = {**{m: scores["swap"].get(m) for m in SWAP_METRICS},
              **{m: scores["retrieval"].get(m) for m in RETRIEVAL_METRICS},
              **{m: zeroshot.get(m) for m in RECOGNITION_METRICS}}
    return {key: float("nan") if value is None else float(value) for key, value in values.items()}


def read_curves(run_dir: Path) -> Curves:
    """The run's `eval/shapes_swap/<metric>` scalars from its TensorBoard events ({} when it has none); a step
    logged twice (a resumed run) keeps its last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = Path(run_dir) / "tb" / "version_0"
    if not log_dir.is_dir():
        return {}
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    curves = {}
    for tag in events.Tags().get("scalars", []):
        metric = tag[len(CURVE_PREFIX):] if tag.startswith(CURVE_PREFIX) else None
        if metric in CURVE_METRICS:
            points = {event.step: event.value for event in events.Scalars(tag)}
            curves[metric] = (sorted(points), [float(points[step]) for step in sorted(points)])
    return curves


def missing_reason(run: GridRun) -> Optional[str]:
    """Why a grid run cannot be scored (None when its export is complete)."""
    if export_complete(run.directory):
        return None
    if not run.directory.is_dir():
        return "not run (no run directory)"
    log = run.directory / RUN_LOG
    return "no complete export" + (f" (see {log})" if log.is_file() else "")


@dataclass(frozen=True)
class Target:
    """Something to score: a grid run's export (mechanisms measured on its run directory) or a frozen row."""

    name: str
    export: Path
    scorer: str
    cache: Path
    run_dir: Optional[Path] = None  # where mechanism metrics are measured (None: not measured)


def run_target(run: GridRun, with_mechanisms: bool) -> Target:
    return Target(run.name, run.directory / "export", "clip", run.directory / CACHE_FILE,
                  run.directory if with_mechanisms else None)


def frozen_targets(study: Study, stored: Collection[str] = ()) -> List[Target]:
    """One target per frozen row not yet `stored`, each cached under <sweep>/study_frozen/<label>/ (the backbone
    is not ours). A row is scored once: a row whose scores a results bundle holds keeps them, so a later sitting
    on another CPU does not replace them with bits of its own."""
    frozen = study.settings.frozen
    rows = {label: scorer for label, scorer in frozen.rows.items() if label not in stored}
    if rows and not (frozen.export / "model.json").is_file():
        raise StudyError(f"study.frozen.backbone: no export at {frozen.export} (train the backbone first)")
    return [Target(label, frozen.export, scorer, frozen_cache(study, label)) for label, scorer in rows.items()]


def validity_targets(study: Study, stored: Collection[str] = ()) -> List[Target]:
    """One target per validity backbone not yet `stored` (global cosine), cached under
    <sweep>/study_frozen/validity_<i>/. Like a frozen row, a backbone is scored once: one trained again in a later
    sitting (other bits on another CPU) leaves the bundle's scores of the first as they are."""
    validity = study.settings.validity
    pairs = [(name, export) for name, export in zip(validity.names(), validity.backbones) if name not in stored]
    absent = [str(export) for _, export in pairs if not (export / "model.json").is_file()]
    if absent:
        raise StudyError(f"study.validity.backbones: no export at {absent} (train the backbones first)")
    return [Target(name, export, "clip", frozen_cache(study, name)) for name, export in pairs]


def frozen_cache(study: Study, label: str) -> Path:
    return study.directory / FROZEN_DIR / label / CACHE_FILE


def score_targets(targets: Sequence[Target], splits: Sequence[str], data: Path, evaluator: Evaluator,
                  mechanisms: Optional[Mechanisms], evaluations: Evaluations, phase: str, progress: Progress,
                  recompute: bool) -> None:
    """Score each target on `splits` (from its cache where valid) into `evaluations`, a progress line each."""
    for number, target in enumerate(targets, start=1):
        start = time.perf_counter()
        target.cache.parent.mkdir(parents=True, exist_ok=True)
        try:
            result = cached_scores(target.cache, target.export, target.scorer, data, splits, evaluator,
                                   mechanisms, target.run_dir, recompute)
        except Exception as err:  # one broken export must not cost the other runs' report; it is listed there
            problem = f"scoring on {', '.join(splits)} failed: {type(err).__name__}: {err}"
            evaluations.errors.setdefault(target.name, []).append(problem)
            progress(f"[{phase} {number}/{len(targets)}] {target.name}: FAILED, {problem}")
            traceback.print_exc()
            continue
        evaluations.scores.setdefault(target.name, {}).update(result.splits)
        if result.errors:
            evaluations.errors.setdefault(target.name, []).extend(result.errors)
        progress(f"[{phase} {number}/{len(targets)}] {target.name} ({', '.join(splits)}): "
                 f"{result.describe(time.perf_counter() - start)}")


@dataclass
class Stored:
    """Scores kept in a results bundle (`study/bundle.py`) for runs and rows whose folders are not here."""

    runs: Dict[str, Dict[str, SplitEval]] = field(default_factory=dict)  # grid and check runs
    frozen: Dict[str, Dict[str, SplitEval]] = field(default_factory=dict)  # frozen rows, validity backbones
    curves: Dict[str, Curves] = field(default_factory=dict)
    errors: Dict[str, List[str]] = field(default_factory=dict)


def split_runs(runs: Sequence[GridRun], evaluations: Evaluations, stored: Stored) -> List[GridRun]:
    """The runs whose export is here (returned, to be scored); the others take their stored scores and curves
    or are listed as missing. A run with both scores from its folder: the folder is the one that is scored."""
    ready = []
    for run in runs:
        reason = missing_reason(run)
        if reason is None:
            ready.append(run)
            evaluations.curves[run.name] = read_curves(run.directory)
        elif run.name in stored.runs:
            evaluations.scores[run.name] = dict(stored.runs[run.name])
            evaluations.curves[run.name] = stored.curves.get(run.name, {})
            if stored.errors.get(run.name):
                evaluations.errors[run.name] = list(stored.errors[run.name])
        else:
            evaluations.missing[run.name] = reason
    return ready


def evaluate_study(study: Study, evaluator: Evaluator = score_splits, mechanisms: Optional[Mechanisms] = None,
                   progress: Progress = print, recompute: bool = False, stored: Optional[Stored] = None,
                   score_all: bool = False) -> Tuple[Evaluations, Dict[Tuple[str, str], Selection]]:
    """Score the study: every grid run on the selection split, then the chosen settings' runs and the frozen
    rows on the reporting splits, and every check run on the selection split. Returns the scores and the
    selections (see `select_settings`).

    `stored`: scores from a results bundle, for the runs and rows whose folders are not here. `score_all`: score
    (and measure) every run on every split, not only the chosen settings' runs on the reporting splits, so that
    a bundle holds whatever a later selection (with more seeds finished) chooses; the selection reads the
    selection split all the same.

    Cost on two CPU cores (one thread, a 500-item swap split and 500 retrieval images, ViT-Shapes-16-64): about
    6 s per run and split with the global cosine, about 160 s per split for the SGI row.
    """
    settings, evaluations, stored = study.settings, Evaluations(), stored or Stored()
    frozen = frozen_targets(study, stored.frozen) if settings.frozen else []  # a missing backbone stops first
    validity = validity_targets(study, stored.frozen) if settings.validity else []
    ready = split_runs(study.runs, evaluations, stored)
    for label, scores in stored.frozen.items():
        evaluations.scores[label] = dict(scores)
    score_targets([run_target(run, False) for run in ready], [settings.selection_split], settings.data, evaluator,
                  None, evaluations, settings.selection_split, progress, recompute)
    selections = select_settings(study, evaluations)
    chosen = [run for run in ready if run.name in evaluations.scores
              and (score_all or selections[(run.method, run.condition)].chosen == run.setting)]
    score_targets([run_target(run, True) for run in chosen], settings.splits, settings.data, evaluator, mechanisms,
                  evaluations, "report", progress, recompute)
    # Frozen rows have no setting to choose: the selection split would cost them time (SGI: minutes) for nothing.
    score_targets(frozen, settings.splits, settings.data, evaluator, None, evaluations, "frozen", progress,
                  recompute)
    score_targets(validity, settings.splits, settings.data, evaluator, None, evaluations, "validity", progress,
                  recompute)
    checks = split_runs(study.checks, evaluations, stored)
    score_targets([run_target(run, False) for run in checks], [settings.selection_split], settings.data, evaluator,
                  None, evaluations, "checks", progress, recompute)
    return evaluations, selections


# ----- selection on the validation split --------------------------------------------------------------------
@dataclass
class Selection:
    """The setting chosen for one (method, condition), and every setting's validation mean and seed count."""

    chosen: Optional[str]
    validation: Dict[str, Tuple[float, int]]  # setting -> (mean over seeds, seeds), in grid order
    values: Dict[str, Tuple[float, ...]] = field(default_factory=dict)  # setting -> its per-seed values


def select_settings(study: Study, evaluations: Evaluations) -> Dict[Tuple[str, str], Selection]:
    """Per (method, condition), the setting with the best mean selection metric on the selection split.

    Reads nothing but the selection split's scores. A tie goes to the first setting in grid order; a setting
    without a scored run is left out of the choice (and shown with no value).
    """
    split, metric = study.settings.selection_split, study.settings.selection_metric
    selections = {}
    for method in study.methods():
        for condition in study.conditions():
            validation, per_seed = {}, {}
            for setting in study.settings_of(method, condition):
                values = [evaluations.metric(run.name, split, metric) for run in study.runs
                          if (run.method, run.condition, run.setting) == (method, condition, setting)]
                values = [value for value in values if value is not None and math.isfinite(value)]
                validation[setting] = (float(np.mean(values)) if values else math.nan, len(values))
                per_seed[setting] = tuple(values)
            selections[(method, condition)] = Selection(best_setting(validation), validation, per_seed)
    return selections


def best_setting(validation: Mapping[str, Tuple[float, int]]) -> Optional[str]:
    scored = [(mean, -index, setting) for index, (setting, (mean, count)) in enumerate(validation.items()) if count]
    return max(scored)[2] if scored else None


# A validation curve is flat when its best and worst settings' means differ by less than this many standard
# errors of that difference (each setting's seed-level standard error, sd / sqrt(seeds), added in quadrature).
FLAT_MULTIPLE = 2.0


@dataclass(frozen=True)
class SelectionFlags:
    """What a selection can and cannot say. `edge`: the chosen setting is the smallest or largest of its grid, so
    the grid does not bracket the optimum (a setting beyond it might be better). `flat`: the best and worst
    settings' validation means differ by less than FLAT_MULTIPLE standard errors of their difference, so the
    choice is within seed noise (None: fewer than two scored settings, or a setting with fewer than two seeds)."""

    edge: bool
    flat: Optional[bool]
    spread: float  # best mean - worst mean over the scored settings
    noise: float  # FLAT_MULTIPLE x the standard error of that difference

    @property
    def bracketed(self) -> bool:
        return not self.edge

    def labels(self) -> List[str]:
        return ((["not bracketed (edge of the grid)"] if self.edge else ["bracketed"])
                + (["flat within seed noise"] if self.flat else [] if self.flat is False else ["flatness not known"]))


def setting_order(settings: Sequence[str]) -> List[str]:
    """The settings from smallest to largest when each is one `axis=number` (an lr grid), else in grid order."""
    values = {}
    for setting in settings:
        axis, _, value = setting.partition("=")
        try:
            values[setting] = (axis, float(value))
        except ValueError:
            return list(settings)
    if len({axis for axis, _ in values.values()}) != 1:
        return list(settings)
    return sorted(settings, key=lambda setting: values[setting][1])


def standard_error(values: Sequence[float]) -> float:
    return float(np.std(values, ddof=1)) / math.sqrt(len(values))


def selection_flags(selection: Selection) -> Optional[SelectionFlags]:
    """The selection's flags (None when nothing was chosen: no scored run, or a grid of one setting)."""
    if selection.chosen is None or len(selection.validation) < 2:
        return None
    order = setting_order(list(selection.validation))
    edge = selection.chosen in (order[0], order[-1])
    scored = {setting: mean for setting, (mean, count) in selection.validation.items() if count}
    best, worst = max(scored, key=scored.get), min(scored, key=scored.get)
    spread = scored[best] - scored[worst]
    sides = [selection.values.get(setting, ()) for setting in (best, worst)]
    if len(scored) < 2 or any(len(values) < 2 for values in sides):
        return SelectionFlags(edge, None, spread, math.nan)
    noise = FLAT_MULTIPLE * math.sqrt(sum(standard_error(values) ** 2 for values in sides))
    return SelectionFlags(edge, spread < noise, spread, noise)


# ----- summaries over seeds and paired differences -------------------------------------------------------------
@dataclass
class Cell:
    """One report row (a method in a condition, or a frozen row) on one split: its runs' scores by seed."""

    method: str
    condition: str
    split: str
    setting: str
    seeds: Dict[str, SplitEval]
    frozen: bool = False
    sources: Dict[str, str] = field(default_factory=dict)  # seed -> the cache file holding its outcomes


def study_cells(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection]
                ) -> List[Cell]:
    """Every row x reporting split at the chosen setting (rows without a scored run are left out)."""
    cells = []
    for split in study.settings.splits:
        for method in study.methods():
            for condition in study.conditions():
                chosen = selections[(method, condition)].chosen
                runs = [run for run in study.runs
                        if (run.method, run.condition, run.setting) == (method, condition, chosen)
                        and split in evaluations.scores.get(run.name, {})]
                if runs:
                    cells.append(Cell(method, condition, split, chosen,
                                      {run.seed: evaluations.scores[run.name][split] for run in runs},
                                      sources={run.seed: str(run.directory / CACHE_FILE) for run in runs}))
        for label in (study.settings.frozen.rows if study.settings.frozen else {}):
            if split in evaluations.scores.get(label, {}):
                cells.append(Cell(label, NO_CONDITION, split, "-", {NO_SEED: evaluations.scores[label][split]},
                                  frozen=True, sources={NO_SEED: str(frozen_cache(study, label))}))
    return cells


@dataclass(frozen=True)
class Summary:
    """A metric of one cell: mean over seeds with its 95% t-interval."""

    method: str
    condition: str
    split: str
    metric: str
    interval: Interval
    n_seeds: int
    setting: str


def summarise(cell: Cell) -> List[Summary]:
    """The cell's metrics and mechanism metrics, each summarised over its seeds (NaN values left out)."""
    per_seed = [{**metric_values(scores), **{f"mechanism/{key}": value for key, value
                                              in (scores.get("mechanisms") or {}).items()}}
                for scores in cell.seeds.values()]
    keys = unique_values(key for values in per_seed for key in values)
    summaries = []
    for key in keys:
        values = [values[key] for values in per_seed if key in values and math.isfinite(values[key])]
        if values:
            summaries.append(Summary(cell.method, cell.condition, cell.split, key, seed_interval(values),
                                     len(values), cell.setting))
    return summaries


def item_values(outcomes: Sequence[Mapping[str, object]], metric: str) -> Dict[str, float]:
    """Per swap item, its share (x100) of a metric whose mean over items is the aggregate.

    `text` / `image` / `group`: 0 or 100 per item. `acc_<type>`: the mean of the item's two caption choices
    (text_i0, text_i1), over the items of that type only: each item holds two of the 2-way decisions, so the
    mean over items equals the benchmark's `acc_<type>`.
    """
    if metric in ("text", "image", "group"):
        return {str(o["id"]): 100.0 * float(o[metric]) for o in outcomes}
    if metric.startswith("acc_"):
        kind = metric[len("acc_"):]
        return {str(o["id"]): 50.0 * (float(o["text_i0"]) + float(o["text_i1"])) for o in outcomes
                if o["type"] == kind}
    raise StudyError(f"no per-item form of the metric {metric!r}")


def split_item_values(scores: SplitEval, metric: str) -> Dict[str, float]:
    """Per item of one scoring, its share (x100) of `metric`, whose mean over items is the aggregate: the swap
    set's metrics (`item_values`); zero-shot top-1, `shape_top1` / `color_top1` or both attributes pooled
    (`zeroshot_top1`: an item per object and attribute, 100 when the gold class ranks first); R@1 over the
    queries of both retrieval directions (`retrieval_r1`: an item per query, `<direction>:<index in the
    stored order>`, 100 when its rank is 0)."""
    if metric in RECOGNITION_METRICS or metric == "zeroshot_top1":
        prefix = "" if metric == "zeroshot_top1" else metric[:-len("_top1")] + ":"
        return {str(item): 100.0 * (int(rank) == 0) for item, _, rank, _ in scores.get("zeroshot_outcomes") or []
                if str(item).startswith(prefix)}
    if metric == "retrieval_r1":
        values: Dict[str, float] = {}
        counts: Dict[str, int] = {}
        for direction, rank, _ in scores["retrieval_outcomes"]:
            counts[direction] = counts.get(direction, 0) + 1
            values[f"{direction}:{counts[direction] - 1}"] = 100.0 * (int(rank) == 0)
        return values
    return item_values(scores["swap_outcomes"], metric)


def outcome_matrix(cell: Cell, seeds: Sequence[str], metric: str) -> Tuple[List[str], np.ndarray]:
    """[len(seeds), items] per-item values of `metric` (items sorted by id; every seed must hold the same)."""
    rows = [split_item_values(cell.seeds[seed], metric) for seed in seeds]
    ids = sorted(rows[0])
    if any(sorted(row) != ids for row in rows):
        raise StudyError(f"{cell.method} ({cell.condition}) on {cell.split}: the seeds were scored on different items")
    return ids, np.array([[row[item] for item in ids] for row in rows], dtype=np.float64)


@dataclass(frozen=True)
class Comparison:
    """A method minus its reference on the same items and paired seeds, with the paired bootstrap interval and the
    seed-level paired t (`seed`: over the per-seed mean differences; None where it was not computed)."""

    method: str
    condition: str
    reference: str
    split: str
    metric: str
    interval: Interval
    n_seeds: int
    n_items: int
    seed: Optional[SeedTest] = None


def paired_seeds(method: Cell, reference: Cell) -> Tuple[List[str], List[str]]:
    """Seeds paired by label; a frozen reference (one scoring, no seed) pairs with every seed of the method."""
    if reference.frozen:
        return list(method.seeds), [NO_SEED] * len(method.seeds)
    common = [seed for seed in method.seeds if seed in reference.seeds]
    return common, common


def compare(method: Cell, reference: Cell, reference_label: str, metric: str, resamples: int,
            seed: int) -> Optional[Comparison]:
    """The paired items x seeds bootstrap of `metric`, method minus reference (None without a shared seed)."""
    method_seeds, reference_seeds = paired_seeds(method, reference)
    if not method_seeds:
        return None
    ids, values = outcome_matrix(method, method_seeds, metric)
    reference_ids, reference_values = outcome_matrix(reference, reference_seeds, metric)
    if not ids and not reference_ids:  # not scored on this metric (a split scored before recognition was)
        return None
    if ids != reference_ids:
        raise StudyError(f"{method.method} and {reference_label} were scored on different {method.split} items")
    interval = paired_bootstrap(values, reference_values, resamples=resamples, seed=seed)
    return Comparison(method.method, method.condition, reference_label, method.split, metric, interval,
                      len(method_seeds), len(ids), paired_seed_t((values - reference_values).mean(axis=1)))


def reference_of(cell: Cell, settings: StudySettings, cells: Mapping[Tuple[str, str, str], Cell]
                 ) -> Optional[Tuple[str, Cell]]:
    """Whom a cell is compared with: frozen-backbone methods and the other frozen rows with the frozen
    reference, every other method with the baseline in its condition; None for the references themselves."""
    frozen = settings.frozen
    if frozen and (cell.method in frozen.methods or (cell.frozen and cell.method != frozen.reference)):
        reference = cells.get((frozen.reference, NO_CONDITION, cell.split))
        return (frozen.reference, reference) if reference else None
    if cell.frozen or cell.method == settings.baseline:
        return None
    reference = cells.get((settings.baseline, cell.condition, cell.split))
    label = settings.baseline if cell.condition == NO_CONDITION else f"{settings.baseline} ({cell.condition})"
    return (label, reference) if reference else None


def contrast_of(cell: Cell, settings: StudySettings, cells: Mapping[Tuple[str, str, str], Cell]
                ) -> Optional[Tuple[str, Cell]]:
    """The same method in the contrast's reference condition, for a trained cell in its condition; else None."""
    if settings.contrast is None or cell.frozen or cell.condition != settings.contrast[0]:
        return None
    reference = cells.get((cell.method, settings.contrast[1], cell.split))
    return (f"{cell.method} ({settings.contrast[1]})", reference) if reference else None


def comparisons(cells: Sequence[Cell], settings: StudySettings) -> List[Comparison]:
    """Every cell against its reference (`reference_of`) and, with a contrast, against itself in the contrast's
    reference condition (`contrast_of`), for each of PAIRED_METRICS."""
    by_key = {(cell.method, cell.condition, cell.split): cell for cell in cells}
    pairs = [(cell, reference) for cell in cells
             for reference in (reference_of(cell, settings, by_key), contrast_of(cell, settings, by_key)) if reference]
    found = []
    for cell, reference in pairs:
        for metric in PAIRED_METRICS:
            comparison = compare(cell, reference[1], reference[0], metric, settings.resamples,
                                 settings.bootstrap_seed)
            found += [comparison] if comparison else []
    return found


def tradeoffs(cells: Sequence[Cell], settings: StudySettings) -> List[Comparison]:
    """What each row gains in composition and costs in recognition: every trained row, and every frozen row but
    the reference, against the frozen reference (the backbone's global cosine) on TRADEOFF_METRICS, with the
    same paired bootstrap as `comparisons` (none without frozen rows)."""
    frozen = settings.frozen
    if frozen is None:
        return []
    by_key = {(cell.method, cell.condition, cell.split): cell for cell in cells}
    found = []
    for cell in cells:
        reference = by_key.get((frozen.reference, NO_CONDITION, cell.split))
        if reference is None or cell is reference:
            continue
        for metric in TRADEOFF_METRICS:
            comparison = compare(cell, reference, frozen.reference, metric, settings.resamples,
                                 settings.bootstrap_seed)
            found += [comparison] if comparison else []
    return found


# ----- checks beside each row ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckResult:
    """A check run against the grid run it varies (same method, condition, setting and seed) on the selection
    split: the two values and their difference with a paired bootstrap over items (one seed)."""

    check: GridRun
    reference: str  # the grid run's name
    chosen: bool  # the grid run's setting is its row's chosen one (the check stands beside the reported row)
    metric: str
    value: float
    reference_value: float
    interval: Interval
    n_items: int


def check_results(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection]
                  ) -> List[CheckResult]:
    """Every scored check run against its grid run on the selection split, for each of PAIRED_METRICS."""
    split, settings = study.settings.selection_split, study.settings
    grid = {(run.method, run.condition, run.setting, run.seed): run for run in study.runs}
    results = []
    for check in study.checks:
        base = grid.get((check.method, check.condition, check.setting, check.seed))
        mine, theirs = (evaluations.scores.get(run.name, {}).get(split) if run else None for run in (check, base))
        if mine is None or theirs is None:
            continue
        chosen = selections[(base.method, base.condition)].chosen == base.setting
        for metric in PAIRED_METRICS:
            values, reference = split_item_values(mine, metric), split_item_values(theirs, metric)
            ids = sorted(values)
            if ids != sorted(reference):
                raise StudyError(f"check {check.name} and {base.name} were scored on different {split} items")
            interval = paired_bootstrap(np.array([[values[i] for i in ids]]), np.array([[reference[i] for i in ids]]),
                                        resamples=settings.resamples, seed=settings.bootstrap_seed)
            results.append(CheckResult(check, base.name, chosen, metric, metric_values(mine)[metric],
                                       metric_values(theirs)[metric], interval, len(ids)))
    return results


# ----- did a row's own term act? --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Activity:
    """A method's runs against the baseline's runs of the same condition, setting and seed, decision by decision
    on every split both hold (`outcome_keys`). A row none of whose decisions differs is inactive: its own term
    never changed training enough to change one decision, so its scores are the baseline's and not a result of
    the method. The bundle records no direct measure of a term's activity
    (such as the share of steps a hinge fired); this is the measure derived from what it records."""

    method: str
    condition: str
    reference: str  # the baseline's row label
    pairs: int  # run pairs compared
    outcomes: int  # per-item outcomes compared
    differing: int

    @property
    def active(self) -> Optional[bool]:
        """False: inactive; None: no pair to compare."""
        return self.differing > 0 if self.pairs else None


def outcome_keys(scores: SplitEval) -> Dict[str, object]:
    """Every per-item decision of one scoring that a reported number reads, keyed by its kind and item: a swap
    item's flags, whether a retrieval query and a zero-shot object rank their answer first. (A rank deep in a
    retrieval list moves with the last bits of the weights and no number reads it.)"""
    keyed: Dict[str, object] = {f"swap:{o['id']}": tuple(int(o[flag]) for flag in OUTCOME_FLAGS)
                                for o in scores.get("swap_outcomes") or []}
    for index, (direction, rank, _) in enumerate(scores.get("retrieval_outcomes") or []):
        keyed[f"retrieval:{index}:{direction}"] = int(rank) == 0
    for item, _, rank, _ in scores.get("zeroshot_outcomes") or []:
        keyed[f"zeroshot:{item}"] = int(rank) == 0
    return keyed


def row_activity(study: Study, evaluations: Evaluations) -> List[Activity]:
    """The activity of every row compared with the baseline in its condition (not the baseline's own rows, not
    the frozen-backbone methods, which are compared with the frozen reference)."""
    settings = study.settings
    frozen_methods = settings.frozen.methods if settings.frozen else ()
    baseline_runs = {(run.condition, run.setting, run.seed): run for run in study.runs
                     if run.method == settings.baseline}
    found = []
    for method in (m for m in study.methods() if m != settings.baseline and m not in frozen_methods):
        for condition in study.conditions():
            pairs = outcomes = differing = 0
            for run in (r for r in study.runs if (r.method, r.condition) == (method, condition)):
                base = baseline_runs.get((condition, run.setting, run.seed))
                mine, theirs = (evaluations.scores.get(r.name, {}) if r else {} for r in (run, base))
                splits = [split for split in mine if split in theirs]
                if not splits:
                    continue
                pairs += 1
                for split in splits:
                    first, second = outcome_keys(mine[split]), outcome_keys(theirs[split])
                    keys = set(first) | set(second)
                    outcomes += len(keys)
                    differing += sum(1 for key in keys if first.get(key) != second.get(key))
            if pairs:
                label = settings.baseline if condition == NO_CONDITION else f"{settings.baseline} ({condition})"
                found.append(Activity(method, condition, label, pairs, outcomes, differing))
    return found


def inactive_rows(activity: Sequence[Activity]) -> set:
    """(method, condition) of the rows whose own term changed no outcome."""
    return {(a.method, a.condition) for a in activity if a.active is False}


# ----- what a reader may state -----------------------------------------------------------------------------------
def excludes_zero(interval: Interval) -> int:
    """+1 when the interval lies above 0, -1 below, 0 when it holds 0 (or is not defined)."""
    if interval.low > 0:
        return 1
    if interval.high < 0:
        return -1
    return 0


def agreement(comparison: Comparison) -> int:
    """+1 / -1 when the bootstrap and the seed-level t intervals both exclude 0 on that side, else 0."""
    bootstrap = excludes_zero(comparison.interval)
    seed = excludes_zero(comparison.seed.interval) if comparison.seed else 0
    return bootstrap if bootstrap == seed else 0


def claims(differences: Sequence[Comparison], inactive: Collection[Tuple[str, str]]) -> List[Comparison]:
    """The paired differences a reader may state as a difference: both intervals exclude 0 on the same side, and
    the row is not inactive. No correction for the number of comparisons is applied: each is read at 95%."""
    return [c for c in differences if agreement(c) and (c.method, c.condition) not in inactive]


# ----- everything the report shows ------------------------------------------------------------------------------
@dataclass
class Findings:
    """The report's numbers, computed once from the scores: rows per split, their summaries over seeds, the
    paired differences (baseline, frozen reference, contrast), the trade-off, the checks, each selection's flags
    and each row's activity against the baseline."""

    cells: List[Cell]
    summaries: List[Summary]
    differences: List[Comparison]
    tradeoffs: List[Comparison]
    checks: List[CheckResult]
    flags: Dict[Tuple[str, str], Optional[SelectionFlags]] = field(default_factory=dict)
    activity: List[Activity] = field(default_factory=list)

    @property
    def inactive(self) -> set:
        return inactive_rows(self.activity)


def analyse(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection]) -> Findings:
    cells = study_cells(study, evaluations, selections)
    return Findings(cells, [summary for cell in cells for summary in summarise(cell)],
                    comparisons(cells, study.settings), tradeoffs(cells, study.settings),
                    check_results(study, evaluations, selections),
                    {key: selection_flags(selection) for key, selection in selections.items()},
                    row_activity(study, evaluations))

"""`python -m lightning_modules.study --sweep runs/sweeps/NAME [--data-root DIR] [--out DIR]`: the study's report.

A study is a sweep (`slurm/sweep.py`) whose grid axes follow one convention:
- `method`: the method (its label, e.g. `method-clip_ft` -> `clip_ft`, names a report row);
- `negatives`: the condition the methods are compared under (e.g. `with` / `without` hard negatives); optional;
- `seed`: the training seed; seeds are the repeats the intervals are over;
- every other axis (normally `lr`, also e.g. a loss weight) is a hyperparameter *setting*, chosen per method and
  condition on the validation split.

Settings come from the sweep file's `study:` block (copied into sweep.json), every key optional but `data`:

    study:
      data: data/shapes_study          # the world (--data-root overrides); relative paths from the current directory
      baseline: clip_ft                # the method every fine-tuning method is compared with, per condition
      selection: {split: val, metric: group}   # the split and metric the setting is chosen on
      splits: [test, test_unseen]      # the reporting splits (never used for selection)
      frozen:                          # rows scored without training, from one backbone (a run dir or export)
        backbone: runs/study/backbone
        rows: {frozen_cosine: clip, sgi: sgi}  # row label -> scorer (evaluation.evaluate.SCORERS)
        reference: frozen_cosine       # the frozen cosine (default: the one row scored by `clip`)
        methods: [tflocal, tfglobal]   # frozen-backbone methods: compared with the reference, not the baseline
      bootstrap: {resamples: 10000, seed: 0}
      contrast: {condition: with, reference: without}   # optional: what the condition adds to each method
      validity:                        # the testbed validity table (validity.py); optional
        backbones: [runs/study/backbone, runs/study/backbone_seed1]  # run dirs or exports, one per pretraining seed
        control: {method: clip_ft, negatives: with}   # the positive control: a grid cell, at its chosen setting
        criteria: {relation_gain: 15, group_gain: 10, chance_margin: 5, ceiling: 95}  # these are the defaults

What it does, in order:
1. Scores every grid run whose export is complete on the selection split: the shapes swap set (per-item
   outcomes and aggregates) and retrieval over `captions_<split>.json` (R@1 both ways). A grid run without an
   export, or whose scoring fails, is listed in the report as missing (counted), never dropped silently.
2. Chooses, per (method, condition), the setting with the best mean validation metric over seeds (the first in
   grid order on a tie). Only the selection split's numbers enter this choice.
3. Scores the runs of the chosen settings on the reporting splits, with each method's own mechanism metrics
   (`mechanisms(run_dir, data_root, split) -> dict`, `lightning_modules.study.mechanisms.measure`), and the frozen rows
   (nothing to select: reporting splits only), and the validity backbones with the global cosine (`clip`) on
   the reporting splits. The runs of other settings are never scored on a reporting split.
4. Summarises per method x condition x split: the mean and Student-t 95% interval over seeds of each metric
   (`stats.seed_interval`), and the paired items x seeds bootstrap (`stats.paired_bootstrap`) of
   the group score and the 2-way relation accuracy of each method against the baseline in the same condition
   (frozen-backbone methods and the other frozen rows against the frozen reference); with `contrast`, also of
   each method in `contrast.condition` against the same method in `contrast.reference` (seeds paired by label:
   what, say, the hard negatives add to each method, the baseline included).
5. Writes the report folder (`--out`, default `<sweep>/report/`): results.md, results.csv, differences.csv,
   scores_<split>.png, validation_curves.png and tb_hparams/ (`tensorboard --logdir <sweep>/report/tb_hparams`):
   report.py;
   with `validity`, its section in results.md (also printed), rows in results.csv and validity.json.

Each run's scores are cached in `<run>/study_eval.json` with the per-item outcomes they were computed from (an
independent bootstrap can be recomputed from them). The cache is keyed by the export's files (sizes and
modification times), the scorer, and per split the data root and the split's annotation files; anything else is
scored again. The frozen rows are cached under `<sweep>/study_frozen/<row>/`, the validity backbones under
`<sweep>/study_frozen/validity_<i>/` (i: the backbone's place in the list, from 0).
"""
from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from core.cli import add_data_root, add_output, refuse_renamed
from core.files import atomic_write_text
from lightning_modules.study.runs import RUN_LOG, SWEEP_FILE, export_complete
from lightning_modules.study.stats import DEFAULT_RESAMPLES, Interval, paired_bootstrap, seed_interval

CACHE_FILE = "study_eval.json"
CACHE_VERSION = 1
FROZEN_DIR = "study_frozen"
NO_CONDITION = "-"  # the condition of a grid without a `negatives` axis, and of the frozen rows
NO_SEED = "-"
# The axes with a role; every other grid axis is a hyperparameter setting chosen on validation.
ROLE_AXES = ("method", "negatives", "seed")
SWAP_METRICS = ("text", "image", "group", "acc_attribute", "acc_relation", "acc_object")
RETRIEVAL_METRICS = ("i2t_r1", "t2i_r1")
METRICS = SWAP_METRICS + RETRIEVAL_METRICS
# Paired differences: the group score and the 2-way relation accuracy, the two the study is about.
PAIRED_METRICS = ("group", "acc_relation")
# The per-item fields kept in the cache (0/1), the two-by-two protocol's names (two_by_two.py).
OUTCOME_FLAGS = ("text_i0", "text_i1", "image_c0", "image_c1", "text", "image", "group", "tie")

STUDY_KEYS = ("data", "baseline", "selection", "splits", "frozen", "bootstrap", "validity", "contrast")
CONTRAST_KEYS = ("condition", "reference")
SELECTION_KEYS = ("split", "metric")
FROZEN_KEYS = ("backbone", "rows", "reference", "methods")
BOOTSTRAP_KEYS = ("resamples", "seed")
VALIDITY_KEYS = ("backbones", "control", "criteria")
CONTROL_KEYS = ("method", "negatives")
CRITERIA_KEYS = ("relation_gain", "group_gain", "chance_margin", "ceiling")
VALIDITY_PREFIX = "validity_"  # the name (and cache folder) of validity backbone i: validity_<i>

SplitEval = Dict[str, object]  # one run on one split: outcomes, aggregates, mechanisms (see `score_splits`)
Evaluator = Callable[[Path, str, Path, Sequence[str]], Dict[str, SplitEval]]
Mechanisms = Callable[[Path, Path, str], Dict[str, float]]
Progress = Callable[[str], None]


class StudyError(ValueError):
    """A study that cannot be reported; the message names the setting or file and the problem."""


# ----- settings ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FrozenRows:
    """Rows scored from one frozen backbone export without training, and who is compared with them."""

    export: Path
    rows: Dict[str, str]  # label -> scorer name
    reference: str
    methods: Tuple[str, ...]


@dataclass(frozen=True)
class ValiditySettings:
    """The testbed validity table: backbone exports (one per pretraining seed), the positive control cell and
    the pass criteria (the defaults are the method study's criteria, in points: docs/study.md#design)."""

    backbones: Tuple[Path, ...]
    control_method: str
    control_condition: str
    relation_gain: float = 15.0  # (b) control minus backbone, 2-way relation accuracy, at least
    group_gain: float = 10.0  # (b) control minus backbone, swap group score, at least
    chance_margin: float = 5.0  # (a) backbone 2-way relation within this of 50
    ceiling: float = 95.0  # (a) backbone 2-way attribute below this

    def names(self) -> List[str]:
        return [f"{VALIDITY_PREFIX}{index}" for index in range(len(self.backbones))]


@dataclass(frozen=True)
class StudySettings:
    data: Path
    baseline: str = "clip_ft"
    selection_split: str = "val"
    selection_metric: str = "group"
    splits: Tuple[str, ...] = ("test", "test_unseen")
    frozen: Optional[FrozenRows] = None
    resamples: int = DEFAULT_RESAMPLES
    bootstrap_seed: int = 0
    validity: Optional[ValiditySettings] = None
    contrast: Optional[Tuple[str, str]] = None  # (condition, reference condition): each method across the two


def _mapping(value: object, where: str, keys: Sequence[str]) -> dict:
    """`value` as a dict whose keys are all among `keys`, else a StudyError naming the valid ones."""
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise StudyError(f"{where} must be a mapping, got {value!r}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise StudyError(f"{where}: unknown keys {unknown}; valid: {list(keys)}")
    return value


def parse_settings(study: Mapping[str, object], data: Optional[Path] = None) -> StudySettings:
    """The study block of sweep.json as settings (`data` overrides study.data); a bad block is a StudyError."""
    study = _mapping(study, "study", STUDY_KEYS)
    selection = _mapping(study.get("selection"), "study.selection", SELECTION_KEYS)
    bootstrap = _mapping(study.get("bootstrap"), "study.bootstrap", BOOTSTRAP_KEYS)
    root = data if data is not None else study.get("data")
    if root is None:
        raise StudyError("no world to score: set study.data in the sweep file or pass --data-root")
    splits = study.get("splits", StudySettings.splits)
    if not isinstance(splits, (list, tuple)) or not splits or not all(isinstance(s, str) for s in splits):
        raise StudyError(f"study.splits must be a non-empty list of split names, got {splits!r}")
    settings = StudySettings(
        data=Path(root), baseline=str(study.get("baseline", StudySettings.baseline)),
        selection_split=str(selection.get("split", StudySettings.selection_split)),
        selection_metric=str(selection.get("metric", StudySettings.selection_metric)), splits=tuple(splits),
        frozen=parse_frozen(study.get("frozen")), resamples=int(bootstrap.get("resamples", DEFAULT_RESAMPLES)),
        bootstrap_seed=int(bootstrap.get("seed", 0)), validity=parse_validity(study.get("validity")),
        contrast=parse_contrast(study.get("contrast")))
    check_settings(settings)
    return settings


def parse_frozen(frozen: object) -> Optional[FrozenRows]:
    """study.frozen as FrozenRows (None when absent); the reference defaults to the one row scored by `clip`."""
    if frozen is None:
        return None
    frozen = _mapping(frozen, "study.frozen", FROZEN_KEYS)
    rows = frozen.get("rows")
    if not frozen.get("backbone") or not isinstance(rows, dict) or not rows:
        raise StudyError("study.frozen needs a backbone (run directory or export) and rows {label: scorer}")
    from evaluation.evaluate import SCORERS

    unknown = sorted(scorer for scorer in rows.values() if scorer not in SCORERS)
    if unknown:
        raise StudyError(f"study.frozen.rows: unknown scorers {unknown}; registered: {sorted(SCORERS)}")
    cosine_rows = [label for label, scorer in rows.items() if scorer == "clip"]
    reference = frozen.get("reference") or (cosine_rows[0] if len(cosine_rows) == 1 else None)
    if reference not in rows:
        raise StudyError(f"study.frozen.reference must name one of the rows {sorted(rows)} (it defaults to the "
                         f"single row scored by `clip`), got {reference!r}")
    methods = frozen.get("methods") or []
    if not isinstance(methods, list):
        raise StudyError(f"study.frozen.methods must be a list of method labels, got {methods!r}")
    return FrozenRows(backbone_export(Path(frozen["backbone"])), {str(k): str(v) for k, v in rows.items()},
                      str(reference), tuple(str(m) for m in methods))


def parse_contrast(contrast: object) -> Optional[Tuple[str, str]]:
    """study.contrast as (condition, reference condition), both required and different; None when absent."""
    if contrast is None:
        return None
    contrast = _mapping(contrast, "study.contrast", CONTRAST_KEYS)
    if any(not isinstance(contrast.get(key), str) for key in CONTRAST_KEYS):
        raise StudyError(f"study.contrast needs condition and reference, two condition labels; got {contrast!r}")
    if contrast["condition"] == contrast["reference"]:
        raise StudyError(f"study.contrast compares a condition with itself: {contrast!r}")
    return contrast["condition"], contrast["reference"]


def parse_validity(validity: object) -> Optional[ValiditySettings]:
    """study.validity as ValiditySettings (None when absent). The control's `negatives` may be left out only in
    a grid without a `negatives` axis; whether the cell exists is checked against the grid (`check_grid`)."""
    if validity is None:
        return None
    validity = _mapping(validity, "study.validity", VALIDITY_KEYS)
    backbones = validity.get("backbones")
    if not isinstance(backbones, list) or not backbones or not all(isinstance(b, str) and b for b in backbones):
        raise StudyError("study.validity.backbones must be a non-empty list of backbone run directories or exports "
                         f"(one per pretraining seed), got {backbones!r}")
    control = _mapping(validity.get("control"), "study.validity.control", CONTROL_KEYS)
    if not control.get("method"):
        raise StudyError("study.validity.control needs the method of the positive control cell, e.g. "
                         "{method: clip_ft, negatives: with}")
    criteria = _mapping(validity.get("criteria"), "study.validity.criteria", CRITERIA_KEYS)
    bad = {key: value for key, value in criteria.items()
           if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)}
    if bad:
        raise StudyError(f"study.validity.criteria must be numbers (points), got {bad}")
    return ValiditySettings(tuple(backbone_export(Path(b)) for b in backbones), str(control["method"]),
                            str(control.get("negatives", NO_CONDITION)),
                            **{key: float(value) for key, value in criteria.items()})


def backbone_export(path: Path) -> Path:
    """The export folder of `path`: a run directory's `export/`, or `path` itself when it is an export."""
    return path / "export" if (path / "export" / "model.json").is_file() else path


def check_settings(settings: StudySettings) -> None:
    """What the settings must hold on their own (the grid is checked by `check_grid`)."""
    if settings.selection_split in settings.splits:
        raise StudyError(f"the selection split {settings.selection_split!r} is also a reporting split: a "
                         "setting chosen on a split cannot be reported on it")
    if settings.selection_metric not in METRICS:
        raise StudyError(f"study.selection.metric {settings.selection_metric!r} is not one of {list(METRICS)}")
    if settings.resamples < 100:
        raise StudyError(f"study.bootstrap.resamples must be at least 100, got {settings.resamples}")


# ----- the grid ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GridRun:
    """One run of the sweep with its role in the study."""

    name: str
    method: str
    condition: str
    setting: str  # the hyperparameter choice, e.g. "lr=0.0001" ("-" when the grid has none)
    seed: str
    directory: Path


@dataclass
class Study:
    directory: Path
    settings: StudySettings
    runs: List[GridRun]

    def methods(self) -> List[str]:
        return _unique(run.method for run in self.runs)

    def conditions(self) -> List[str]:
        return _unique(run.condition for run in self.runs)

    def settings_of(self, method: str, condition: str) -> List[str]:
        return _unique(run.setting for run in self.runs if (run.method, run.condition) == (method, condition))


def _unique(values) -> list:
    """The distinct values in first-seen (grid) order."""
    return list(dict.fromkeys(values))


def choice_value(axis: str, label: str) -> str:
    """The value of a sweep choice label (`lr-0.0001` on axis `lr` -> `0.0001`)."""
    return label[len(axis) + 1:] if label.startswith(f"{axis}-") else label


def grid_run(entry: Mapping[str, object], sweep_dir: Path) -> GridRun:
    choices = dict(entry.get("choices") or {})
    if "method" not in choices:
        raise StudyError(f"{sweep_dir / SWEEP_FILE}: run {entry['name']} has no `method` axis; a study's grid names "
                         "the method on an axis called `method`")
    values = {axis: choice_value(axis, label) for axis, label in choices.items()}
    setting = ", ".join(f"{axis}={value}" for axis, value in values.items() if axis not in ROLE_AXES) or "-"
    return GridRun(str(entry["name"]), values["method"], values.get("negatives", NO_CONDITION), setting,
                   values.get("seed", NO_SEED), sweep_dir / str(entry["name"]))


def load_study(sweep_dir: Path, data: Optional[Path] = None) -> Study:
    """The study of a sweep directory (its sweep.json), with settings checked against its grid."""
    path = Path(sweep_dir) / SWEEP_FILE
    if not path.is_file():
        raise StudyError(f"{path} does not exist: run `python -m slurm.sweep <sweep.yaml> ...` first")
    document = json.loads(path.read_text())
    settings = parse_settings(document.get("study") or {}, data)
    runs = [grid_run(entry, Path(sweep_dir)) for entry in document["runs"]]
    study = Study(Path(sweep_dir), settings, runs)
    check_grid(study)
    return study


def check_grid(study: Study) -> None:
    methods, settings = study.methods(), study.settings
    named = [settings.baseline] + list(settings.frozen.methods if settings.frozen else [])
    absent = [name for name in named if name not in methods]
    if absent:
        raise StudyError(f"study names methods {absent} that the grid does not have; its methods: {methods}")
    if settings.frozen and set(settings.frozen.rows) & set(methods):
        raise StudyError(f"frozen row labels {sorted(set(settings.frozen.rows) & set(methods))} repeat method labels")
    validity = settings.validity
    if validity:
        cell = (validity.control_method, validity.control_condition)
        cells = _unique((run.method, run.condition) for run in study.runs)
        if cell not in cells:
            raise StudyError(f"study.validity.control {{method: {cell[0]}, negatives: {cell[1]}}} is not a cell of "
                             f"the grid; its cells: {[f'{m} ({c})' for m, c in cells]}")
        taken = set(validity.names()) & set(settings.frozen.rows if settings.frozen else {})
        if taken:
            raise StudyError(f"frozen row labels {sorted(taken)} are the validity backbones' names; rename them")
    absent = [label for label in settings.contrast or () if label not in study.conditions()]
    if absent:
        raise StudyError(f"study.contrast names conditions {absent} that the grid does not have; its conditions: "
                         f"{study.conditions()}")
    if not settings.data.is_dir():
        raise StudyError(f"the world {settings.data} does not exist (study.data or --data-root)")


# ----- scoring and its cache --------------------------------------------------------------------------------
def score_splits(export_dir: Path, scorer_name: str, data: Path, splits: Sequence[str]) -> Dict[str, SplitEval]:
    """The real evaluator: swap-set outcomes and retrieval on each split, the export loaded once."""
    from evaluation.benchmarks.retrieval import CocoRetrieval
    from evaluation.benchmarks.two_by_two import ShapesSwap
    from lightning_modules.demo import build_scorer
    from evaluation.harness import run_benchmark

    scorer = build_scorer(Path(export_dir), scorer_name)
    scored = {}
    for split in splits:
        swap = run_benchmark(ShapesSwap(data, split=split), scorer)
        retrieval = run_benchmark(CocoRetrieval(data, annotation_file=f"annotations/captions_{split}.json",
                                                images=Path(data) / "images" / split), scorer)
        scored[split] = {"swap_outcomes": [compact_outcome(o) for o in swap.outcomes], "swap": swap.aggregates,
                         "retrieval_outcomes": [[o["direction"], o["rank"], o["ties"]] for o in retrieval.outcomes],
                         "retrieval": retrieval.aggregates}
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
    atomic_write_text(path, json.dumps(_finite(document)))


def _finite(value):
    """JSON has no NaN: an undefined aggregate is stored as null (and read back as NaN by `metric_values`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
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
@dataclass
class Evaluations:
    """Everything scored for the report, keyed by grid run name or frozen row label."""

    scores: Dict[str, Dict[str, SplitEval]] = field(default_factory=dict)
    missing: Dict[str, str] = field(default_factory=dict)  # grid run name -> why it has no scores
    errors: Dict[str, List[str]] = field(default_factory=dict)  # run or row -> problems (mechanisms, scoring)

    def metric(self, name: str, split: str, metric: str) -> Optional[float]:
        scores = self.scores.get(name, {}).get(split)
        return None if scores is None else metric_values(scores).get(metric)


def metric_values(scores: SplitEval) -> Dict[str, float]:
    """The report's metrics of one run on one split (NaN where undefined, e.g. no item of a type)."""
    values = {**{m: scores["swap"].get(m) for m in SWAP_METRICS},
              **{m: scores["retrieval"].get(m) for m in RETRIEVAL_METRICS}}
    return {key: float("nan") if value is None else float(value) for key, value in values.items()}


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


def frozen_targets(study: Study) -> List[Target]:
    """One target per frozen row, each cached under <sweep>/study_frozen/<label>/ (the backbone is not ours)."""
    frozen = study.settings.frozen
    if not (frozen.export / "model.json").is_file():
        raise StudyError(f"study.frozen.backbone: no export at {frozen.export} (train the backbone first)")
    return [Target(label, frozen.export, scorer, frozen_cache(study, label)) for label, scorer in frozen.rows.items()]


def validity_targets(study: Study) -> List[Target]:
    """One target per validity backbone (global cosine), cached under <sweep>/study_frozen/validity_<i>/."""
    validity = study.settings.validity
    absent = [str(export) for export in validity.backbones if not (export / "model.json").is_file()]
    if absent:
        raise StudyError(f"study.validity.backbones: no export at {absent} (train the backbones first)")
    return [Target(name, export, "clip", frozen_cache(study, name))
            for name, export in zip(validity.names(), validity.backbones)]


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


def evaluate_study(study: Study, evaluator: Evaluator = score_splits, mechanisms: Optional[Mechanisms] = None,
                   progress: Progress = print, recompute: bool = False
                   ) -> Tuple[Evaluations, Dict[Tuple[str, str], Selection]]:
    """Score the study: every grid run on the selection split, then the chosen settings' runs and the frozen
    rows on the reporting splits. Returns the scores and the selections (see `select_settings`).

    Cost on two CPU cores (one thread, a 500-item swap split and 500 retrieval images, ViT-Shapes-16-64): about
    6 s per run and split with the global cosine, about 160 s per split for the SGI row.
    """
    settings, evaluations = study.settings, Evaluations()
    frozen = frozen_targets(study) if settings.frozen else []  # a missing backbone stops before any scoring
    validity = validity_targets(study) if settings.validity else []
    ready = []
    for run in study.runs:
        reason = missing_reason(run)
        if reason is None:
            ready.append(run)
        else:
            evaluations.missing[run.name] = reason
    score_targets([run_target(run, False) for run in ready], [settings.selection_split], settings.data, evaluator,
                  None, evaluations, settings.selection_split, progress, recompute)
    selections = select_settings(study, evaluations)
    chosen = [run for run in ready if run.name in evaluations.scores
              and selections[(run.method, run.condition)].chosen == run.setting]
    score_targets([run_target(run, True) for run in chosen], settings.splits, settings.data, evaluator, mechanisms,
                  evaluations, "report", progress, recompute)
    # Frozen rows have no setting to choose: the selection split would cost them time (SGI: minutes) for nothing.
    score_targets(frozen, settings.splits, settings.data, evaluator, None, evaluations, "frozen", progress,
                  recompute)
    score_targets(validity, settings.splits, settings.data, evaluator, None, evaluations, "validity", progress,
                  recompute)
    return evaluations, selections


# ----- selection on the validation split --------------------------------------------------------------------
@dataclass
class Selection:
    """The setting chosen for one (method, condition), and every setting's validation mean and seed count."""

    chosen: Optional[str]
    validation: Dict[str, Tuple[float, int]]  # setting -> (mean over seeds, seeds), in grid order


def select_settings(study: Study, evaluations: Evaluations) -> Dict[Tuple[str, str], Selection]:
    """Per (method, condition), the setting with the best mean selection metric on the selection split.

    Reads nothing but the selection split's scores. A tie goes to the first setting in grid order; a setting
    without a scored run is left out of the choice (and shown with no value).
    """
    split, metric = study.settings.selection_split, study.settings.selection_metric
    selections = {}
    for method in study.methods():
        for condition in study.conditions():
            validation = {}
            for setting in study.settings_of(method, condition):
                values = [evaluations.metric(run.name, split, metric) for run in study.runs
                          if (run.method, run.condition, run.setting) == (method, condition, setting)]
                values = [value for value in values if value is not None and math.isfinite(value)]
                validation[setting] = (float(np.mean(values)) if values else math.nan, len(values))
            selections[(method, condition)] = Selection(best_setting(validation), validation)
    return selections


def best_setting(validation: Mapping[str, Tuple[float, int]]) -> Optional[str]:
    scored = [(mean, -index, setting) for index, (setting, (mean, count)) in enumerate(validation.items()) if count]
    return max(scored)[2] if scored else None


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
    keys = _unique(key for values in per_seed for key in values)
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


def outcome_matrix(cell: Cell, seeds: Sequence[str], metric: str) -> Tuple[List[str], np.ndarray]:
    """[len(seeds), items] per-item values of `metric` (items sorted by id; every seed must hold the same)."""
    rows = [item_values(cell.seeds[seed]["swap_outcomes"], metric) for seed in seeds]
    ids = sorted(rows[0])
    if any(sorted(row) != ids for row in rows):
        raise StudyError(f"{cell.method} ({cell.condition}) on {cell.split}: the seeds were scored on different items")
    return ids, np.array([[row[item] for item in ids] for row in rows], dtype=np.float64)


@dataclass(frozen=True)
class Comparison:
    """A method minus its reference on the same items and paired seeds, with the paired bootstrap interval."""

    method: str
    condition: str
    reference: str
    split: str
    metric: str
    interval: Interval
    n_seeds: int
    n_items: int


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
    if ids != reference_ids:
        raise StudyError(f"{method.method} and {reference_label} were scored on different {method.split} items")
    interval = paired_bootstrap(values, reference_values, resamples=resamples, seed=seed)
    return Comparison(method.method, method.condition, reference_label, method.split, metric, interval,
                      len(method_seeds), len(ids))


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


# ----- command line -------------------------------------------------------------------------------------------
def load_mechanisms(limit: Optional[int] = None, splits: Optional[Sequence[str]] = None) -> Mechanisms:
    """`lightning_modules.study.mechanisms.measure` with these options (imported on use: it pulls in the models).

    Args:
        limit: captions / samples per measurement (None: measure's default).
        splits: measure only these splits (None: every reporting split); the others get no mechanism metrics, so
            a long study can spend its mechanism budget on the split it reports them for.
    """
    from lightning_modules.study.mechanisms import measure

    options = {} if limit is None else {"limit": limit}

    def measured(run_dir: Path, data: Path, split: str) -> Dict[str, float]:
        return measure(run_dir, data, split, **options) if splits is None or split in splits else {}
    return measured


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--sweep", required=True, type=Path, help="the sweep directory (holding sweep.json)")
    add_data_root(parser, help="the world to score (default: study.data of the sweep)")
    add_output(parser, "folder", help="the report folder (default: SWEEP/report/)")
    parser.add_argument("--recompute", action="store_true", help="score everything again, ignoring the caches")
    parser.add_argument("--mechanism-limit", type=int, help="captions per mechanism measurement (default 256)")
    parser.add_argument("--mechanism-splits", help="comma-separated splits to measure mechanisms on (default: all "
                                                   "reporting splits)")
    refuse_renamed(parser, {"--data": "--data-root DIR"})
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Path:
    from lightning_modules.study.report import write_report

    args = parse_args(argv)
    try:
        study = load_study(args.sweep, args.data_root)
        evaluations, selections = evaluate_study(study, mechanisms=load_mechanisms(
            args.mechanism_limit, args.mechanism_splits.split(",") if args.mechanism_splits else None),
            recompute=args.recompute)
        results = write_report(study, evaluations, selections, args.out or args.sweep / "report")
    except StudyError as err:
        raise SystemExit(f"study error: {err}") from None
    print(f"report: {results}")
    return results


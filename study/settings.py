"""What a study is: its settings (the sweep file's `study:` block) and its grid of runs (sweep.json).

The keys, their defaults and what the study does with them are described in `study/cli.py`; this module only
reads and checks them, so that the analysis, the tables and the command can share one vocabulary.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from slurm.runs import SWEEP_FILE
from study.stats import DEFAULT_RESAMPLES

CACHE_FILE = "study_eval.json"
CACHE_VERSION = 2  # 2: with the shapes world's zero-shot recognition (`shapes_zeroshot`)
FROZEN_DIR = "study_frozen"
NO_CONDITION = "-"  # the condition of a grid without a `negatives` axis, and of the frozen rows
NO_SEED = "-"
NO_CHECK = "-"  # the check of a study grid run (check runs have a `check` axis)
# The axes with a role; every other grid axis is a hyperparameter setting chosen on validation.
ROLE_AXES = ("method", "negatives", "seed", "check")
SWAP_METRICS = ("text", "image", "group", "acc_attribute", "acc_relation", "acc_object")
RETRIEVAL_METRICS = ("i2t_r1", "t2i_r1")
RECOGNITION_METRICS = ("shape_top1", "color_top1")  # zero-shot, on the world's objects
METRICS = SWAP_METRICS + RETRIEVAL_METRICS + RECOGNITION_METRICS
# Paired differences: the group score and the 2-way relation accuracy, the two the study is about.
PAIRED_METRICS = ("group", "acc_relation")
# The trade-off: composition (swap group) against recognition (zero-shot top-1 over both attributes, R@1 over
# the queries of both retrieval directions), each row against the frozen backbone.
TRADEOFF_METRICS = ("group", "zeroshot_top1", "retrieval_r1")
# The per-item fields kept in the cache (0/1), the two-by-two protocol's names (two_by_two.py).
OUTCOME_FLAGS = ("text_i0", "text_i1", "image_c0", "image_c1", "text", "image", "group", "tie")

STUDY_KEYS = ("data", "baseline", "selection", "splits", "frozen", "bootstrap", "validity", "contrast", "checks")
CONTRAST_KEYS = ("condition", "reference")
SELECTION_KEYS = ("split", "metric")
FROZEN_KEYS = ("backbone", "rows", "reference", "methods")
BOOTSTRAP_KEYS = ("resamples", "seed")
VALIDITY_KEYS = ("backbones", "control", "criteria")
CONTROL_KEYS = ("method", "negatives")
CRITERIA_KEYS = ("relation_gain", "group_gain", "chance_margin", "ceiling", "recognition_floor")
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
    recognition_floor: float = 80.0  # (d) each backbone's zero-shot shape and colour top-1 at least this

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
    checks: Optional[Path] = None  # a sweep of one-seed variants of the grid's runs, scored on validation


def _mapping(value: object, where: str, keys: Sequence[str]) -> dict:
    """`value` as a dict whose keys are all among `keys`, else a StudyError naming the valid ones."""
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise StudyError(f"{where} must be a mapping, got {value!r}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise StudyError(f"{where}: unknown keys {unknown}; valid: {list(keys)}")
    return value


def parse_settings(study: Mapping[str, object], data: Optional[Path] = None, scorers: bool = True) -> StudySettings:
    """The study block of sweep.json as settings (`data` overrides study.data); a bad block is a StudyError.
    `scorers` False leaves out the check of the frozen rows' scorer names against the registry, which imports
    the models: a study read back from a results bundle was checked when it was written, and its page is made
    with numpy and the standard library alone."""
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
        frozen=parse_frozen(study.get("frozen"), scorers),
        resamples=int(bootstrap.get("resamples", DEFAULT_RESAMPLES)),
        bootstrap_seed=int(bootstrap.get("seed", 0)), validity=parse_validity(study.get("validity")),
        contrast=parse_contrast(study.get("contrast")), checks=parse_checks(study.get("checks")))
    check_settings(settings)
    return settings


def parse_frozen(frozen: object, scorers: bool = True) -> Optional[FrozenRows]:
    """study.frozen as FrozenRows (None when absent); the reference defaults to the one row scored by `clip`.
    `scorers`: check the scorer names against the registry (`evaluation.evaluate.SCORERS`)."""
    if frozen is None:
        return None
    frozen = _mapping(frozen, "study.frozen", FROZEN_KEYS)
    rows = frozen.get("rows")
    if not frozen.get("backbone") or not isinstance(rows, dict) or not rows:
        raise StudyError("study.frozen needs a backbone (run directory or export) and rows {label: scorer}")
    if scorers:  # the registry imports the models
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


def parse_checks(checks: object) -> Optional[Path]:
    """study.checks: the sweep directory of the checks (None when absent)."""
    if checks is None:
        return None
    if not isinstance(checks, str) or not checks:
        raise StudyError(f"study.checks must be the directory of a sweep of checks, got {checks!r}")
    return Path(checks)


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
    check: str = NO_CHECK  # a check run's variant of the grid run (method, condition, setting, seed)


@dataclass
class Study:
    directory: Path
    settings: StudySettings
    runs: List[GridRun]
    checks: List[GridRun] = field(default_factory=list)  # the runs of `settings.checks` (one-seed variants)
    world: Optional[Mapping[str, object]] = None  # the world's checksums ({"root", "files"}), where known

    def methods(self) -> List[str]:
        return unique_values(run.method for run in self.runs)

    def conditions(self) -> List[str]:
        return unique_values(run.condition for run in self.runs)

    def settings_of(self, method: str, condition: str) -> List[str]:
        return unique_values(run.setting for run in self.runs if (run.method, run.condition) == (method, condition))


def unique_values(values) -> list:
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
                   values.get("seed", NO_SEED), sweep_dir / str(entry["name"]), values.get("check", NO_CHECK))


def load_study(sweep_dir: Path, data: Optional[Path] = None) -> Study:
    """The study of a sweep directory (its sweep.json), with settings checked against its grid; the runs of its
    checks sweep (`study.checks`) when that sweep has been written."""
    path = Path(sweep_dir) / SWEEP_FILE
    if not path.is_file():
        raise StudyError(f"{path} does not exist: run `python -m slurm.sweep <sweep.yaml> ...` first")
    document = json.loads(path.read_text())
    checks_dir = (document.get("study") or {}).get("checks")
    checks_file = Path(checks_dir) / SWEEP_FILE if isinstance(checks_dir, str) and checks_dir else None
    checks = json.loads(checks_file.read_text()) if checks_file is not None and checks_file.is_file() else None
    return study_of(Path(sweep_dir), document, checks, data)


def study_of(directory: Path, document: Mapping[str, object], checks: Optional[Mapping[str, object]] = None,
             data: Optional[Path] = None, world: bool = True) -> Study:
    """The study of a sweep.json document (and its checks sweep's), run directories under `directory` (and the
    checks sweep's directory), checked against the grid; `world` False leaves out the check that the world is
    there and the check of the frozen rows' scorers (a study read back from a results bundle needs neither, and
    its page is made without the models)."""
    settings = parse_settings(document.get("study") or {}, data, scorers=world)
    runs = [grid_run(entry, directory) for entry in document["runs"]]
    check_runs = [grid_run(entry, settings.checks) for entry in (checks or {}).get("runs", [])]
    study = Study(directory, settings, runs, check_runs, world=document.get("world"))
    check_grid(study, world)
    return study


def check_grid(study: Study, world: bool = True) -> None:
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
        cells = unique_values((run.method, run.condition) for run in study.runs)
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
    unmatched = sorted(run.name for run in study.checks if run.check == NO_CHECK or run.method not in methods)
    if unmatched:
        raise StudyError(f"checks {unmatched[:4]} (of {settings.checks}) need a `check` axis and a method of the "
                         f"grid ({methods})")
    if world and not settings.data.is_dir():
        raise StudyError(f"the world {settings.data} does not exist (study.data or --data-root)")

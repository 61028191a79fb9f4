"""The testbed validity table of a study: can this testbed show a compositional gain?

Set by `study.validity` in the sweep file (`study`). Per reporting split it sets the pretrained
backbones (the global cosine of each backbone export, one per pretraining seed) beside the positive control (a
grid cell, normally CLIP-FT with hard negatives, at its setting chosen on validation) on 2-way relation,
attribute and object accuracy and the swap group score, and runs three checks:

(a) the failure is there: the backbone's mean 2-way relation accuracy is within `chance_margin` points of chance
    (50) and its mean 2-way attribute accuracy is below `ceiling`;
(b) the positive control works: the control's gain over the backbone (difference of means) is at least
    `relation_gain` points on 2-way relation accuracy and at least `group_gain` points on the group score;
(c) systematic generalisation is measurable: the control is scored on `test_unseen` beside `test` (PASS when
    both are scored); its gap `test - test_unseen` is shown, paired over the control's seeds.

Means and 95% intervals over seeds are `stats.seed_interval`. The gains compare two unpaired seed sets (the
backbones' pretraining seeds and the control's fine-tuning seeds, possibly different counts), so they are the
difference of the two means with Welch's t-interval (`stats.difference_interval`); a paired bootstrap
needs paired seeds. The checks read the means; the intervals are printed beside them. A FAIL is always shown.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from study.analysis import Cell, Evaluations, metric_values
from study.settings import SplitEval, Study, ValiditySettings
from study.stats import Interval, difference_interval, seed_interval
from study.tables import TITLES, interval_text, table

VALIDITY_METRICS = ("acc_relation", "acc_attribute", "acc_object", "group")
CHANCE_2WAY = 50.0
IN_DISTRIBUTION, UNSEEN = "test", "test_unseen"


@dataclass(frozen=True)
class Estimate:
    """A metric over seeds: the per-seed values (seed order) and their mean with its t-interval."""

    values: Tuple[float, ...]
    interval: Interval


@dataclass
class SplitValidity:
    """One reporting split: backbone and control estimates and the control's gains, per metric (absent: no
    finite value)."""

    split: str
    backbone: Dict[str, Estimate] = field(default_factory=dict)
    control: Dict[str, Estimate] = field(default_factory=dict)
    gains: Dict[str, Interval] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    key: str  # "a", "b" or "c"
    title: str
    split: Optional[str]  # None for (c), which spans the two test splits
    passed: bool
    detail: str


@dataclass
class Validity:
    settings: ValiditySettings
    control_setting: Optional[str]  # the control cell's chosen setting (None: no control run scored)
    backbones_scored: Dict[str, int]  # split -> backbones scored on it
    splits: List[SplitValidity]
    gap: Dict[str, Estimate]  # control: test - test_unseen, per seed
    checks: List[Check]

    @property
    def control_label(self) -> str:
        return f"{self.settings.control_method} ({self.settings.control_condition})"


# ----- numbers ------------------------------------------------------------------------------------------------
def estimates(scores: Sequence[SplitEval]) -> Dict[str, Estimate]:
    """Per metric, the seed interval of the finite per-seed values (a metric with none is left out)."""
    found = {}
    for metric in VALIDITY_METRICS:
        values = tuple(v for v in (metric_values(s)[metric] for s in scores) if math.isfinite(v))
        if values:
            found[metric] = Estimate(values, seed_interval(values))
    return found


def measure_validity(study: Study, evaluations: Evaluations, cells: Sequence[Cell]) -> Validity:
    """The validity table from the scored backbones and the control's cells (`study.study_cells`)."""
    settings = study.settings.validity
    control_cells = {cell.split: cell for cell in cells
                     if (cell.method, cell.condition) == (settings.control_method, settings.control_condition)}
    splits, scored = [], {}
    for split in study.settings.splits:
        backbones = [evaluations.scores[name][split] for name in settings.names()
                     if split in evaluations.scores.get(name, {})]
        scored[split] = len(backbones)
        control = control_cells.get(split)
        row = SplitValidity(split, estimates(backbones), estimates(list(control.seeds.values()) if control else []))
        for metric in VALIDITY_METRICS:
            if metric in row.backbone and metric in row.control:
                row.gains[metric] = difference_interval(row.control[metric].values, row.backbone[metric].values)
        splits.append(row)
    setting = next((cell.setting for cell in control_cells.values()), None)
    gap = generalisation_gap(control_cells.get(IN_DISTRIBUTION), control_cells.get(UNSEEN))
    checks = [check for row in splits for check in (failure_check(row, settings), control_check(row, settings))]
    checks.append(generalisation_check(study.settings.splits, control_cells, gap))
    return Validity(settings, setting, scored, splits, gap, checks)


def generalisation_gap(test: Optional[Cell], unseen: Optional[Cell]) -> Dict[str, Estimate]:
    """Per metric, the control's test - test_unseen over the seeds scored on both (paired by seed)."""
    if test is None or unseen is None:
        return {}
    seeds = [seed for seed in test.seeds if seed in unseen.seeds]
    gap = {}
    for metric in VALIDITY_METRICS:
        values = tuple(metric_values(test.seeds[s])[metric] - metric_values(unseen.seeds[s])[metric] for s in seeds)
        values = tuple(v for v in values if math.isfinite(v))
        if values:
            gap[metric] = Estimate(values, seed_interval(values))
    return gap


# ----- the three checks ---------------------------------------------------------------------------------------
def _criterion(name: str, interval: Optional[Interval], needs: str, met: bool, note: str = "") -> str:
    if interval is None:
        return f"{name} not measured"
    return f"{name} {interval_text(interval)}{note} (needs {needs}: {'yes' if met else 'no'})"


def failure_check(row: SplitValidity, settings: ValiditySettings) -> Check:
    """(a) the backbone is near chance on relations and below the ceiling on attribute binding."""
    relation, attribute = row.backbone.get("acc_relation"), row.backbone.get("acc_attribute")
    distance = abs(relation.interval.estimate - CHANCE_2WAY) if relation else math.inf
    near_chance = distance <= settings.chance_margin
    below = attribute is not None and attribute.interval.estimate < settings.ceiling
    detail = "; ".join([
        _criterion("backbone 2-way relation", relation and relation.interval,
                   f"within {settings.chance_margin:g} of {CHANCE_2WAY:g}", near_chance,
                   f", {distance:.1f} from chance" if relation else ""),
        _criterion("backbone 2-way attribute", attribute and attribute.interval, f"< {settings.ceiling:g}", below)])
    return Check("a", "the failure is there", row.split, near_chance and below, detail)


def control_check(row: SplitValidity, settings: ValiditySettings) -> Check:
    """(b) the control's gains over the backbone reach the criteria."""
    relation, group = row.gains.get("acc_relation"), row.gains.get("group")
    relation_met = relation is not None and relation.estimate >= settings.relation_gain
    group_met = group is not None and group.estimate >= settings.group_gain
    detail = "; ".join([_criterion("2-way relation gain", relation, f">= {settings.relation_gain:g}", relation_met),
                        _criterion("swap group gain", group, f">= {settings.group_gain:g}", group_met)])
    return Check("b", "the positive control works", row.split, relation_met and group_met, detail)


def generalisation_check(splits: Sequence[str], control_cells: Mapping[str, Cell],
                         gap: Mapping[str, Estimate]) -> Check:
    """(c) the control is scored on both test splits; the gap is presented, not judged."""
    absent = [split for split in (IN_DISTRIBUTION, UNSEEN) if split not in control_cells]
    if absent:
        why = [f"`{s}` is not a reporting split" if s not in splits else f"the control has no scores on `{s}`"
               for s in absent]
        return Check("c", "systematic generalisation is measurable", None, False, "; ".join(why))
    shown = ", ".join(f"{TITLES[m]} {interval_text(e.interval)}" for m, e in gap.items()) or "no finite value"
    seeds = max((len(e.values) for e in gap.values()), default=0)
    detail = (f"the control is scored on `{IN_DISTRIBUTION}` and `{UNSEEN}`; gap `{IN_DISTRIBUTION}` - `{UNSEEN}` "
              f"(paired over {seeds} seeds): {shown}")
    return Check("c", "systematic generalisation is measurable", None, True, detail)


# ----- report -------------------------------------------------------------------------------------------------
def markdown_section(validity: Validity, selection_split: str) -> List[str]:
    """The "Testbed validity" section of results.md (also printed by the report command)."""
    settings = validity.settings
    lines = ["## Testbed validity: pretrained backbones against the positive control", "",
             f"- Backbone: the global cosine (`clip`) of {len(settings.backbones)} pretrained backbone exports, one "
             "per pretraining seed: " + ", ".join(f"`{path}`" for path in settings.backbones) + ".",
             f"- Positive control: `{validity.control_label}` at "
             f"`{validity.control_setting or 'no scored run'}` (chosen on `{selection_split}`), over its seeds.",
             "- Mean [95% t-interval over seeds]. Gain: control mean minus backbone mean, Welch t-interval over the "
             "two unpaired seed sets. The checks read the means.",
             f"- Criteria: (a) backbone 2-way relation within {settings.chance_margin:g} of {CHANCE_2WAY:g} and "
             f"2-way attribute < {settings.ceiling:g}; (b) gains >= {settings.relation_gain:g} (2-way relation) "
             f"and >= {settings.group_gain:g} (swap group); (c) the control scored on `{IN_DISTRIBUTION}` and "
             f"`{UNSEEN}`.", ""]
    header = ["row", "seeds"] + [TITLES[m] for m in VALIDITY_METRICS]
    for row in validity.splits:
        backbone_seeds = validity.backbones_scored[row.split]
        control_seeds = max((len(e.values) for e in row.control.values()), default=0)
        rows = [["backbone (global cosine)", str(backbone_seeds)] + _cells(row.backbone),
                [f"control: {validity.control_label}", str(control_seeds)] + _cells(row.control),
                ["gain: control - backbone", f"{control_seeds} + {backbone_seeds}"]
                + [interval_text(row.gains[m]) if m in row.gains else "-" for m in VALIDITY_METRICS]]
        lines += [f"### `{row.split}`", ""] + table(header, rows, 1) + [""]
    lines += ["### Checks", ""] + [check_line(check) for check in validity.checks] + [""]
    return lines


def _cells(found: Mapping[str, Estimate]) -> List[str]:
    return [interval_text(found[m].interval) if m in found else "-" for m in VALIDITY_METRICS]


def check_line(check: Check) -> str:
    where = f", on `{check.split}`" if check.split else ""
    return f"- **{'PASS' if check.passed else 'FAIL'}** ({check.key}) {check.title}{where}: {check.detail}"


def csv_rows(validity: Validity) -> List[List[object]]:
    """results.csv rows (method, negatives, split, metric, mean, low, high, n_seeds, lr): `validity/backbone`,
    `validity/control`, `validity/gain` (n_seeds `control + backbone`) and `validity/gap` (split
    `test-test_unseen`)."""
    settings, rows = validity.settings, []
    condition, setting = settings.control_condition, validity.control_setting or "-"

    def add(method, negatives, split, metric, interval, seeds, lr):
        rows.append([method, negatives, split, metric, interval.estimate, interval.low, interval.high, seeds, lr])

    for row in validity.splits:
        for metric in VALIDITY_METRICS:
            if metric in row.backbone:
                add("validity/backbone", "-", row.split, metric, row.backbone[metric].interval,
                    len(row.backbone[metric].values), "-")
            if metric in row.control:
                add("validity/control", condition, row.split, metric, row.control[metric].interval,
                    len(row.control[metric].values), setting)
            if metric in row.gains:
                add("validity/gain", condition, row.split, metric, row.gains[metric],
                    f"{len(row.control[metric].values)} + {len(row.backbone[metric].values)}", setting)
    for metric, estimate in validity.gap.items():
        add("validity/gap", condition, f"{IN_DISTRIBUTION}-{UNSEEN}", metric, estimate.interval,
            len(estimate.values), setting)
    return rows


def as_json(validity: Validity) -> dict:
    """validity.json: the criteria, every estimate with its per-seed values, the gains and the checks."""
    settings = validity.settings

    def estimate(e: Estimate) -> dict:
        return {**e.interval.as_dict(), "values": list(e.values)}

    return {
        "backbones": [str(path) for path in settings.backbones],
        "control": {"method": settings.control_method, "negatives": settings.control_condition,
                    "setting": validity.control_setting},
        "criteria": {"relation_gain": settings.relation_gain, "group_gain": settings.group_gain,
                     "chance_margin": settings.chance_margin, "ceiling": settings.ceiling},
        "gain_interval": "difference of means, Welch t-interval (95%) over the two unpaired seed sets",
        "splits": {row.split: {"backbone": {m: estimate(e) for m, e in row.backbone.items()},
                               "control": {m: estimate(e) for m, e in row.control.items()},
                               "gain": {m: i.as_dict() for m, i in row.gains.items()}}
                   for row in validity.splits},
        "gap": {m: estimate(e) for m, e in validity.gap.items()},
        "checks": [{"check": c.key, "title": c.title, "split": c.split, "passed": c.passed, "detail": c.detail}
                   for c in validity.checks],
        "passed": all(check.passed for check in validity.checks),
    }

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
    both are scored); its gap `test - test_unseen` is shown, paired over the control's seeds;
(d) the backbone recognises what the captions name: every backbone's zero-shot shape and colour top-1 is at least
    `recognition_floor` (80): a backbone that cannot tell the shapes apart cannot fail at composing them;
(e) relation direction is near chance for every backbone, not only on their mean: each backbone's 2-way relation
    accuracy within `chance_margin` of 50;
(f) object words dominate the backbone's text attribution (mean attribution of object tokens above that of
    composition tokens: the failure CAE's hinge is built against). Measured where a backbone's record holds an
    attribution gap (`attr_gap_*` mechanism metrics, A_comp - A_obj); where none is recorded the check says
    NOT MEASURED, which is not a PASS.

The checks (d)-(f) are per backbone and per reporting split; the world they hold for is named by its checksum.
The testbed is valid only when every check passes: where one fails or is not measured, the study's method
comparisons are provisional (the report says so beside them).

Means and 95% intervals over seeds are `stats.seed_interval`. The gains compare two unpaired seed sets (the
backbones' pretraining seeds and the control's fine-tuning seeds, possibly different counts), so they are the
difference of the two means with Welch's t-interval (`stats.difference_interval`); a paired bootstrap
needs paired seeds. The checks read the means; the intervals are printed beside them. A FAIL is always shown.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from core.run_records import world_checksum
from study.analysis import Cell, Evaluations, metric_values
from study.settings import SplitEval, Study, ValiditySettings
from study.stats import Interval, difference_interval, seed_interval
from study.tables import TITLES, interval_text, table

VALIDITY_METRICS = ("acc_relation", "acc_attribute", "acc_object", "group")
BACKBONE_METRICS = ("acc_relation", "shape_top1", "color_top1")  # per backbone: checks (d) and (e)
ATTRIBUTION_PREFIX = "attr_gap_"  # a mechanism metric A_comp - A_obj (x100) of one attribution method
ATTRIBUTION_COUNT = "attr_gap_captions"  # the captions behind the gaps, not a gap
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
    per_backbone: Dict[str, Dict[str, float]] = field(default_factory=dict)  # name -> BACKBONE_METRICS values
    attribution: Dict[str, Dict[str, float]] = field(default_factory=dict)  # name -> its recorded attr_gap_*


@dataclass(frozen=True)
class Check:
    key: str  # "a" to "f"
    title: str
    split: Optional[str]  # None for (c), which spans the two test splits
    passed: Optional[bool]  # None: not measured (never a pass)
    detail: str

    @property
    def status(self) -> str:
        return "NOT MEASURED" if self.passed is None else "PASS" if self.passed else "FAIL"


@dataclass
class Validity:
    settings: ValiditySettings
    control_setting: Optional[str]  # the control cell's chosen setting (None: no control run scored)
    backbones_scored: Dict[str, int]  # split -> backbones scored on it
    splits: List[SplitValidity]
    gap: Dict[str, Estimate]  # control: test - test_unseen, per seed
    checks: List[Check]
    world: Optional[str] = None  # the world's checksum (core.run_records.world_checksum), where recorded

    @property
    def control_label(self) -> str:
        return f"{self.settings.control_method} ({self.settings.control_condition})"

    @property
    def passed(self) -> bool:
        """Every check passed (one failed or not measured: the testbed is not shown valid)."""
        return all(check.passed is True for check in self.checks)

    def not_passed(self) -> List[Check]:
        return [check for check in self.checks if check.passed is not True]


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
        named = {name: evaluations.scores[name][split] for name in settings.names()
                 if split in evaluations.scores.get(name, {})}
        backbones = list(named.values())
        scored[split] = len(backbones)
        control = control_cells.get(split)
        row = SplitValidity(split, estimates(backbones), estimates(list(control.seeds.values()) if control else []),
                            per_backbone={name: {m: metric_values(scores)[m] for m in BACKBONE_METRICS}
                                          for name, scores in named.items()},
                            attribution={name: recorded_attribution(scores) for name, scores in named.items()})
        for metric in VALIDITY_METRICS:
            if metric in row.backbone and metric in row.control:
                row.gains[metric] = difference_interval(row.control[metric].values, row.backbone[metric].values)
        splits.append(row)
    setting = next((cell.setting for cell in control_cells.values()), None)
    gap = generalisation_gap(control_cells.get(IN_DISTRIBUTION), control_cells.get(UNSEEN))
    checks = [check for row in splits for check in (failure_check(row, settings), control_check(row, settings))]
    checks.append(generalisation_check(study.settings.splits, control_cells, gap))
    checks += [check for row in splits for check in (recognition_check(row, settings),
                                                     per_backbone_chance_check(row, settings),
                                                     attribution_check(row))]
    world = world_checksum(study.world["files"]) if study.world and study.world.get("files") else None
    return Validity(settings, setting, scored, splits, gap, checks, world)


def recorded_attribution(scores: SplitEval) -> Dict[str, float]:
    """The attribution gaps (A_comp - A_obj, x100, per attribution method) a backbone's record holds ({}: none)."""
    mechanisms = scores.get("mechanisms") or {}
    return {key: float(value) for key, value in mechanisms.items()
            if key.startswith(ATTRIBUTION_PREFIX) and key != ATTRIBUTION_COUNT and value is not None}


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


def recognition_check(row: SplitValidity, settings: ValiditySettings) -> Check:
    """(d) every backbone's zero-shot shape and colour top-1 reach the floor."""
    title = "the backbone recognises shapes and colours"
    if not row.per_backbone:
        return Check("d", title, row.split, None, "no backbone scored")
    floor = settings.recognition_floor
    parts, met = [], True
    for name, values in row.per_backbone.items():
        shape, colour = values["shape_top1"], values["color_top1"]
        ok = math.isfinite(shape) and math.isfinite(colour) and shape >= floor and colour >= floor
        met = met and ok
        parts.append(f"{name} shape {shape:.1f}, colour {colour:.1f} ({'yes' if ok else 'no'})")
    return Check("d", title, row.split, met,
                 f"zero-shot top-1 per backbone, needs shape and colour >= {floor:g}: " + "; ".join(parts))


def per_backbone_chance_check(row: SplitValidity, settings: ValiditySettings) -> Check:
    """(e) every backbone, not only their mean, is near chance on relation direction."""
    title = "relation direction is near chance for every backbone"
    if not row.per_backbone:
        return Check("e", title, row.split, None, "no backbone scored")
    parts, met = [], True
    for name, values in row.per_backbone.items():
        distance = abs(values["acc_relation"] - CHANCE_2WAY)
        ok = math.isfinite(distance) and distance <= settings.chance_margin
        met = met and ok
        parts.append(f"{name} {values['acc_relation']:.1f} ({'yes' if ok else 'no'})")
    return Check("e", title, row.split, met, f"2-way relation per backbone, needs within {settings.chance_margin:g} "
                                              f"of {CHANCE_2WAY:g}: " + "; ".join(parts))


def attribution_check(row: SplitValidity) -> Check:
    """(f) object words dominate every backbone's text attribution (each recorded gap A_comp - A_obj below 0);
    not measured where no backbone record holds a gap."""
    title = "object words dominate the backbone's text attribution"
    measured = {name: gaps for name, gaps in row.attribution.items() if gaps}
    if not measured or len(measured) < len(row.per_backbone):
        return Check("f", title, row.split, None, "not measured: the bundle records no attribution by word kind for "
                                                  "every frozen backbone (no `attr_gap_*` in their records)")
    parts = [f"{name} {key[len(ATTRIBUTION_PREFIX):]} {gap:.3g}" for name, gaps in measured.items()
             for key, gap in gaps.items()]
    met = all(gap < 0 for gaps in measured.values() for gap in gaps.values())
    return Check("f", title, row.split, met, "attribution gap A_comp - A_obj (x100) per backbone, needs < 0: "
                 + "; ".join(parts))


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
    verdict = ("every check passes" if validity.passed else
               f"NOT SHOWN VALID: {not_passed_text(validity)}. The method comparisons of this study are "
               "provisional: they measure this testbed, and no conclusion about the methods is read from them")
    lines = ["## Testbed validity: pretrained backbones against the positive control", "",
             f"**Validity: {verdict}.**", "",
             f"- World: checksum `{validity.world or 'not recorded'}` (sha256 of its annotation files' checksums).",
             f"- Backbone: the global cosine (`clip`) of {len(settings.backbones)} pretrained backbone exports, one "
             "per pretraining seed: " + ", ".join(f"`{path}`" for path in settings.backbones) + ".",
             f"- Positive control: `{validity.control_label}` at "
             f"`{validity.control_setting or 'no scored run'}` (chosen on `{selection_split}`), over its seeds.",
             "- Mean [95% t-interval over seeds]. Gain: control mean minus backbone mean, Welch t-interval over the "
             "two unpaired seed sets. The checks read the means.",
             f"- Criteria: (a) backbone 2-way relation within {settings.chance_margin:g} of {CHANCE_2WAY:g} and "
             f"2-way attribute < {settings.ceiling:g}; (b) gains >= {settings.relation_gain:g} (2-way relation) "
             f"and >= {settings.group_gain:g} (swap group); (c) the control scored on `{IN_DISTRIBUTION}` and "
             f"`{UNSEEN}`; per backbone: (d) zero-shot shape and colour top-1 >= {settings.recognition_floor:g}, "
             f"(e) 2-way relation within {settings.chance_margin:g} of {CHANCE_2WAY:g}, (f) object words above "
             "composition words in the text attribution (NOT MEASURED where no record holds it: not a pass).", ""]
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


def not_passed_text(validity: Validity) -> str:
    """The checks that did not pass, each with its status and splits: `(b) FAIL on `test_unseen`; ...`."""
    found: Dict[Tuple[str, str], List[str]] = {}
    for check in validity.not_passed():
        found.setdefault((check.key, check.status), []).extend([f"`{check.split}`"] if check.split else [])
    return "; ".join(f"({key}) {status}" + (f" on {', '.join(splits)}" if splits else "")
                     for (key, status), splits in sorted(found.items()))


def _cells(found: Mapping[str, Estimate]) -> List[str]:
    return [interval_text(found[m].interval) if m in found else "-" for m in VALIDITY_METRICS]


def check_line(check: Check) -> str:
    where = f", on `{check.split}`" if check.split else ""
    return f"- **{check.status}** ({check.key}) {check.title}{where}: {check.detail}"


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
        "world": validity.world,
        "criteria": {"relation_gain": settings.relation_gain, "group_gain": settings.group_gain,
                     "chance_margin": settings.chance_margin, "ceiling": settings.ceiling,
                     "recognition_floor": settings.recognition_floor},
        "gain_interval": "difference of means, Welch t-interval (95%) over the two unpaired seed sets",
        "splits": {row.split: {"backbone": {m: estimate(e) for m, e in row.backbone.items()},
                               "control": {m: estimate(e) for m, e in row.control.items()},
                               "gain": {m: i.as_dict() for m, i in row.gains.items()},
                               "per_backbone": row.per_backbone, "attribution": row.attribution}
                   for row in validity.splits},
        "gap": {m: estimate(e) for m, e in validity.gap.items()},
        "checks": [{"check": c.key, "title": c.title, "split": c.split, "passed": c.passed, "status": c.status,
                    "detail": c.detail} for c in validity.checks],
        "passed": validity.passed,
    }

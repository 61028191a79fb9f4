"""The study's report files (`python -m study`) and page (`python -m study.page`): tables, CSV, plots and the
TensorBoard view.

`<out>/report/` gets:
- `results.md`: per reporting split, every row's scores as `mean [low, high]` (Student-t 95% over seeds) at its
  validation-chosen setting; the selection table (every setting's validation mean, and whether the choice is
  bracketed by the grid and above seed noise: `analysis.selection_flags`); the rows whose own term changed no
  decision against the baseline (inactive, `analysis.row_activity`); the paired differences against the
  reference, each with its items x seeds bootstrap and its seed-level paired t; the claims (both intervals
  exclude 0 on one side, the row active; provisional where the testbed is not shown valid); the composition /
  recognition trade-off against the frozen backbone; the checks beside each row (one-seed variants on the
  selection split); the mechanism metrics; the grid runs that are missing or failed;
- `results.csv` (long: method, negatives, split, metric, mean, low, high, n_seeds, lr; mechanism metrics as
  `mechanism/<key>`), `differences.csv`, `tradeoffs.csv` (each row minus the frozen reference), `selection.csv`,
  and `cells.json`: for every row and reporting split, the cache file (`study_eval.json`) of each seed, whose
  per-item outcomes the numbers are computed from;
- `scores_<split>.png` (group score and 2-way relation accuracy with their intervals),
  `tradeoff_<split>.png` (each row's swap group change against its zero-shot and R@1 change, from the frozen
  backbone), `validation_curves.png` (every run's `eval/shapes_swap/*` TensorBoard curve, a column per method);
- `tb_hparams/`: one hparams session per scored run (`tensorboard --logdir <report>/tb_hparams`);
- with `study.validity`: the "Testbed validity" section of results.md (first, and printed), its rows in
  results.csv (`validity/*`) and `validity.json` (validity.py).

`write_page` writes the same Markdown as one page (the figures beside it in `images/`, named `study_*.png`),
from scores alone: the page a results bundle regenerates (`study/page.py`).
"""
from __future__ import annotations

import csv
import io
import json
import math
import shutil
from pathlib import Path
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from core.files import atomic_write_text
from study import validity as study_validity
from study.analysis import (
    CURVE_METRICS,
    CURVE_PREFIX,
    FLAT_MULTIPLE,
    Cell,
    CheckResult,
    Comparison,
    Curves,
    Evaluations,
    Findings,
    Selection,
    SelectionFlags,
    Summary,
    agreement,
    analyse,
    claims,
    excludes_zero,
    json_safe,
    metric_values,
)
from study.settings import METRICS, NO_CONDITION, PAIRED_METRICS, TRADEOFF_METRICS, Progress, Study
from study.stats import Interval
from study.tables import CHANCE, TITLES, interval_text, mechanism_text, table

TB_DIR = "tb_hparams"
FOLDER_SOURCE = "each run's `study_eval.json` (`cells.json` here names the files behind every row)"
CURVE_PLOT = "validation_curves"
Numbers = Tuple[Findings, Optional[study_validity.Validity]]
Figures = Dict[str, str]  # figure name (e.g. "scores_test") -> its link in the Markdown
LABEL_STEP = 8  # points between the stacked labels of points that land on one spot


def report_numbers(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection]
                   ) -> Numbers:
    """Every number of the report, computed once: the findings and, with `study.validity`, the validity table."""
    findings = analyse(study, evaluations, selections)
    validity = (study_validity.measure_validity(study, evaluations, findings.cells) if study.settings.validity
                else None)
    return findings, validity


def write_report(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection],
                 out_dir: Path, progress: Progress = print, numbers: Optional[Numbers] = None) -> Path:
    """Every report file under `out_dir`; returns the path of results.md. The testbed validity section, when
    the study has one, also goes to `progress` (it is the first thing to read: can the testbed show a gain?).
    `numbers`: `report_numbers` when the caller has them already."""
    out_dir.mkdir(parents=True, exist_ok=True)
    findings, validity = numbers or report_numbers(study, evaluations, selections)
    validity_lines, validity_rows = [], []
    if validity is not None:
        validity_lines = study_validity.markdown_section(validity, study.settings.selection_split)
        validity_rows = study_validity.csv_rows(validity)
        atomic_write_text(out_dir / "validity.json", json.dumps(json_safe(study_validity.as_json(validity)), indent=2))
        progress("\n".join(validity_lines))
    figures = write_figures(study, evaluations, selections, findings, out_dir, prefix="")
    atomic_write_text(out_dir / "results.md", markdown(study, evaluations, selections, findings, validity_lines,
                                                       figures, FOLDER_SOURCE, validity))
    atomic_write_text(out_dir / "results.csv", results_csv(findings.summaries, validity_rows))
    atomic_write_text(out_dir / "differences.csv", differences_csv(findings.differences))
    atomic_write_text(out_dir / "tradeoffs.csv", differences_csv(findings.tradeoffs))
    atomic_write_text(out_dir / "selection.csv", selection_csv(study, selections))
    atomic_write_text(out_dir / "cells.json", cells_manifest(findings.cells))
    write_hparams(study, evaluations, selections, out_dir / TB_DIR)
    return out_dir / "results.md"


def write_page(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection], page: Path,
               header: Sequence[str], source: str, plots: bool = True, numbers: Optional[Numbers] = None) -> str:
    """The report as one Markdown page (`header` first), its figures in `images/` beside it as `study_*.png`
    (`plots` False: the page alone); returns the page's text. `numbers`: `report_numbers` when the caller has
    them already."""
    findings, validity = numbers or report_numbers(study, evaluations, selections)
    validity_lines = (study_validity.markdown_section(validity, study.settings.selection_split) if validity
                      else [])
    names = figure_names(study)
    figures = {name: f"images/study_{name}.png" for name in names}
    if plots:
        write_figures(study, evaluations, selections, findings, page.parent / "images", prefix="study_")
    text = "\n".join(header) + "\n\n" + markdown(study, evaluations, selections, findings, validity_lines, figures,
                                                 source, validity)
    page.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(page, text)
    return text


# ----- figures ------------------------------------------------------------------------------------------------
def figure_names(study: Study) -> List[str]:
    return ([f"scores_{split}" for split in study.settings.splits] + [f"tradeoff_{split}" for split in
            study.settings.splits] if study.settings.frozen else [f"scores_{split}" for split in
            study.settings.splits]) + [CURVE_PLOT]


def write_figures(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection],
                  findings: Findings, folder: Path, prefix: str) -> Figures:
    """Every plot as `<folder>/<prefix><name>.png`; returns name -> file name."""
    folder.mkdir(parents=True, exist_ok=True)
    names = figure_names(study)
    for split in study.settings.splits:
        plot_scores(findings.summaries, split, report_rows(study, findings.summaries, split),
                    folder / f"{prefix}scores_{split}.png")
        if f"tradeoff_{split}" in names:
            plot_tradeoff(findings.tradeoffs, split, folder / f"{prefix}tradeoff_{split}.png")
    plot_validation_curves(study, selections, evaluations.curves, folder / f"{prefix}{CURVE_PLOT}.png")
    return {name: f"{prefix}{name}.png" for name in names}


# ----- markdown -----------------------------------------------------------------------------------------------
def markdown(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection],
             findings: Findings, validity_lines: Sequence[str] = (), figures: Optional[Figures] = None,
             source: str = FOLDER_SOURCE, validity: Optional[study_validity.Validity] = None) -> str:
    settings, figures = study.settings, figures or {}
    lines = [f"# Study report: {study.directory.name}", ""] + preamble(study, evaluations, source) + [""]
    lines += list(validity_lines)
    for split in settings.splits:
        lines += [f"## Scores on `{split}` (mean [95% t-interval over seeds], setting chosen on "
                  f"`{settings.selection_split}`)", ""]
        lines += scores_table(study, findings.summaries, split, findings) + [""]
        lines += figure(figures, f"scores_{split}", f"swap group and 2-way relation on {split}, mean and 95% "
                                                    "interval over seeds")
    lines += [f"## Selection on `{settings.selection_split}`: mean {settings.selection_metric} over seeds "
              "(seeds) per setting; the chosen one in bold", ""]
    lines += selection_table(study, selections, findings.flags) + [""] + selection_rule() + [""]
    lines += activity_section(study, findings)
    lines += ["## Paired differences: method minus reference on the same items, paired bootstrap over items x "
              f"seeds ({settings.resamples} resamples) and seed-level paired t, 95% intervals", ""]
    lines += differences_table(findings.differences, findings.inactive) + [""]
    lines += claims_section(findings, validity)
    lines += tradeoff_section(study, findings.tradeoffs, figures)
    lines += checks_section(study, findings.checks)
    lines += mechanisms_section(study, findings.summaries)
    lines += ["## Validation curves (every run; the chosen setting's solid)", ""]
    lines += figure(figures, CURVE_PLOT, "validation curves of every run, a column per method")
    lines += missing_section(study, evaluations)
    return "\n".join(lines) + "\n"


def figure(figures: Figures, name: str, alt: str) -> List[str]:
    return [f"![{alt}]({figures[name]})", ""] if name in figures else []


def preamble(study: Study, evaluations: Evaluations, source: str = FOLDER_SOURCE) -> List[str]:
    settings, total = study.settings, len(study.runs)
    scored = sum(1 for run in study.runs if run.name in evaluations.scores)
    frozen = settings.frozen
    lines = [f"- World: `{settings.data}`; selection on `{settings.selection_split}` by "
             f"`{settings.selection_metric}`; reported on {', '.join(f'`{s}`' for s in settings.splits)} "
             "(never used for selection).",
             f"- Grid runs: {total}; scored: {scored}; missing or failed: {total - scored} (listed at the end).",
             f"- Baseline: `{settings.baseline}`, compared within each condition (`negatives`).",
             f"- Per-item outcomes: {source}."]
    if frozen:
        lines.append(f"- Frozen rows from `{frozen.export}`: " + ", ".join(
            f"`{label}` ({scorer})" for label, scorer in frozen.rows.items())
            + f"; frozen-backbone methods {list(frozen.methods)} and the other frozen rows are compared with "
              f"`{frozen.reference}`.")
    lines.append("- Paired differences: items matched by id; seeds matched by seed (a frozen reference, scored "
                 "once, pairs with every seed); each with its items x seeds bootstrap and its seed-level paired t "
                 "(the per-seed mean differences, Student t on seeds - 1 degrees of freedom); `reading` says better "
                 "or worse only where both intervals exclude 0 on the same side.")
    lines.append("- Scores in %. `(one run)`: a single seed or a frozen row scored once, no interval over seeds. "
                 "Chance: swap group 16.7, swap text / image 25, 2-way 50, zero-shot shape 25, colour 16.7.")
    return lines


def by_key(summaries: Sequence[Summary]) -> Dict[Tuple[str, str, str, str], Summary]:
    return {(s.method, s.condition, s.split, s.metric): s for s in summaries}


def report_rows(study: Study, summaries: Sequence[Summary], split: str) -> List[Tuple[str, str]]:
    """(method, condition) of the rows with a summary on `split`: grid methods x conditions in grid order,
    then the frozen rows."""
    present = {(s.method, s.condition) for s in summaries if s.split == split}
    grid = [(m, c) for m in study.methods() for c in study.conditions() if (m, c) in present]
    frozen = [(label, NO_CONDITION) for label in (study.settings.frozen.rows if study.settings.frozen else {})
              if (label, NO_CONDITION) in present]
    return grid + frozen


def row_label(method: str, condition: str, findings: Optional[Findings]) -> str:
    """The row's method, marked `(inactive)` when its own term changed no decision (not a result)."""
    return f"{method} (inactive)" if findings is not None and (method, condition) in findings.inactive else method


def setting_label(setting: str, flags: Optional[SelectionFlags]) -> str:
    """The chosen setting with what the selection cannot say beside it."""
    if flags is None:
        return setting
    notes = (["not bracketed"] if flags.edge else []) + (["flat"] if flags.flat else [])
    return f"{setting} ({', '.join(notes)})" if notes else setting


def scores_table(study: Study, summaries: Sequence[Summary], split: str,
                 findings: Optional[Findings] = None) -> List[str]:
    found = by_key(summaries)
    flags = findings.flags if findings is not None else {}
    rows = []
    for method, condition in report_rows(study, summaries, split):
        cells = [found.get((method, condition, split, metric)) for metric in METRICS]
        first = next(cell for cell in cells if cell is not None)
        rows.append([row_label(method, condition, findings), condition,
                     setting_label(first.setting, flags.get((method, condition))),
                     str(max(c.n_seeds for c in cells if c))]
                    + [interval_text(c.interval) if c else "-" for c in cells])
    if not rows:
        return ["(no scored runs)"]
    return table(["method", "negatives", "setting", "seeds"] + [TITLES[m] for m in METRICS], rows, 4)


def selection_table(study: Study, selections: Mapping[Tuple[str, str], Selection],
                    flags: Optional[Mapping[Tuple[str, str], Optional[SelectionFlags]]] = None) -> List[str]:
    settings_order = list(dict.fromkeys(s for sel in selections.values() for s in sel.validation))
    rows = []
    for (method, condition), selection in selections.items():
        cells = []
        for setting in settings_order:
            mean, count = selection.validation.get(setting, (math.nan, 0))
            text = f"{mean:.1f} ({count})" if count else ("no run" if setting in selection.validation else "")
            cells.append(f"**{text}**" if setting == selection.chosen else text)
        found = (flags or {}).get((method, condition))
        rows.append([method, condition, selection.chosen or "none scored"] + cells
                    + [flags_text(found)])
    return table(["method", "negatives", "chosen"] + settings_order + ["flags"], rows, 3, 3 + len(settings_order))


def flags_text(flags: Optional[SelectionFlags]) -> str:
    if flags is None:
        return "-"
    spread = f"best - worst {flags.spread:.1f}" + (f" vs {flags.noise:.1f}" if math.isfinite(flags.noise) else "")
    return ", ".join(flags.labels()) + f" ({spread})"


def selection_rule() -> List[str]:
    return [f"Flags: `not bracketed (edge of the grid)`: the chosen setting is the grid's smallest or largest, so "
            "the grid does not bracket the optimum and a setting beyond it may score better; `flat within seed "
            "noise`: the best and worst settings' validation means differ by less than "
            f"{FLAT_MULTIPLE:g} standard errors of that difference (each setting's seed-level standard error, "
            "sd / sqrt(seeds), added in quadrature; `best - worst X vs Y` gives both), so the choice is not "
            "above seed noise."]


def activity_section(study: Study, findings: Findings) -> List[str]:
    """The rows against the baseline's paired runs, decision by decision: which rows' own terms acted."""
    if not findings.activity:
        return []
    rows = [[a.method, a.condition, a.reference, str(a.pairs), str(a.outcomes), str(a.differing),
             "inactive: not a result" if a.active is False else "active"] for a in findings.activity]
    return [f"## Did each row's own term act? Its runs against `{study.settings.baseline}`'s runs of the same "
            "negatives, setting and seed, decision by decision", "",
            "Every run of the row (each setting and seed) against its paired baseline run, on every split both "
            "hold: each swap item's decisions, and whether each retrieval query and each zero-shot object rank "
            "their answer first. A row none of whose decisions differs is inactive: its own term never changed "
            "training enough to change one decision, so its scores are the baseline's. It is marked "
            "`(inactive)` in the tables, its differences are not read, and it enters no claim. The bundle "
            "records no direct measure of a term's activity (such as the share of steps a hinge fired); this is "
            "the measure derived from what it records.", ""] + table(
        ["method", "negatives", "against", "run pairs", "decisions compared", "decisions differing", "reading"],
        rows, 3, 6) + [""]


def differences_table(differences: Sequence[Comparison], inactive: Collection[Tuple[str, str]] = ()) -> List[str]:
    if not differences:
        return ["(no comparison: a reference or its runs are missing)"]
    rows = [[d.split, d.method, d.condition, d.reference, TITLES[d.metric], interval_text(d.interval),
             seed_t_text(d), p_text(d.seed.p_value) if d.seed else "-", str(d.n_seeds), str(d.n_items),
             verdict(d, inactive)] for d in differences]
    return table(["split", "method", "negatives", "reference", "metric", "difference [95% bootstrap]",
                  "seed-level t [95%]", "p (seed t)", "seeds", "items", "reading"], rows, 5, 10)


def seed_t_text(comparison: Comparison) -> str:
    """The seed-level t interval (`mean (one seed)` where one seed leaves none)."""
    if comparison.seed is None or not math.isfinite(comparison.seed.interval.low):
        return "- (one seed)"
    return interval_text(comparison.seed.interval)


def p_text(p: float) -> str:
    if not math.isfinite(p):
        return "-"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def verdict(comparison: Comparison, inactive: Collection[Tuple[str, str]] = ()) -> str:
    """What the two intervals support: better or worse only where both exclude 0 on the same side."""
    if (comparison.method, comparison.condition) in inactive:
        return "inactive row: not read"
    side = agreement(comparison)
    if side:
        return "better" if side > 0 else "worse"
    bootstrap = excludes_zero(comparison.interval)
    seed = excludes_zero(comparison.seed.interval) if comparison.seed else 0
    if comparison.seed is None or not math.isfinite(comparison.seed.interval.low):
        return "not shown: one seed" if bootstrap else "no difference shown"
    if bootstrap and not seed:
        return "not shown: bootstrap only"
    if seed and not bootstrap:
        return "not shown: seed t only"
    return "no difference shown" if not bootstrap else "not shown: the intervals disagree"


def claim_lines(findings: Findings, validity: Optional[study_validity.Validity]) -> List[str]:
    """The claims a reader may state, one line each, and what they rest on: the paired differences whose bootstrap
    and seed-level t intervals both exclude 0 on the same side, of active rows; marked provisional where the
    testbed is not shown valid."""
    found = claims(findings.differences, findings.inactive)
    provisional = validity is not None and not validity.passed
    tag = "provisional: " if provisional else ""
    lines = [f"- {tag}`{c.method}` ({c.condition}) is {'above' if agreement(c) > 0 else 'below'} `{c.reference}` "
             f"on {TITLES[c.metric]}, `{c.split}`: {c.interval.estimate:+.1f}, bootstrap "
             f"[{c.interval.low:.1f}, {c.interval.high:.1f}], seed-level t [{c.seed.interval.low:.1f}, "
             f"{c.seed.interval.high:.1f}] ({c.seed.df} df, p {p_text(c.seed.p_value)})" for c in found]
    return lines or ["- none: no paired difference has both intervals excluding 0 on the same side"]


def claims_statement(findings: Findings, validity: Optional[study_validity.Validity]) -> str:
    """How the claims were read: how many comparisons, at what level, no multiplicity correction, which rows are
    left out, and whether the testbed's validity lets them be read as conclusions."""
    total = len(findings.differences)
    with_t = sum(1 for c in findings.differences if c.seed is not None and math.isfinite(c.seed.interval.low))
    inactive = sorted(f"`{m}` ({c})" for m, c in findings.inactive)
    text = (f"{total} paired differences are each read at 95% ({with_t} of them with a seed-level t; the others "
            "have one seed), with no correction for multiplicity: where no difference exists, about 1 in 20 "
            f"comparisons excludes 0 by chance (about {0.05 * total:.0f} of {total}). A claim needs the bootstrap "
            "and the seed-level t interval to exclude 0 on the same side.")
    if inactive:
        text += f" Inactive rows enter no claim: {', '.join(inactive)}."
    if validity is not None and not validity.passed:
        text += (f" The testbed is not shown valid ({study_validity.not_passed_text(validity)}): every claim is "
                 "provisional, a measurement of this testbed rather than a conclusion about the methods.")
    return text


def claims_section(findings: Findings, validity: Optional[study_validity.Validity]) -> List[str]:
    if not findings.differences:
        return []
    return ["## Claims: differences both intervals show", "", claims_statement(findings, validity), ""] + \
        claim_lines(findings, validity) + [""]


def tradeoff_section(study: Study, tradeoffs: Sequence[Comparison], figures: Figures) -> List[str]:
    """Per split, each row's change from the frozen backbone in composition and in recognition."""
    if study.settings.frozen is None:
        return []
    reference = study.settings.frozen.reference
    lines = [f"## Composition against recognition: each row minus `{reference}` (the backbone it starts from), "
             "paired bootstrap as above", "",
             "Recognition: zero-shot top-1 over each object's shape and colour (the world's classes), and R@1 over "
             "the queries of both retrieval directions. A method that gains composition at no cost sits up and "
             "to the right of 0.", ""]
    found = {(c.method, c.condition, c.split, c.metric): c for c in tradeoffs}
    for split in study.settings.splits:
        rows = list(dict.fromkeys((c.method, c.condition) for c in tradeoffs if c.split == split))
        lines += [f"### `{split}`", ""]
        if not rows:
            lines += ["(no row to compare: the frozen reference or the rows are missing)", ""]
            continue
        body = [[method, condition, str(max(found[(method, condition, split, m)].n_seeds
                                            for m in TRADEOFF_METRICS if (method, condition, split, m) in found))]
                + [interval_text(found[(method, condition, split, m)].interval) if (method, condition, split, m)
                   in found else "-" for m in TRADEOFF_METRICS] for method, condition in rows]
        lines += table(["method", "negatives", "seeds"] + [f"{TITLES[m]} change" for m in TRADEOFF_METRICS],
                       body, 2) + [""]
        lines += figure(figures, f"tradeoff_{split}", f"swap group change against recognition change on {split}")
    return lines


def checks_section(study: Study, checks: Sequence[CheckResult]) -> List[str]:
    """The one-seed checks beside each row: the check's value, its grid run's and the difference."""
    if study.settings.checks is None:
        return []
    split = study.settings.selection_split
    lines = [f"## Checks beside each row: one seed on `{split}`, each against the study's run it varies (same "
             "method, negatives, setting and seed); difference with a paired bootstrap over items", ""]
    if not checks:
        return lines + [f"(no check scored: run the sweep of {study.settings.checks})", ""]
    found = {(r.check.name, r.metric): r for r in checks}
    body = []
    for name in dict.fromkeys(r.check.name for r in checks):
        first = next(r for r in checks if r.check.name == name)
        run = first.check
        body.append([run.method, run.condition, run.setting, run.check, run.seed, "yes" if first.chosen else "no"]
                    + [f"{found[(name, m)].value:.1f} / {found[(name, m)].reference_value:.1f}: "
                       f"{interval_text(found[(name, m)].interval)}" if (name, m) in found else "-"
                       for m in PAIRED_METRICS])
    return lines + table(["method", "negatives", "setting", "check", "seed", "row's setting"]
                         + [f"{TITLES[m]}: check / run: difference" for m in PAIRED_METRICS], body, 6) + [
        "", "`row's setting`: whether the varied run has its row's chosen setting (else the check is at another "
            "setting than the row reports).", ""]


def mechanisms_section(study: Study, summaries: Sequence[Summary]) -> List[str]:
    mechanism = [s for s in summaries if s.metric.startswith("mechanism/")]
    if not mechanism:
        return ["## Mechanisms", "", "(no mechanism metrics: none was measured on these splits)", ""]
    lines = []
    found = by_key(mechanism)
    keys = list(dict.fromkeys(s.metric for s in mechanism))
    for split in study.settings.splits:
        rows = []
        for method, condition in report_rows(study, mechanism, split):
            cells = [found.get((method, condition, split, key)) for key in keys]
            rows.append([method, condition] + [mechanism_text(c.interval) if c else "-" for c in cells])
        lines += [f"## Mechanisms on `{split}` (mean [95% t-interval over seeds])", ""]
        lines += (table(["method", "negatives"] + [k[len("mechanism/"):] for k in keys], rows, 2) if rows
                  else ["(none measured)"]) + [""]
    return lines


def missing_section(study: Study, evaluations: Evaluations) -> List[str]:
    lines = [f"## Missing and failed runs ({len(evaluations.missing)} missing, "
             f"{sum(1 for problems in evaluations.errors.values() if problems)} with problems)", ""]
    lines += [f"- `{name}`: {reason}" for name, reason in evaluations.missing.items()]
    lines += [f"- `{name}`: {problem}" for name, problems in evaluations.errors.items() for problem in problems]
    if len(lines) == 2:
        lines.append("(none)")
    return lines


# ----- CSV ----------------------------------------------------------------------------------------------------
def _csv(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([["" if isinstance(v, float) and not math.isfinite(v) else v for v in row] for row in rows])
    return buffer.getvalue()


def results_csv(summaries: Sequence[Summary], extra_rows: Sequence[Sequence[object]] = ()) -> str:
    """The summaries, then `extra_rows` in the same columns (the testbed validity rows)."""
    return _csv(["method", "negatives", "split", "metric", "mean", "low", "high", "n_seeds", "lr"],
                [[s.method, s.condition, s.split, s.metric, s.interval.estimate, s.interval.low, s.interval.high,
                  s.n_seeds, s.setting] for s in summaries] + [list(row) for row in extra_rows])


def differences_csv(differences: Sequence[Comparison]) -> str:
    """One row per paired difference: the bootstrap interval (`low`, `high`) and the seed-level t (`seed_low`,
    `seed_high`, `seed_p`, `seed_df`; empty with one seed)."""
    nan = math.nan
    return _csv(["method", "negatives", "reference", "split", "metric", "difference", "low", "high", "n_seeds",
                 "n_items", "seed_low", "seed_high", "seed_p", "seed_df"],
                [[d.method, d.condition, d.reference, d.split, d.metric, d.interval.estimate, d.interval.low,
                  d.interval.high, d.n_seeds, d.n_items]
                 + ([d.seed.interval.low, d.seed.interval.high, d.seed.p_value, d.seed.df] if d.seed else
                    [nan, nan, nan, ""]) for d in differences])


def selection_csv(study: Study, selections: Mapping[Tuple[str, str], Selection]) -> str:
    split, metric = study.settings.selection_split, study.settings.selection_metric
    return _csv(["method", "negatives", "lr", "split", "metric", "mean", "n_seeds", "chosen"],
                [[method, condition, setting, split, metric, mean, count, setting == selection.chosen]
                 for (method, condition), selection in selections.items()
                 for setting, (mean, count) in selection.validation.items()])


def cells_manifest(cells: Sequence[Cell]) -> str:
    """JSON: split -> "method|negatives" -> {setting, seeds: {seed: cache file}} (to recompute any number)."""
    manifest: Dict[str, Dict[str, object]] = {}
    for cell in cells:
        manifest.setdefault(cell.split, {})[f"{cell.method}|{cell.condition}"] = {
            "setting": cell.setting, "frozen": cell.frozen, "seeds": dict(cell.sources)}
    return json.dumps(manifest, indent=2)


# ----- plots --------------------------------------------------------------------------------------------------
def pyplot():
    """matplotlib's pyplot on the Agg backend (files only; no display on a cluster node)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scores(summaries: Sequence[Summary], split: str, rows: Sequence[Tuple[str, str]], path: Path) -> None:
    """Group score and 2-way relation accuracy per method (a bar per condition; frozen rows in grey), with the
    interval over seeds as error bars (the axis stops at 0 and 100; the tables carry the full intervals)."""
    plt = pyplot()
    found = by_key(summaries)
    methods = list(dict.fromkeys(method for method, _ in rows))
    conditions = [c for c in dict.fromkeys(condition for _, condition in rows) if c != NO_CONDITION]
    colours = {condition: plt.get_cmap("tab10")(index) for index, condition in enumerate(conditions)}
    width = 0.8 / max(1, len(conditions))
    figure, axes = plt.subplots(1, len(PAIRED_METRICS), figsize=(max(6.0, 1.1 * len(methods) + 2), 4.5),
                                squeeze=False)
    for axis, metric in zip(axes[0], PAIRED_METRICS):
        for position, (method, condition) in enumerate((m, c) for m in methods for c in [*conditions, NO_CONDITION]):
            summary = found.get((method, condition, split, metric))
            if summary is None:
                continue
            offset = 0.0 if condition == NO_CONDITION else (conditions.index(condition) - (len(conditions) - 1) / 2)
            x = methods.index(method) + offset * width
            interval = summary.interval
            error = ([[interval.estimate - interval.low], [interval.high - interval.estimate]]
                     if math.isfinite(interval.low) else None)
            label = "frozen" if condition == NO_CONDITION else f"negatives={condition}"
            axis.bar(x, interval.estimate, width=width, color=colours.get(condition, "grey"), yerr=error, capsize=3,
                     label=None if label in axis.get_legend_handles_labels()[1] else label)
        axis.axhline(CHANCE[metric], color="black", linestyle="--", linewidth=1, label="chance")
        axis.set_xticks(range(len(methods)), methods, rotation=30, ha="right")
        axis.set_ylim(0, 100)
        axis.set_title(f"{TITLES[metric]} on {split}")
        axis.set_ylabel("% (mean, 95% interval over seeds)")
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_validation_curves(study: Study, selections: Mapping[Tuple[str, str], Selection],
                           all_curves: Mapping[str, Curves], path: Path) -> None:
    """Every run's validation curves (`all_curves`, by run name): a column per method, a row per metric; the chosen
    setting's runs solid, the other settings' dashed and faint; the colour is the condition."""
    plt = pyplot()
    curves = {run.name: all_curves.get(run.name, {}) for run in study.runs}
    metrics = [m for m in CURVE_METRICS if any(m in c for c in curves.values())] or ["group"]
    methods, conditions = study.methods(), study.conditions()
    colours = {condition: plt.get_cmap("tab10")(index) for index, condition in enumerate(conditions)}
    figure, axes = plt.subplots(len(metrics), len(methods), figsize=(3.6 * len(methods), 2.8 * len(metrics)),
                                squeeze=False, sharey="row")
    for column, method in enumerate(methods):
        for row, metric in enumerate(metrics):
            axis = axes[row][column]
            for run in (r for r in study.runs if r.method == method and metric in curves[r.name]):
                chosen = selections[(run.method, run.condition)].chosen == run.setting
                steps, values = curves[run.name][metric]
                axis.plot(steps, values, color=colours[run.condition], linestyle="-" if chosen else "--",
                          alpha=1.0 if chosen else 0.35, linewidth=1)
            axis.set_title(f"{method}: {TITLES.get(metric, metric)}", fontsize="small")
            axis.set_xlabel("step", fontsize="small")
    handles = [plt.Line2D([], [], color=colours[c], label=f"negatives={c}") for c in conditions]
    handles += [plt.Line2D([], [], color="black", label="chosen setting"),
                plt.Line2D([], [], color="black", linestyle="--", alpha=0.35, label="other settings")]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize="small")
    if not any(curves.values()):
        figure.suptitle(f"no {CURVE_PREFIX}* curves in the runs' TensorBoard logs (evaluation.benchmarks unset?)")
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_tradeoff(tradeoffs: Sequence[Comparison], split: str, path: Path) -> None:
    """Swap group change (y) against zero-shot top-1 change and R@1 change (x, one panel each) from the frozen
    backbone, a point per row (colour: condition), with the paired bootstrap intervals as error bars."""
    plt = pyplot()
    found = {(c.method, c.condition, c.metric): c for c in tradeoffs if c.split == split}
    rows = list(dict.fromkeys((c.method, c.condition) for c in tradeoffs if c.split == split))
    conditions = list(dict.fromkeys(condition for _, condition in rows))
    colours = {condition: plt.get_cmap("tab10")(index) for index, condition in enumerate(conditions)}
    composition, recognition = TRADEOFF_METRICS[0], TRADEOFF_METRICS[1:]
    figure, axes = plt.subplots(1, len(recognition), figsize=(6.0 * len(recognition), 5.0), squeeze=False)
    for axis, metric in zip(axes[0], recognition):
        points = [(method, condition, found[(method, condition, metric)], found[(method, condition, composition)])
                  for method, condition in rows
                  if (method, condition, metric) in found and (method, condition, composition) in found]
        stacks = label_stack([(x.interval.estimate, y.interval.estimate) for _, _, x, y in points])
        for (method, condition, x, y), stack in zip(points, stacks):
            axis.errorbar(x.interval.estimate, y.interval.estimate, xerr=error_bar(x.interval),
                          yerr=error_bar(y.interval), fmt="o", color=colours[condition], capsize=2,
                          label=None if legend(condition) in axis.get_legend_handles_labels()[1] else legend(condition))
            axis.annotate(method, (x.interval.estimate, y.interval.estimate), fontsize="x-small",
                          xytext=(3, 3 + LABEL_STEP * stack), textcoords="offset points", color=colours[condition])
        axis.axhline(0, color="black", linewidth=0.8)
        axis.axvline(0, color="black", linewidth=0.8)
        axis.set_xlabel(f"{TITLES[metric]} change (points)")
        axis.set_ylabel(f"{TITLES[composition]} change (points)")
        axis.set_title(f"composition against recognition on {split}", fontsize="small")
        if points:
            axis.legend(title="negatives", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def label_stack(points: Sequence[Tuple[float, float]], width: float = 0.14, height: float = 0.035) -> List[int]:
    """For each point, the line its label goes up to (0: beside the point) so that no two labels overlap: a label
    is a box `width` x `height` of the points' spans, right of and above its point, and each takes the lowest
    line free of the labels placed before it. Rows that land on one spot (CLIP-FT and a method equal to it) so
    keep readable labels."""
    if not points:
        return []
    x_span, y_span = [max(1e-9, max(p[axis] for p in points) - min(p[axis] for p in points)) for axis in (0, 1)]
    boxes: List[Tuple[float, float, float, float]] = []
    lines = []
    for x, y in points:
        line = 0
        while any(overlaps((x, y + line * height * y_span, x + width * x_span, y + (line + 1) * height * y_span), box)
                  for box in boxes):
            line += 1
        boxes.append((x, y + line * height * y_span, x + width * x_span, y + (line + 1) * height * y_span))
        lines.append(line)
    return lines


def overlaps(first: Tuple[float, float, float, float], second: Tuple[float, float, float, float]) -> bool:
    """Whether two boxes (x0, y0, x1, y1) share an area."""
    return first[0] < second[2] and second[0] < first[2] and first[1] < second[3] and second[1] < first[3]


def legend(condition: str) -> str:
    return "frozen" if condition == NO_CONDITION else condition


def error_bar(interval: Interval):
    """matplotlib's [[below], [above]] of an interval (None without one)."""
    if not (math.isfinite(interval.low) and math.isfinite(interval.high)):
        return None
    return [[interval.estimate - interval.low], [interval.high - interval.estimate]]


# ----- TensorBoard hparams ------------------------------------------------------------------------------------
def hparams_metrics(scores: Mapping[str, Mapping[str, object]]) -> Dict[str, float]:
    """`<split>/<metric>` of every split the run was scored on (finite values only)."""
    return {f"{split}/{metric}": value for split, split_scores in scores.items()
            for metric, value in metric_values(split_scores).items() if math.isfinite(value)}


def hparams_sessions(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection]
                     ) -> List[Tuple[str, Dict[str, object]]]:
    """(name, hparams) of every scored grid run and frozen row."""
    sessions = [(run.name, {"method": run.method, "negatives": run.condition, "lr": run.setting, "seed": run.seed,
                            "chosen": selections[(run.method, run.condition)].chosen == run.setting})
                for run in study.runs if run.name in evaluations.scores]
    frozen = study.settings.frozen.rows if study.settings.frozen else {}
    return sessions + [(label, {"method": label, "negatives": NO_CONDITION, "lr": "-", "seed": "-", "chosen": True})
                       for label in frozen if label in evaluations.scores]


def write_hparams(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection],
                  log_dir: Path) -> None:
    """One hparams session per scored run and frozen row under `log_dir/<name>/`, and one experiment summary
    at `log_dir` naming every hparam value and every metric.

    Not `SummaryWriter.add_hparams`: it writes an experiment summary per run holding only that run's metrics,
    and TensorBoard shows the first one it finds, so a run scored on validation only would hide the test
    columns. The folder is written afresh (an old view would repeat runs).
    """
    from torch.utils.tensorboard.summary import hparams, scalar
    from torch.utils.tensorboard.writer import FileWriter

    shutil.rmtree(log_dir, ignore_errors=True)
    sessions = [(name, values, hparams_metrics(evaluations.scores[name]))
                for name, values in hparams_sessions(study, evaluations, selections)]
    sessions = [session for session in sessions if session[2]]
    if not sessions:
        return
    domains = {key: sorted({str(values[key]) for _, values, _ in sessions})
               for key in ("method", "negatives", "lr", "seed")}
    metric_names = list(dict.fromkeys(key for _, _, metrics in sessions for key in metrics))
    experiment, _, _ = hparams(sessions[0][1], {key: 0.0 for key in metric_names}, domains)
    _write_summaries(FileWriter(str(log_dir)), [experiment])
    for name, values, metrics in sessions:
        _, start, end = hparams(values, metrics, domains)
        # TensorBoard reads a session's metric values from the scalars of the metric's tag in the session's run.
        _write_summaries(FileWriter(str(log_dir / name)),
                         [scalar(key, value) for key, value in metrics.items()] + [start, end])


def _write_summaries(writer, summaries: Sequence[object]) -> None:
    for summary in summaries:
        writer.add_summary(summary)
    writer.close()

"""The study's report files (`python -m study`): tables, CSV, plots and the TensorBoard view.

`<out>/report/` gets:
- `results.md`: per reporting split, every row's scores as `mean [low, high]` (Student-t 95% over seeds) at its
  validation-chosen setting; the selection table (every setting's validation mean); the paired differences
  against the reference; the mechanism metrics; the grid runs that are missing or failed;
- `results.csv` (long: method, negatives, split, metric, mean, low, high, n_seeds, lr; mechanism metrics as
  `mechanism/<key>`), `differences.csv`, `selection.csv`, and `cells.json`: for every row and reporting split,
  the cache file (`study_eval.json`) of each seed, whose per-item outcomes the numbers are computed from;
- `scores_<split>.png` (group score and 2-way relation accuracy with their intervals),
  `validation_curves.png` (every run's `eval/shapes_swap/*` TensorBoard curve, a column per method);
- `tb_hparams/`: one hparams session per scored run (`tensorboard --logdir <report>/tb_hparams`);
- with `study.validity`: the "Testbed validity" section of results.md (first, and printed), its rows in
  results.csv (`validity/*`) and `validity.json` (validity.py).
"""
from __future__ import annotations

import csv
import io
import json
import math
import shutil
from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Tuple

from core.files import atomic_write_text
from study import validity as study_validity
from study.analysis import (
    Cell,
    Comparison,
    Evaluations,
    Selection,
    Summary,
    comparisons,
    json_safe,
    metric_values,
    study_cells,
    summarise,
)
from study.settings import METRICS, NO_CONDITION, PAIRED_METRICS, Progress, Study
from study.stats import Interval
from study.tables import CHANCE, TITLES, interval_text, mechanism_text, table

CURVE_PREFIX = "eval/shapes_swap/"
CURVE_METRICS = ("group", "acc_relation", "acc_attribute", "acc_object", "text", "image")
TB_DIR = "tb_hparams"


def write_report(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection],
                 out_dir: Path, progress: Progress = print) -> Path:
    """Every report file under `out_dir`; returns the path of results.md. The testbed validity section, when
    the study has one, also goes to `progress` (it is the first thing to read: can the testbed show a gain?)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = study_cells(study, evaluations, selections)
    summaries = [summary for cell in cells for summary in summarise(cell)]
    differences = comparisons(cells, study.settings)
    validity, validity_lines, validity_rows = None, [], []
    if study.settings.validity:
        validity = study_validity.measure_validity(study, evaluations, cells)
        validity_lines = study_validity.markdown_section(validity, study.settings.selection_split)
        validity_rows = study_validity.csv_rows(validity)
        atomic_write_text(out_dir / "validity.json", json.dumps(json_safe(study_validity.as_json(validity)), indent=2))
        progress("\n".join(validity_lines))
    atomic_write_text(out_dir / "results.md", markdown(study, evaluations, selections, summaries, differences,
                                                       validity_lines))
    atomic_write_text(out_dir / "results.csv", results_csv(summaries, validity_rows))
    atomic_write_text(out_dir / "differences.csv", differences_csv(differences))
    atomic_write_text(out_dir / "selection.csv", selection_csv(study, selections))
    atomic_write_text(out_dir / "cells.json", cells_manifest(cells))
    for split in study.settings.splits:
        plot_scores(summaries, split, report_rows(study, summaries, split), out_dir / f"scores_{split}.png")
    plot_validation_curves(study, selections, out_dir / "validation_curves.png")
    write_hparams(study, evaluations, selections, out_dir / TB_DIR)
    return out_dir / "results.md"


# ----- markdown -----------------------------------------------------------------------------------------------
def markdown(study: Study, evaluations: Evaluations, selections: Mapping[Tuple[str, str], Selection],
             summaries: Sequence[Summary], differences: Sequence[Comparison],
             validity_lines: Sequence[str] = ()) -> str:
    settings = study.settings
    lines = [f"# Study report: {study.directory.name}", ""] + preamble(study, evaluations) + [""]
    lines += list(validity_lines)
    for split in settings.splits:
        lines += [f"## Scores on `{split}` (mean [95% t-interval over seeds], setting chosen on "
                  f"`{settings.selection_split}`)", ""]
        lines += scores_table(study, summaries, split) + [""]
    lines += [f"## Selection on `{settings.selection_split}`: mean {settings.selection_metric} over seeds "
              "(seeds) per setting; the chosen one in bold", ""]
    lines += selection_table(study, selections) + [""]
    lines += ["## Paired differences: method minus reference on the same items, paired bootstrap over items x "
              f"seeds ({settings.resamples} resamples), 95% interval", ""]
    lines += differences_table(differences) + [""]
    lines += mechanisms_section(study, summaries)
    lines += missing_section(study, evaluations)
    return "\n".join(lines) + "\n"


def preamble(study: Study, evaluations: Evaluations) -> List[str]:
    settings, total = study.settings, len(study.runs)
    scored = sum(1 for run in study.runs if run.name in evaluations.scores)
    frozen = settings.frozen
    lines = [f"- World: `{settings.data}`; selection on `{settings.selection_split}` by "
             f"`{settings.selection_metric}`; reported on {', '.join(f'`{s}`' for s in settings.splits)} "
             "(never used for selection).",
             f"- Grid runs: {total}; scored: {scored}; missing or failed: {total - scored} (listed at the end).",
             f"- Baseline: `{settings.baseline}`, compared within each condition (`negatives`).",
             "- Per-item outcomes: each run's `study_eval.json` (`cells.json` here names the files behind every row)."]
    if frozen:
        lines.append(f"- Frozen rows from `{frozen.export}`: " + ", ".join(
            f"`{label}` ({scorer})" for label, scorer in frozen.rows.items())
            + f"; frozen-backbone methods {list(frozen.methods)} and the other frozen rows are compared with "
              f"`{frozen.reference}`.")
    lines.append("- Paired differences: items matched by id; seeds matched by seed (a frozen reference, scored "
                 "once, pairs with every seed); `reading` says whether the interval excludes 0.")
    lines.append("- Scores in %. `(one run)`: a single seed or a frozen row scored once, no interval over seeds. "
                 "Chance: swap group 16.7, swap text / image 25, 2-way 50.")
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


def scores_table(study: Study, summaries: Sequence[Summary], split: str) -> List[str]:
    found = by_key(summaries)
    rows = []
    for method, condition in report_rows(study, summaries, split):
        cells = [found.get((method, condition, split, metric)) for metric in METRICS]
        first = next(cell for cell in cells if cell is not None)
        rows.append([method, condition, first.setting, str(max(c.n_seeds for c in cells if c))]
                    + [interval_text(c.interval) if c else "-" for c in cells])
    if not rows:
        return ["(no scored runs)"]
    return table(["method", "negatives", "setting", "seeds"] + [TITLES[m] for m in METRICS], rows, 4)


def selection_table(study: Study, selections: Mapping[Tuple[str, str], Selection]) -> List[str]:
    settings_order = list(dict.fromkeys(s for sel in selections.values() for s in sel.validation))
    rows = []
    for (method, condition), selection in selections.items():
        cells = []
        for setting in settings_order:
            mean, count = selection.validation.get(setting, (math.nan, 0))
            text = f"{mean:.1f} ({count})" if count else ("no run" if setting in selection.validation else "")
            cells.append(f"**{text}**" if setting == selection.chosen else text)
        rows.append([method, condition, selection.chosen or "none scored"] + cells)
    return table(["method", "negatives", "chosen"] + settings_order, rows, 3)


def differences_table(differences: Sequence[Comparison]) -> List[str]:
    if not differences:
        return ["(no comparison: a reference or its runs are missing)"]
    rows = [[d.split, d.method, d.condition, d.reference, TITLES[d.metric], interval_text(d.interval),
             str(d.n_seeds), str(d.n_items), verdict(d.interval)] for d in differences]
    return table(["split", "method", "negatives", "reference", "metric", "difference [95%]", "seeds", "items",
                  "reading"], rows, 5, 8)


def verdict(interval: Interval) -> str:
    """Whether the interval excludes zero (the only reading the interval supports)."""
    if interval.low > 0:
        return "better"
    if interval.high < 0:
        return "worse"
    return "no difference shown"


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
    return _csv(["method", "negatives", "reference", "split", "metric", "difference", "low", "high", "n_seeds",
                 "n_items"],
                [[d.method, d.condition, d.reference, d.split, d.metric, d.interval.estimate, d.interval.low,
                  d.interval.high, d.n_seeds, d.n_items] for d in differences])


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


def read_curves(run_dir: Path) -> Dict[str, Tuple[List[int], List[float]]]:
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
            curves[metric] = (sorted(points), [points[step] for step in sorted(points)])
    return curves


def plot_validation_curves(study: Study, selections: Mapping[Tuple[str, str], Selection], path: Path) -> None:
    """Every run's validation curves: a column per method, a row per metric; the chosen setting's runs solid,
    the other settings' dashed and faint; the colour is the condition."""
    plt = pyplot()
    curves = {run.name: read_curves(run.directory) for run in study.runs}
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

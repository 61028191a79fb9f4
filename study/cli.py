"""`python -m study --sweep runs/sweeps/NAME [--data-root DIR] [--out DIR] [--bundle DIR]`: the study's report.

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
      checks: runs/study/checks        # optional: a sweep of one-seed variants of grid runs (a `check` axis)
      validity:                        # the testbed validity table (validity.py); optional
        backbones: [runs/study/backbone, runs/study/backbone_seed1]  # run dirs or exports, one per pretraining seed
        control: {method: clip_ft, negatives: with}   # the positive control: a grid cell, at its chosen setting
        criteria: {relation_gain: 15, group_gain: 10, chance_margin: 5, ceiling: 95}  # these are the defaults

What it does, in order:
1. Scores every grid run whose export is complete on the selection split: the shapes swap set (per-item
   outcomes and aggregates), retrieval over `captions_<split>.json` (R@1 both ways) and zero-shot shape and
   colour classification of the split's objects (`shapes_zeroshot`: recognition beside composition). A grid run
   without an export, or whose scoring fails, is listed in the report as missing (counted), never dropped
   silently.
2. Chooses, per (method, condition), the setting with the best mean validation metric over seeds (the first in
   grid order on a tie). Only the selection split's numbers enter this choice.
3. Scores the runs of the chosen settings on the reporting splits, with each method's own mechanism metrics
   (`mechanisms(run_dir, data_root, split) -> dict`, `study.mechanisms.measure`), and the frozen rows
   (nothing to select: reporting splits only), and the validity backbones with the global cosine (`clip`) on
   the reporting splits. The runs of other settings are scored on a reporting split only for a bundle (below),
   and never read from it. The check runs are scored on the selection split.
4. Summarises per method x condition x split: the mean and Student-t 95% interval over seeds of each metric
   (`stats.seed_interval`), and the paired items x seeds bootstrap (`stats.paired_bootstrap`) of
   the group score and the 2-way relation accuracy of each method against the baseline in the same condition
   (frozen-backbone methods and the other frozen rows against the frozen reference); with `contrast`, also of
   each method in `contrast.condition` against the same method in `contrast.reference` (seeds paired by label:
   what, say, the hard negatives add to each method, the baseline included); of each row against the frozen
   reference on the swap group score, zero-shot top-1 and R@1 (the composition / recognition trade-off); and of
   each check run against the grid run it varies (same method, condition, setting and seed; items only).
5. Writes the report folder (`--out`, default `<sweep>/report/`): results.md, results.csv, differences.csv,
   tradeoffs.csv, scores_<split>.png, tradeoff_<split>.png, validation_curves.png and tb_hparams/
   (`tensorboard --logdir <sweep>/report/tb_hparams`): report.py;
   with `validity`, its section in results.md (also printed), rows in results.csv and validity.json.

With `--bundle DIR` (default: the sweep file's `bundle:`), the study is also kept as data (`study/bundle.py`):
every run's config digest, backbone checksum, validation curves, per-item outcomes on every split and mechanism
metrics, the frozen rows, the selection, the validity table and the comparisons. Runs whose folders are gone are
read from it; every run here is scored on every split (and measured), so the bundle holds whatever a later
selection chooses. `python -m study.page --bundle DIR --out PAGE` makes the report page from it alone.

Each run's scores are cached in `<run>/study_eval.json` with the per-item outcomes they were computed from (an
independent bootstrap can be recomputed from them). The cache is keyed by the export's files (sizes and
modification times), the scorer, and per split the data root and the split's annotation files; anything else is
scored again. The frozen rows are cached under `<sweep>/study_frozen/<row>/`, the validity backbones under
`<sweep>/study_frozen/validity_<i>/` (i: the backbone's place in the list, from 0).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Dict, Optional, Sequence

from core.cli import add_data_root, add_output, refuse_renamed
from study.analysis import evaluate_study
from study.bundle import read_stored, update_bundle, with_bundled_checks, world_checksums
from study.report import report_numbers, write_report
from study.settings import SWEEP_FILE, Mechanisms, StudyError, load_study


# ----- command line -------------------------------------------------------------------------------------------
def load_mechanisms(limit: Optional[int] = None, splits: Optional[Sequence[str]] = None) -> Mechanisms:
    """`study.mechanisms.measure` with these options (imported on use: it pulls in the models).

    Args:
        limit: captions / samples per measurement (None: measure's default).
        splits: measure only these splits (None: every reporting split); the others get no mechanism metrics, so
            a long study can spend its mechanism budget on the split it reports them for.
    """
    from study.mechanisms import measure

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
    parser.add_argument("--bundle", type=Path, help="the results bundle to read runs from and write the study to "
                                                    "(default: the sweep file's `bundle:`, if any)")
    refuse_renamed(parser, {"--data": "--data-root DIR"})
    return parser.parse_args(argv)


def bundle_of(sweep: Path, given: Optional[Path]) -> Optional[Path]:
    """--bundle, else the sweep file's `bundle:` (copied into sweep.json), else none."""
    if given is not None:
        return given
    bundle = json.loads((Path(sweep) / SWEEP_FILE).read_text()).get("bundle")
    return Path(bundle) if bundle else None


def main(argv: Optional[Sequence[str]] = None) -> Path:
    args = parse_args(argv)
    try:
        study = load_study(args.sweep, args.data_root)
        study = replace(study, world=world_checksums(study.settings.data, [study.settings.selection_split,
                                                                           *study.settings.splits]))
        bundle = bundle_of(args.sweep, args.bundle)
        study = with_bundled_checks(study, bundle) if bundle else study
        evaluations, selections = evaluate_study(study, mechanisms=load_mechanisms(
            args.mechanism_limit, args.mechanism_splits.split(",") if args.mechanism_splits else None),
            recompute=args.recompute, stored=read_stored(bundle, study) if bundle else None,
            score_all=bundle is not None)
        numbers = report_numbers(study, evaluations, selections)
        if bundle is not None:
            print(f"bundle: {update_bundle(bundle, study, evaluations, selections, *numbers)}")
        results = write_report(study, evaluations, selections, args.out or args.sweep / "report", numbers=numbers)
    except StudyError as err:
        raise SystemExit(f"study error: {err}") from None
    print(f"report: {results}")
    return results

"""The method study over a sweep (`python -m study --sweep DIR`), its probes and the demo table.

Above training and the launchers: it reads sweeps (`slurm/`), builds runs' modules (`lightning_modules/`) and
scores them (`evaluation/`); nothing below imports it. Inside, each module imports only the ones listed before it:

- `stats.py`: Student-t intervals over seeds, the paired items x seeds bootstrap, the seed-level paired t, Welch's
  difference interval.
- `settings.py`: the study's settings (the sweep file's `study:` block) and its grid of runs.
- `analysis.py`: scoring (cached per run with its per-item outcomes), selection on the validation split and its
  flags (bracketed, flat), summaries over seeds, paired differences, each row's activity and the claims.
- `tables.py`: metric titles, chance levels, interval text and Markdown tables.
- `validity.py`: the testbed validity table (backbones against the positive control, checks (a)-(f) per world and
  backbone: PASS, FAIL or NOT MEASURED).
- `report.py`: results.md / .csv, differences, selection, plots and the TensorBoard hparams view; the same
  Markdown as one page (`write_page`).
- `records.py`: the results bundle as files (layout, gzip JSON records, the carried backbone, its restore); the
  part of it that `slurm.sweep` reads is the file contract of `core/run_records.py`.
- `bundle.py`: the study kept as data (records per run, frozen rows, report.json, in `records.py`'s layout), merged
  sitting by sitting, and the study read back from it alone.
- `mechanisms.py`: each method's own mechanism measured on a run (attribution gaps, MACCO's reconstruction with
  the true or another partner, SmartCLIP's masks).
- `cli.py` (also `__main__.py`): the command; `page.py`: `python -m study.page`, the report page from a bundle
  (and the README's and docs/study.md's generated blocks, `headline.py`); `restore.py`: the bundle's backbone put
  back for its own world; `world.py`: the study's configs for the world of another seed, in folders of its own.
- `demo.py`: `python -m study.demo`, the demo's table: each fine-tuning method at a small budget against the study's
  backbone, item by item, and the committed study's headline.
- probes of the testbed itself: `position_probe.py`, `relation_text_probe.py` (can a CLIP of this size learn
  left/right from pixels, and from text?) and `term_gradients.py` (each loss term's gradient per tower).
"""

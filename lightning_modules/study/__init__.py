"""The method study over a sweep (`python -m lightning_modules.study --sweep DIR`, docs/study.md).

- `command.py`: the command: scores every run of the sweep (cached per run with its per-item outcomes), chooses
  each method's setting on the validation split, scores the chosen runs on the reporting splits.
- `stats.py`: Student-t intervals over seeds, the paired items x seeds bootstrap, Welch's difference interval.
- `report.py`: results.md / .csv, differences, selection, plots and the TensorBoard hparams view.
- `validity.py`: the testbed validity table (backbones against the positive control, PASS / FAIL per criterion).
- `mechanisms.py`: each method's own mechanism measured on a run (attribution gaps, MACCO's reconstruction with
  the true or another partner, SmartCLIP's masks).
- `runs.py`: a sweep's files as `slurm.sweep` writes them (sweep.json, run logs, finished exports).
"""

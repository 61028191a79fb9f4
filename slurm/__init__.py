"""SLURM integration: sbatch templates, grid sweeps as array jobs (`sweep.py`), the sweep's file layout (`runs.py`)
and its runs as local child processes (`local.py`).
A sweep skips what a study has kept by reading the study's run records through the file contract of
`core/run_records.py` (the format is the study's, `study/records.py`)."""

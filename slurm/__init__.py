"""SLURM integration: sbatch templates, grid sweeps as array jobs (`sweep.py`), the sweep's file layout (`runs.py`)
and the results bundle's (`bundle.py`), which a sweep reads to skip what a study has kept."""

"""SLURM integration: sbatch templates, grid sweeps as array jobs, and a local single-node cluster for tests."""

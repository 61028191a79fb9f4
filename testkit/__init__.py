"""Helpers for tests and benchmarks, never for training or scoring real data.

- `standin/`: small files in each benchmark's official format (tests, `perf/` timings), so every scorer and
  loader runs without the real benchmark downloads.
- `localcluster.py`: a one-node SLURM cluster started in a temporary folder, for the sweep tests.
"""

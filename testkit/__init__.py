"""Helpers for tests and benchmarks, never for training or scoring real data.

- `standin/`: small files in each benchmark's official format (tests, `perf/` timings), so every scorer and
  loader runs without the real benchmark downloads.
- `fixtures.py`: the real-data fixtures committed under `tests/data/` (`fixture("sugarcrepe")`), failing with
  the restore command when one is missing.
- `parity/`: scripts that regenerate the parity fixtures under `tests/data/parity/` from each method's official
  code.
- `localcluster.py`: a one-node SLURM cluster started in a temporary folder, for the sweep tests.
"""

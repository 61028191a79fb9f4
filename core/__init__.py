"""The shared bottom layer without torch: what every command needs before any model exists.

- `config.py`: the typed configuration schema and its loading (`configs/base.yaml` <- `--config` files <- CLI
  overrides). The preprocessing and feature-cache CLIs (`datamodules`), the leakage guard (`evaluation`) and
  `lightning_modules.fit` all read the same schema.
- `cli.py`: the one command-line dialect of every entry point.
- `files.py`: atomic file writes.
- `run_records.py`: the file contract between the study's results bundle and the sweep that skips the runs it
  holds: where a run's record is and the fields the sweep checks (standard library only).
- `zoo.py`: the table of published compositional checkpoints (what they are, where, in which format); the code
  that loads them is `modeling/published.py`.

Model code (construction, encoders, the export format, checkpoint formats) lives one layer up, in `modeling/`.
Layers (checked by tests/test_layers.py): `core`, `parsers` <- `modeling` <- `datamodules` <- `evaluation` <-
`lightning_modules`, `testkit` <- `slurm`, `perf`, `gpucheck` <- `study`.
"""

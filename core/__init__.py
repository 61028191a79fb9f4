"""The shared bottom layer: what training, data preparation and evaluation all need, and nothing above it.

- `config.py`: the typed configuration schema and its loading (`configs/base.yaml` <- `--config` files <- CLI
  overrides). The preprocessing and feature-cache CLIs (`datamodules`), the leakage guard (`evaluation`) and
  `lightning_modules.fit` all read the same schema.
- `encoders.py`: open_clip model construction (`build_model`) and `CLIPEncoders`, which the methods train, the
  feature cache (`datamodules/features.py`) runs frozen, and the scorers (`evaluation/`) run to score.
- `export.py`: the exported model format (`export/open_clip.pt` + `model.json`): written by the training
  callback, read by every scorer.
- `files.py`: atomic file writes.

Why a package of its own rather than inside `evaluation/` [ours]: the frozen-feature cache in `datamodules/`
builds the CLIP and reads the configuration too, so the lowest package that needs these pieces is
`datamodules`; placing them in `evaluation/` (or leaving them in `lightning_modules/`) would make that import
point upward. Layers (checked by tests/test_layers.py): `core`, `parsers` <- `datamodules` <- `evaluation` <-
`lightning_modules` <- `slurm`, `perf`.
"""

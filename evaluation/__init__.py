"""Evaluation: every benchmark, how it is scored, and the command that runs them (`python -m evaluation`).

To change how one benchmark is scored, read its file in `benchmarks/` (its items from the official files, the
per-item rule `outcome`, and its aggregates); `benchmarks/base.py` holds the rules all share (strict `>`: a tie
is wrong) and the `Scorer` interface, `benchmarks/annotations.py` the readers every benchmark reads its files with
(a damaged file or an empty text is refused, naming the file).

- `benchmarks/`: the loaders, one file per benchmark family, `BENCHMARKS` by name (`benchmarks/__init__.py`);
  `benchmarks/data/` holds the official exclusion lists.
- `scorers.py`: the global-cosine `ClipScorer` (and the embedding / function scorers it builds on).
- `sgi.py`: Structure-Guided Inference, a training-free scorer on a frozen CLIP.
- `aligner.py`: the TFLocal / TFGlobal aligner's export format and `AlignerScorer` (the module is in `modeling/`).
- `harness.py`: runs benchmarks with a scorer, stores per-item outcomes, aggregates, writes the tables.
- `provenance.py`: what was scored (training step, sha256 of the weights file), recorded with every result.
- `evaluate.py` (also `__main__.py`): the CLI, `python -m evaluation.evaluate` = `python -m evaluation`.
- `leakage.py`: `python -m evaluation.leakage`, which evaluation images are also training images.

Layers: this package imports `core`, `parsers` and `datamodules` (the Shapes swap set, the frozen-feature
helpers), never `lightning_modules`: a trained model reaches evaluation only through its export, or as a
`Scorer` a training module hands to the harness. tests/test_layers.py checks this on every run of the suite.
"""

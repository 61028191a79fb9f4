"""Data: what training reads, and the offline jobs that prepare it.

- `coco.py`: the COCO-format DataModule (captions, NegCLIP hard negatives, token and patch masks).
- `annotations.py`: COCO / Karpathy / NegCLIP annotation readers; `inputs.py`: input checks before any work.
- `preprocess.py`: the offline scene-graph + grounding job (`python -m datamodules.preprocess`), whose records
  `masks.py` turns into text-token and image-patch masks; `word_vocabulary.py`: the parsed words CLIP-CAE's
  perturbation attribution replaces a word with.
- `features.py`: the frozen-feature cache (`python -m datamodules.features`) and its DataModule (TFLocal/TFGlobal).
- `cache.py`: the sharded, checksummed store and the shard loop that both offline caches use.
- `transforms.py`: image transforms; `hard_negatives.py`: NegCLIP negative captions and images.
- `shapes/`: the generated shapes world (`python -m datamodules.shapes`).

Layer: imports `parsers` and `core` only (tests/test_layers.py).
"""

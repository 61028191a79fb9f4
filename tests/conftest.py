"""Fixtures every test module may ask for by name: a tiny shapes world and its preprocessing cache (both built
once per session)."""
from __future__ import annotations

from pathlib import Path

import pytest

from datamodules import features
from datamodules.shapes import generate
from fitting import aligner_config, tiny_config


@pytest.fixture(scope="session")
def shapes_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    generate(root, n_train=16, n_val=8, image_size=64, seed=0)  # 2 captions per image
    return root


@pytest.fixture(scope="session")
def mask_cache(shapes_root, tmp_path_factory) -> Path:
    """The preprocessing cache of the tiny shapes world (ground-truth grounder), built once."""
    from datamodules.preprocess import run as run_preprocess

    cache = tmp_path_factory.mktemp("mask_cache")
    run_preprocess(tiny_config(shapes_root, cache, "data.masks=true", f"preprocess.cache_root={cache}"))
    return cache


@pytest.fixture(scope="session")
def feature_cache(shapes_root, tmp_path_factory) -> Path:
    """The tiny shapes world's frozen features (random-init ViT-Tiny, seed 0, 3 hard negatives), built once."""
    cache = tmp_path_factory.mktemp("features")
    manifests = features.run(aligner_config(shapes_root, cache, cache))
    assert manifests["train"]["counts"]["captions"] == 32 and manifests["val"]["counts"]["captions"] == 16
    return cache

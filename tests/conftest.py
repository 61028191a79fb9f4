"""Fixtures every test module may ask for by name: a tiny shapes world and its preprocessing cache (both built
once per session)."""
from __future__ import annotations

from pathlib import Path

import pytest

from datamodules.shapes import generate
from fitting import tiny_config


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

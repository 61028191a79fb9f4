"""Every registered method is complete (docs/adding-a-method.md): its option class is its config section, its
paper recipe and study overlay exist and load as that method, and perf.step measures it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from core.config import REPO_ROOT, MethodConfig
from lightning_modules import METHODS, load_run_config
from lightning_modules.methods import REGISTRY
from perf.step import CONFIG_FILES, VARIANTS

STUDY_BASE = [REPO_ROOT / "configs" / "study" / "finetune.yaml"]


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_the_option_class_is_the_method_section(name):
    options = REGISTRY[name].options
    assert issubclass(options, MethodConfig) and dataclasses.is_dataclass(options)
    cfg = load_run_config([], [f"method.name={name}"])
    assert set(cfg.method.keys()) == {field.name for field in dataclasses.fields(options)}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_the_recipe_and_the_study_overlay_load_as_the_method(name):
    entry = REGISTRY[name]
    assert load_run_config([REPO_ROOT / entry.recipe]).method.name == name
    assert load_run_config([*STUDY_BASE, REPO_ROOT / entry.study_overlay]).method.name == name


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_perf_step_measures_the_method(name):
    measured = set()
    for variant, overrides in VARIANTS.items():
        files = [REPO_ROOT / CONFIG_FILES[variant]] if variant in CONFIG_FILES else []
        measured.add(load_run_config(files, overrides).method.name)
    assert name in measured


def test_the_module_registry_is_the_registry():
    assert sorted(METHODS) == sorted(REGISTRY)
    for name, entry in REGISTRY.items():
        assert METHODS[name] is entry.load()
        assert Path(REPO_ROOT / entry.recipe).is_file() and Path(REPO_ROOT / entry.study_overlay).is_file()

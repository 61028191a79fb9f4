"""Training methods for compositional CLIP, selected by `method.name` through `METHODS`.

`METHODS` is built on first access (PEP 562): the method modules import Lightning and open_clip (about 10 s),
and CLIs that import this package only to look a method up must validate their inputs and fail within a second
or two, before any of that.

Training only (README "Layout"): this package builds on `evaluation` (benchmarks scored during training),
`datamodules`, `modeling` (losses, attribution, long-context text, the aligner module), `parsers` and `core`
(config schema, encoders, export); only `slurm`, `perf` and `study` import it. The methods, one file each on
`base.py`, are in `methods/`; `monitor.py` is the attribution-gap callback; `fit.py` the training command.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Sequence, Type

from omegaconf import DictConfig

from core.config import load_config, load_config_or_exit

if TYPE_CHECKING:
    from lightning_modules.base import CompositionalCLIPModule


def _registry() -> Dict[str, Type["CompositionalCLIPModule"]]:
    from lightning_modules.methods import REGISTRY

    return {name: entry.load() for name, entry in REGISTRY.items()}


def _methods() -> Dict[str, Type["CompositionalCLIPModule"]]:
    """The registry, built once; then an ordinary module attribute (tests may patch its entries)."""
    if "METHODS" not in globals():
        globals()["METHODS"] = _registry()
    return globals()["METHODS"]


def __getattr__(name: str):
    """`METHODS` and `CompositionalCLIPModule`, imported on first use."""
    if name == "METHODS":
        return _methods()
    if name == "CompositionalCLIPModule":
        from lightning_modules.base import CompositionalCLIPModule

        return CompositionalCLIPModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_run_config(config_files: Sequence = (), overrides: Sequence[str] = (), **kwargs) -> DictConfig:
    """`core.config.load_config` with every method's typed options: a training run's config, fully checked."""
    from lightning_modules.methods import METHOD_OPTIONS

    return load_config(config_files, overrides, methods=METHOD_OPTIONS, **kwargs)


def load_run_config_or_exit(config_files: Sequence, overrides: Sequence[str]) -> DictConfig:
    """`load_run_config` for command-line entry points: a config error ends the program with its message."""
    from lightning_modules.methods import METHOD_OPTIONS

    return load_config_or_exit(config_files, overrides, methods=METHOD_OPTIONS)


def method_class(name: str) -> Type["CompositionalCLIPModule"]:
    """The module class registered as `name`; an unknown name lists the valid ones."""
    methods = _methods()
    if name not in methods:
        raise KeyError(f"unknown method {name!r}; registered methods: {', '.join(sorted(methods))}")
    return methods[name]

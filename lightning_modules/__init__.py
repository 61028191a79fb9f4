"""Training methods for compositional CLIP, selected by `method.name` through `METHODS`.

`METHODS` is built on first access (PEP 562): the method modules import Lightning and open_clip (about 10 s),
and CLIs that import this package only to look a method up must validate their inputs and fail within a second
or two, before any of that.

The training side of the layers (README "Layout"): this package builds on `evaluation` (benchmarks scored during
training, the aligner the TFLocal module trains), `datamodules`, `parsers` and `core` (config schema, encoders,
export), and only `slurm` and `perf` import it. The methods, one file each on `base.py`, are in `methods/`;
attribution (the library, the training-time monitor and the heat-map CLI) is in `attribution/`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Type

if TYPE_CHECKING:
    from lightning_modules.base import CompositionalCLIPModule


def _registry() -> Dict[str, Type["CompositionalCLIPModule"]]:
    from lightning_modules.methods.clip_cae import ClipCAE
    from lightning_modules.methods.clip_ft import ClipFineTune
    from lightning_modules.methods.macco import MaccoCLIP
    from lightning_modules.methods.smartclip import SmartCLIP
    from lightning_modules.methods.tflocal import TFGlobal, TFLocal

    return {
        "clip_ft": ClipFineTune,
        "clip_cae": ClipCAE,
        "macco": MaccoCLIP,
        "smartclip": SmartCLIP,
        "tflocal": TFLocal,
        "tfglobal": TFGlobal,
    }


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


def method_class(name: str) -> Type["CompositionalCLIPModule"]:
    """The module class registered as `name`; an unknown name lists the valid ones."""
    methods = _methods()
    if name not in methods:
        raise KeyError(f"unknown method {name!r}; registered methods: {', '.join(sorted(methods))}")
    return methods[name]

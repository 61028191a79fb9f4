"""Training methods for compositional CLIP, selected by `method.name` through `METHODS`."""
from __future__ import annotations

from typing import Dict, Type

from lightning_modules.base import CompositionalCLIPModule
from lightning_modules.clip_cae import ClipCAE
from lightning_modules.clip_ft import ClipFineTune
from lightning_modules.macco import MaccoCLIP
from lightning_modules.smartclip import SmartCLIP
from lightning_modules.tflocal import TFGlobal, TFLocal

METHODS: Dict[str, Type[CompositionalCLIPModule]] = {
    "clip_ft": ClipFineTune,
    "clip_cae": ClipCAE,
    "macco": MaccoCLIP,
    "smartclip": SmartCLIP,
    "tflocal": TFLocal,
    "tfglobal": TFGlobal,
}


def method_class(name: str) -> Type[CompositionalCLIPModule]:
    """The module class registered as `name`; an unknown name lists the valid ones."""
    if name not in METHODS:
        raise KeyError(f"unknown method {name!r}; registered methods: {', '.join(sorted(METHODS))}")
    return METHODS[name]

"""The methods, one file each on the shared base (`lightning_modules/base.py`): to change one method, read its file.

- `clip_ft.py`: contrastive fine-tuning of CLIP; NegCLIP with its hard-negative captions and images (`clip_ft`);
- `clip_cae.py`: CLIP-CAE, composition-aware attribution losses (`clip_cae`);
- `macco.py`: MACCO-CLIP, learnable mask tokens over the composition (`macco`);
- `smartclip.py`: SmartCLIP, text-conditioned binary masks over the image embedding (`smartclip`);
- `tflocal.py`: the TFLocal / TFGlobal aligners on a frozen CLIP (`tflocal`, `tfglobal`); the aligner network,
  its export and its benchmark scorer are in `evaluation/aligner.py`.

`REGISTRY` pairs each method name with its option class (`options.py`), its module class (imported on first
use: the method files import Lightning and open_clip, which config checks do not need), its paper recipe and its
study overlay. docs/adding-a-method.md is the checklist of every place a new method goes (tests/test_registry.py
enforces the entry's parts, tests/test_adding_a_method.py that the page names every place the tests read). Losses
shared by several methods are in `modeling/losses.py` and `modular_losses.py`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict

from lightning_modules.methods.options import (AlignerOptions, ClipCAEOptions, ClipFTOptions, MaccoOptions,
                                               SmartCLIPOptions)


@dataclass(frozen=True)
class MethodEntry:
    """One registered method: `options` is its config section's class, `module` "package.module:Class" its
    LightningModule, `recipe` the paper config and `study_overlay` its layer of the method study's configs."""

    options: type
    module: str
    recipe: str
    study_overlay: str

    def load(self) -> type:
        module, _, name = self.module.partition(":")
        return getattr(importlib.import_module(module), name)


REGISTRY: Dict[str, MethodEntry] = {
    "clip_ft": MethodEntry(ClipFTOptions, "lightning_modules.methods.clip_ft:ClipFineTune", "configs/clip_ft.yaml",
                           "configs/study/clip_ft.yaml"),
    "clip_cae": MethodEntry(ClipCAEOptions, "lightning_modules.methods.clip_cae:ClipCAE",
                            "configs/cae_attention.yaml", "configs/study/cae_attention.yaml"),
    "macco": MethodEntry(MaccoOptions, "lightning_modules.methods.macco:MaccoCLIP", "configs/macco.yaml",
                         "configs/study/macco.yaml"),
    "smartclip": MethodEntry(SmartCLIPOptions, "lightning_modules.methods.smartclip:SmartCLIP",
                             "configs/smartclip.yaml", "configs/study/smartclip.yaml"),
    "tflocal": MethodEntry(AlignerOptions, "lightning_modules.methods.tflocal:TFLocal", "configs/tflocal.yaml",
                           "configs/study/tflocal.yaml"),
    "tfglobal": MethodEntry(AlignerOptions, "lightning_modules.methods.tflocal:TFGlobal", "configs/tfglobal.yaml",
                            "configs/study/tfglobal.yaml"),
}

METHOD_OPTIONS: Dict[str, type] = {name: entry.options for name, entry in REGISTRY.items()}

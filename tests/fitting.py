"""Helpers the training tests share: the tiny model and config, a batch as fit builds it, an export's weights and
a callback that poisons one step, one that stops a run (the fixtures are in conftest.py)."""
from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from core.config import REPO_ROOT
from lightning_modules import load_run_config
from lightning_modules.fit import build_datamodule

TINY = "ViT-Tiny-16-64"
STEPS_PER_EPOCH = 4  # 32 captions / batch 8


# Methods whose batches need the preprocessing cache's masks, with the tiny model's attribution settings.
NEEDS_MASKS = {"clip_cae": ["method.attribution.eclip_layers=2"], "macco": []}


def method_overrides(method: str, mask_cache: Path) -> list:
    if method not in NEEDS_MASKS:
        return [f"method.name={method}"]
    return [f"method.name={method}", "data.masks=true", f"preprocess.cache_root={mask_cache}", *NEEDS_MASKS[method]]


def tiny_config(shapes_root: Path, runs_root: Path, *overrides: str):
    return load_run_config([REPO_ROOT / "configs" / "demo" / "pretrain.yaml"], [
        f"model.name={TINY}", f"data.root={shapes_root}", f"runs_root={runs_root}", "data.batch_size=8",
        "data.num_workers=0", "trainer.enable_progress_bar=false", "optim.warmup_steps=2", "optim.lr=1e-3",
        "trainer.log_every_n_steps=1", "data.masks=false", *overrides])


def a_batch(module, cfg) -> dict:
    datamodule = build_datamodule(cfg, module)
    datamodule.setup("fit")
    return next(iter(datamodule.train_dataloader()))


def exported_state(run_dir: Path) -> dict:
    return torch.load(run_dir / "export" / "open_clip.pt")


class StopAfter(L.Callback):
    """Stands in for a killed job: stop at `steps` (last.ckpt is written at the stop)."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


class NanAtStep(L.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            batch["image"].fill_(float("nan"))


# The aligner tests' world: 3 hard negatives per caption and a small aligner.
NEGATIVES = 3
SMALL_ALIGNER = ["method.aligner_width=32", "method.aligner_layers=1", "method.aligner_heads=2"]


def aligner_config(root: Path, tmp: Path, cache: Path, *overrides: str):
    return tiny_config(root, tmp, "method.name=tflocal", f"data.features_cache={cache}",
                       f"method.hard_negatives.captions={NEGATIVES}", *SMALL_ALIGNER, *overrides)

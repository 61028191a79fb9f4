"""Callbacks shared by every method."""
from __future__ import annotations

import logging
from pathlib import Path

import lightning as L

from lightning_modules.export import export_model

log = logging.getLogger(__name__)


class LastCheckpoint(L.Callback):
    """Keeps `last.ckpt`, the resume point: after each epoch's last batch, every N steps, and at the end.

    Lightning's ModelCheckpoint writes last.ckpt only alongside a top-k save; this writes it on its own
    schedule through `trainer.save_checkpoint` (atomic on local disks, collective-safe under DDP). It saves
    from `on_train_batch_end`, also for the epoch's last batch: Lightning restores that state as "epoch
    finished" and starts the next epoch cleanly, whereas a checkpoint taken in `on_train_epoch_end` of a
    step-based run resumes into a spurious extra batch. Nothing is written when training dies with an
    exception, so the previous checkpoint stays the last good one.
    """

    def __init__(self, path: Path, every_n_steps: int = 0):
        self.path = Path(path)
        self.every_n_steps = every_n_steps
        self._saved_step = -1

    def _save(self, trainer: L.Trainer) -> None:
        if trainer.sanity_checking or trainer.fast_dev_run or trainer.global_step == self._saved_step:
            return
        trainer.save_checkpoint(self.path)
        self._saved_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        step_due = self.every_n_steps and trainer.global_step % self.every_n_steps == 0
        if step_due or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._save(trainer)


class ExportCallback(L.Callback):
    """At the end of fit, export the CLIP weights as a vanilla open_clip checkpoint (rank 0 only)."""

    def __init__(self, export_dir: Path):
        self.export_dir = Path(export_dir)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        extra = {"method": module.cfg.method.name, "global_step": trainer.global_step,
                 "initialised_from": module.cfg.model.pretrained}
        path = export_model(module.clip, module.model_name, self.export_dir, extra)
        log.info("exported %s (step %d) to %s", module.model_name, trainer.global_step, path)

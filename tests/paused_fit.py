"""`python paused_fit.py FOLDER PAUSE[,PAUSE...] -- FIT ARGUMENTS`: fit's command (`lightning_modules.fit.main`) with
pauses, so that a test can signal a real fit process at a chosen point of a run instead of guessing one by time.

At each pause the process writes `FOLDER/paused-<pause>` and waits until the test writes `FOLDER/go-<pause>` (or
until a signal raises in the wait, which is the point). Pauses:
- `step-N`: inside the training step that follows global step N (its forward done, before backward and update);
- `stop-save`: inside the checkpoint write of a stop (before the file is written);
- `after-stop`: after the stop was saved and recorded (an `on_exception` after fit's own callbacks).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.trainer.states import TrainerStatus

from lightning_modules import fit

# Only keeps a broken test from hanging: every pause is released by the test or ended by a signal long before.
GUARD_SECONDS = 600


class Pauses(L.Callback):
    def __init__(self, folder: Path, pauses: list):
        self.folder, self.pauses = folder, set(pauses)

    def pause(self, name: str) -> None:
        if name not in self.pauses:
            return
        self.pauses.discard(name)
        (self.folder / f"paused-{name}").touch()
        deadline = time.monotonic() + GUARD_SECONDS
        while not (self.folder / f"go-{name}").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"pause {name} was never released")
            time.sleep(0.02)

    def on_before_backward(self, trainer: L.Trainer, *args) -> None:
        self.pause(f"step-{trainer.global_step}")

    def on_save_checkpoint(self, trainer: L.Trainer, *args) -> None:
        if trainer.state.status == TrainerStatus.INTERRUPTED:  # the checkpoint SafeStop writes at a stop
            self.pause("stop-save")

    def on_exception(self, trainer: L.Trainer, *args) -> None:
        self.pause("after-stop")


def main(argv: list) -> None:
    folder, pauses, separator, *fit_args = argv
    assert separator == "--", "usage: paused_fit.py FOLDER PAUSE[,PAUSE...] -- FIT ARGUMENTS"
    callback = Pauses(Path(folder), pauses.split(","))
    build_trainer = fit.build_trainer

    def with_pauses(cfg, run_dir, extra_callbacks=(), benchmarks=None):
        return build_trainer(cfg, run_dir, [*extra_callbacks, callback], benchmarks)

    fit.build_trainer = with_pauses
    fit.main(fit_args)


if __name__ == "__main__":
    main(sys.argv[1:])

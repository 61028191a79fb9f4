"""Callbacks shared by every method."""
from __future__ import annotations

import logging
import os
import platform
import statistics
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, ContextManager, Iterator, Optional

import lightning as L
from omegaconf import OmegaConf
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
import torch
from torch import nn

from core.run_records import CONFIG_DIGEST
from modeling.export import export_model
from evaluation.harness import flat_scalars, run_all
from evaluation.scorers import ClipScorer
from lightning_modules.resume import PREVIOUS_CHECKPOINT, config_digest

log = logging.getLogger(__name__)

# A checkpoint being written: never a resume candidate (resume.py), renamed into place once complete.
PARTIAL_SUFFIX = ".partial"


class LastCheckpoint(L.Callback):
    """Keeps `last.ckpt`, the resume point: after each epoch's last batch, every N steps, and at the end.

    Lightning's ModelCheckpoint writes last.ckpt only alongside a top-k save; this writes it on its own
    schedule through `trainer.save_checkpoint` (collective-safe under DDP) into `last.ckpt.partial`, and only a
    complete file is renamed into place, the old one becoming `previous.ckpt`: an interrupted write (a second
    Ctrl-C, a killed job) leaves both as they were. The two renames run inside `uninterrupted()` (the run's
    `StopSignals.uninterrupted`), so an interrupt cannot fall between them. It saves from `on_train_batch_end`,
    also for the epoch's last batch: Lightning restores that state as "epoch finished" and starts the next epoch
    cleanly, whereas a checkpoint taken in `on_train_epoch_end` of a step-based run resumes into a spurious extra
    batch. Nothing is written when training dies with an exception, so the previous checkpoint stays the last
    good one.
    """

    def __init__(self, path: Path, every_n_steps: int = 0,
                 uninterrupted: Callable[[], ContextManager[None]] = nullcontext):
        self.path = Path(path)
        self.every_n_steps = every_n_steps
        self.uninterrupted = uninterrupted
        self._saved_step = -1

    def save(self, trainer: L.Trainer) -> Optional[Path]:
        """Write the current weights as the resume point (once per step); its path, or None in a smoke run."""
        if trainer.sanity_checking or trainer.fast_dev_run:
            return None
        if trainer.global_step == self._saved_step:
            return self.path
        trainer.lightning_module.check_finite(weights=True)  # before the rotation: the old file stays last.ckpt
        partial = self.path.with_name(self.path.name + PARTIAL_SUFFIX)
        try:
            trainer.save_checkpoint(partial)
            if trainer.is_global_zero:
                with self.uninterrupted():
                    # Keep the previous resume point (a rename, no copy): if the new file is ever damaged,
                    # resume.py falls back to it.
                    if self.path.is_file():
                        os.replace(self.path, self.path.with_name(PREVIOUS_CHECKPOINT))
                    os.replace(partial, self.path)
        finally:
            if trainer.is_global_zero:
                partial.unlink(missing_ok=True)  # what an interrupted write left
        self._saved_step = trainer.global_step
        return self.path

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        step_due = self.every_n_steps and trainer.global_step % self.every_n_steps == 0
        if step_due or trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self.save(trainer)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.save(trainer)


class SamplesPerSecond(L.Callback):
    """Training throughput, `train/samples_per_s` (all ranks together), in the progress bar and TensorBoard.

    An interval is the wall time between two consecutive training batch ends, so it covers data loading,
    forward, backward and the optimizer: a starving DataLoader shows up here. Validation is left out (the
    clock restarts after it); a benchmark evaluation or checkpoint save inside a batch end is a pause the
    median over the last `window` intervals ignores. With gradient accumulation a micro-batch is a batch.
    """

    def __init__(self, window: int = 20):
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        self.window = window
        self._intervals: deque = deque(maxlen=window)
        self._last_end: Optional[float] = None

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch: dict,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._intervals.append(now - self._last_end)
        self._last_end = now
        if not self._intervals:
            return  # the first batch has no interval yet
        samples = len(batch["text"]) * trainer.world_size  # every rank loads a batch of the same size
        module.log("train/samples_per_s", samples / statistics.median(self._intervals), prog_bar=True,
                   on_step=True, on_epoch=False, batch_size=len(batch["text"]))

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._last_end = time.perf_counter() if self._last_end is not None else None


class RunProgress:
    """What Lightning's progress bars show, less two items that mean nothing in a fit run: the logger's version
    (`v_num`: always 0, since a resumed run continues the same TensorBoard curves) and the epoch total of a run
    bounded by steps (`max_epochs=-1` made the Rich bar's description `Epoch k/-2`)."""

    def get_metrics(self, trainer: L.Trainer, module: L.LightningModule) -> dict:
        metrics = super().get_metrics(trainer, module)
        metrics.pop("v_num", None)
        return metrics


class RichRunProgress(RunProgress, RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        # padded to the validation description's length as Lightning does, so the bars do not flicker
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"


class TQDMRunProgress(RunProgress, TQDMProgressBar):
    """The tqdm bar shows the epoch without a total already."""


def run_progress_bar() -> ProgressBar:
    """The progress bar Lightning would pick (Rich when installed, else tqdm), showing what means something."""
    return RichRunProgress() if _RICH_AVAILABLE else TQDMRunProgress()


class MidEpochStopState(L.Callback):
    """Checkpoints written after a stop in the middle of an epoch resume in that epoch.

    When training stops before an epoch's last batch (max_steps, `should_stop`), Lightning marks the epoch
    completed before `on_train_end`, so a checkpoint written then would resume at the *next* epoch, with the
    rest of this one never seen. The loop state of such a checkpoint is rewritten to what a checkpoint taken
    after the same batch inside the epoch holds (the epoch started, not processed), which Lightning resumes
    mid-epoch, and the training loader's saved position (`ResumableLoader`) skips the batches already seen.
    """

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict) -> None:
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        if not 0 < batches < trainer.num_training_batches:
            return
        progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]
        if progress["total"]["processed"] != progress["total"]["started"]:
            return  # saved inside the epoch: already the mid-epoch state
        for counts in (progress["total"], progress["current"]):
            counts["processed"] -= 1
            counts["completed"] = counts["processed"]
        checkpoint["epoch"] = progress["total"]["completed"]


class ExportCallback(L.Callback):
    """At the end of fit, export the CLIP weights as a vanilla open_clip checkpoint (rank 0 only)."""

    def __init__(self, export_dir: Path):
        self.export_dir = Path(export_dir)

    def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        module.refuse_non_finite_export()
        metadata = {**export_metadata(module.cfg, trainer.global_step), "numerics": training_numerics(trainer)}
        path = export_model(module.plain_clip(), module.model_name, self.export_dir, metadata,
                            getattr(module, "model_config", None))
        log.info("exported %s (step %d) to %s", module.model_name, trainer.global_step, path)


def export_metadata(cfg, global_step: int) -> dict:
    """What model.json records beside the weights: the method, the step, the backbone the run started from
    (its `model` section without the adapters: what weight interpolation rebuilds as the pretrained end, see
    evaluation/interpolation.py), the adapters the export merged, if any, and the digest of the config that
    trained it (`resume.config_digest`: a rerun or a sweep takes the run as finished only when its config has the
    same, see fit.already_finished and slurm/sweep.py)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    lora = model.pop("lora")
    return {"method": cfg.method.name, "global_step": global_step, "initialised_from": model["pretrained"],
            "backbone": model, "lora": lora if lora["rank"] else None,
            CONFIG_DIGEST: config_digest(OmegaConf.to_container(cfg, resolve=True))}


def cpu_model() -> str:
    """The CPU's vendor, family and model as /proc/cpuinfo names them (e.g. `AuthenticAMD family 26 model 2`),
    else what `platform` knows. Two CPUs with the same vector instruction set but of other generations pick other
    matrix-multiply kernels, so this is part of what trained bits depend on."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first processor's block is enough
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "vendor_id" in fields:
        return f"{fields['vendor_id']} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    return platform.processor() or platform.machine()


def training_numerics(trainer: L.Trainer) -> dict:
    """What the exact bits of trained weights depend on beyond the config: the device (for a CPU its vector
    instruction set and its generation), the threads per process, the number of processes, the precision and
    torch's version. The same config trained again with any of these changed gives other weights after a few
    hundred steps, so a results bundle records them with each backbone (study/records.py) to say why a regenerated
    one differs."""
    device = trainer.strategy.root_device
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu {torch.backends.cpu.get_cpu_capability()}")
    return {"device": name, "cpu": cpu_model(), "threads": torch.get_num_threads(), "processes": trainer.world_size,
            "precision": str(trainer.precision), "torch": torch.__version__}


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Every submodule in eval mode for the body, then each back in its own previous mode.

    `module.train(was_training)` would not do: it would switch a frozen backbone that its method keeps in eval
    mode into training mode.
    """
    modes = [(submodule, submodule.training) for submodule in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for submodule, training in modes:
            submodule.training = training


def schedule_finished(trainer: L.Trainer) -> bool:
    """Training reached `trainer.max_steps` or `trainer.max_epochs` (not a stop: a signal, a diverged step)."""
    epochs = trainer.fit_loop.epoch_progress.current.processed
    return (trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps) or \
        (trainer.max_epochs not in (None, -1) and epochs >= trainer.max_epochs)


class BenchmarkEvaluation(L.Callback):
    """Scores the model on benchmarks every N optimizer steps (rank 0) and logs eval/<benchmark>/<metric>.

    The benchmarks are read when the callback is built, so a missing benchmark folder stops the run before
    training, not hours into it. Other ranks wait at a barrier while rank 0 evaluates (a long evaluation
    under NCCL needs a process-group timeout longer than the evaluation). The model is scored with the
    standard global cosine (`ClipScorer`) in its current weights and returned to training mode afterwards.
    """

    def __init__(self, benchmarks: dict, every_n_steps: int, batch_size: int = 256):
        if every_n_steps <= 0:
            raise ValueError("evaluation.every_n_steps must be positive when evaluation.benchmarks is set")
        self.benchmarks = benchmarks
        self.every_n_steps = every_n_steps
        self.batch_size = batch_size
        self.last_results: list = []
        self._evaluated_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        # global_step repeats over the micro-batches of gradient accumulation: evaluate once per step
        if trainer.sanity_checking or step == 0 or step % self.every_n_steps or step == self._evaluated_step:
            return
        self._score(trainer, module, step)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """A run that finished its schedule is scored at its last step too: its final scores are those of the
        weights it exports (the hparams summary shows them). A run stopped early keeps its last scores."""
        step = trainer.global_step
        if step > 0 and step != self._evaluated_step and schedule_finished(trainer):
            self._score(trainer, module, step)

    def _score(self, trainer: L.Trainer, module: L.LightningModule, step: int) -> None:
        self._evaluated_step = step
        if trainer.is_global_zero:
            self.last_results = self._evaluate(module)
            if trainer.logger is not None:
                trainer.logger.log_metrics(flat_scalars(self.last_results), step=step)
        trainer.strategy.barrier("benchmark_evaluation")

    def headline_tags(self) -> list:
        """The logged tags of the last scores' headline metrics (`Benchmark.headline`; every metric of a benchmark
        or combined score without one)."""
        tags = []
        for tag in flat_scalars(self.last_results):
            name, _, key = tag[len("eval/"):].partition("/")
            headline = getattr(self.benchmarks.get(name), "headline", ())
            if not headline or key in headline:
                tags.append(tag)
        return sorted(tags)

    def _evaluate(self, module: L.LightningModule) -> list:
        precision = "bf16-mixed" if module.device.type == "cuda" else "32-true"
        with eval_mode(module):
            if hasattr(module, "benchmark_scorer"):  # a method that scores differently (the aligners)
                scorer = module.benchmark_scorer(str(module.device), precision, self.batch_size)
            else:
                scorer = ClipScorer(module.plain_clip(), module.tokenizer, module.preprocess_val,
                                    device=str(module.device), precision=precision, batch_size=self.batch_size)
            return run_all(self.benchmarks, scorer)

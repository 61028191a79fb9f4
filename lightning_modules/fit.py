"""`python -m lightning_modules.fit --config FILE [--config FILE2] [key=value ...]`: train one method.

The run directory `runs_root/<experiment>/` is stable: running the same command again (or a SLURM requeue)
resumes from the run's newest intact checkpoint and continues the same TensorBoard curves (fixed logger
version). A run directory is one experiment: a rerun with a changed config (outside the keys that are safe to
change on resume) is refused before anything is written, and so is a second process while one is training
in it. A start that fails before its first training step leaves no run directory behind; once a step has
trained the directory is never removed: a signal or a failure leaves a resumable checkpoint (never weights
that produced a non-finite loss), a line in `stops.jsonl` and a non-zero exit status (stops.py). A run whose
training set shares images with the benchmarks it scores during training is refused before anything is built
or written (leakage.py), unless evaluation.allow_train_overlap.
"""
from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import shlex
import shutil
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from core.cli import AUTO, PRECISIONS, add_key_values, precision_problem
from core.config import GPU_ACCELERATORS, ConfigError, save_config, uses_gpu
from core.run_records import CONFIG_DIGEST
from modeling.encoders import model_config, pretrained_problem
from datamodules.cache import CacheError, with_arguments
from datamodules.coco import CocoDataModule
from datamodules.inputs import InputError, data_input_problems, raise_if_any
from evaluation.benchmarks import BENCHMARKS, Benchmark, MissingBenchmarkData
from evaluation.harness import build_benchmarks, default_roots
from evaluation.leakage import TrainingOverlapError, check_training_overlap, config_training_image_ids
from modeling.lora import lora_setting_problems
from lightning_modules import METHODS, load_run_config_or_exit, method_class
from lightning_modules.monitor import build_attribution_monitor
from lightning_modules.base import CompositionalCLIPModule
from lightning_modules.callbacks import (BenchmarkEvaluation, ExportCallback, LastCheckpoint, MidEpochStopState,
                                        SamplesPerSecond, run_progress_bar)
from lightning_modules.base import NonFiniteLossError
from lightning_modules.resume import (CHECKPOINT_DIR, LAST_CHECKPOINT, LENGTH_KEYS, CorruptCheckpointError,
                                     ResumeConfigError, candidates, check_resume_config, checked_checkpoint,
                                     checkpoint_step, choose_resume_checkpoint, config_digest, refuse_old_layout)
from lightning_modules.stops import (STOPS_RECORD, RunDirectoryBusy, RunLock, SafeStop, StopSignals, StoppedBySignal,
                                     requeue_slurm_job, slurm_plugins)

log = logging.getLogger("lightning_modules.fit")



def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[], help="YAML merged over configs/base.yaml, "
                        "in the order given (repeatable)")
    add_key_values(parser, help="config overrides, e.g. trainer.max_steps=100")
    # Options and key=value overrides may interleave (`--config a.yaml k=v --config b.yaml`): plain parse_args
    # takes the positionals once and calls later ones unrecognized. Every --config still merges before every
    # override, each in the order given.
    return parser.parse_intermixed_args(argv)


def run_dir_of(cfg: DictConfig) -> Path:
    return Path(cfg.runs_root) / cfg.experiment


def _previous_run_name(run_dir: Path) -> Path:
    index = 1
    while run_dir.with_name(f"{run_dir.name}.previous-{index}").exists():
        index += 1
    return run_dir.with_name(f"{run_dir.name}.previous-{index}")


def prepare_run_dir(cfg: DictConfig) -> Path:
    """Create the run directory and write the resolved config (rank 0 only).

    With `resume=false`, an existing run directory is moved aside (never deleted) and training starts fresh.
    """
    run_dir = run_dir_of(cfg)
    if rank_zero_only.rank == 0:
        if not cfg.resume and run_dir.exists():
            aside = _previous_run_name(run_dir)
            shutil.move(str(run_dir), str(aside))
            log.warning("resume=false: moved the previous run directory to %s", aside)
        save_config(cfg, run_dir / "config.yaml")
    return run_dir


def stored_configs(cfg: DictConfig, run_dir: Path) -> List[tuple]:
    """(where, config) pairs a resume must agree with: the run's config.yaml, and the config stored in the
    `resume_from` checkpoint."""
    stored = []
    if (run_dir / "config.yaml").is_file():
        stored.append((run_dir, OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))))
    if cfg.resume_from:
        checkpoint = torch.load(checked_checkpoint(Path(cfg.resume_from)), map_location="cpu",
                                weights_only=False, mmap=True)
        stored.append((Path(cfg.resume_from), checkpoint.get("hyper_parameters", {}).get("config", {})))
    return stored


def check_rerun(cfg: DictConfig) -> list:
    """Refuse (`ResumeConfigError`) a resume whose config differs from what the run directory (or the named
    checkpoint) ran with, outside the safe keys; return the safe changes."""
    if not cfg.resume:
        return []
    new = OmegaConf.to_container(cfg, resolve=True)
    changes = []
    for where, stored in stored_configs(cfg, run_dir_of(cfg)):
        refuse_old_layout(stored, where)
        changes += check_resume_config(stored, new, where)
    return changes


def record_resume(run_dir: Path, checkpoint: Optional[str], changes: list) -> None:
    """Append what this start resumed from and which safe keys it changed to `resumes.jsonl` (rank 0)."""
    if checkpoint is None or rank_zero_only.rank != 0:
        return
    entry = {"checkpoint": checkpoint, "step": checkpoint_step(Path(checkpoint)),
             "changed": {key: {"stored": old, "now": new} for key, old, new in changes}}
    with open(run_dir / "resumes.jsonl", "a", encoding="utf-8") as file:
        file.write(json.dumps(entry, default=str) + "\n")


class Attempt:
    """This start of a run: its trainer once built (how far it trained decides what a failure may remove)."""

    trainer: Optional[L.Trainer] = None

    @property
    def trained(self) -> bool:
        return self.trainer is not None and self.trainer.global_step > 0


@contextmanager
def removed_unless_trained(run_dir: Path, fresh: bool) -> Iterator[Attempt]:
    """A run directory this start creates (`fresh`: resume=false moves an old one aside) is removed again when
    the start fails before its first training step (a missing data root, a bad option found while building): no
    empty run for TensorBoard to list. Once a step has trained it stays, whatever happens."""
    created = fresh or not run_dir.exists()
    attempt = Attempt()
    try:
        yield attempt
    except BaseException:
        if (created and rank_zero_only.rank == 0 and run_dir.exists() and not attempt.trained
                and not candidates(run_dir)):
            shutil.rmtree(run_dir, ignore_errors=True)
            log.warning("the start failed before its first training step: removed the run directory %s it had "
                        "created", run_dir)
        raise


@contextmanager
def weights_from_checkpoint(resuming: bool) -> Iterator[None]:
    """While a resumed run builds its model, hide open_clip's "Model initialized randomly" warning: the
    weights come from the checkpoint."""
    class RandomInitNotice(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "initialized randomly" not in record.getMessage()

    notice = RandomInitNotice()
    root = logging.getLogger()
    if resuming:
        root.addFilter(notice)
    try:
        yield
    finally:
        root.removeFilter(notice)


def resume_checkpoint(cfg: DictConfig, run_dir: Path) -> Optional[str]:
    """`resume_from`, or the newest intact checkpoint of this run directory (see resume.py); None when not
    resuming or there is none."""
    if not cfg.resume:
        return None
    chosen = checked_checkpoint(Path(cfg.resume_from)) if cfg.resume_from else choose_resume_checkpoint(run_dir)
    if chosen is not None:
        print(f"Resuming from {chosen}", flush=True)
    return str(chosen) if chosen is not None else None


def resolve_precision(precision: str, accelerator: str = "auto") -> str:
    """"auto": bf16-mixed when the run trains on a GPU (logits and losses stay fp32 inside the losses), 32-true on
    the CPU (also on a machine that has a GPU, with trainer.accelerator=cpu)."""
    if precision != "auto":
        return precision
    return "bf16-mixed" if uses_gpu(accelerator) else "32-true"


def has_validation(cfg: DictConfig) -> bool:
    return cfg.trainer.limit_val_batches != 0 and bool(cfg.data.val_annotations)


def build_callbacks(cfg: DictConfig, run_dir: Path,
                    benchmarks: Optional[Dict[str, Benchmark]] = None) -> List[L.Callback]:
    signals = StopSignals()
    last = LastCheckpoint(run_dir / CHECKPOINT_DIR / LAST_CHECKPOINT, cfg.checkpoint.every_n_steps,
                          uninterrupted=signals.uninterrupted)
    callbacks: List[L.Callback] = [
        SafeStop(run_dir, save=last.save, signals=signals),  # first: it must know whether a step is in progress
        signals,
        last,
        MidEpochStopState(),
        ExportCallback(run_dir / "export"),
        SamplesPerSecond(),
    ]
    if cfg.trainer.enable_progress_bar:  # Lightning refuses a bar in the callbacks when the flag is off
        callbacks.append(run_progress_bar())
    if cfg.checkpoint.monitor and has_validation(cfg):
        callbacks.append(ModelCheckpoint(
            dirpath=run_dir / CHECKPOINT_DIR, filename="best-{step}", monitor=cfg.checkpoint.monitor,
            mode=cfg.checkpoint.mode, save_top_k=1, auto_insert_metric_name=False,
            save_on_train_epoch_end=False))  # only after validation, where the metric is fresh
    if evaluates_during_training(cfg):
        callbacks.append(build_evaluation_callback(cfg.evaluation, benchmarks))
    monitor = build_attribution_monitor(cfg)
    if monitor is not None:
        callbacks.append(monitor)
    return callbacks


def evaluates_during_training(cfg: DictConfig) -> bool:
    return bool(cfg.evaluation.benchmarks) and bool(cfg.evaluation.every_n_steps)


def configured_benchmarks(evaluation: DictConfig) -> Dict[str, Benchmark]:
    """`evaluation.benchmarks`, built from `evaluation.data_root` / `roots` / `options`."""
    roots = default_roots(Path(evaluation.data_root), {k: Path(v) for k, v in evaluation.roots.items()})
    options = {name: dict(values) for name, values in evaluation.options.items()}
    return build_benchmarks(list(evaluation.benchmarks), roots, options)


def build_evaluation_callback(evaluation: DictConfig,
                              benchmarks: Optional[Dict[str, Benchmark]] = None) -> BenchmarkEvaluation:
    benchmarks = configured_benchmarks(evaluation) if benchmarks is None else benchmarks
    return BenchmarkEvaluation(benchmarks, evaluation.every_n_steps, evaluation.batch_size)


def training_benchmarks(cfg: DictConfig) -> Dict[str, Benchmark]:
    """The benchmarks this run scores during training ({} when it scores none); a missing one is an error."""
    return configured_benchmarks(cfg.evaluation) if evaluates_during_training(cfg) else {}


def check_train_overlap(cfg: DictConfig, benchmarks: Dict[str, Benchmark]) -> None:
    """Refuse (`TrainingOverlapError`, with the counts) a training set that holds images of `benchmarks`,
    unless `evaluation.allow_train_overlap` (then it is logged)."""
    if benchmarks:
        source = f"data.train_annotations={cfg.data.train_annotations}"
        check_training_overlap(config_training_image_ids(cfg.data), benchmarks, cfg.evaluation.allow_train_overlap,
                               source)


def build_trainer(cfg: DictConfig, run_dir: Path, extra_callbacks: Sequence[L.Callback] = (),
                  benchmarks: Optional[Dict[str, Benchmark]] = None) -> L.Trainer:
    t = cfg.trainer
    logger = TensorBoardLogger(save_dir=str(run_dir), name="tb", version=0, default_hp_metric=False)
    optional = {key: t[key] for key in ("gradient_clip_val", "val_check_interval", "limit_train_batches",
                                        "limit_val_batches") if t[key] is not None}
    if not has_validation(cfg):
        optional["limit_val_batches"] = 0
    callbacks = [*build_callbacks(cfg, run_dir, benchmarks), *extra_callbacks]
    # Without a best-checkpoint callback Lightning would add its own ModelCheckpoint in the logger directory.
    enable_checkpointing = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    return L.Trainer(
        default_root_dir=str(run_dir), logger=logger, callbacks=callbacks, fast_dev_run=t.fast_dev_run,
        enable_checkpointing=enable_checkpointing,
        max_steps=t.max_steps, max_epochs=t.max_epochs, precision=resolve_precision(t.precision, t.accelerator),
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=t.strategy,
        accumulate_grad_batches=t.accumulate_grad_batches, log_every_n_steps=t.log_every_n_steps,
        check_val_every_n_epoch=t.check_val_every_n_epoch, num_sanity_val_steps=t.num_sanity_val_steps,
        deterministic=t.deterministic, enable_progress_bar=t.enable_progress_bar,
        use_distributed_sampler=False,  # the datamodule builds seeded DistributedSamplers itself
        plugins=slurm_plugins(), **optional)


def build_module(cfg: DictConfig, resuming: bool = False) -> CompositionalCLIPModule:
    with weights_from_checkpoint(resuming):
        return method_class(cfg.method.name)(cfg)


def build_datamodule(cfg: DictConfig, module: CompositionalCLIPModule) -> L.LightningDataModule:
    if cfg.data.features_cache and getattr(module, "reads_cached_features", False):
        from datamodules.features import FeatureDataModule  # frozen-backbone methods read cached features

        return FeatureDataModule.for_module(cfg, module)
    return CocoDataModule(cfg.data, module.tokenizer, module.preprocess_train, module.preprocess_val,
                          seed=cfg.seed, preprocess=cfg.preprocess, image_config=module.clip.visual.preprocess_cfg,
                          grid_size=module.encoders.grid_size[0], hard_negatives=cfg.method.hard_negatives)


def split_global_batch(key: str, global_batch: int, devices: int, accumulate: int = 1) -> int:
    """The per-device batch of `global_batch` over `devices` (x `accumulate` micro-batches); a batch that does not
    divide is a `ConfigError` naming `key` and the nearest batches that would."""
    parts = devices * accumulate
    if global_batch < parts or global_batch % parts:
        below, above = global_batch // parts * parts, (global_batch // parts + 1) * parts
        nearest = " or ".join(str(b) for b in (below, above) if b > 0)
        raise ConfigError(f"{key}={global_batch} is the global batch and does not divide over {devices} device(s) x "
                          f"{accumulate} accumulated micro-batch(es); give a multiple of {parts} (e.g. {nearest})")
    return global_batch // parts


def with_per_device_batches(cfg: DictConfig, devices: int) -> DictConfig:
    """Record in `cfg` the per-device batches fit derives from the global ones (`data.batch_size`,
    `data.val_batch_size`) and the trainer's device count (devices x nodes) and accumulation."""
    accumulate = cfg.trainer.accumulate_grad_batches
    data = cfg.data
    data.per_device_batch_size = split_global_batch("data.batch_size", data.batch_size, devices, accumulate)
    data.per_device_val_batch_size = split_global_batch("data.val_batch_size",
                                                        data.val_batch_size or data.batch_size, devices)
    if rank_zero_only.rank == 0:
        print(f"global batch {data.batch_size} = {devices} device(s) x {data.per_device_batch_size} per device"
              + (f" x {accumulate} accumulated" if accumulate > 1 else ""), flush=True)
    return cfg


def check_inputs(cfg: DictConfig) -> None:
    """Before anything is built: the method is registered (`ConfigError`, naming the closest), the config asks
    nothing of it that it cannot do, and the data this run reads exists (`InputError` naming every problem)."""
    method = registered_method(cfg.method.name)
    raise_if_any(config_problems(cfg, method), "training")
    raise_if_any(data_problems(cfg, method) + start_problems(cfg), "training")


def start_problems(cfg: DictConfig) -> List[str]:
    """What this start needs beyond its data: the weights it starts or resumes from, and the GPUs it asks for
    (not among `config_problems`: a sweep checks those on a login node, which may have no GPU and not yet the
    export a previous sweep writes)."""
    problems = [problem for problem in (pretrained_problem(cfg.model.pretrained),) if problem]
    if cfg.resume and cfg.resume_from and not Path(cfg.resume_from).is_file():
        problems.append(f"resume_from={cfg.resume_from}: no such checkpoint file (a run's checkpoints are "
                        f"{CHECKPOINT_DIR}/{LAST_CHECKPOINT} and {CHECKPOINT_DIR}/best-*.ckpt in its run directory)")
    return problems + gpu_problems(cfg.trainer)


def gpu_problems(trainer: DictConfig) -> List[str]:
    """`trainer.accelerator=gpu` (or cuda) where this process sees no CUDA GPU, or fewer than `trainer.devices`."""
    if trainer.accelerator not in GPU_ACCELERATORS:
        return []
    key = f"trainer.accelerator={trainer.accelerator}"
    if torch.version.cuda is None:
        return [f"{key}: this torch ({torch.__version__}) is built without CUDA; train on the CPU with "
                f"trainer.accelerator=cpu, or install a CUDA build of torch"]
    visible = torch.cuda.device_count()
    if visible == 0:
        return [f"{key}: no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); train on the CPU with trainer.accelerator=cpu"]
    if isinstance(trainer.devices, int) and trainer.devices > visible:
        return [f"trainer.devices={trainer.devices}: only {visible} CUDA GPU(s) are visible to this process"]
    return []


def registered_method(name: str) -> type:
    """The method class registered as `name`; a typo is a one-line `ConfigError` with the closest and every name."""
    if name not in METHODS:
        closest = difflib.get_close_matches(name, list(METHODS), n=1)
        hint = f"; did you mean '{closest[0]}'?" if closest else ""
        raise ConfigError(f"method.name={name!r} is not a registered method{hint} (methods: "
                          f"{', '.join(sorted(METHODS))})")
    return METHODS[name]


def config_problems(cfg: DictConfig, method: type) -> List[str]:
    """What the config asks of `method` that cannot work, found without reading any data file or building a
    model (slurm.sweep checks every run of a sweep with this before submitting)."""
    return (hard_negative_problems(cfg, method) + mask_problems(cfg, method) + benchmark_name_problems(cfg)
            + precision_problems(cfg) + lora_problems(cfg, method))


def lora_problems(cfg: DictConfig, method: type) -> List[str]:
    """LoRA (`model.lora.rank` > 0) needs a method that trains its backbone (`trains_backbone`), and settings that
    fit the model's layers (read from its open_clip config, not built)."""
    lora = cfg.model.lora
    if not lora.rank:
        return []
    if not getattr(method, "trains_backbone", True):
        users = ", ".join(name for name, cls in sorted(METHODS.items()) if getattr(cls, "trains_backbone", True))
        return [f"model.lora.rank={lora.rank}: method {cfg.method.name} keeps its backbone frozen and trains only its "
                f"own head, so there is nothing for adapters to adapt (LoRA applies to {users}); set "
                f"model.lora.rank=0"]
    model = cfg.model
    problems = lora_setting_problems(lora, model_config(model.name, model.pretrained, model.config_dir))
    if not model.pretrained and not lora.allow_random_backbone:
        problems.append(f"model.lora.rank={lora.rank} with model.pretrained={model.pretrained}: adapters on a randomly "
                        f"initialised backbone adapt nothing learnt; set model.pretrained (a tag such as openai, or a "
                        f"run's export folder), or model.lora.allow_random_backbone=true for tests")
    return problems


def precision_problems(cfg: DictConfig) -> List[str]:
    """`trainer.precision` in Lightning's names or `auto`; Lightning's legacy spellings (`bf16`, `32`) are refused
    naming the new one, as every command refuses them."""
    problem = precision_problem(cfg.trainer.precision, (AUTO,) + PRECISIONS)
    return [f"trainer.precision: {problem}"] if problem else []


def data_problems(cfg: DictConfig, method: type) -> List[str]:
    """The data files this run reads that are missing (the image folders not, for a method on cached features,
    except the one the attribution monitor's probe reads)."""
    reads_features = bool(cfg.data.features_cache) and getattr(method, "reads_cached_features", False)
    problems = data_input_problems(cfg.data, need_train=True, need_images=not reads_features)
    return problems + (probe_image_problems(cfg) if reads_features and not problems else [])


def probe_image_problems(cfg: DictConfig) -> List[str]:
    """The attribution monitor's probe images: the validation image folder (the training one without validation)."""
    if not cfg.monitor.every_n_steps:
        return []
    split = "val" if cfg.data.val_annotations else "train"
    images = cfg.data[f"{split}_images"]
    if (Path(cfg.data.root) / images).is_dir():
        return []
    return [f"data.{split}_images={images}: no directory {Path(cfg.data.root) / images}, where the attribution "
            f"monitor reads its probe images (monitor.every_n_steps=0 trains without the monitor)"]


def mask_problems(cfg: DictConfig, method: type) -> List[str]:
    """A method that reads the preprocessing cache's masks from every batch (its `required_masks`) needs
    `data.masks=true`; without it the first training step would fail."""
    masks = getattr(method, "required_masks", ())
    if not masks or cfg.data.masks:
        return []
    return [f"data.masks=false: method {cfg.method.name} reads {' and '.join(masks)} from every batch: set "
            f"data.masks=true and run python -m datamodules.preprocess with this run's --config files and "
            f"overrides first"]


def benchmark_name_problems(cfg: DictConfig) -> List[str]:
    """`evaluation.benchmarks` entries that are not registered benchmarks, each with the closest name."""
    problems = []
    for name in cfg.evaluation.benchmarks:
        if name not in BENCHMARKS:
            closest = difflib.get_close_matches(name, list(BENCHMARKS), n=1)
            hint = f"; did you mean '{closest[0]}'?" if closest else f" (benchmarks: {', '.join(sorted(BENCHMARKS))})"
            problems.append(f"evaluation.benchmarks: {name!r} is not a registered benchmark{hint}")
    return problems


def hard_negative_problems(cfg: DictConfig, method: type) -> List[str]:
    """NegCLIP's hard negatives (`method.hard_negatives.*`) for a method that would ignore them: captions need a
    method that trains on hard captions (`uses_hard_negatives`), images one that trains on the neighbours
    (`uses_hard_negative_images`)."""
    def users(flag: str) -> str:
        return ", ".join(name for name, cls in sorted(METHODS.items()) if getattr(cls, flag, False))

    name, negatives, problems = cfg.method.name, cfg.method.hard_negatives, []
    if negatives.captions < 0:
        problems.append(f"method.hard_negatives.captions={negatives.captions}: give 0 (none) or more")
    if negatives.captions > 0 and not getattr(method, "uses_hard_negatives", False):
        problems.append(f"method.hard_negatives.captions={negatives.captions}: method {name} does not train on "
                        f"hard-negative captions (only {users('uses_hard_negatives')} do)")
    if negatives.images and not getattr(method, "uses_hard_negative_images", False):
        problems.append(f"method.hard_negatives.images=true: method {name} does not train on hard-negative images "
                        f"(only {users('uses_hard_negative_images')} do)")
    return problems


def already_finished(cfg: DictConfig, run_dir: Path, checkpoint: Optional[str], changes: Sequence[tuple] = ()) -> bool:
    """A rerun of a run that trained its whole length (its resume checkpoint reached `trainer.max_steps`, or
    `max_epochs` when steps are unlimited), exported that step, and whose export records this config's digest:
    nothing to do, so nothing is written (no empty event file, no re-export). A longer max_steps / max_epochs
    continues it; a length the run has already passed, under another digest, is a `ResumeConfigError` naming the
    changed keys (`changes`, from `check_rerun`): the export would be labelled with a length it was not trained
    for. An export written before exports recorded their digest is judged by its step alone."""
    export = run_dir / "export" / "model.json"
    if checkpoint is None or not export.is_file():
        return False
    state = torch.load(checkpoint, map_location="cpu", weights_only=False, mmap=True)
    step = int(state.get("global_step", -1))
    metadata = json.loads(export.read_text())
    if metadata.get("global_step") != step or not trained_its_length(cfg, state):
        return False
    recorded = metadata.get(CONFIG_DIGEST)
    if recorded is None or recorded == config_digest(OmegaConf.to_container(cfg, resolve=True)):
        return True
    changed = "; ".join(f"{key}: {old!r} (stored) -> {new!r} (now)" for key, old, new in changes
                        if key in LENGTH_KEYS) or "its export records another config"
    raise ResumeConfigError(
        f"{run_dir} finished at step {step} (its export), and this config asks for no more steps under another "
        f"length ({changed}): a finished run is not shortened. Nothing was written. Ask for more steps to continue "
        f"it, or train this length in its own run directory with experiment=<new name>")


def trained_its_length(cfg: DictConfig, state: dict) -> bool:
    """Whether the checkpoint `state` has reached the run's length: `trainer.max_steps`, or `max_epochs` when
    steps are unlimited."""
    if cfg.trainer.max_steps > 0:
        return int(state.get("global_step", -1)) >= cfg.trainer.max_steps
    epochs = state.get("loops", {}).get("fit_loop", {}).get("epoch_progress", {}).get("current", {})
    return cfg.trainer.max_epochs > 0 and epochs.get("completed", 0) >= cfg.trainer.max_epochs


def run(cfg: DictConfig, extra_callbacks: Sequence[L.Callback] = ()) -> Optional[L.Trainer]:
    """Train `cfg` in its run directory, resuming when possible; return the trainer (None when the run had
    already finished and there was nothing to do).

    Raises `StoppedBySignal` after a stop by signal (a checkpoint written), `NonFiniteLossError` after a
    diverged step (nothing of it saved), `RunDirectoryBusy` when another process trains in the directory.
    """
    check_inputs(cfg)
    changes = check_rerun(cfg)
    benchmarks = training_benchmarks(cfg)
    check_train_overlap(cfg, benchmarks)
    with RunLock(run_dir_of(cfg)), removed_unless_trained(run_dir_of(cfg), fresh=not cfg.resume) as attempt:
        # The trainer first (it writes nothing until fit): its device count sets the per-device batch, which
        # config.yaml and the module's saved config record.
        trainer = attempt.trainer = build_trainer(cfg, run_dir_of(cfg), extra_callbacks, benchmarks)
        cfg = with_per_device_batches(cfg, trainer.world_size)
        checkpoint = resume_checkpoint(cfg, run_dir_of(cfg))
        if already_finished(cfg, run_dir_of(cfg), checkpoint, changes):  # before config.yaml is written
            print(f"{run_dir_of(cfg)} finished at step {checkpoint_step(Path(checkpoint))} (its export is in "
                  f"{run_dir_of(cfg) / 'export'}): nothing to do", flush=True)
            return None
        run_dir = prepare_run_dir(cfg)
        L.seed_everything(cfg.seed, workers=True)
        module = build_module(cfg, resuming=checkpoint is not None)
        datamodule = build_datamodule(cfg, module)
        record_resume(run_dir, checkpoint, changes)
        fit_or_report_stop(trainer, module, datamodule, checkpoint)
    return trainer


def fit_or_report_stop(trainer: L.Trainer, module: CompositionalCLIPModule, datamodule: L.LightningDataModule,
                       checkpoint: Optional[str]) -> None:
    """`trainer.fit` with the stop signals handled, an early stop turned into an error that says where the run
    can resume from."""
    safe_stop = next(callback for callback in trainer.callbacks if isinstance(callback, SafeStop))
    signals = safe_stop.signals
    try:
        with signals.installed(trainer):
            trainer.fit(module, datamodule=datamodule, ckpt_path=checkpoint)
    except (SIGTERMException, KeyboardInterrupt, SystemExit) as err:
        # A forced stop (a second Ctrl-C) comes out as KeyboardInterrupt, or as the SystemExit(1) that Lightning
        # turns one into; any other is not a stop of ours.
        if not isinstance(err, SIGTERMException) and not signals.forced:
            raise
        if signals.forced and not safe_stop.outcome.get("forced"):
            safe_stop.record_late_interrupt(trainer.global_step)
        if signals.received == signal.SIGUSR1 and not signals.forced:
            requeue_slurm_job()
        raise signals.stop_error(trainer.global_step, safe_stop.outcome) from None
    except NonFiniteLossError as err:
        resume = safe_stop.outcome.get("resume_from")
        kept = (f"the newest good checkpoint is {resume} (step {checkpoint_step(resume)}); a rerun resumes from it "
                f"and meets the same batches, so change something with resume=false or experiment=<new name>"
                if resume else "no checkpoint was written before it")
        raise NonFiniteLossError(f"{err}; {kept}. Recorded in {trainer.default_root_dir}/{STOPS_RECORD}",
                                 err.step) from None


def this_run_arguments(args: argparse.Namespace) -> str:
    """fit's own `--config` files and overrides, as one shell-quoted string: what the jobs that build its caches
    take too."""
    return shlex.join([*(part for path in args.config for part in ("--config", path)), *args.overrides])


def main(argv: Optional[Sequence[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        run(load_run_config_or_exit(args.config, args.overrides))
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None
    except (ResumeConfigError, TrainingOverlapError, RunDirectoryBusy) as err:
        raise SystemExit(f"refused: {err}") from None
    except (InputError, MissingBenchmarkData, CorruptCheckpointError) as err:
        raise SystemExit(str(err)) from None
    except CacheError as err:  # met when the datamodule opens the cache, before the first step
        raise SystemExit(with_arguments(str(err), this_run_arguments(args))) from None
    except StoppedBySignal as err:
        print(str(err), file=sys.stderr, flush=True)
        raise SystemExit(err.exit_code) from None
    except KeyboardInterrupt:  # a Ctrl-C outside training (a stop during training is a StoppedBySignal)
        print("interrupted by SIGINT (a stop during training is recorded in the run directory's stops.jsonl)",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
    except NonFiniteLossError as err:
        raise SystemExit(f"training stopped: {err}") from None


if __name__ == "__main__":
    main()

"""Which checkpoint a rerun (or a SLURM requeue) resumes from, and whether the rerun may resume at all.

Candidates in a run directory, newest training step first (modification time breaks ties):
- `hpc_ckpt_<n>.ckpt`: written by Lightning's own SLURM handler (runs from before `stops.StopSignals`);
- `checkpoints/last.ckpt`: written by `LastCheckpoint` (every N steps, epoch ends, the end of training, a stop);
- `checkpoints/previous.ckpt`: the last.ckpt before it, kept by a rename before every save;
- `checkpoints/best-<step>.ckpt`: the best checkpoint by `checkpoint.monitor`.
`resume_from=PATH` names the checkpoint instead.

A checkpoint is a zip archive (torch.save); a truncated or damaged file fails the archive's own CRC check,
which is cheap next to loading it. A damaged candidate is reported by name and the next one is used; when
every candidate is damaged the run stops with an error naming them, instead of silently starting over.

A run directory is one experiment: a rerun whose resolved config differs from the stored `config.yaml` in
anything but `RESUME_SAFE_KEYS` is refused before anything is written (`config_changes`).

Two runs give the same result when their configs agree outside `RESULT_NEUTRAL_KEYS`; `config_digest` is the
fingerprint of that part (a results bundle stores it per run, and the sweep compares it before skipping a run
whose results the bundle already holds).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from core.config import DERIVED_KEYS, MethodConfig

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
PREVIOUS_CHECKPOINT = "previous.ckpt"
BEST_CHECKPOINTS = "best-*.ckpt"

# Keys a resumed run may change without becoming a different experiment: how long it runs, what it logs and
# evaluates, how it reports progress, where it resumes from, how many loader workers it uses (each sample's
# randomness is seeded by the sample, not by the worker), how many devices share the global batch (the
# sampler interleaves one seeded order over the ranks, so every optimizer step sees the same samples on any
# device count), and a guard that computes nothing (model.lora.allow_random_backbone: a run configured before it
# existed reads it absent). A key ending in "." is a prefix (a whole section). The per-device batches derived from
# the devices (core.config.DERIVED_KEYS) are not compared: the global batch is.
# Changing the length re-stretches the cosine schedule from the resume step on; the change is recorded in
# `resumes.jsonl` of the run directory, so the record says what ran.
RESUME_SAFE_KEYS = (
    "trainer.max_steps", "trainer.max_epochs", "trainer.log_every_n_steps", "trainer.enable_progress_bar",
    "trainer.num_sanity_val_steps", "checkpoint.every_n_steps", "evaluation.", "monitor.", "resume", "resume_from",
    "runs_root", "data.num_workers", "trainer.devices", "trainer.num_nodes", "model.lora.allow_random_backbone",
)


# The run's length: safe to change on resume (a longer run continues), but two runs of different lengths are
# different results, so it stays in the digest, and a finished run is not shortened (fit.already_finished).
LENGTH_KEYS = ("trainer.max_steps", "trainer.max_epochs")

# The resume-safe keys that cannot change what a run computes (all but the length).
RESULT_NEUTRAL_KEYS = tuple(key for key in RESUME_SAFE_KEYS if key not in LENGTH_KEYS)


class CorruptCheckpointError(RuntimeError):
    """Every resume candidate of a run directory is damaged."""


class ResumeConfigError(ValueError):
    """A rerun's config differs from the stored one in keys that make it a different experiment."""


def candidates(run_dir: Path) -> List[Path]:
    """Resume candidates that exist, in modification order, newest first (see `choose_resume_checkpoint`)."""
    run_dir = Path(run_dir)
    found = list(run_dir.glob("hpc_ckpt_*.ckpt")) + list((run_dir / CHECKPOINT_DIR).glob(BEST_CHECKPOINTS))
    found += [path for path in (run_dir / CHECKPOINT_DIR / LAST_CHECKPOINT, run_dir / CHECKPOINT_DIR /
                                PREVIOUS_CHECKPOINT) if path.is_file()]
    return sorted(found, key=lambda path: path.stat().st_mtime, reverse=True)


def checkpoint_step(path: Path) -> int:
    """The global step a checkpoint was written at (memory-mapped: the tensors are not read)."""
    return int(torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("global_step", -1))


def damage(path: Path) -> Optional[str]:
    """Why `path` is not a readable checkpoint archive, or None when it is intact."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad_member = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"{type(err).__name__}: {err}"
    return f"damaged member {bad_member}" if bad_member else None


def choose_resume_checkpoint(run_dir: Path) -> Optional[Path]:
    """The intact candidate of the highest training step (the newest file among equals); None when there is no
    candidate (a fresh start)."""
    intact, damaged = [], []
    for path in candidates(Path(run_dir)):
        reason = damage(path)
        if reason is None:
            intact.append((checkpoint_step(path), path))
        else:
            damaged.append(f"{path} ({reason})")
    if intact:
        step, path = max(intact, key=lambda found: found[0])  # max keeps the first (newest) of equal steps
        if damaged:
            log.warning("resuming from %s instead of the damaged %s", path, ", ".join(damaged))
            print(f"Checkpoint damaged, falling back: {', '.join(damaged)} -> {path} (step {step})", flush=True)
        return path
    if damaged:
        raise CorruptCheckpointError(f"every checkpoint of {run_dir} is damaged: {'; '.join(damaged)}. Move them "
                                     f"aside to start over (resume=false moves the whole run directory aside)")
    return None


def checked_checkpoint(path: Path) -> Path:
    """`resume_from=PATH`: the named checkpoint, which must exist and be intact."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"resume_from={path}: no such checkpoint file")
    reason = damage(path)
    if reason is not None:
        raise CorruptCheckpointError(f"resume_from={path} is damaged ({reason})")
    return path


def flatten(config: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; lists stay values."""
    flat: Dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _listed(key: str, keys: Tuple[str, ...]) -> bool:
    return any(key == listed or (listed.endswith(".") and key.startswith(listed)) for listed in keys)


def is_resume_safe(key: str) -> bool:
    return _listed(key, RESUME_SAFE_KEYS)


def result_keys(config: Mapping[str, Any]) -> Dict[str, Any]:
    """The flattened config without the keys that cannot change a run's result (`RESULT_NEUTRAL_KEYS`: loader
    workers, device and node counts, logging, evaluation and monitor settings, where it resumes from) and
    without the per-device batches derived from the device count (the global batch stays)."""
    return {key: value for key, value in sorted(flatten(config).items())
            if not _listed(key, RESULT_NEUTRAL_KEYS) and key not in DERIVED_KEYS}


def config_digest(config: Mapping[str, Any]) -> str:
    """sha256 (hex) of `result_keys(config)` as canonical JSON (sorted keys, no spaces): the same for every
    run that trains the same thing, whatever machine, device count or loader it ran with."""
    canonical = json.dumps(result_keys(config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def config_changes(stored: Mapping[str, Any], new: Mapping[str, Any]) -> List[Tuple[str, Any, Any]]:
    """Every `(key, stored value, new value)` that differs (a key missing on one side reads as `<absent>`),
    derived keys left out."""
    before, after = flatten(stored), flatten(new)
    absent = "<absent>"
    return [(key, before.get(key, absent), after.get(key, absent)) for key in sorted(set(before) | set(after))
            if before.get(key, absent) != after.get(key, absent) and key not in DERIVED_KEYS]


def refuse_old_layout(stored: Mapping[str, Any], where: Path) -> None:
    """A run written before each method owned its options and NegCLIP's settings became one block
    (`method.hard_negatives: true/false`, `data.num_hard_negatives`, `data.hard_negative_images`, every method's
    options in one section) is refused on resume with the edits that convert its config.yaml."""
    from lightning_modules.methods import METHOD_OPTIONS  # light: the option classes only

    method, data = dict(stored.get("method") or {}), dict(stored.get("data") or {})
    if not isinstance(method.get("hard_negatives", {}), bool) and "num_hard_negatives" not in data:
        return
    name = method.get("name", "clip_ft")
    own = {field.name for field in dataclasses.fields(METHOD_OPTIONS.get(name, MethodConfig))}
    foreign = sorted(key for key in method if key not in own)
    aligner = name in ("tflocal", "tfglobal")  # they scored data.num_hard_negatives without the flag
    captions = data.get("num_hard_negatives", 0) if method.get("hard_negatives") or aligner else 0
    raise ResumeConfigError(
        f"{where} was written by an older version whose config.yaml has another layout; nothing was written. To "
        f"resume it, edit its config.yaml (and, with resume_from, use a checkpoint of the converted run):\n"
        f"  - replace method.hard_negatives: {method.get('hard_negatives')} with method.hard_negatives: "
        f"{{captions: {captions}, images: {str(bool(data.get('hard_negative_images', False))).lower()}}}\n"
        f"  - delete data.num_hard_negatives and data.hard_negative_images\n"
        f"  - delete the keys of other methods under method: {', '.join(foreign) or '(none)'}\n"
        f"  - add data.per_device_batch_size / per_device_val_batch_size: nothing (fit derives them); note that "
        f"data.batch_size is now the global batch (it was per device)\n"
        f"or start it fresh with resume=false (the old directory is moved aside).")


def check_resume_config(stored: Mapping[str, Any], new: Mapping[str, Any], run_dir: Path) -> List[Tuple[str, Any, Any]]:
    """The safe changes of a resume; a `ResumeConfigError` listing the others when there are any."""
    changes = config_changes(stored, new)
    unsafe = [change for change in changes if not is_resume_safe(change[0])]
    if unsafe:
        listed = "\n".join(f"  {key}: {old!r} (stored) -> {value!r} (now)" for key, old, value in unsafe)
        raise ResumeConfigError(
            f"{run_dir} holds a different experiment; these keys differ from its config.yaml:\n{listed}\n"
            f"Nothing was written. Either start this config fresh with resume=false (the old run directory is "
            f"moved aside, never deleted), or give it its own run directory with experiment=<new name>. Keys that "
            f"may change on resume: {', '.join(RESUME_SAFE_KEYS)}")
    return changes

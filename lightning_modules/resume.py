"""Which checkpoint a rerun (or a SLURM requeue) resumes from, and what to do with a corrupted one.

Candidates in a run directory, newest first by modification time:
- `hpc_ckpt_<n>.ckpt`: written by Lightning's SLURM plugin when SIGUSR1 arrives before preemption;
- `checkpoints/last.ckpt`: written by `LastCheckpoint` (every N steps, epoch ends, the end of training);
- `checkpoints/previous.ckpt`: the last.ckpt before it, kept by a rename before every save.

A checkpoint is a zip archive (torch.save); a truncated or damaged file fails the archive's own CRC check,
which is cheap next to loading it. A damaged candidate is reported by name and the next one is used; when
every candidate is damaged the run stops with an error naming them, instead of silently starting over.
"""
from __future__ import annotations

import logging
import zipfile
from pathlib import Path
from typing import List, Optional

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
PREVIOUS_CHECKPOINT = "previous.ckpt"


class CorruptCheckpointError(RuntimeError):
    """Every resume candidate of a run directory is damaged."""


def candidates(run_dir: Path) -> List[Path]:
    """Resume candidates that exist, newest first."""
    found = list(Path(run_dir).glob("hpc_ckpt_*.ckpt"))
    found += [path for path in (run_dir / CHECKPOINT_DIR / LAST_CHECKPOINT, run_dir / CHECKPOINT_DIR /
                                PREVIOUS_CHECKPOINT) if path.is_file()]
    return sorted(found, key=lambda path: path.stat().st_mtime, reverse=True)


def damage(path: Path) -> Optional[str]:
    """Why `path` is not a readable checkpoint archive, or None when it is intact."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad_member = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"{type(err).__name__}: {err}"
    return f"damaged member {bad_member}" if bad_member else None


def choose_resume_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest intact candidate; None when there is none (a fresh start)."""
    found = candidates(Path(run_dir))
    damaged = []
    for path in found:
        reason = damage(path)
        if reason is None:
            if damaged:
                log.warning("resuming from %s instead of the damaged %s", path, ", ".join(damaged))
                print(f"Checkpoint damaged, falling back: {', '.join(damaged)} -> {path}", flush=True)
            return path
        damaged.append(f"{path} ({reason})")
    if damaged:
        raise CorruptCheckpointError(f"every checkpoint of {run_dir} is damaged: {'; '.join(damaged)}. Move them "
                                     f"aside to start over (resume=false moves the whole run directory aside)")
    return None

"""How a training run stops early without losing or misreporting work.

- `RunLock`: one `fit` process per run directory. A second process that would write into a directory another
  one is training in is refused before it writes anything (an advisory `flock` on `<run_dir>.lock`, released
  by the kernel when the holder dies, so a killed or preempted job never leaves a stale lock behind). A lock
  still held after the process it names died on this host (a child that inherited the lock outlived it) is
  recognised as stale and taken over.
- `StopSignals`: SIGTERM, SIGINT and SIGUSR1 (SLURM's warning before a time limit or a preemption) stop
  training at the next point between two optimizer steps (with gradient accumulation, after the step's last
  micro-batch), where the loop state and the weights agree; a checkpoint is written there and the process exits
  with 128 + the signal's number. The signal may come to the whole process group (`scancel`, `timeout`, Ctrl-C):
  loader workers ignore it (datamodules/loader_workers.py). Under SLURM, SIGUSR1 also requeues the job.
  (Lightning's own SLURM handler saves inside the signal handler, wherever the step was: halfway through a step
  the restored loop counts one batch twice and every later curve point is filed one step late, so it is
  switched off, see `slurm_plugins`.) A second SIGTERM or SIGUSR1 changes nothing (a scheduler or `timeout` may
  deliver one twice).
- A Ctrl-C (SIGINT) after a stop began stops at once: the step, validation, evaluation or checkpoint write in
  flight is abandoned and no checkpoint is written after it. Checkpoints are written to a temporary file and
  renamed into place (the renames finish before the interrupt is raised), so the run resumes from the newest
  complete checkpoint: the first stop's, when its write had finished.
- `SafeStop`: what a failure leaves behind. A non-finite loss never reaches a checkpoint, and a checkpoint
  holding the weights that produced it is moved aside (`diverged-<step>.ckpt`). Any other failure between two
  steps writes a resumable checkpoint. Every early stop appends a line to `stops.jsonl` in the run directory:
  the step, why, whether a second Ctrl-C forced it (`forced`), and the checkpoint a rerun resumes from.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_modules.base import NonFiniteLossError
from lightning_modules.resume import CHECKPOINT_DIR, candidates, checkpoint_step, choose_resume_checkpoint

log = logging.getLogger(__name__)

STOPS_RECORD = "stops.jsonl"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
FORCED_DETAIL = "a second SIGINT stopped the run at once: the work in flight was abandoned and no checkpoint written"


class RunDirectoryBusy(RuntimeError):
    """Another process is training in this run directory."""


class StoppedBySignal(RuntimeError):
    """Training stopped early on a signal; `exit_code` is the status the process should end with."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


# ----- one process per run directory ----------------------------------------------------------------------
def lock_path(run_dir: Path) -> Path:
    """Beside the run directory, not in it: `resume=false` moves the directory aside while holding the lock."""
    return run_dir.with_name(f"{run_dir.name}.lock")


class RunLock:
    """An exclusive, non-blocking `flock` on `<run_dir>.lock`, taken by global rank 0 only.

    The file holds the holder's host, pid and start time, for the refusal message, and is removed by its holder
    on exit (while still locked; a process that opened the old file before that sees it is gone and retries).
    Other ranks of a DDP run are started by rank 0 (or by srun beside it) and share its directory by design.
    """

    def __init__(self, run_dir: Path):
        self.path = lock_path(Path(run_dir))
        self._handle = None

    def __enter__(self) -> "RunLock":
        if rank_zero_only.rank != 0:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while self._handle is None:
            handle = open(self.path, "a+", encoding="utf-8")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                if self._break_if_stale(handle, holder):
                    continue
                handle.close()
                raise RunDirectoryBusy(
                    f"{self.path.with_suffix('')} is in use by {holder}; nothing was written. Wait for it to end, "
                    f"stop it, or give this run its own directory with experiment=<new name>") from None
            if self._is_current(handle):
                self._handle = handle
            else:  # its holder removed the file after we opened it: lock the new one
                handle.close()
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(f"fit pid {os.getpid()} on {socket.gethostname()} since "
                           f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        self._handle.flush()
        return self

    def _break_if_stale(self, handle, holder: str) -> bool:
        """Remove the lock file when the fit process it names is dead on this host (the lock is then held by a
        process that inherited it, such as a loader worker outliving a killed run, and guards nothing); True when
        removed (`handle` is closed then). Breakers take turns on the folder's flock and remove the file only if
        it is still the one whose holder they read, so two of them never remove each other's new lock."""
        if not holder_is_gone(holder):
            return False
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:
            fcntl.flock(folder, fcntl.LOCK_EX)
            if self._is_current(handle):
                self.path.unlink()
                log.warning("%s was held for %s, which is no longer running: a stale lock, taken over", self.path,
                            holder)
        finally:
            os.close(folder)  # releases the folder's flock
        handle.close()
        return True

    def _is_current(self, handle) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            return False

    def __exit__(self, *exc_info) -> None:
        if self._handle is not None:
            self.path.unlink(missing_ok=True)
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None


def holder_is_gone(holder: str) -> bool:
    """Whether the holder line a lock file names (`fit pid N on HOST since ...`) is a process of this host that is
    no longer running (a zombie, dead but not yet reaped, counts as gone). A holder on another host, or a line in
    another form, is taken to be running."""
    match = re.match(r"fit pid (\d+) on (\S+) since", holder)
    if match is None or match.group(2) != socket.gethostname():
        return False
    return not process_running(int(match.group(1)))


def process_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"  # the state follows the command name
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# ----- signals ---------------------------------------------------------------------------------------------
def slurm_plugins() -> List[Any]:
    """Under SLURM, its environment without Lightning's auto-requeue (whose SIGUSR1 handler saves mid-step);
    `StopSignals` saves at a step boundary and requeues instead."""
    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def slurm_job_id() -> Optional[str]:
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job() -> None:
    """`scontrol requeue` this job (rank 0), as SLURM's SIGUSR1 warning asks; logged, never fatal."""
    job = slurm_job_id()
    if job is None or rank_zero_only.rank != 0:
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except FileNotFoundError:
        log.warning("SIGUSR1 under SLURM job %s: scontrol not found, the job was not requeued", job)
        return
    if result.returncode == 0:
        log.info("requeued SLURM job %s", job)
    else:
        log.warning("requeueing SLURM job %s failed: %s", job, result.stderr.strip())


class StopSignals(L.Callback):
    """Turns SIGTERM / SIGINT / SIGUSR1 into a stop at the next step boundary (see the module docstring).

    The handler records the signal and raises Lightning's stop flag (`received_sigterm`), which the training loop
    checks between batches (and DDP ranks share from rank 0 every batch); `SafeStop` then writes the checkpoint.
    Between two micro-batches of one accumulated optimizer step the flag is held down until the step's last
    micro-batch: a stop there would save a step half accumulated, whose resume trains on part of its batches.
    Lightning installs its SIGTERM handler when `fit` starts and calls the one found in place, this one, from it;
    it also clears its flag then, so a signal that came while the run was being built is raised again in `setup`,
    before any step.

    A SIGINT after the first stop signal is `forced`: it raises KeyboardInterrupt at once, except inside
    `uninterrupted()` (renaming a written checkpoint into place, writing the stop record), which it waits for.
    """

    def __init__(self):
        self.trainer: Optional[L.Trainer] = None
        self.received: Optional[int] = None
        self.forced = False
        self._accumulating = False  # between two micro-batches of one optimizer step
        self._deferring = 0
        self._interrupt_pending = False
        self._previous: Dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            log.warning("received %s: stopping after the current step (a second Ctrl-C stops at once)",
                        signal.Signals(signum).name)
            self.received = signum
            self._raise_stop_flag()
        elif signum == signal.SIGINT and not self.forced:
            log.warning("received a second SIGINT: stopping at once, without a checkpoint of the work in flight")
            self.forced = True
            if self._deferring:
                self._interrupt_pending = True
            else:
                raise KeyboardInterrupt

    def _raise_stop_flag(self) -> None:
        """Raise the flag, or hold it down until the optimizer step's last micro-batch (`on_train_batch_end`):
        Lightning's own SIGTERM handler, which runs just before this one, raises it at any time."""
        if self.trainer is not None:
            self.trainer._signal_connector.received_sigterm = not self._accumulating

    @contextmanager
    def uninterrupted(self) -> Iterator[None]:
        """A forced interrupt that comes inside waits for the end of the block (a few renames or one line)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if self._interrupt_pending and not self._deferring:
            self._interrupt_pending = False
            raise KeyboardInterrupt

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if self.received is not None:
            raise SIGTERMException()

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        self._accumulating = trainer.fit_loop.epoch_loop._should_accumulate()
        if self.received is not None:  # Lightning's own SIGTERM handler raises the flag at any time
            trainer._signal_connector.received_sigterm = not self._accumulating

    @contextmanager
    def installed(self, trainer: L.Trainer) -> Iterator["StopSignals"]:
        self.trainer = trainer
        self._previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        try:
            yield self
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)

    @property
    def signum(self) -> int:
        """The signal that stopped training (SIGTERM when it came through Lightning's own handler alone; SIGINT
        when a second Ctrl-C forced the stop)."""
        if self.forced:
            return signal.SIGINT
        return self.received if self.received is not None else signal.SIGTERM

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def reason(self) -> str:
        """The stop as `stops.jsonl` names it: `signal SIGTERM`, or how a forced stop came about."""
        if not self.forced:
            return f"signal {self.name}"
        first = signal.Signals(self.received).name
        signals = "SIGINT twice" if first == "SIGINT" else f"{first}, then SIGINT"
        return f"signal {signals}: stopped at once"

    def stop_error(self, step: int, outcome: Dict[str, Any]) -> StoppedBySignal:
        """The error a stopped fit ends with: where it stopped and where a rerun resumes (`outcome`: SafeStop's)."""
        saved, resume = outcome.get("saved"), outcome.get("resume_from")
        if saved:
            where = f"saved {saved} (step {checkpoint_step(saved)})"
        elif resume:
            where = (f"no checkpoint was written at the stop; a rerun resumes from {resume} (step "
                     f"{checkpoint_step(resume)})")
        else:
            where = "no checkpoint could be written; a rerun starts over"
        how = "stopped at once by a second SIGINT" if self.forced else f"stopped by {self.name}"
        return StoppedBySignal(self.signum, f"training {how} at step {step}; {where}. Rerun the same command to "
                                            f"resume")


# ----- what a failure leaves behind ------------------------------------------------------------------------
def append_stop_record(run_dir: Path, entry: dict) -> None:
    if rank_zero_only.rank != 0 or not run_dir.is_dir():
        return
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **entry}
    with open(run_dir / STOPS_RECORD, "a", encoding="utf-8") as file:
        file.write(json.dumps(entry, default=str) + "\n")


def move_aside_checkpoints_of_step(run_dir: Path, step: int) -> List[Path]:
    """Rename every resume candidate written at `step` to `checkpoints/diverged-<step>[-n].ckpt` (rank 0): its
    weights are the ones whose loss was not finite, and resuming from them would fail the same way."""
    moved = []
    if rank_zero_only.rank != 0:
        return moved
    for path in candidates(run_dir):
        if checkpoint_step(path) != step:
            continue
        target = run_dir / CHECKPOINT_DIR / f"diverged-{step}.ckpt"
        index = 1
        while target.exists():
            target = run_dir / CHECKPOINT_DIR / f"diverged-{step}-{index}.ckpt"
            index += 1
        os.replace(path, target)
        moved.append(target)
    return moved


def resume_point(run_dir: Path) -> Optional[Path]:
    try:
        return choose_resume_checkpoint(run_dir)
    except Exception:  # every candidate damaged: the record says there is none
        return None


class SafeStop(L.Callback):
    """On any exception out of `fit`: keep good weights, never keep diverged ones, and record the stop.

    - A non-finite loss (`NonFiniteLossError`): nothing is saved; checkpoints holding the weights that produced
      it are moved aside.
    - A signal (Lightning raises `SIGTERMException` between steps) or any other error raised between two
      training steps (a bad image in the loader, a failing validation or benchmark): the current weights are
      written as the resume point (`save`, the run's `LastCheckpoint.save`). An error inside a step may have
      left the weights half-updated, and under DDP the other ranks may not reach a collective save: then the
      previous checkpoint stays the resume point.
    - A stop forced by a second Ctrl-C writes nothing (it may have cut a step short, and it asked not to wait); one
      that cuts the stop's own write short leaves the previous checkpoints as they were (the write is renamed into
      place only once complete). The record says so (`forced`) and names the resume point.
    """

    def __init__(self, run_dir: Path, save: Callable[[L.Trainer], Optional[Path]], signals: StopSignals):
        self.run_dir = Path(run_dir)
        self.save = save
        self.signals = signals
        self.in_step = False
        self.outcome: Dict[str, Any] = {}

    def on_train_batch_start(self, *args) -> None:
        self.in_step = True

    def on_train_batch_end(self, *args) -> None:
        self.in_step = False

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        step = trainer.global_step
        if isinstance(exception, NonFiniteLossError):
            bad_step = exception.step if exception.step is not None else step
            moved = move_aside_checkpoints_of_step(self.run_dir, bad_step)
            self._record(step, "non-finite", str(exception), saved=None, moved=moved)
            return
        signalled = isinstance(exception, (SIGTERMException, KeyboardInterrupt))
        saved = None
        # every DDP rank raises SIGTERMException at the same step; a forced stop asked not to wait for a write
        if (trainer.world_size == 1 or signalled) and not self.signals.forced:
            saved = self._save_between_steps(trainer)
        with self.signals.uninterrupted():
            if signalled or self.signals.forced:
                detail = FORCED_DETAIL if self.signals.forced else str(exception)
                self._record(step, self.signals.reason, detail, saved=saved, moved=[])
            else:
                self._record(step, f"error: {type(exception).__name__}", str(exception), saved=saved, moved=[])

    def _save_between_steps(self, trainer: L.Trainer) -> Optional[Path]:
        if self.in_step or trainer.global_step == 0:
            return None
        try:
            return self.save(trainer)
        except KeyboardInterrupt:  # a second Ctrl-C during the write: the write is abandoned, nothing replaced
            log.warning("the checkpoint being written was abandoned; the previous checkpoints are as they were")
            return None
        except Exception as err:  # the failure may be the disk itself: report, do not mask the original error
            log.warning("could not write a checkpoint after the failure: %s", err)
            return None

    def record_late_interrupt(self, step: int) -> None:
        """A second Ctrl-C that came after the stop was recorded (while the process was shutting down): one more
        line, naming the resume point the stop left (nothing of it was lost)."""
        with self.signals.uninterrupted():
            self._record(step, self.signals.reason, "a second SIGINT while shutting down after the stop; the stop's "
                         "checkpoint was already complete", saved=self.outcome.get("saved"), moved=[])

    def _record(self, step: int, reason: str, detail: str, saved: Optional[Path], moved: List[Path]) -> None:
        resume = resume_point(self.run_dir)
        forced = self.signals.forced
        self.outcome = {"step": step, "reason": reason, "saved": saved, "resume_from": resume, "forced": forced}
        entry = {"step": step, "reason": reason, "detail": detail.splitlines()[0] if detail else "",
                 "saved": saved, "resume_from": resume, "forced": forced, "moved_aside": moved}
        append_stop_record(self.run_dir, entry)

"""A run that stops early loses nothing and misreports nothing: signals (real ones, to real processes) leave a
resumable checkpoint and a non-zero status; a diverged step is never saved; a failure after a trained step
keeps the run directory; two processes never share one; a preempted run continues its curves on the step."""
from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_modules.base import NonFiniteLossError
from lightning_modules.fit import run
from lightning_modules.resume import ResumeConfigError
from lightning_modules.stops import (STOPS_RECORD, RunDirectoryBusy, RunLock, StoppedBySignal, lock_path,
                                     process_running)
from slurm.sweep import main as sweep_main
from fitting import REPO_ROOT, TINY, NanAtStep, exported_state, tiny_config

# A step count the tests never reach: the subprocess runs until it is signalled.
ENDLESS = 100_000


def stop_records(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / STOPS_RECORD).read_text().splitlines()]


def curve(run_dir: Path, tag: str = "train/loss") -> list:
    events = EventAccumulator(str(run_dir / "tb" / "version_0"))
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def step_of(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


class SignalAt(L.Callback):
    """Sends `signum` to this very process at `step`, from inside the training step (before the optimizer
    applies it) or at its end: where a real signal from outside lands."""

    def __init__(self, signum: int, step: int, inside_step: bool = False):
        self.signum, self.step, self.inside_step, self.sent = signum, step, inside_step, False

    def _send(self, trainer) -> None:
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)

    def on_before_optimizer_step(self, trainer, *args) -> None:
        if self.inside_step:
            self._send(trainer)

    def on_train_batch_end(self, trainer, *args) -> None:
        if not self.inside_step:
            self._send(trainer)


@pytest.mark.parametrize("signum, inside_step", [(signal.SIGTERM, False), (signal.SIGINT, True),
                                                 (signal.SIGUSR1, True)])
def test_a_signal_saves_a_checkpoint_that_resumes_to_the_uninterrupted_run_and_curves(shapes_root, tmp_path,
                                                                                      signum, inside_step):
    """The stop lands on a step boundary whatever the signal interrupted, so the resumed weights equal the
    uninterrupted run's and every curve point sits on its own step (no step late, none twice)."""
    overrides = ("trainer.max_steps=6", "data.train_augment=true", "trainer.limit_val_batches=0")
    with pytest.raises(StoppedBySignal) as stopped:
        run(tiny_config(shapes_root, tmp_path / "a", *overrides), extra_callbacks=[SignalAt(signum, 3, inside_step)])
    assert stopped.value.exit_code == 128 + signum
    run_dir = tmp_path / "a" / "demo_pretrain"
    saved_step = 4 if inside_step else 3  # the step in flight finishes first
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == saved_step
    assert not (run_dir / "export").exists()  # an interrupted run is not exported
    record = stop_records(run_dir)[-1]
    assert record["reason"] == f"signal {signal.Signals(signum).name}" and record["step"] == saved_step
    assert record["saved"].endswith("last.ckpt") and record["resume_from"].endswith("last.ckpt")
    run(tiny_config(shapes_root, tmp_path / "a", *overrides))
    run(tiny_config(shapes_root, tmp_path / "b", *overrides))
    a, b = exported_state(run_dir), exported_state(tmp_path / "b" / "demo_pretrain")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6, msg=key)
    for tag in ("train/loss", "lr/backbone"):
        resumed, straight = curve(run_dir, tag), curve(tmp_path / "b" / "demo_pretrain", tag)
        assert [step for step, _ in resumed] == [step for step, _ in straight], tag
        torch.testing.assert_close(torch.tensor([v for _, v in resumed]), torch.tensor([v for _, v in straight]),
                                   rtol=1e-5, atol=1e-6)


def cli_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}


def fit_command(shapes_root: Path, max_steps: int, *extra: str) -> list:
    return [sys.executable, "-m", "lightning_modules.fit", "--config",
            str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), f"model.name={TINY}",
            f"model.config_dir={REPO_ROOT / 'configs' / 'models'}", f"data.root={shapes_root}", "data.masks=false",
            "data.batch_size=8", "data.num_workers=0", f"trainer.max_steps={max_steps}",
            "trainer.enable_progress_bar=false", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1", *extra]


def wait_for(condition, process: subprocess.Popen, what: str) -> None:
    """Poll until `condition()` holds; the generous limit only keeps a broken run from hanging the suite."""
    deadline = time.monotonic() + 600
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the process ended (rc {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"no {what} after 10 minutes")
        time.sleep(0.1)


def training_started(run_dir: Path):
    """True once the run's TensorBoard file holds logged steps (the writer flushes every 10 events)."""
    def check() -> bool:
        files = list((run_dir / "tb" / "version_0").glob("events.out.tfevents.*"))
        return bool(files) and files[0].stat().st_size > 2000
    return check


def test_sigterm_to_a_fit_process_exits_non_zero_with_a_resumable_checkpoint(shapes_root, tmp_path):
    run_dir = tmp_path / "runs" / "demo_pretrain"
    process = subprocess.Popen(fit_command(shapes_root, ENDLESS), cwd=tmp_path, env=cli_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(training_started(run_dir), process, "logged training steps")
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "training stopped by SIGTERM" in err and "Traceback" not in err
    record = stop_records(run_dir)[-1]
    step = step_of(run_dir / "checkpoints" / "last.ckpt")
    assert step >= 1 and record["step"] == step and record["reason"] == "signal SIGTERM"
    resumed = subprocess.run(fit_command(shapes_root, step + 2), cwd=tmp_path, env=cli_env(), capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout and "initialized randomly" not in resumed.stderr
    assert json.loads((run_dir / "export" / "model.json").read_text())["global_step"] == step + 2
    steps = [s for s, _ in curve(run_dir)]
    assert steps == list(range(step + 2))  # every step once, none late


def test_a_second_fit_process_is_refused_while_one_trains_in_the_directory(shapes_root, tmp_path):
    run_dir = tmp_path / "runs" / "demo_pretrain"
    first = subprocess.Popen(fit_command(shapes_root, ENDLESS), cwd=tmp_path, env=cli_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(training_started(run_dir), first, "logged training steps")
    assert f"pid {first.pid}" in lock_path(run_dir).read_text()
    second = subprocess.run(fit_command(shapes_root, ENDLESS), cwd=tmp_path, env=cli_env(), capture_output=True,
                            text=True, timeout=600)
    still_running = first.poll() is None
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=600)
    assert still_running
    assert second.returncode != 0 and "is in use by fit pid" in second.stderr and "Traceback" not in second.stderr
    assert len(list((run_dir / "tb" / "version_0").glob("events.out.tfevents.*"))) == 1  # only the first wrote
    assert not list((run_dir / "checkpoints").glob("*-v1.ckpt"))
    # The lock dies with its holder: the same command now resumes.
    step = step_of(run_dir / "checkpoints" / "last.ckpt")
    again = subprocess.run(fit_command(shapes_root, step + 1), cwd=tmp_path, env=cli_env(), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]


def test_the_lock_is_exclusive_and_released_on_exit(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir):
        other = subprocess.run([sys.executable, "-c", f"from lightning_modules.stops import RunLock\n"
                                f"with RunLock({str(run_dir)!r}): pass"], env=cli_env(), capture_output=True,
                               text=True, timeout=120)
        assert other.returncode != 0 and "RunDirectoryBusy" in other.stderr
    assert not lock_path(run_dir).exists()  # removed by its holder
    with RunLock(run_dir):  # released: taken again
        pass
    with pytest.raises(RunDirectoryBusy):
        with RunLock(run_dir):
            with RunLock(run_dir):  # a second open file description conflicts even in one process
                pass


def test_a_failure_after_trained_steps_keeps_the_run_and_saves_the_weights(shapes_root, tmp_path):
    """A failure between steps (here: a callback at a step's end, as a broken benchmark or bad image would)
    after 3 trained steps: the config, the curves and a resumable checkpoint stay, with a record."""
    class Broken(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 3:
                raise OSError("the benchmark disk went away")

    with pytest.raises(OSError, match="disk went away"):
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=8", "trainer.limit_val_batches=0"),
            extra_callbacks=[Broken()])
    run_dir = tmp_path / "demo_pretrain"
    assert (run_dir / "config.yaml").is_file() and [s for s, _ in curve(run_dir)][:2] == [0, 1]
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == 3
    record = stop_records(run_dir)[-1]
    assert record["reason"] == "error: OSError" and record["step"] == 3 and "disk went away" in record["detail"]
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=8", "trainer.limit_val_batches=0"))
    assert json.loads((run_dir / "export" / "model.json").read_text())["global_step"] == 8


def test_a_failure_inside_a_step_keeps_the_run_without_saving_half_a_step(shapes_root, tmp_path):
    class BrokenInside(L.Callback):
        def on_before_optimizer_step(self, trainer, *args) -> None:
            if trainer.global_step == 2:
                raise RuntimeError("CUDA error: an illegal memory access")

    with pytest.raises(RuntimeError, match="illegal memory"):
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=8", "trainer.limit_val_batches=0"),
            extra_callbacks=[BrokenInside()])
    run_dir = tmp_path / "demo_pretrain"
    assert (run_dir / "config.yaml").is_file() and not (run_dir / "checkpoints" / "last.ckpt").exists()
    record = stop_records(run_dir)[-1]
    assert record["step"] == 2 and record["saved"] is None and record["resume_from"] is None


def test_a_non_finite_loss_moves_the_weights_that_produced_it_aside(shapes_root, tmp_path):
    """Checkpoints every step: the one of step 3 holds the weights whose loss was NaN; it must not stay a resume
    point, and the message names the newest good one."""
    cfg = tiny_config(shapes_root, tmp_path, "trainer.max_steps=8", "checkpoint.every_n_steps=1",
                      "trainer.limit_val_batches=0")
    with pytest.raises(NonFiniteLossError, match=r"global step 3.*itc_loss=nan.*newest good checkpoint is .*step 2"):
        run(cfg, extra_callbacks=[NanAtStep(3)])
    run_dir = tmp_path / "demo_pretrain"
    assert step_of(run_dir / "checkpoints" / "diverged-3.ckpt") == 3
    assert step_of(run_dir / "checkpoints" / "previous.ckpt") == 2
    assert not (run_dir / "checkpoints" / "last.ckpt").exists()
    assert stop_records(run_dir)[-1]["resume_from"].endswith("previous.ckpt")


def test_a_non_finite_loss_found_late_is_still_never_saved(shapes_root, tmp_path):
    """With the check on logging steps only (every 4), the NaN of step 3 is found at step 4, the checkpoint of
    step 4 is refused and step 3's moved aside."""
    cfg = tiny_config(shapes_root, tmp_path, "trainer.max_steps=8", "checkpoint.every_n_steps=1",
                      "trainer.limit_val_batches=0", "trainer.log_every_n_steps=4")
    with pytest.raises(NonFiniteLossError, match=r"global step 3"):
        run(cfg, extra_callbacks=[NanAtStep(3)])
    checkpoints = tmp_path / "demo_pretrain" / "checkpoints"
    steps = {path.name: step_of(path) for path in checkpoints.glob("*.ckpt")}
    assert steps == {"diverged-3.ckpt": 3, "previous.ckpt": 2}, steps


def test_diverging_weights_are_not_saved_and_the_cli_says_so(shapes_root, tmp_path):
    """lr 1e30 overflows the weights in a step or two; nothing non-finite may reach a checkpoint, the directory
    stays, and the CLI says what happened without a traceback."""
    result = subprocess.run(fit_command(shapes_root, 20, "optim.lr=1e30", "optim.warmup_steps=1",
                                        "checkpoint.every_n_steps=1"), cwd=tmp_path, env=cli_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and "training stopped: non-finite" in result.stderr
    assert "Traceback" not in result.stderr
    run_dir = tmp_path / "runs" / "demo_pretrain"
    for path in (run_dir / "checkpoints").glob("*.ckpt"):
        if path.name.startswith("diverged"):
            continue
        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point()), path
    assert stop_records(run_dir)[-1]["reason"] == "non-finite"


def test_a_start_that_fails_before_any_step_still_leaves_nothing(shapes_root, tmp_path):
    with pytest.raises(Exception):
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=1", "model.name=ViT-No-Such-Model"))
    assert not (tmp_path / "demo_pretrain").exists() and not lock_path(tmp_path / "demo_pretrain").exists()


# ----- signals to the whole process group, stops inside a step, a second Ctrl-C ------------------------------------
def spawn(command: list, cwd: Path, out: Path) -> subprocess.Popen:
    """`command` in a session of its own (its own process group, as a job under a scheduler), its stdout and stderr
    in files under `out` (a pipe nobody reads could fill and stall it)."""
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(command, cwd=cwd, env=cli_env(), stdout=open(out / "stdout", "w"),
                            stderr=open(out / "stderr", "w"), start_new_session=True)


def finished(process: subprocess.Popen, out: Path) -> tuple:
    """(exit status, stderr) once `process` has ended (the timeout only keeps a broken run from hanging)."""
    process.wait(timeout=600)
    return process.returncode, (out / "stderr").read_text()


def text_in(path: Path, text: str):
    return lambda: path.is_file() and text in path.read_text()


def test_sigterm_to_the_process_group_with_loader_workers_exits_143_with_a_resumable_checkpoint(shapes_root, tmp_path):
    """`timeout -s TERM` and `scancel` signal every process of the job: the loader workers too. The run still stops
    at a step boundary with 143, no traceback, a record and a checkpoint that `resume_from` continues."""
    run_dir, out = tmp_path / "runs" / "demo_pretrain", tmp_path / "out"
    process = spawn(fit_command(shapes_root, ENDLESS, "data.num_workers=2"), tmp_path, out)
    wait_for(training_started(run_dir), process, "logged training steps")
    os.killpg(process.pid, signal.SIGTERM)
    code, err = finished(process, out)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "training stopped by SIGTERM" in err and "Traceback" not in err
    step = step_of(run_dir / "checkpoints" / "last.ckpt")
    record = stop_records(run_dir)[-1]
    assert step >= 1 and record["step"] == step and record["reason"] == "signal SIGTERM" and not record["forced"]
    resumed = subprocess.run(fit_command(shapes_root, step + 2, "data.num_workers=2",
                                         f"resume_from={run_dir / 'checkpoints' / 'last.ckpt'}"),
                             cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "export" / "model.json").read_text())["global_step"] == step + 2
    assert [s for s, _ in curve(run_dir)] == list(range(step + 2))


def signal_bit(status: str, field: str, signum: int) -> bool:
    """Whether `signum` is set in a signal mask line (`SigBlk`, `SigIgn`) of /proc/<pid>/status."""
    line = next(line for line in status.splitlines() if line.startswith(field + ":"))
    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)


def settled(pid: int, signum: int) -> bool:
    """Whether process `pid` has dealt with a `signum` sent to it: it is dead (or a zombie), or it blocks or ignores
    the signal (then it stays as it is)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    state = next(line for line in status.splitlines() if line.startswith("State:")).split()[1]
    return state == "Z" or signal_bit(status, "SigBlk", signum) or signal_bit(status, "SigIgn", signum)


class SignalGroupInsideStep(L.Callback):
    """At `step`, inside the training step (before backward and update), has another process send SIGTERM to this
    one and to its loader workers, as a scheduler signals a job (torch's workers take a SIGTERM from their parent
    for a shutdown request, so the sender must not be this process), then waits until each worker has dealt with
    it: a worker that dies of it makes the loader raise in the step from here."""

    def __init__(self, step: int):
        self.step, self.sent = step, False

    def on_before_backward(self, trainer, *args) -> None:
        if trainer.global_step != self.step or self.sent:
            return
        self.sent = True
        workers = [child.pid for child in multiprocessing.active_children()]
        assert workers, "the run has no loader workers"
        subprocess.run([sys.executable, "-c", "import os, signal, sys\nfor pid in sys.argv[1:]: "
                        "os.kill(int(pid), signal.SIGTERM)", str(os.getpid()), *map(str, workers)], check=True)
        deadline = time.monotonic() + 600
        while not all(settled(pid, signal.SIGTERM) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.01)


def test_a_group_signal_inside_a_step_finishes_the_step_and_resume_from_continues_it(shapes_root, tmp_path):
    overrides = ("trainer.max_steps=6", "trainer.limit_val_batches=0", "data.num_workers=2")
    with pytest.raises(StoppedBySignal):
        run(tiny_config(shapes_root, tmp_path / "a", *overrides), extra_callbacks=[SignalGroupInsideStep(2)])
    run_dir = tmp_path / "a" / "demo_pretrain"
    last = run_dir / "checkpoints" / "last.ckpt"
    assert step_of(last) == 3 and stop_records(run_dir)[-1]["saved"].endswith("last.ckpt")
    run(tiny_config(shapes_root, tmp_path / "a", *overrides, f"resume_from={last}"))
    run(tiny_config(shapes_root, tmp_path / "b", *overrides))
    a, b = exported_state(run_dir), exported_state(tmp_path / "b" / "demo_pretrain")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6, msg=key)
    assert [s for s, _ in curve(run_dir)] == list(range(6))


class SignalBetweenMicroBatches(L.Callback):
    """Sends SIGTERM to this process after the first micro-batch of the optimizer step that follows `step`."""

    def __init__(self, step: int):
        self.step, self.sent = step, False

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step and not self.sent and trainer.fit_loop.epoch_loop._should_accumulate():
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_between_micro_batches_waits_for_the_optimizer_step(shapes_root, tmp_path):
    """With gradient accumulation an optimizer step spans micro-batches: a stop after the first of them must not
    save half a step (its resume would update on the remaining micro-batches alone)."""
    overrides = ("trainer.max_steps=5", "trainer.limit_val_batches=0", "trainer.accumulate_grad_batches=2")
    with pytest.raises(StoppedBySignal):
        run(tiny_config(shapes_root, tmp_path / "a", *overrides), extra_callbacks=[SignalBetweenMicroBatches(2)])
    run_dir = tmp_path / "a" / "demo_pretrain"
    last = run_dir / "checkpoints" / "last.ckpt"
    assert step_of(last) == 3 and stop_records(run_dir)[-1]["step"] == 3
    run(tiny_config(shapes_root, tmp_path / "a", *overrides, f"resume_from={last}"))
    run(tiny_config(shapes_root, tmp_path / "b", *overrides))
    a, b = exported_state(run_dir), exported_state(tmp_path / "b" / "demo_pretrain")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-6, msg=key)


def paused_fit(shapes_root: Path, tmp_path: Path, pauses: str, max_steps: int, *extra: str) -> subprocess.Popen:
    """fit's command under tests/paused_fit.py, which pauses at `pauses` (files in tmp_path/pauses)."""
    folder = tmp_path / "pauses"
    folder.mkdir(exist_ok=True)
    command = [sys.executable, str(REPO_ROOT / "tests" / "paused_fit.py"), str(folder), pauses, "--",
               *fit_command(shapes_root, max_steps, *extra)[3:]]
    return spawn(command, tmp_path, tmp_path / "out")


def at_pause(process: subprocess.Popen, tmp_path: Path, name: str) -> None:
    wait_for(lambda: (tmp_path / "pauses" / f"paused-{name}").exists(), process, f"the pause {name}")


def release(tmp_path: Path, name: str) -> None:
    (tmp_path / "pauses" / f"go-{name}").touch()


def interrupt_once(process: subprocess.Popen, tmp_path: Path) -> None:
    """A first Ctrl-C to the run's group, and the wait until the run has taken it."""
    os.killpg(process.pid, signal.SIGINT)
    wait_for(text_in(tmp_path / "out" / "stderr", "received SIGINT: stopping"), process, "the first SIGINT taken")


def assert_resumes_from(shapes_root: Path, tmp_path: Path, run_dir: Path, step: int) -> None:
    """`resume_from` the run's last.ckpt continues at `step` to the end (the curves may hold steps after `step`
    twice: logged before the stop and again after the resume)."""
    resumed = subprocess.run(fit_command(shapes_root, step + 2, f"resume_from={run_dir / 'checkpoints' / 'last.ckpt'}"),
                             cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "export" / "model.json").read_text())["global_step"] == step + 2
    assert "Resuming from" in resumed.stdout and sorted({s for s, _ in curve(run_dir)}) == list(range(step + 2))


def test_a_second_ctrl_c_inside_a_step_stops_at_once_keeping_the_last_checkpoint(shapes_root, tmp_path):
    run_dir = tmp_path / "runs" / "demo_pretrain"
    process = paused_fit(shapes_root, tmp_path, "step-3", ENDLESS, "checkpoint.every_n_steps=1")
    at_pause(process, tmp_path, "step-3")  # inside the 4th step; last.ckpt holds step 3
    interrupt_once(process, tmp_path)
    os.killpg(process.pid, signal.SIGINT)  # the second: the step in flight is abandoned
    code, err = finished(process, tmp_path / "out")
    assert code == 128 + signal.SIGINT, err[-3000:]
    assert "stopped at once by a second SIGINT" in err and "Traceback" not in err
    record = stop_records(run_dir)[-1]
    assert record["forced"] and record["reason"] == "signal SIGINT twice: stopped at once"
    assert record["saved"] is None and record["resume_from"].endswith("last.ckpt") and record["step"] == 3
    assert step_of(run_dir / "checkpoints" / "last.ckpt") == 3 and not list(run_dir.rglob("*.partial"))
    assert_resumes_from(shapes_root, tmp_path, run_dir, 3)


@pytest.mark.parametrize("pause, kept_step, saved", [("stop-save", 4, False), ("after-stop", 6, True)])
def test_a_second_ctrl_c_during_or_after_the_stop_never_destroys_a_checkpoint_and_is_recorded(
        shapes_root, tmp_path, pause, kept_step, saved):
    """The first Ctrl-C lands in step 6 (the epoch's save holds step 4); the second while the stop writes step 6
    (the write is abandoned, step 4 stays the resume point) or once it has written and recorded it (kept)."""
    run_dir = tmp_path / "runs" / "demo_pretrain"
    process = paused_fit(shapes_root, tmp_path, f"step-5,{pause}", ENDLESS)
    at_pause(process, tmp_path, "step-5")
    interrupt_once(process, tmp_path)
    release(tmp_path, "step-5")
    at_pause(process, tmp_path, pause)
    os.killpg(process.pid, signal.SIGINT)
    code, err = finished(process, tmp_path / "out")
    assert code == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err
    last = run_dir / "checkpoints" / "last.ckpt"
    assert step_of(last) == kept_step and not list(run_dir.rglob("*.partial"))
    record = stop_records(run_dir)[-1]
    assert record["forced"] and record["resume_from"].endswith("last.ckpt")
    assert (record["saved"] is not None) == saved
    assert_resumes_from(shapes_root, tmp_path, run_dir, kept_step)


# ----- a local sweep stopped by a signal, stale locks, finished means finished -------------------------------------
def sweep_file(shapes_root: Path, tmp_path: Path, seeds: int, max_steps: int) -> Path:
    """A local sweep of `seeds` tiny runs (fit_command's settings)."""
    overrides = fit_command(shapes_root, max_steps)[5:]
    spec = {"name": "stops", "runs_root": str(tmp_path / "runs"),
            "configs": [str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml")], "grid": {"seed": list(range(seeds))},
            "overrides": overrides}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def lock_holder(run_dir: Path) -> int:
    return int(re.match(r"fit pid (\d+)", lock_path(run_dir).read_text()).group(1))


def test_sigterm_to_a_local_sweep_stops_its_runs_which_save_and_release_their_locks(shapes_root, tmp_path):
    path = sweep_file(shapes_root, tmp_path, seeds=2, max_steps=ENDLESS)
    runs = [tmp_path / "runs" / "stops" / f"seed-{seed}" for seed in (0, 1)]
    sweep = spawn([sys.executable, "-m", "slurm.sweep", str(path), "--local", "--jobs", "2"], tmp_path,
                  tmp_path / "out")
    holders = []
    try:
        for run_dir in runs:
            wait_for(training_started(run_dir), sweep, f"logged training steps in {run_dir.name}")
            holders.append(lock_holder(run_dir))
        os.kill(sweep.pid, signal.SIGTERM)  # the sweep alone: it passes the signal on
        code, err = finished(sweep, tmp_path / "out")
    finally:  # a sweep that died alone would leave its runs training
        for pid in holders:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    steps = []
    for run_dir, pid in zip(runs, holders):
        assert not process_running(pid) and not lock_path(run_dir).exists()
        record = stop_records(run_dir)[-1]
        steps.append(step_of(run_dir / "checkpoints" / "last.ckpt"))
        assert record["reason"] == "signal SIGTERM" and record["step"] == steps[-1] >= 1
    sweep_record = json.loads((tmp_path / "runs" / "stops" / STOPS_RECORD).read_text().splitlines()[-1])
    assert sweep_record["reason"] == "signal SIGTERM" and sweep_record["stopped"] == ["seed-0", "seed-1"]
    # The next sweep finds no run in use: both resume from their checkpoints and finish.
    again = subprocess.run([sys.executable, "-m", "slurm.sweep", str(path), "--local", "--jobs", "2",
                            f"trainer.max_steps={max(steps) + 1}"], cwd=tmp_path, env=cli_env(), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for run_dir in runs:
        assert json.loads((run_dir / "export" / "model.json").read_text())["global_step"] == max(steps) + 1


HOLD_AND_DIE = """
import os, sys, time, pathlib
from lightning_modules.stops import RunLock
folder = pathlib.Path(sys.argv[1])
with RunLock(folder / "run"):
    if os.fork() == 0:  # a child that inherits the lock, as a loader worker does, and outlives its parent
        while not (folder / "release").exists():
            time.sleep(0.05)
        os._exit(0)
    (folder / "locked").touch()
    while True:
        time.sleep(1)  # until the test kills it
"""


def test_a_lock_whose_holder_died_is_taken_over_and_a_live_one_still_refuses(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_DIE, str(tmp_path)], env=cli_env(),
                              start_new_session=True)
    try:
        wait_for(lambda: (tmp_path / "locked").exists(), holder, "the lock taken")
        with pytest.raises(RunDirectoryBusy, match=f"fit pid {holder.pid}"):  # alive: in use
            with RunLock(tmp_path / "run"):
                pass
        holder.kill()
        holder.wait()
        with RunLock(tmp_path / "run"):  # its holder is gone; the child holding the old file guards nothing
            assert f"fit pid {os.getpid()}" in lock_path(tmp_path / "run").read_text()
    finally:
        (tmp_path / "release").touch()
        with contextlib.suppress(ProcessLookupError):
            holder.kill()


def exported_step(run_dir: Path) -> int:
    return json.loads((run_dir / "export" / "model.json").read_text())["global_step"]


def test_a_sweep_continues_a_finished_run_asked_for_more_steps_and_refuses_another_run(shapes_root, tmp_path, capsys):
    path = sweep_file(shapes_root, tmp_path, seeds=1, max_steps=2)
    run_dir = tmp_path / "runs" / "stops" / "seed-0"
    sweep_main([str(path), "--local"])
    assert exported_step(run_dir) == 2
    sweep_main([str(path), "--local", "trainer.max_steps=4"])  # more steps: not finished, it continues
    out = capsys.readouterr().out
    assert "its export (step 2) is of another length (trainer.max_steps: 2 (run folder) -> 4 (now))" in out
    assert exported_step(run_dir) == 4 and sorted({s for s, _ in curve(run_dir)}) == [0, 1, 2, 3]
    assert json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])["step"] == 2
    export_time = (run_dir / "export" / "model.json").stat().st_mtime_ns
    sweep_main([str(path), "--local", "trainer.max_steps=4"])  # the same config: finished, nothing runs
    assert "seed-0 skipped: finished" in capsys.readouterr().out
    assert (run_dir / "export" / "model.json").stat().st_mtime_ns == export_time
    for change, named in (("optim.lr=0.5", "optim.lr: 0.001 (run folder) -> 0.5 (now)"),
                          ("trainer.max_steps=3", "finished run is not shortened")):
        with pytest.raises(SystemExit, match="nothing was submitted or run") as refused:
            sweep_main([str(path), "--local", "trainer.max_steps=4", change] if "lr" in change else
                       [str(path), "--local", change])
        assert "seed-0" in str(refused.value) and named in str(refused.value)
    assert exported_step(run_dir) == 4 and (run_dir / "export" / "model.json").stat().st_mtime_ns == export_time


def test_a_finished_run_is_not_shortened_and_its_config_stays_what_ran(shapes_root, tmp_path):
    overrides = ("trainer.limit_val_batches=0",)
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=2", *overrides))
    run_dir = tmp_path / "demo_pretrain"
    assert run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=2", *overrides)) is None  # finished
    with pytest.raises(ResumeConfigError, match=r"trainer.max_steps: 2 \(stored\) -> 1 \(now\)"):
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=1", *overrides))
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["max_steps"] == 2
    assert exported_step(run_dir) == 2

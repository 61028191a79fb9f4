"""A run that stops early loses nothing and misreports nothing: signals (real ones, to real processes) leave a
resumable checkpoint and a non-zero status; a diverged step is never saved; a failure after a trained step
keeps the run directory; two processes never share one; a preempted run continues its curves on the step."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_modules.base import NonFiniteLossError
from lightning_modules.fit import run
from lightning_modules.stops import STOPS_RECORD, RunDirectoryBusy, RunLock, StoppedBySignal, lock_path
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

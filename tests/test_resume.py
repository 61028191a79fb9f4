"""Fault tolerance: a damaged last.ckpt falls back to the previous one; SIGKILL mid-run resumes where it was."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_modules.fit import run
from lightning_modules.resume import CorruptCheckpointError, choose_resume_checkpoint, damage
from test_fit import REPO_ROOT, TINY, shapes_root, tiny_config  # noqa: F401 (fixture)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_damaged_last_checkpoint_falls_back_to_the_previous_one(shapes_root, tmp_path, capfd):
    cfg = tiny_config(shapes_root, tmp_path, "trainer.max_steps=4", "checkpoint.every_n_steps=2",
                      "trainer.limit_val_batches=0")
    run(cfg)
    checkpoints = tmp_path / "demo_pretrain" / "checkpoints"
    assert damage(checkpoints / "last.ckpt") is None and damage(checkpoints / "previous.ckpt") is None
    truncate(checkpoints / "last.ckpt")
    assert "BadZipFile" in damage(checkpoints / "last.ckpt")
    assert choose_resume_checkpoint(tmp_path / "demo_pretrain") == checkpoints / "previous.ckpt"
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=6", "checkpoint.every_n_steps=2",
                    "trainer.limit_val_batches=0"))
    out = capfd.readouterr().out
    assert "Checkpoint damaged, falling back" in out and "Resuming from" in out and "previous.ckpt" in out
    model = json.loads((tmp_path / "demo_pretrain" / "export" / "model.json").read_text())
    assert model["global_step"] == 6


def test_every_checkpoint_damaged_is_an_error_naming_them(shapes_root, tmp_path):
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=4", "checkpoint.every_n_steps=2",
                    "trainer.limit_val_batches=0"))
    checkpoints = tmp_path / "demo_pretrain" / "checkpoints"
    for name in ("last.ckpt", "previous.ckpt"):
        truncate(checkpoints / name)
    with pytest.raises(CorruptCheckpointError) as error:
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=6", "trainer.limit_val_batches=0"))
    assert "last.ckpt" in str(error.value) and "previous.ckpt" in str(error.value)


def fit_command(shapes_root: Path, max_steps: int) -> list:
    return [sys.executable, "-m", "lightning_modules.fit", "--config",
            str(REPO_ROOT / "configs" / "demo" / "pretrain.yaml"), f"model.name={TINY}",
            f"model.config_dir={REPO_ROOT / 'configs' / 'models'}", f"data.root={shapes_root}", "data.masks=false",
            "data.batch_size=8", "data.num_workers=0", f"trainer.max_steps={max_steps}", "checkpoint.every_n_steps=1",
            "trainer.enable_progress_bar=false", "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1"]


def test_sigkill_mid_run_resumes_from_last_checkpoint_on_the_same_curves(shapes_root, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    command = fit_command(shapes_root, max_steps=40)
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    previous = tmp_path / "runs" / "demo_pretrain" / "checkpoints" / "previous.ckpt"
    deadline = time.time() + 240
    while not previous.is_file() and process.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)  # no handler runs: what survives is what was on disk
    process.wait()
    assert previous.is_file(), "the run died before writing two checkpoints"
    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout
    run_dir = tmp_path / "runs" / "demo_pretrain"
    assert json.loads((run_dir / "export" / "model.json").read_text())["global_step"] == 40
    assert [p.name for p in (run_dir / "tb").iterdir()] == ["version_0"]
    events = EventAccumulator(str(run_dir / "tb" / "version_0"))
    events.Reload()
    steps = sorted({event.step for event in events.Scalars("train/loss")})
    assert steps[-1] == 39 and len(list((run_dir / "tb" / "version_0").glob("events.out.tfevents.*"))) == 2

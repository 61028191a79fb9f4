"""Fault tolerance and run integrity: the highest intact checkpoint (last, previous, best, hpc) is resumed;
`resume_from` names one; SIGKILL mid-run resumes where it was; a changed config is refused before anything is
written; a failed start leaves no run directory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from datamodules.inputs import InputError
from lightning_modules.fit import run
from lightning_modules.resume import CorruptCheckpointError, ResumeConfigError, choose_resume_checkpoint, damage
from fitting import REPO_ROOT, TINY, tiny_config


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


def cli_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}


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


def fake_checkpoint(path: Path, step: int) -> Path:
    """A real (zip) torch checkpoint holding only its step: what the chooser reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step}, path)
    return path


def test_the_highest_intact_step_wins_whatever_the_file_kind_or_age(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    best = fake_checkpoint(checkpoints / "best-5.ckpt", 5)
    last = fake_checkpoint(checkpoints / "last.ckpt", 5)
    fake_checkpoint(tmp_path / "hpc_ckpt_1.ckpt", 3)
    fake_checkpoint(checkpoints / "previous.ckpt", 4)  # written last: the newest file, an older step
    assert choose_resume_checkpoint(tmp_path) in (best, last)
    truncate(last)
    assert choose_resume_checkpoint(tmp_path) == best
    truncate(best)
    assert choose_resume_checkpoint(tmp_path) == checkpoints / "previous.ckpt"


def test_an_intact_best_checkpoint_is_used_when_last_and_previous_are_damaged(shapes_root, tmp_path, capfd):
    overrides = ("checkpoint.every_n_steps=2",)  # validation at the epoch end (step 4) writes best-4.ckpt
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=4", *overrides))
    checkpoints = tmp_path / "demo_pretrain" / "checkpoints"
    assert (checkpoints / "best-4.ckpt").is_file()
    for name in ("last.ckpt", "previous.ckpt"):
        truncate(checkpoints / name)
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=6", *overrides))
    out = capfd.readouterr().out
    assert "Checkpoint damaged, falling back" in out and f"Resuming from {checkpoints / 'best-4.ckpt'}" in out
    assert json.loads((tmp_path / "demo_pretrain" / "export" / "model.json").read_text())["global_step"] == 6


def test_resume_from_names_the_checkpoint_and_refuses_a_missing_or_damaged_one(shapes_root, tmp_path, capfd):
    base = ("checkpoint.every_n_steps=1", "trainer.limit_val_batches=0")
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=3", *base))
    previous = tmp_path / "demo_pretrain" / "checkpoints" / "previous.ckpt"
    kept = tmp_path / "step2.ckpt"
    kept.write_bytes(previous.read_bytes())
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=4", f"resume_from={kept}", *base))
    assert f"Resuming from {kept}" in capfd.readouterr().out
    resumes = [json.loads(line) for line in (tmp_path / "demo_pretrain" / "resumes.jsonl").read_text().splitlines()]
    assert resumes[-1]["step"] == 2 and resumes[-1]["checkpoint"] == str(kept)
    with pytest.raises(InputError, match="resume_from=.*nope.ckpt: no such checkpoint file"):  # before building
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=5", f"resume_from={tmp_path / 'nope.ckpt'}", *base))
    truncate(kept)
    with pytest.raises(CorruptCheckpointError, match="resume_from"):
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=5", f"resume_from={kept}", *base))


def snapshot(run_dir: Path) -> dict:
    """Every file of a run directory with its content hash and modification time."""
    return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.read_bytes()) for p in run_dir.rglob("*")
            if p.is_file()}


@pytest.mark.parametrize("changed, keys", [
    (("optim.lr=0.05", "data.batch_size=16"), ["optim.lr", "data.batch_size"]),
    (("method.name=smartclip",), ["method.name"]),
])
def test_a_changed_config_is_refused_before_anything_is_written(shapes_root, tmp_path, changed, keys):
    base = ("trainer.limit_val_batches=0",)
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=1", *base))
    run_dir = tmp_path / "demo_pretrain"
    before = snapshot(run_dir)
    with pytest.raises(ResumeConfigError) as error:
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=3", *base, *changed))
    message = str(error.value)
    assert all(key in message for key in keys) and "trainer.max_steps" not in message.split("Keys that")[0]
    assert "resume=false" in message and "experiment=" in message
    assert snapshot(run_dir) == before  # config.yaml, checkpoints and event files untouched


def test_safe_changes_resume_and_are_recorded(shapes_root, tmp_path):
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=1", "trainer.limit_val_batches=0"))
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=2", "trainer.limit_val_batches=0",
                    "trainer.log_every_n_steps=5", "data.num_workers=1"))
    run_dir = tmp_path / "demo_pretrain"
    record = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 1
    assert record["changed"] == {"trainer.max_steps": {"stored": 1, "now": 2},
                                 "trainer.log_every_n_steps": {"stored": 1, "now": 5},
                                 "data.num_workers": {"stored": 0, "now": 1}}
    assert "max_steps: 2" in (run_dir / "config.yaml").read_text()


def test_cli_refusal_names_the_keys_and_the_ways_out(shapes_root, tmp_path):
    first = subprocess.run(fit_command(shapes_root, 1), cwd=tmp_path, env=cli_env(), capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    config = (tmp_path / "runs" / "demo_pretrain" / "config.yaml").read_text()
    refused = subprocess.run(fit_command(shapes_root, 3) + ["optim.lr=0.05"], cwd=tmp_path, env=cli_env(),
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0
    assert "optim.lr" in refused.stderr and "resume=false" in refused.stderr and "Traceback" not in refused.stderr
    assert (tmp_path / "runs" / "demo_pretrain" / "config.yaml").read_text() == config


def test_a_missing_data_root_is_refused_before_anything_is_built_or_written(shapes_root, tmp_path):
    from datamodules.inputs import InputError

    with pytest.raises(InputError, match="data.root"):
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=1", f"data.root={tmp_path / 'no_such_data'}"))
    assert not (tmp_path / "demo_pretrain").exists()


def test_a_start_that_fails_while_building_leaves_no_run_directory(shapes_root, tmp_path):
    """A failure after the run directory was made (here: an unknown model name, found while building) removes
    the directory this start created."""
    with pytest.raises(Exception):
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=1", "model.name=ViT-No-Such-Model"))
    assert not (tmp_path / "demo_pretrain").exists()


def test_rerunning_a_finished_run_writes_nothing(shapes_root, tmp_path, capfd, caplog):
    """The same command again after the run finished: nothing to do, so no empty event file, no re-export,
    no "initialized randomly" notice (a resumed model's weights come from its checkpoint)."""
    overrides = ("trainer.max_steps=2", "trainer.limit_val_batches=0")
    run(tiny_config(shapes_root, tmp_path, *overrides))
    run_dir = tmp_path / "demo_pretrain"
    before = snapshot(run_dir / "tb") | snapshot(run_dir / "export")
    capfd.readouterr()
    assert run(tiny_config(shapes_root, tmp_path, *overrides)) is None
    assert "finished at step 2" in capfd.readouterr().out
    assert snapshot(run_dir / "tb") | snapshot(run_dir / "export") == before
    caplog.clear()
    trainer = run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=3", "trainer.limit_val_batches=0"))
    assert trainer.global_step == 3  # a longer run continues
    assert not [r for r in caplog.records if "initialized randomly" in r.getMessage()]


def test_a_run_of_the_old_config_layout_is_refused_with_the_edits_that_convert_it(shapes_root, tmp_path):
    run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=1", "trainer.limit_val_batches=0"))
    config = tmp_path / "demo_pretrain" / "config.yaml"
    old = yaml.safe_load(config.read_text())
    old["method"] = {"name": "clip_ft", "hard_negatives": True, "mlm_weight": 20.0, "hard_mask": True}
    old["data"].update(num_hard_negatives=3, hard_negative_images=False)
    config.write_text(yaml.safe_dump(old))
    before = snapshot(tmp_path / "demo_pretrain")
    with pytest.raises(ResumeConfigError) as error:
        run(tiny_config(shapes_root, tmp_path, "trainer.max_steps=2", "trainer.limit_val_batches=0"))
    message = str(error.value)
    assert "method.hard_negatives: {captions: 3, images: false}" in message
    assert "delete the keys of other methods under method: hard_mask, mlm_weight" in message
    assert "data.batch_size is now the global batch" in message and "resume=false" in message
    assert snapshot(tmp_path / "demo_pretrain") == before

"""Sweeps on a real single-node SLURM cluster (munged + slurmctld + slurmd started here), with a requeue.

Needs Debian's slurm-wlm and munge. Locally the test is skipped when they are missing (`-m "not slurm"`
deselects it); under CI (CI=true, as .ci/run sets) it installs them with apt-get and runs.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from datamodules.shapes import generate
from slurm.localcluster import LocalSlurm
from slurm.sweep import expand, load_sweep, main as sweep_main

REPO = Path(__file__).resolve().parents[1]
STEPS = 150


def ensure_slurm_installed() -> None:
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    if not os.environ.get("CI") or os.geteuid() != 0:
        pytest.skip("slurm-wlm and munge are not installed (CI installs them)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"], check=True, env=env,
                   capture_output=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ensure_slurm_installed()
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def write_sweep(tmp_path: Path, shapes: Path) -> Path:
    spec = {"name": "requeue_test", "runs_root": str(tmp_path / "runs"),
            "configs": [str(REPO / "configs" / "demo" / "pretrain.yaml")],
            "grid": {"seed": [0, 1]},
            "overrides": ["model.name=ViT-Tiny-16-64", f"model.config_dir={REPO / 'configs' / 'models'}",
                          f"data.root={shapes}", "data.masks=false", "data.batch_size=8", "data.num_workers=0",
                          f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=5", "trainer.limit_val_batches=0",
                          "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=5"],
            "slurm": {"cpus_per_task": 1, "time": "00:20:00"}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_grid_expansion_names_runs_from_their_choices(tmp_path):
    runs = expand({"method": {"ft": ["method.name=clip_ft"], "cae": ["method.name=clip_cae", "x.yaml"]},
                   "seed": [0, 1]}, ["base.yaml"], ["trainer.max_steps=5"])
    assert [run.name for run in runs] == ["method-ft_seed-0", "method-ft_seed-1", "method-cae_seed-0",
                                          "method-cae_seed-1"]
    assert runs[2].configs == ["base.yaml", "x.yaml"]
    assert runs[2].overrides == ["trainer.max_steps=5", "method.name=clip_cae", "seed=0"]
    assert runs[0].fit_args("r")[-2:] == ["experiment=method-ft_seed-0", "runs_root=r"]


def test_dry_run_prints_the_array_script_and_every_run(tmp_path, capsys):
    path = write_sweep(tmp_path, tmp_path / "shapes")
    sweep_main([str(path), "--dry-run"])
    out = capsys.readouterr().out
    assert "#SBATCH --array=0-1" in out and "#SBATCH --signal=SIGUSR1@90" in out and "#SBATCH --requeue" in out
    assert "# task 0:" in out and "# task 1:" in out and "seed=1" in out
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    assert len(load_sweep(path).runs) == 2


def test_unknown_sweep_keys_are_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ngrids: {seed: [0]}\n")
    with pytest.raises(SystemExit, match="unknown keys.*grids"):
        sweep_main([str(path), "--dry-run"])


def squeue_ids(cluster: LocalSlurm, job: str) -> list:
    out = cluster.command("squeue", "-h", "-r", "-j", job, "-o", "%i %T").stdout.split("\n")
    return [line.split() for line in out if line.strip()]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slurm
def test_sweep_on_real_slurm_with_a_requeued_task_resuming(cluster, tmp_path):
    shapes = tmp_path / "shapes"
    generate(shapes, n_train=64, n_val=8, image_size=64, seed=0)
    path = write_sweep(tmp_path, shapes)
    submitted = subprocess.run([sys.executable, "-m", "slurm.sweep", str(path)], cwd=REPO, env=cluster.env,
                               capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.split("array job ")[1].split(":")[0]
    sweep_dir = tmp_path / "runs" / "requeue_test"
    first_run = sweep_dir / "seed-0"
    wait_for(lambda: (first_run / "checkpoints" / "last.ckpt").is_file(), 300, "the first checkpoint of task 0")
    requeued = cluster.command("scontrol", "requeue", f"{job}_0")
    assert requeued.returncode == 0, requeued.stderr
    wait_for(lambda: any(state == "PENDING" for i, state in squeue_ids(cluster, job) if i == f"{job}_0"), 60,
             "task 0 back in the queue")
    cluster.command("scontrol", "update", f"JobId={job}_0", "StartTime=now")  # skip SLURM's requeue delay
    wait_for(lambda: not squeue_ids(cluster, job), 480, "both tasks to finish")
    for name in ("seed-0", "seed-1"):
        model = json.loads((sweep_dir / name / "export" / "model.json").read_text())
        assert model["global_step"] == STEPS, name
        assert [p.name for p in (sweep_dir / name / "tb").iterdir()] == ["version_0"], name
    log = next(sweep_dir.glob("slurm-*_0.out")).read_text()
    assert "Resuming from" in log, log[-3000:]
    assert len(list((first_run / "tb" / "version_0").glob("events.out.tfevents.*"))) == 2  # the same curves grew

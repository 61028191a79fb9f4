"""`pip install .` ships a working package: a wheel built from the repository, installed (not editable) into a fresh
venv, trains and answers its commands from a working directory outside the repository.

The fresh venv reaches the project venv's third-party packages through a `.pth` line naming its site-packages. A
folder that a `.pth` line adds is not scanned for `.pth` files of its own, so the editable install's finder there
stays inactive: every project module must come from the wheel, which the test checks before running anything.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parents[1]
# What a wheel is not built from, at the top of the checkout: run outputs, data, build leftovers, and the folders
# of documents, results and tests. The build runs on a clean copy, so that stale files of an earlier in-tree build
# cannot enter the wheel and the checkout gets no build folder.
NOT_BUILT_FROM = (".git", ".venv", ".gpu", ".hypothesis", ".pytest_cache", ".ruff_cache", "build", "dist",
                  "*.egg-info", "runs", "data", "cache", "checkpoints", "eval", "results", "docs", "tests")
# The world and the config of one tiny fit: tests/fitting.py's settings, written out as a user's config file.
WORLD = ["--n-train", "16", "--n-val", "8", "--image-size", "64", "--seed", "0"]
STEPS = 3


def require_pip_and_venv() -> None:
    """pip and venv are part of every supported Python install; without them the test cannot build or install."""
    missing = [name for name in ("pip", "venv") if importlib.util.find_spec(name) is None]
    if not missing:
        return
    message = f"{' and '.join(missing)} not importable by {sys.executable}: cannot build and install the wheel"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def run(command: List[str], cwd: Path) -> subprocess.CompletedProcess:
    """`command` in `cwd`, offline and with no path of the checkout injected; fails the test with its output."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-4000:]}"
    return done


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a clean copy of the repository, with the running venv's pip and setuptools."""
    source = tmp_path / "source"
    top_level = shutil.ignore_patterns(*NOT_BUILT_FROM)
    shutil.copytree(REPO, source, symlinks=True, ignore=lambda folder, names: (
        (top_level(folder, names) if Path(folder) == REPO else set()) | {n for n in names if n == "__pycache__"}))
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(wheels), str(source)], cwd=tmp_path)
    (wheel,) = wheels.glob("compositional_clip_lab-*.whl")
    return wheel


def site_packages(python: Path, cwd: Path) -> Path:
    done = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd)
    return Path(done.stdout.strip())


def fresh_venv(tmp_path: Path) -> Path:
    """A venv without this project whose third-party packages are the running interpreter's; its python."""
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site_packages(python, tmp_path) / "project_venv_packages.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a fresh venv holding the wheel, installed with --no-deps."""
    require_pip_and_venv()
    tmp_path = tmp_path_factory.mktemp("package")
    wheel = build_wheel(tmp_path)
    python = fresh_venv(tmp_path)
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
         str(wheel)], cwd=tmp_path)
    return python


@pytest.fixture
def elsewhere(tmp_path) -> Path:
    """A working directory outside the repository (no configs/, no packages beside it)."""
    assert REPO not in tmp_path.resolve().parents
    return tmp_path


def test_the_project_comes_from_the_wheel_not_the_checkout(installed, elsewhere):
    code = ("import json, core.config, lightning_modules, modeling, study, testkit;"
            "import evaluation.benchmarks.elevater as e;"
            "print(json.dumps({m.__name__: m.__file__ for m in (lightning_modules, modeling, study, testkit)} | "
            "{'base': str(core.config.BASE_CONFIG), 'tasks': str(e.TASKS_FILE)}))")
    where = json.loads(run([str(installed), "-c", code], elsewhere).stdout)
    site = site_packages(installed, elsewhere)
    for name, path in where.items():
        assert Path(path).is_relative_to(site), f"{name} resolves to {path}, not the installed wheel in {site}"
        assert Path(path).is_file(), name
    assert Path(where["base"]) == site / "core" / "configs" / "base.yaml"


def test_the_commands_answer(installed, elsewhere):
    fit_help = run([str(installed), "-m", "lightning_modules.fit", "--help"], elsewhere).stdout
    assert "--config" in fit_help
    listing = run([str(installed), "-m", "evaluation", "--list"], elsewhere).stdout
    assert "sugarcrepe:" in listing and "elevater" in listing


def test_a_tiny_fit_from_a_config_file(installed, elsewhere):
    run([str(installed), "-m", "datamodules.shapes", "--out", "world", *WORLD], elsewhere)
    # The model comes from the model configs the package carries (base.yaml's model.config_dir).
    (elsewhere / "tiny.yaml").write_text(f"""\
experiment: tiny
runs_root: runs
model:
  name: ViT-Tiny-16-64
  pretrained: null
method:
  name: clip_ft
data:
  root: world
  train_annotations: annotations/captions_train.json
  train_images: images/train
  val_annotations: annotations/captions_val.json
  val_images: images/val
  batch_size: 8
  num_workers: 0
optim:
  lr: 1.0e-3
  warmup_steps: 2
trainer:
  max_steps: {STEPS}
  max_epochs: -1
  precision: 32-true
  accelerator: cpu
  devices: 1
  log_every_n_steps: 1
  num_sanity_val_steps: 0
  enable_progress_bar: false
monitor:
  every_n_steps: 0
""")
    run([str(installed), "-m", "lightning_modules.fit", "--config", "tiny.yaml"], elsewhere)
    run_dir = elsewhere / "runs" / "tiny"
    assert json.loads((run_dir / "export" / "model.json").read_text())["model"] == "ViT-Tiny-16-64"
    assert (run_dir / "export" / "open_clip.pt").stat().st_size > 0
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()

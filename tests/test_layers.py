"""The package layers hold (setup.cfg `[importlinter]`), and the check fails when one import crosses them.

core, parsers <- modeling <- datamodules <- evaluation <- lightning_modules, testkit <- slurm, perf, gpucheck <- study:
a package imports only the packages below it, and inside the study and inside evaluation.benchmarks each module imports
only those below it (so neither has an import circle). Every contract in setup.cfg is run. import-linter reads every
import statement, so a lazy import inside a function or one under `if TYPE_CHECKING:` counts as much as a top-level
one.
"""
from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "parsers", "modeling", "datamodules", "evaluation", "lightning_modules", "testkit", "slurm", "perf",
            "gpucheck", "study")
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='setup.cfg', no_cache=True))")


def contracts() -> Dict[str, configparser.SectionProxy]:
    """setup.cfg's import-linter contracts by section name: every one of them is checked below."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(REPO_ROOT / "setup.cfg")
    return {name: config[name] for name in config.sections() if name.startswith("importlinter:contract:")}


def lint(root: Path) -> subprocess.CompletedProcess:
    """import-linter on the packages under `root` with `root/setup.cfg`, in a fresh interpreter (so that the
    packages are found under `root`, not where this process imported them from)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def copy_of_repo(tmp_path: Path) -> Path:
    """The packages and setup.cfg of this checkout, copied to `tmp_path/repo`."""
    root = tmp_path / "repo"
    for package in PACKAGES:
        shutil.copytree(REPO_ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "setup.cfg", root / "setup.cfg")
    return root


def test_layers_hold():
    result = lint(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(contracts())} kept, 0 broken" in result.stdout


def test_every_benchmarks_module_is_in_a_layer():
    """A module the contract does not name is free to import any other: a new one must be placed in a layer."""
    contract = contracts()["importlinter:contract:benchmarks"]
    named = {module.strip() for line in contract["layers"].split("\n") for module in line.split("|") if module.strip()}
    modules = {path.stem for path in (REPO_ROOT / "evaluation" / "benchmarks").glob("*.py")} - {"__init__"}
    assert named == modules


@pytest.mark.parametrize("module, added, arrow", [
    # a lazy import inside a function: data preparation reaching up into evaluation
    ("datamodules/cache.py", "\n\ndef _upward():\n    from evaluation.harness import run_benchmark\n",
     "datamodules.cache -> evaluation.harness"),
    # the typing back-door the benchmarks once used to name the scorer of the training package
    ("evaluation/benchmarks/base.py",
     "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_modules.base import Terms\n",
     "evaluation.benchmarks.base -> lightning_modules.base"),
    # the bottom layer importing a package above it
    ("core/files.py", "\nimport parsers.scene_graph\n", "core.files -> parsers.scene_graph"),
    # the plain-torch library reaching into training
    ("modeling/losses.py", "\n\ndef _upward():\n    from lightning_modules.base import Terms\n",
     "modeling.losses -> lightning_modules.base"),
    # training reaching into the study above it
    ("lightning_modules/fit.py", "\n\ndef _upward():\n    from study.stats import seed_interval\n",
     "lightning_modules.fit -> study.stats"),
    # a timing benchmark importing the GPU node check that runs it (the check runs `python -m perf.gpu` instead)
    ("perf/gpu.py", "\n\ndef _sideways():\n    from gpucheck.stages import FIT_RUNS\n", "perf.gpu -> gpucheck.stages"),
    # the study's results format read by the sweep through imports instead of its file contract (core/run_records.py)
    ("slurm/sweep.py", "\n\ndef _upward():\n    from study.records import carried_backbones\n",
     "slurm.sweep -> study.records"),
    # the import circle the study once had: the analysis reaching back into the report
    ("study/analysis.py", "\n\ndef _circle():\n    from study.report import write_report\n",
     "study.analysis -> study.report"),
    # the import circle the benchmarks once had: the image reading reaching back into the base for ImageRef
    ("evaluation/benchmarks/images.py", "\n\ndef _circle():\n    from evaluation.benchmarks.base import Item\n",
     "evaluation.benchmarks.images -> evaluation.benchmarks.base"),
    # a family reaching into a family beside it
    ("evaluation/benchmarks/sugarcrepe.py", "\nfrom evaluation.benchmarks.valse import Valse\n",
     "evaluation.benchmarks.sugarcrepe -> evaluation.benchmarks.valse"),
])
def test_a_forbidden_import_breaks_the_layers(tmp_path, module, added, arrow):
    root = copy_of_repo(tmp_path)
    with open(root / module, "a") as handle:
        handle.write(added)
    result = lint(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{len(contracts()) - 1} kept, 1 broken" in result.stdout
    assert arrow in result.stdout

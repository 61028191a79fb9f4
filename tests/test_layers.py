"""The package layers hold (setup.cfg `[importlinter]`), and the check fails when one import crosses them.

core, parsers <- modeling <- datamodules <- evaluation <- lightning_modules, testkit <- slurm, perf <- study: a
package imports only the packages below it, and inside the study each module imports only those below it (so the
study has no import circle). import-linter reads every import statement, so a lazy import inside a function or one under
`if TYPE_CHECKING:` counts as much as a top-level one.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "parsers", "modeling", "datamodules", "evaluation", "lightning_modules", "testkit", "slurm", "perf",
            "study")
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='setup.cfg', no_cache=True))")


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
    assert "2 kept, 0 broken" in result.stdout


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
    # the import circle the study once had: the analysis reaching back into the report
    ("study/analysis.py", "\n\ndef _circle():\n    from study.report import write_report\n",
     "study.analysis -> study.report"),
])
def test_a_forbidden_import_breaks_the_layers(tmp_path, module, added, arrow):
    root = copy_of_repo(tmp_path)
    with open(root / module, "a") as handle:
        handle.write(added)
    result = lint(root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 kept, 1 broken" in result.stdout
    assert arrow in result.stdout

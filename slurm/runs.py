"""A sweep's files as `slurm.sweep` writes them and the method study (`study`) reads them.

`SWEEP_FILE` (the expanded grid, in the sweep directory), `RUN_LOG` (each run's output, in its run directory)
and `export_complete` (whether fit finished a run): the launcher's file layout, which the study above it reads.
"""
from __future__ import annotations

from pathlib import Path

import yaml

SWEEP_FILE = "sweep.json"
RUN_LOG = "sweep.log"


def export_complete(run_dir: Path) -> bool:
    """Whether fit finished the run: its export's `model.json` (written last by ExportCallback) exists and, for
    an aligner method (TFLocal / TFGlobal, whose module writes `aligner.json` after the callback), that too."""
    export = Path(run_dir) / "export"
    if not (export / "model.json").is_file():
        return False
    return (export / "aligner.json").is_file() or not _exports_aligner(Path(run_dir) / "config.yaml")


def _exports_aligner(config_file: Path) -> bool:
    """The run's method (from the config.yaml fit wrote) writes an aligner export; False without a config."""
    if not config_file.is_file():
        return False
    from lightning_modules import method_class  # heavy (torch): only for a run that has an export
    from lightning_modules.methods.tflocal import AlignerModule

    method = (yaml.safe_load(config_file.read_text()) or {}).get("method", {}).get("name")
    return method is not None and issubclass(method_class(method), AlignerModule)

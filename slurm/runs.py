"""A sweep's files as `slurm.sweep` writes them and the method study (`study`) reads them.

`SWEEP_FILE` (the expanded grid, in the sweep directory), `RUN_LOG` (each run's output, in its run directory)
and `export_complete` (whether fit wrote a run's whole export): the launcher's file layout, which the study above
it reads. `run_state` says whether a run folder holds the run a config asks for, finished (its export records
that config's digest), or what stands in the way.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple

import yaml

from core.run_records import CONFIG_DIGEST, EXPORT_METADATA

SWEEP_FILE = "sweep.json"
RUN_LOG = "sweep.log"
RUN_CONFIG = "config.yaml"  # the resolved config fit writes in the run folder at every start that trains

# What `run_state` finds: nothing more to train, fit starts or continues the run, or the folder holds another run.
FINISHED, TO_RUN, REFUSED = "finished", "to run", "refused"


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


def run_state(run_dir: Path, config: Mapping[str, Any]) -> Tuple[str, str]:
    """(state, why) of the run folder `run_dir` for `config`, the run's resolved config now.

    - FINISHED: its export is complete and records the digest of `config` (lightning_modules/resume.py
      `config_digest`: the result-affecting keys). An export written before exports recorded it is finished when
      its step is `trainer.max_steps` and the folder's config.yaml, if any, has that digest.
    - REFUSED, naming what differs: config.yaml differs from `config` outside the keys a resume may change (fit
      would refuse it too); or the export is of a run at least as long as `config` asks for under another digest (a
      finished run is not shortened); or it is of another config with no checkpoint to continue from.
    - TO_RUN: anything else. fit starts the run, or resumes it from its newest checkpoint: then `why` says so (a
      longer `trainer.max_steps` continues a finished run).
    """
    from lightning_modules.resume import LENGTH_KEYS, candidates, config_changes, config_digest, is_resume_safe

    stored = read_run_config(run_dir)
    changes = config_changes(stored, config) if stored is not None else []
    unsafe = [change for change in changes if not is_resume_safe(change[0])]
    if unsafe:
        return REFUSED, f"its run folder holds another experiment ({described(unsafe)})"
    if not export_complete(run_dir):
        return TO_RUN, ""
    metadata = json.loads((Path(run_dir) / "export" / EXPORT_METADATA).read_text())
    step, max_steps, digest = metadata.get("global_step"), config["trainer"]["max_steps"], config_digest(config)
    recorded = metadata.get(CONFIG_DIGEST)
    if recorded is None and (stored is None or config_digest(stored) == digest) and max_steps in (step, -1):
        recorded = digest  # an export from before exports recorded their digest: its folder's config and step
        # (a run bounded by epochs alone, max_steps -1, has no step to compare)
    if recorded == digest:
        return FINISHED, ""
    lengths = described([change for change in changes if change[0] in LENGTH_KEYS]) or f"trainer.max_steps={max_steps}"
    if isinstance(step, int) and 0 < max_steps <= step:
        return REFUSED, (f"it finished at step {step} (its export) and this config asks for no more steps "
                         f"({lengths}): a finished run is not shortened; train that length under its own run name")
    if not candidates(run_dir):
        return REFUSED, (f"its export (step {step}) is of another config ({lengths}) and there is no checkpoint to "
                         "continue it from; move the run folder aside to train it again")
    return TO_RUN, f"its export (step {step}) is of another length ({lengths}): it resumes from its newest checkpoint"


def described(changes: List[Tuple[str, Any, Any]], limit: int = 8) -> str:
    """`key: stored -> now` for up to `limit` changes `(key, in the run folder, now)`."""
    lines = [f"{key}: {old!r} (run folder) -> {new!r} (now)" for key, old, new in changes[:limit]]
    return "; ".join(lines + ([f"and {len(changes) - limit} more keys"] if len(changes) > limit else []))


def read_run_config(run_dir: Path) -> Optional[dict]:
    """The config.yaml fit wrote in `run_dir`, or None."""
    path = Path(run_dir) / RUN_CONFIG
    return yaml.safe_load(path.read_text()) if path.is_file() else None

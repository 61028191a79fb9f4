"""`python -m slurm.sweep configs/sweeps/FILE.yaml [--dry-run] [--local]`: a grid of runs as one SLURM array job.

A sweep file names the config files every run starts from, a grid, fixed overrides and the SLURM resources:

    name: shapes_methods
    runs_root: runs/sweeps            # run directories: <runs_root>/<name>/<run name>/
    configs: [configs/demo/pretrain.yaml]
    grid:
      method:                         # named choices, each a list of overrides (or extra config files)
        clip_ft: [method.name=clip_ft]
        clip_cae: [method.name=clip_cae, data.masks=true]
      seed: [0, 1]                    # a config key with its values
    overrides: [trainer.max_steps=300]
    slurm: {nodes: 1, gpus_per_node: 0, cpus_per_task: 2, time: "02:00:00"}

Every combination becomes one run with a stable directory named from its grid choices
(`method-clip_ft_seed-0`), so a requeued or resubmitted task resumes its own run. The runs are written to
`<runs_root>/<name>/sweep.json`; array task i runs `python -m slurm.sweep --task sweep.json i` under srun.
`--dry-run` prints the sbatch script and the runs; `--local` runs them one after another without SLURM.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml

from datamodules.files import atomic_write_text

SWEEP_FILE = "sweep.json"
SLURM_DEFAULTS = {"partition": None, "nodes": 1, "gpus_per_node": 0, "cpus_per_task": 4, "time": "24:00:00",
                  "mem": None, "max_parallel": None, "extra": []}
SWEEP_KEYS = {"name", "runs_root", "configs", "grid", "overrides", "slurm"}


class SweepError(ValueError):
    """A sweep file that cannot be expanded; the message names the file and the problem."""


@dataclass
class Run:
    """One combination of the grid: its name, config files and overrides (fit's command line)."""

    name: str
    configs: List[str]
    overrides: List[str]
    choices: Dict[str, str] = field(default_factory=dict)

    def fit_args(self, runs_root: str) -> List[str]:
        args = [arg for config in self.configs for arg in ("--config", config)]
        return args + self.overrides + [f"experiment={self.name}", f"runs_root={runs_root}"]


@dataclass
class Sweep:
    name: str
    runs_root: str
    runs: List[Run]
    slurm: Dict[str, object]

    @property
    def directory(self) -> Path:
        return Path(self.runs_root) / self.name


def load_sweep(path: Path) -> Sweep:
    spec = yaml.safe_load(Path(path).read_text()) or {}
    unknown = set(spec) - SWEEP_KEYS
    if unknown:
        raise SweepError(f"{path}: unknown keys {sorted(unknown)}; valid: {sorted(SWEEP_KEYS)}")
    if not spec.get("name"):
        raise SweepError(f"{path}: a sweep needs a name")
    slurm = {**SLURM_DEFAULTS, **(spec.get("slurm") or {})}
    unknown = set(slurm) - set(SLURM_DEFAULTS)
    if unknown:
        raise SweepError(f"{path}: unknown slurm keys {sorted(unknown)}; valid: {sorted(SLURM_DEFAULTS)}")
    runs = expand(spec.get("grid") or {}, list(spec.get("configs") or []), list(spec.get("overrides") or []))
    return Sweep(spec["name"], str(spec.get("runs_root", "runs/sweeps")), runs, slurm)


def axis_choices(key: str, values) -> List[tuple]:
    """(label, overrides) per choice: named choices map to override lists, plain values to `key=value`."""
    if isinstance(values, dict):
        return [(f"{key}-{label}", [str(o) for o in (items if isinstance(items, list) else [items])])
                for label, items in values.items()]
    if isinstance(values, list) and values:
        return [(f"{key}-{value}", [f"{key}={json.dumps(value) if isinstance(value, list) else value}"])
                for value in values]
    raise SweepError(f"grid axis {key!r} needs a non-empty list of values or a mapping of named choices")


def expand(grid: Dict[str, object], configs: List[str], overrides: List[str]) -> List[Run]:
    """Every combination of the grid axes, in file order; extra `.yaml` items become config files."""
    axes = [axis_choices(key, values) for key, values in grid.items()]
    runs = []
    for combination in itertools.product(*axes) if axes else [()]:
        extra = [item for _, items in combination for item in items]
        run_configs = configs + [item for item in extra if item.endswith((".yaml", ".yml"))]
        run_overrides = overrides + [item for item in extra if not item.endswith((".yaml", ".yml"))]
        name = slug("_".join(label for label, _ in combination)) or "run"
        runs.append(Run(name, run_configs, run_overrides, {label.split("-")[0]: label for label, _ in combination}))
    names = [run.name for run in runs]
    if len(set(names)) != len(names):
        raise SweepError(f"two grid combinations get the same run name: {sorted(names)}")
    return runs


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", text).strip("-")


def sbatch_script(sweep: Sweep, sweep_file: Path) -> str:
    """The array-job script: one task per run, one srun task per GPU (or one on CPU nodes)."""
    s = sweep.slurm
    tasks_per_node = max(1, int(s["gpus_per_node"] or 0))
    array = f"0-{len(sweep.runs) - 1}" + (f"%{s['max_parallel']}" if s["max_parallel"] else "")
    lines = ["#!/bin/bash", f"#SBATCH --job-name={sweep.name}", f"#SBATCH --array={array}",
             f"#SBATCH --nodes={s['nodes']}", f"#SBATCH --ntasks-per-node={tasks_per_node}",
             f"#SBATCH --cpus-per-task={s['cpus_per_task']}", f"#SBATCH --time={s['time']}",
             "#SBATCH --signal=SIGUSR1@90", "#SBATCH --requeue", "#SBATCH --open-mode=append",
             f"#SBATCH --output={sweep.directory.resolve()}/slurm-%A_%a.out"]
    lines += [f"#SBATCH --gres=gpu:{s['gpus_per_node']}"] if s["gpus_per_node"] else []
    lines += [f"#SBATCH --partition={s['partition']}"] if s["partition"] else []
    lines += [f"#SBATCH --mem={s['mem']}"] if s["mem"] else []
    lines += [f"#SBATCH {option}" for option in s["extra"]]
    lines += ["set -euo pipefail", f"cd {Path.cwd()}", "export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}",
              f"srun {sys.executable} -m slurm.sweep --task {sweep_file.resolve()} \"$SLURM_ARRAY_TASK_ID\""]
    return "\n".join(lines) + "\n"


def write_sweep_file(sweep: Sweep) -> Path:
    sweep.directory.mkdir(parents=True, exist_ok=True)
    path = sweep.directory / SWEEP_FILE
    document = {"name": sweep.name, "runs_root": str(sweep.directory), "runs": [asdict(run) for run in sweep.runs]}
    atomic_write_text(path, json.dumps(document, indent=2))
    return path


def slurm_topology() -> List[str]:
    """trainer.num_nodes / trainer.devices from the allocation, so a config cannot disagree with SLURM."""
    if "SLURM_JOB_ID" not in os.environ:
        return []
    nodes = os.environ.get("SLURM_JOB_NUM_NODES", "1")
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    return [f"trainer.num_nodes={nodes}", f"trainer.devices={per_node}"]


def run_task(sweep_file: Path, index: int) -> None:
    """Array task `index`: fit that run in its own stable directory (resumes when it exists)."""
    from lightning_modules import fit

    document = json.loads(Path(sweep_file).read_text())
    if not 0 <= index < len(document["runs"]):
        raise SystemExit(f"{sweep_file} has {len(document['runs'])} runs; no task {index}")
    run = Run(**document["runs"][index])
    print(f"sweep {document['name']}: task {index} -> {run.name}", flush=True)
    fit.main(run.fit_args(document["runs_root"]) + slurm_topology())


def submit(script: str) -> str:
    result = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"sbatch failed: {result.stderr.strip()}")
    return result.stdout.strip().split(";")[0]


def run_local(sweep: Sweep, sweep_file: Path) -> None:
    for index, run in enumerate(sweep.runs):
        print(f"[{index + 1}/{len(sweep.runs)}] {run.name}", flush=True)
        subprocess.run([sys.executable, "-m", "slurm.sweep", "--task", str(sweep_file), str(index)], check=True)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("sweep", nargs="?", type=Path, help="the sweep YAML")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the sbatch script and the runs; submit nothing")
    mode.add_argument("--local", action="store_true", help="run every combination here, one after another")
    parser.add_argument("--task", nargs=2, metavar=("SWEEP_JSON", "INDEX"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Optional[str]:
    args = parse_args(argv)
    if args.task:
        run_task(Path(args.task[0]), int(args.task[1]))
        return None
    if args.sweep is None:
        raise SystemExit("give a sweep YAML (see --help)")
    try:
        sweep = load_sweep(args.sweep)
    except SweepError as err:
        raise SystemExit(f"sweep error: {err}") from None
    if args.dry_run:
        print(sbatch_script(sweep, sweep.directory / SWEEP_FILE))
        for index, run in enumerate(sweep.runs):
            print(f"# task {index}: {sweep.directory / run.name}  {' '.join(run.fit_args(str(sweep.directory)))}")
        return None
    sweep_file = write_sweep_file(sweep)
    if args.local:
        run_local(sweep, sweep_file)
        return None
    job_id = submit(sbatch_script(sweep, sweep_file))
    print(f"submitted array job {job_id}: {len(sweep.runs)} runs under {sweep.directory}; "
          f"tensorboard --logdir {sweep.directory}")
    return job_id


if __name__ == "__main__":
    main()

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
    exclude:                          # combinations left out of the product: every axis must match (one of
      - {method: clip_cae, seed: 1}   # the labels, when an axis lists several)
      - {method: [clip_ft, clip_cae], seed: 2}
    slurm: {nodes: 1, gpus_per_node: 0, cpus_per_task: 2, time: "02:00:00"}

Every combination becomes one run with a stable directory named from its grid choices
(`method-clip_ft_seed-0`), so a requeued or resubmitted task resumes its own run. The runs are written to
`<runs_root>/<name>/sweep.json`; array task i runs `python -m slurm.sweep --task sweep.json i` under srun.
`--dry-run` prints the sbatch script and the runs; `--local` runs them here without SLURM, one after another
or `--jobs N` at a time (each with cpus // N threads), with a progress line per finished run, each run's output in
`<run>/sweep.log`, a finished run skipped (so running the sweep again resumes it), and a failed run reported at
the end (exit status 1) without stopping the others. A run is finished when its export records the digest of its
config now (`slurm/runs.py`, `run_state`): a finished run whose config now asks for more steps resumes from its
last checkpoint, and a run folder that holds another experiment, or a run the config would shorten, stops the
command before anything is written, submitted or run (a dry run too), naming the runs and keys; no run folder is
deleted. SIGTERM or SIGINT to a `--local` sweep is passed to its running runs, each in its own process group, which
save and exit; no further run starts, and the sweep records the stop in `<sweep directory>/stops.jsonl` and exits
with 128 + the signal's number (`slurm/local.py`).

Any other key=value argument is an override of every run's config, after the sweep file's own: `trainer.accelerator=gpu`
moves the whole grid to a GPU (its runs' `data.num_workers: auto` then gives them loader processes, and a SLURM
array asks for one GPU per task when the sweep's `slurm.gpus_per_node` is 0). The run names and directories stay
those of the grid.

`only.AXIS=LABEL[,LABEL...]` (a key=value argument, one per axis) runs part of the grid: a run is kept when, for
every axis named, its label is one of those given (`only.method=clip_ft only.negatives=with,without`). sweep.json still
lists the whole grid, so task indices, run directories and the study report are those of the full sweep: the
full sweep run later skips what the part finished, and the report lists the runs not yet run as missing.

Before anything is written, submitted or run (a dry run too), every selected run is checked as fit checks it
before training: its config files and overrides merged (a typo names the closest key or file), the choices, the
method name against the registry and the options that method cannot train with (hard negatives it ignores, masks
it needs). A problem in any run stops the command, naming each run (task index and name). Missing data files are
a warning (a login node may not see what the compute nodes read; fit checks them again where each run starts),
and an error with `--local`, whose runs read them here.

An optional `study:` mapping (settings of the study report, `python -m study`, which validates
it) is copied into sweep.json unchanged.

An optional `bundle: DIR` names the results bundle the study report writes (its format is the study's,
`study/records.py`; the part read here is the file contract of `core/run_records.py`): a run whose
record is in `DIR/<name>/runs/` is skipped (`--local`, the SLURM array and each array task alike) when its
resolved config has the record's digest and its backbone (`model.pretrained`) the record's sha256, so a sweep
run later, from a clean clone with the backbones regenerated, continues where the bundle stopped. A record that
differs in either stops the command before anything runs, naming the runs and the differing keys: the bundle
belongs to another study. So does a bundle made on another world than the runs' `data.root` holds (the `world`
checksums of the bundle's sweep.json), naming both world checksums: a world of another seed generated into the same
folder has the same config digests.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from core.cli import add_key_values, key_value_sections, refuse_renamed
from core.config import GPU_ACCELERATORS, ConfigError
from core.files import atomic_write_text
from core.run_records import (BACKBONE, BACKBONE_NUMERICS, BACKBONE_PATH, BACKBONE_SHA256, CONFIG, CONFIG_DIGEST,
                               backbone_weights, bundle_world, config_differences, export_numerics, file_sha256,
                               read_run_record, world_problem)
from slurm.local import LocalRuns, SweepStopped, record_sweep_stop
from slurm.runs import FINISHED, REFUSED, RUN_LOG, SWEEP_FILE, TO_RUN, run_state

SLURM_DEFAULTS = {"partition": None, "nodes": 1, "gpus_per_node": 0, "cpus_per_task": 4, "time": "24:00:00",
                  "mem": None, "max_parallel": None, "extra": []}
SWEEP_KEYS = {"name", "runs_root", "configs", "grid", "overrides", "exclude", "slurm", "study", "bundle"}
# Runs named one by one in a problem (more are given as index ranges).
FEW_RUNS = 4
# Thread-count variables a child run gets under --jobs: torch's intra-op pool reads OMP_NUM_THREADS at start.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
ONLY_SETTINGS = {"only": "only.AXIS=LABEL[,LABEL...]"}
ONLY = "only."


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
    study: Dict[str, object] = field(default_factory=dict)
    bundle: Optional[str] = None  # the results bundle whose records this sweep skips (core/run_records.py)

    @property
    def directory(self) -> Path:
        return Path(self.runs_root) / self.name


def load_sweep(path: Path, overrides: Sequence[str] = ()) -> Sweep:
    """The sweep of file `path`, with `overrides` (fit's key=value) after every run's own."""
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
    study = spec.get("study") or {}
    if not isinstance(study, dict):
        raise SweepError(f"{path}: study must be a mapping of report settings, got {type(study).__name__}")
    grid = spec.get("grid") or {}
    runs = expand(grid, list(spec.get("configs") or []), list(spec.get("overrides") or []))
    runs = excluded(runs, checked_exclusions(path, grid, spec.get("exclude") or []))
    bundle = spec.get("bundle")
    if bundle is not None and not (isinstance(bundle, str) and bundle):
        raise SweepError(f"{path}: bundle must be a folder path, got {bundle!r}")
    for run in runs:
        run.overrides += list(overrides)
    return Sweep(spec["name"], str(spec.get("runs_root", "runs/sweeps")), runs, with_gpus(slurm, overrides), study,
                 bundle)


def with_gpus(slurm: Dict[str, object], overrides: Sequence[str]) -> Dict[str, object]:
    """The SLURM resources, with one GPU per node when the command line moves the runs to a GPU and the sweep file
    asks for none (the runs' `trainer.devices` follow the tasks per node, one per GPU)."""
    accelerator = dict(item.partition("=")[::2] for item in overrides).get("trainer.accelerator")
    if accelerator in GPU_ACCELERATORS and not slurm["gpus_per_node"]:
        return {**slurm, "gpus_per_node": 1}
    return slurm


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


def checked_exclusions(path: Path, grid: Dict[str, object], exclude) -> List[Dict[str, set]]:
    """The `exclude` entries as {axis: {"axis-label", ...}} (an entry's axis may list several labels, any of which
    matches); an axis or label the grid lacks is a typo, named here."""
    if not isinstance(exclude, list) or not all(isinstance(entry, dict) and entry for entry in exclude):
        raise SweepError(f"{path}: exclude must be a list of non-empty {{axis: label}} mappings")
    labels = {key: {label.split("-", 1)[1] for label, _ in axis_choices(key, values)} for key, values in grid.items()}
    checked = []
    for entry in exclude:
        given = {axis: [str(label) for label in (value if isinstance(value, list) else [value])]
                 for axis, value in entry.items()}
        for axis, names in given.items():
            for label in names:
                if axis not in labels or label not in labels[axis]:
                    raise SweepError(f"{path}: exclude names {axis}: {label}, which the grid does not have "
                                     f"(axes and labels: {({k: sorted(v) for k, v in labels.items()})})")
        checked.append({axis: {f"{axis}-{label}" for label in names} for axis, names in given.items()})
    return checked


def excluded(runs: List[Run], exclusions: List[Dict[str, set]]) -> List[Run]:
    """`runs` without those whose choice on every axis of some exclusion is one of its labels (e.g. a method with
    no condition)."""
    def matches(run: Run, exclusion: Dict[str, set]) -> bool:
        return all(run.choices.get(axis) in labels for axis, labels in exclusion.items())
    return [run for run in runs if not any(matches(run, exclusion) for exclusion in exclusions)]


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "-", text).strip("-")


def parse_only(sweep: Sweep, only_settings: Dict[str, str]) -> Dict[str, set]:
    """The `only.AXIS=LABEL,LABEL` settings ({axis: "label,label"}) as {axis: {"axis-label", ...}}; an axis or
    label the grid lacks is a typo, named here."""
    labels: Dict[str, set] = {}
    for run in sweep.runs:
        for axis, label in run.choices.items():
            labels.setdefault(axis, set()).add(label)
    only: Dict[str, set] = {}
    for axis, given in only_settings.items():
        for label in (label.strip() for label in given.split(",")):
            if f"{axis}-{label}" not in labels.get(axis, set()):
                valid = {key: sorted(value.split("-", 1)[1] for value in values) for key, values in labels.items()}
                raise SweepError(f"only.{axis}={label}: the grid has no such axis and label (axes and labels: "
                                 f"{valid})")
            only.setdefault(axis, set()).add(f"{axis}-{label}")
    return only


def selected_indices(sweep: Sweep, only: Dict[str, set]) -> List[int]:
    """Task indices of the runs whose choice on every `only` axis is one of its labels (all runs without one)."""
    return [index for index, run in enumerate(sweep.runs)
            if all(run.choices.get(axis) in labels for axis, labels in only.items())]


def run_problems(run: Run, runs_root: str) -> Tuple[List[str], List[str]]:
    """(config problems, missing data) of one run, found as fit finds them before building anything: its command
    line parsed by fit, every config file and override merged and the choices checked (`load_config`), the
    method looked up in the registry, the options it cannot train with; then the data files it reads."""
    # Lightning and the methods: imported once a sweep file has loaded
    from lightning_modules import fit, load_run_config

    args = fit.parse_args(run.fit_args(runs_root))
    try:
        cfg = load_run_config(args.config, args.overrides)
        method = fit.registered_method(cfg.method.name)
    except ConfigError as err:
        return [str(err)], []
    return fit.config_problems(cfg, method), fit.data_problems(cfg, method)


def check_runs(sweep: Sweep, indices: Sequence[int], data_here: bool) -> List[str]:
    """Check every run of `indices` before anything is submitted or run: a config problem in any run is a
    `SweepError` naming the runs (task index and name) and the problem. Missing data is an error too when the
    runs read it here (`data_here`, --local); else it is returned, one line per problem with the runs it
    concerns, to be reported: a login node may not see the data that the compute nodes read (fit checks it again
    there)."""
    config: Dict[str, List[int]] = {}
    data: Dict[str, List[int]] = {}
    for index in indices:
        config_problems, data_problems = run_problems(sweep.runs[index], str(sweep.directory))
        for found, problems in ((config, config_problems), (data, data_problems)):
            for problem in problems:
                found.setdefault(problem, []).append(index)

    def lines(found: Dict[str, List[int]]) -> List[str]:
        return [f"{which_runs(sweep, tasks, len(indices))}: {problem}" for problem, tasks in found.items()]

    errors = lines(config) + (lines(data) if data_here else [])
    if errors:
        raise SweepError("runs that would fail before training (nothing was submitted or run):\n  - "
                         + "\n  - ".join(errors))
    return lines(data)


def run_config(run: Run, runs_root: str) -> dict:
    """The run's config resolved as fit resolves it, as plain containers (what its config.yaml will hold but the
    per-device batches)."""
    from omegaconf import OmegaConf

    from lightning_modules import fit, load_run_config

    args = fit.parse_args(run.fit_args(runs_root))
    return OmegaConf.to_container(load_run_config(args.config, args.overrides), resolve=True)


ABSENT, BUNDLED, UNCHECKED, DIFFERS = "absent", "bundled", "unchecked", "differs"


def bundle_status(bundle: Path, sweep_name: str, run: Run, runs_root: str) -> Tuple[str, List[str]]:
    """Whether the bundle holds this run's results: (ABSENT, []) without a record; (BUNDLED, []) when the record
    matches the run's config digest and backbone checksum; (DIFFERS, problems) when it does not; (UNCHECKED,
    [backbone]) when the run's backbone is not here to be checksummed."""
    from lightning_modules.resume import config_digest, result_keys

    record = read_run_record(bundle, sweep_name, run.name)
    if record is None:
        return ABSENT, []
    config = run_config(run, runs_root)
    weights = backbone_weights(config["model"]["pretrained"])
    if weights is not None and not weights.is_file():
        return UNCHECKED, [str(weights)]
    problems = record_problems(record, config_digest(config), result_keys(config),
                               file_sha256(weights) if weights is not None else None, export_numerics(weights))
    return (DIFFERS, problems) if problems else (BUNDLED, [])


def record_problems(record: Mapping[str, Any], digest: str, config: Mapping[str, Any],
                    backbone_sha256: Optional[str], backbone_numerics: Optional[Mapping[str, Any]] = None) -> List[str]:
    """Why a run's stored record does not belong to the run as configured now ([] when it does): another config
    (the differing keys named) or another backbone (its checksum differs: the study was not continued from the
    same backbone). A backbone retrained from the same config differs when it was trained on another device, CPU
    (instruction set or generation), thread count or torch version; where both sides recorded these, the
    difference is named."""
    problems = []
    if record.get(CONFIG_DIGEST) != digest:
        differences = config_differences(record.get(CONFIG) or {}, config)
        problems.append("its config differs from the bundle's record: "
                        + ("; ".join(differences) if differences else "same keys, another digest"))
    stored = record.get(BACKBONE) or {}
    if stored.get(BACKBONE_SHA256) != backbone_sha256:
        problems.append(f"its backbone {stored.get(BACKBONE_PATH)} has sha256 {backbone_sha256} here, and "
                        f"{stored.get(BACKBONE_SHA256)} in the bundle: not the backbone the bundled runs started from"
                        + numerics_difference(stored.get(BACKBONE_NUMERICS), backbone_numerics))
    return problems


def numerics_difference(stored: Optional[Mapping[str, Any]], now: Optional[Mapping[str, Any]]) -> str:
    """How the two backbones' training differed numerically, as a clause for `record_problems`."""
    if not stored or not now:
        return (" (a backbone trained again gives the same bits only on the same device, CPU generation, "
                "thread count and torch version; the bundle's backbones carry no record of those)")
    differences = config_differences(stored, now)
    if not differences:
        return " (trained with the same recorded numerics: its config, data or other libraries differ)"
    return " (trained differently: " + "; ".join(differences) + ")"


def world_refusal(bundle: Path, runs: Sequence[Run], runs_root: str, data_here: bool) -> Optional[str]:
    """One line refusing the runs when their world (`data.root`) is not the one the bundle was made on, naming both
    world checksums (core/run_records.py): a config digest names the world's folder, not its contents, so without
    this a world of another seed in the same folder would find every run "in the bundle". None when the worlds
    agree, when the bundle records none, or when the world is not here and the runs run elsewhere (each array
    task checks it where it runs)."""
    if bundle_world(bundle) is None:
        return None
    for root in dict.fromkeys(str(run_config(run, runs_root)["data"]["root"]) for run in runs):
        if data_here or Path(root).is_dir():
            problem = world_problem(bundle, Path(root))
            if problem:
                return problem
    return None


def check_bundle(sweep: Sweep, indices: Sequence[int], data_here: bool) -> Tuple[List[int], List[str]]:
    """(the tasks of `indices` whose results the sweep's bundle holds: skipped, lines naming the bundled runs
    whose backbone is not here to check). A bundle of another world is a `SweepError` (`world_refusal`); a record of
    another config or backbone is one naming the runs and what differs; so is an unchecked backbone when the runs
    run here (`data_here`, --local)."""
    if not sweep.bundle:
        return [], []
    refusal = world_refusal(Path(sweep.bundle), [sweep.runs[index] for index in indices], str(sweep.directory),
                            data_here)
    if refusal:
        raise SweepError(f"refused (nothing was submitted or run): {refusal}")
    bundled: List[int] = []
    differs: Dict[str, List[int]] = {}
    unchecked: Dict[str, List[int]] = {}
    for index in indices:
        status, details = bundle_status(Path(sweep.bundle), sweep.name, sweep.runs[index], str(sweep.directory))
        if status == BUNDLED:
            bundled.append(index)
        for detail in details if status == DIFFERS else []:
            differs.setdefault(detail, []).append(index)
        for backbone in details if status == UNCHECKED else []:
            unchecked.setdefault(f"its backbone {backbone} is not here, so its record in {sweep.bundle} cannot be "
                                 "checked (train the backbones first: make study does)", []).append(index)

    def lines(found: Dict[str, List[int]]) -> List[str]:
        return [f"{which_runs(sweep, tasks, len(indices))}: {problem}" for problem, tasks in found.items()]

    if differs or (unchecked and data_here):
        raise SweepError(f"the bundle {sweep.bundle} holds results of other runs under these runs' names (nothing "
                         "was submitted or run):\n  - " + "\n  - ".join(lines(differs) + lines(unchecked))
                         + f"\nThe bundle belongs to another study: move {sweep.bundle} aside to start a new one, or "
                           "run the configs and backbones it was made with.")
    return bundled, lines(unchecked)


def check_run_folders(sweep: Sweep, indices: Sequence[int]) -> None:
    """Refuse (`SweepError`, naming each run and what differs) runs whose folder holds another run than their
    config asks for (slurm/runs.py `run_state`): another experiment, a finished run this config would shorten, or
    the export of another config with nothing to continue it from. Nothing is deleted or moved: the researcher
    decides."""
    problems: Dict[str, List[int]] = {}
    for index in indices:
        state, why = local_state(sweep, sweep.runs[index])
        if state == REFUSED:
            problems.setdefault(why, []).append(index)
    if problems:
        raise SweepError("run folders that hold another run than the sweep asks for (nothing was submitted or run):"
                         "\n  - " + "\n  - ".join(f"{which_runs(sweep, tasks, len(indices))}: {why}"
                                                  for why, tasks in problems.items())
                         + "\nRestore the config they were trained with, give the changed runs their own sweep "
                           "name, or move their folders aside to train them again.")


def which_runs(sweep: Sweep, tasks: Sequence[int], checked: int) -> str:
    """The runs a problem concerns: `every run (tasks 0-71)` when all `checked` runs, a few by index and name
    (`tasks 0 (seed-0), 2 (seed-2)`), many by index (`tasks 0-9,12`)."""
    if len(tasks) == checked > 1:
        return f"every run (tasks {index_ranges(tasks)})"
    if len(tasks) <= FEW_RUNS:
        named = ", ".join(f"{task} ({sweep.runs[task].name})" for task in tasks)
        return f"task {named}" if len(tasks) == 1 else f"tasks {named}"
    return f"tasks {index_ranges(tasks)}"


def index_ranges(indices: Sequence[int]) -> str:
    """Increasing indices as runs of consecutive ones: [0, 1, 2, 5] -> "0-2,5"."""
    spans: List[List[int]] = []
    for index in indices:
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in spans)


def array_spec(indices: Sequence[int], total: int) -> str:
    """SLURM's --array value: the range when every task runs, else the listed indices."""
    return f"0-{total - 1}" if list(indices) == list(range(total)) else ",".join(str(i) for i in indices)


def sbatch_script(sweep: Sweep, sweep_file: Path, indices: Optional[Sequence[int]] = None) -> str:
    """The array-job script: one task per run (of `indices`, default all), one srun task per GPU (or one on CPU
    nodes)."""
    s = sweep.slurm
    tasks_per_node = max(1, int(s["gpus_per_node"] or 0))
    indices = range(len(sweep.runs)) if indices is None else indices
    array = array_spec(indices, len(sweep.runs)) + (f"%{s['max_parallel']}" if s["max_parallel"] else "")
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
    document = {"name": sweep.name, "runs_root": str(sweep.directory), "runs": [asdict(run) for run in sweep.runs],
                "study": sweep.study, "bundle": sweep.bundle}
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
    if document.get("bundle"):
        refusal = world_refusal(Path(document["bundle"]), [run], document["runs_root"], data_here=True)
        if refusal:
            raise SystemExit(f"refused: {refusal}")
        status, details = bundle_status(Path(document["bundle"]), document["name"], run, document["runs_root"])
        if status in (DIFFERS, UNCHECKED):
            raise SystemExit(f"refused: the bundle {document['bundle']} holds another result for {run.name}: "
                             + "; ".join(details))
        if status == BUNDLED:
            print(f"{run.name}: its results are in the bundle {document['bundle']}; nothing to do", flush=True)
            return
    fit.main(run.fit_args(document["runs_root"]) + slurm_topology())


def submit(script: str) -> str:
    result = subprocess.run(["sbatch", "--parsable"], input=script, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"sbatch failed: {result.stderr.strip()}")
    return result.stdout.strip().split(";")[0]


def local_threads(jobs: int) -> int:
    """Threads per run when `jobs` runs share this process's CPUs (its affinity mask, as SLURM or taskset set)."""
    return max(1, len(os.sched_getaffinity(0)) // jobs)


def task_command(sweep_file: Path, index: int) -> List[str]:
    return [sys.executable, "-m", "slurm.sweep", "--task", str(sweep_file), str(index)]


def run_one(runs: LocalRuns, name: str, command: List[str], log_path: Path, threads: int) -> Optional[tuple]:
    """Run `command` with `threads` threads as run `name` of `runs` (in its own process group), appending its output
    to `log_path`; (return code, seconds), or None when the sweep was stopped before it started."""
    if runs.received is not None:
        return None
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **{variable: str(threads) for variable in THREAD_VARIABLES}}
    start = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)} ({threads} threads)\n")
        log.flush()
        process = runs.start(name, command, log, env)
        if process is None:
            log.write("not started: the sweep was stopped\n")
            return None
        code = process.wait()
        runs.ended(name)
    return code, time.perf_counter() - start


def run_local(sweep: Sweep, sweep_file: Path, jobs: int = 1,
              command: Optional[Callable[[Path, int], List[str]]] = None,
              indices: Optional[Sequence[int]] = None, bundled: Sequence[int] = ()) -> List[str]:
    """Every run of the sweep (or those of `indices`) here, `jobs` at a time; returns the names of those that failed.

    A finished run is skipped: its export records the digest of its config now (slurm/runs.py `run_state`), so a
    second call resumes an interrupted sweep (fit itself resumes a run that has checkpoints but no export, or
    whose config now asks for more steps), and so is a run of `bundled` (its results are in the sweep's bundle,
    `check_bundle`). `command` builds a run's command line (tests swap in trivial ones). A progress line is printed
    as each run finishes, in the order they finish. A run is done when it exits 0 with an export of its config.

    SIGTERM or SIGINT stops the sweep (slurm/local.py): passed to the running runs, which save and exit; no more
    start; `SweepStopped` is raised once they have all ended, the stop recorded in the sweep's stops.jsonl.
    """
    command = command or task_command
    indices = range(len(sweep.runs)) if indices is None else indices
    total, threads = len(indices), local_threads(jobs)
    pending = pending_runs(sweep, indices, bundled)
    finished = total - len(pending)
    outcomes: Dict[str, List[str]] = {"stopped": [], "finished": [], "failed": [], "not_started": []}
    print(f"running {len(pending)} runs, {jobs} at a time, {threads} threads each", flush=True)
    runs = LocalRuns()
    with runs.forwarding(), ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one, runs, run.name, command(sweep_file, index),
                               sweep.directory / run.name / RUN_LOG, threads): run for index, run in pending}
        for future in as_completed(futures):
            run, result = futures[future], future.result()
            if result is None:
                outcomes["not_started"].append(run.name)
                continue
            finished += 1
            outcome, status = local_outcome(sweep, run, runs, *result)
            outcomes[outcome].append(run.name)
            print(f"[{finished}/{total}] {run.name} {status}", flush=True)
    if runs.received is not None:
        raise sweep_stop(sweep, runs.received, outcomes)
    return outcomes["failed"]


def pending_runs(sweep: Sweep, indices: Sequence[int], bundled: Sequence[int]) -> List[Tuple[int, Run]]:
    """The (index, run) of `indices` to run, in order; a line for each run skipped (in the bundle, or finished)
    and for each finished run that continues (its config asks for more steps)."""
    pending, skipped = [], 0
    for index, run in ((index, sweep.runs[index]) for index in indices):
        state, why = (FINISHED, "") if index in bundled else local_state(sweep, run)
        if state == REFUSED:  # main refuses these before anything runs; a caller of run_local alone meets it here
            raise SweepError(f"task {index} ({run.name}): {why}")
        if state == TO_RUN:
            pending.append((index, run))
            if why:
                print(f"{run.name}: {why}", flush=True)
            continue
        skipped += 1
        reason = (f"its results are in the bundle {sweep.bundle}" if index in bundled else
                  "finished (its export records this config)")
        print(f"[{skipped}/{len(indices)}] {run.name} skipped: {reason}", flush=True)
    return pending


def local_state(sweep: Sweep, run: Run) -> Tuple[str, str]:
    """`run_state` of the run's folder for its config now (TO_RUN without a folder: nothing to compare)."""
    run_dir = sweep.directory / run.name
    if not run_dir.is_dir():
        return TO_RUN, ""
    return run_state(run_dir, run_config(run, str(sweep.directory)))


def local_outcome(sweep: Sweep, run: Run, runs: LocalRuns, code: int, seconds: float) -> Tuple[str, str]:
    """(outcome, progress text) of a run that ended with status `code`: finished, stopped (by the sweep's signal:
    resumable) or failed."""
    log_path = sweep.directory / run.name / RUN_LOG
    if runs.stopped_by(code):
        return "stopped", f"stopped by {signal.Signals(code - 128).name} (rc {code}): resumes when the sweep runs again"
    if code == 0 and local_state(sweep, run)[0] == FINISHED:
        return "finished", f"done in {seconds:.0f} s"
    if code:
        return "failed", f"failed (rc {code}, log {log_path})"
    return "failed", f"ended without an export of its config (rc 0, log {log_path})"


def sweep_stop(sweep: Sweep, signum: int, outcomes: Dict[str, List[str]]) -> SweepStopped:
    """The error a stopped local sweep ends with, its stop recorded in the sweep's stops.jsonl."""
    record = record_sweep_stop(sweep.directory, signum, outcomes)
    counts = ", ".join(f"{len(names)} {outcome.replace('_', ' ')}" for outcome, names in outcomes.items())
    return SweepStopped(signum, f"sweep {sweep.name} stopped by {signal.Signals(signum).name}: {counts} "
                                f"(recorded in {record}). Run the same command again to resume the stopped runs and "
                                f"start the others")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("sweep", nargs="?", type=Path, help="the sweep YAML")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the sbatch script and the runs; submit nothing")
    mode.add_argument("--local", action="store_true", help="run every combination here (see --jobs)")
    parser.add_argument("--jobs", type=int, default=1, help="with --local: runs at once (default 1), each with "
                        "max(1, cpus // jobs) threads")
    add_key_values(parser, dest="settings", help="only.AXIS=LABEL[,LABEL...]: run only the grid's runs with one "
                   "of these labels on this axis; any other KEY=VALUE overrides every run's config, e.g. "
                   "trainer.accelerator=gpu (see below)")
    parser.add_argument("--task", nargs=2, metavar=("SWEEP_JSON", "INDEX"), help=argparse.SUPPRESS)
    refuse_renamed(parser, {"--only": "only.AXIS=LABEL[,LABEL...] (a key=value argument)"})
    args = parser.parse_intermixed_args(argv)
    if args.sweep is not None and "=" in str(args.sweep):  # a key=value argument took the sweep file's place
        parser.error(f"give the sweep YAML first, before {args.sweep}")
    args.only = key_value_sections(parser, [item for item in args.settings if item.startswith(ONLY)],
                                   ONLY_SETTINGS)["only"]
    args.overrides = [item for item in args.settings if not item.startswith(ONLY)]
    malformed = [item for item in args.overrides if "=" not in item]
    if malformed:
        parser.error(f"{malformed[0]!r}: give only.AXIS=LABEL[,LABEL...] or a config override KEY=VALUE")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Optional[str]:
    args = parse_args(argv)
    if args.task:
        run_task(Path(args.task[0]), int(args.task[1]))
        return None
    if args.sweep is None:
        raise SystemExit("give a sweep YAML (see --help)")
    if args.jobs < 1 or (args.jobs != 1 and not args.local):
        raise SystemExit(f"--jobs {args.jobs}: needs --local and a positive number")
    try:
        sweep = load_sweep(args.sweep, args.overrides)
        indices = selected_indices(sweep, parse_only(sweep, args.only))
        if not indices:
            chosen = " ".join(f"only.{axis}={labels}" for axis, labels in args.only.items())
            raise SweepError(f"{chosen} selects none of the {len(sweep.runs)} runs")
        missing_data = check_runs(sweep, indices, data_here=args.local)
        bundled, unchecked = check_bundle(sweep, indices, data_here=args.local)
        check_run_folders(sweep, [index for index in indices if index not in bundled])
    except SweepError as err:
        raise SystemExit(f"sweep error: {err}") from None
    for line in missing_data:
        print(f"warning: {line}; not found here, fit checks it again where each run starts", file=sys.stderr)
    for line in unchecked:
        print(f"warning: {line}; each of these runs checks it where it starts", file=sys.stderr)
    submitted = [index for index in indices if index not in bundled]
    if args.dry_run:
        print(sbatch_script(sweep, sweep.directory / SWEEP_FILE, submitted) if submitted else
              f"# nothing to submit: the results of all {len(indices)} runs are in the bundle {sweep.bundle}")
        for index in indices:
            run, skipped = sweep.runs[index], "  (in the bundle: skipped)" if index in bundled else ""
            print(f"# task {index}: {sweep.directory / run.name}  {' '.join(run.fit_args(str(sweep.directory)))}"
                  f"{skipped}")
        return None
    sweep_file = write_sweep_file(sweep)
    if args.local:
        try:
            failed = run_local(sweep, sweep_file, args.jobs, indices=indices, bundled=bundled)
        except SweepStopped as stop:
            print(str(stop), file=sys.stderr, flush=True)
            raise SystemExit(stop.exit_code) from None
        if failed:
            raise SystemExit(f"{len(failed)} of {len(indices)} runs failed (logs: <run>/{RUN_LOG}): "
                             + ", ".join(failed))
        return None
    if not submitted:
        print(f"nothing to submit: the results of all {len(indices)} runs are in the bundle {sweep.bundle}")
        return None
    job_id = submit(sbatch_script(sweep, sweep_file, submitted))
    print(f"submitted array job {job_id}: {len(submitted)} runs under {sweep.directory} ({len(bundled)} in the "
          f"bundle, skipped); tensorboard --logdir {sweep.directory}")
    return job_id


if __name__ == "__main__":
    main()

"""`python -m gpucheck`: the GPU node check: the real training path on CUDA and its throughput, in one command.

    make gpu-prepare     # where a package index and spaCy are: the bundle (.gpu/: wheels, world, caches, records)
    make gpu-check       # on the GPU node: python3 -m gpucheck --bundle .gpu --out runs/gpu_check
    python -m gpucheck --device cpu --bundle DIR --work DIR --out PATH   # the CPU mode, tiny (the tests)

Four stages run in order (docs/gpu.md), each in its own process group under its own hard timeout
(`gpucheck.stages.CheckSettings.stage_timeout_s`: 460 s in all on a GPU), killed with its children when it runs
over: environment (wheels installed, versions), fit (`python -m lightning_modules.fit` of every method on the
device, a resume, an export, an evaluation), numerics (one step of every method on the CPU against the device) and
throughput (the timing benchmark `python -m perf.gpu --sections training`: samples/s, peak memory, MFU). The
results so far are rewritten whole after every stage and, while one runs, each time it reports a finished part:
PATH.json and PATH.md, and every stage's output in PATH.log. So a check killed at any point leaves what had
finished. `--stages` reruns some stages into the same PATH.json, keeping the others' results (with when each ran).
The exit status is 0 when every stage that ran passed.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from core.cli import add_output, output_paths
from core.files import atomic_write_text
from gpucheck import bundle as gpu_bundle
from gpucheck.stages import REPO_ROOT, RESUMED, SETTINGS, STAGES, CheckSettings

SCHEMA = "gpu_check/1"
DEFAULT_OUT = Path("runs/gpu_check")
DEFAULT_WORK = Path("runs/gpu_check_work")
# How often a running stage's document is looked at (and the results rewritten when it changed).
POLL_S = 2.0
# After its timeout a stage gets SIGTERM, then SIGKILL this much later.
KILL_GRACE_S = 5.0
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that started it ends


class Stopped(Exception):
    """The check got SIGTERM or SIGINT: the running stage is stopped and the results written before it exits."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", choices=sorted(SETTINGS), default="cuda",
                        help="cuda (the check) or cpu (the same stages at tiny sizes)")
    parser.add_argument("--bundle", type=Path, default=gpu_bundle.DEFAULT_BUNDLE,
                        help=f"what `make gpu-prepare` wrote (default {gpu_bundle.DEFAULT_BUNDLE})")
    add_output(parser, "formats", default=DEFAULT_OUT,
               help=f"the results: PATH.json, PATH.md and PATH.log (default {DEFAULT_OUT})")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK,
                        help=f"runs, checkpoints and the stages' own files (default {DEFAULT_WORK})")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    args = parser.parse_args(argv)
    args.stages = [name.strip() for name in args.stages.split(",") if name.strip()]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; known: {', '.join(STAGES)}")
    return args


# ----- one stage ------------------------------------------------------------------------------------------------
def stage_command(name: str, settings: CheckSettings, bundle: Path, work: Path, document: Path) -> List[str]:
    if name == "throughput":
        records = bundle / gpu_bundle.RECORDS
        return [sys.executable, "-m", "perf.gpu", "--sections", "training", "--out", str(document.with_suffix("")),
                *(["--records", str(records)] if records.is_file() else []), *settings.throughput]
    return [sys.executable, "-m", "gpucheck.stages", name, "--device", settings.device, "--bundle", str(bundle),
            "--work", str(work), "--out", str(document)]


def stage_environment(bundle: Path) -> Dict[str, str]:
    """The stages' environment: the repository and the bundle's installed wheels first on the path, output
    unbuffered, no hub downloads."""
    path = [str(REPO_ROOT), str(bundle / gpu_bundle.SITE), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def read_document(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet (or a reader raced a rename: the next poll reads it)
        return None


class Check:
    """The results of one check: every stage's status and document, written whole after every change."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.settings = args, SETTINGS[args.device]
        self.paths = output_paths(args.out, [".json", ".md", ".log"])
        self.work = args.work.resolve()
        self.process: Optional[subprocess.Popen] = None
        self.result = self._previous() or {"schema": SCHEMA, "stages": {}}
        self.result.update(device=args.device, bundle=str(args.bundle), command=" ".join(sys.argv),
                           started=now(), stage_order=list(STAGES))

    def _previous(self) -> Optional[dict]:
        """The results of an earlier check at the same PATH when only some stages run now (theirs are replaced)."""
        previous = read_document(self.paths[".json"])
        if set(self.args.stages) == set(STAGES) or not previous or previous.get("schema") != SCHEMA:
            return None
        return previous

    def write(self) -> None:
        self.paths[".json"].parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.paths[".json"], json.dumps(self.result, indent=1, default=str))
        atomic_write_text(self.paths[".md"], markdown(self.result))

    def run_stage(self, name: str) -> bool:
        timeout = self.settings.stage_timeout_s[name]
        document = self.work / "stages" / f"{name}.json"
        document.parent.mkdir(parents=True, exist_ok=True)
        document.unlink(missing_ok=True)
        entry = {"status": "running", "started": now(), "timeout_s": timeout, "seconds": None, "rc": None,
                 "result": None}
        self.result["stages"][name] = entry
        self.write()
        rc, seconds = self._watch(name, stage_command(name, self.settings, self.args.bundle.resolve(), self.work,
                                                      document), document, timeout, entry)
        entry.update(rc=rc, seconds=seconds, result=read_document(document),
                     status="timeout" if rc is None else ("ok" if rc == 0 else "failed"))
        self.write()
        return entry["status"] == "ok"

    def _watch(self, name: str, command: List[str], document: Path, timeout: float, entry: dict):
        """Run a stage in its own process group, rewriting the results whenever its document changes; (return
        code or None when killed at the timeout, seconds)."""
        start = time.monotonic()
        seen = None
        with open(self.paths[".log"], "a", encoding="utf-8") as log:
            log.write(f"\n===== {now()} stage {name} (timeout {timeout:.0f} s): {' '.join(command)}\n")
            log.flush()
            process = self.process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=stage_environment(self.args.bundle.resolve()), stdout=log,
                stderr=subprocess.STDOUT, preexec_fn=own_group_ending_with_the_check)
            while True:
                try:
                    return process.wait(timeout=POLL_S), time.monotonic() - start
                except subprocess.TimeoutExpired:
                    pass
                stamp = document.stat().st_mtime_ns if document.is_file() else None
                if stamp != seen:
                    seen, entry["result"] = stamp, read_document(document)
                    self.write()
                if time.monotonic() - start > timeout:
                    stop(process)
                    log.write(f"===== stage {name} killed at its {timeout:.0f} s timeout\n")
                    return None, time.monotonic() - start


    def stop_running(self, signum: int) -> None:
        """After SIGTERM / SIGINT: the running stage's group stopped, and marked as stopped in the results."""
        if self.process is not None and self.process.poll() is None:
            stop(self.process)
        for entry in self.result["stages"].values():
            if entry["status"] == "running":
                entry.update(status="stopped", rc=None, error=f"the check got signal {signum}")
        self.result["finished"] = now()
        self.write()


def own_group_ending_with_the_check() -> None:
    """In a stage's process, before it runs: a process group of its own (the timeout ends it with its children),
    and SIGTERM when the check's process ends, however it ends (Linux: prctl PR_SET_PDEATHSIG)."""
    os.setpgrp()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: a stage outlives a killed check until its own timeout
        pass


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the stage's whole process group, SIGKILL after a grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def now() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def raise_stopped(signum: int, frame) -> None:
    raise Stopped(signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    check = Check(args)
    check.write()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, raise_stopped)
    try:
        passed = [check.run_stage(name) for name in STAGES if name in args.stages]
    except Stopped as stopped:
        check.stop_running(stopped.args[0])
        return 128 + stopped.args[0]
    check.result["finished"] = now()
    check.write()
    print(f"\n{markdown(check.result)}\nwrote {check.paths['.json']}, {check.paths['.md']} and {check.paths['.log']}",
          flush=True)
    return 0 if all(passed) else 1


# ----- the Markdown report ----------------------------------------------------------------------------------------
def number(value, form: str) -> str:
    return "-" if value is None else format(value, form)


def markdown(result: dict) -> str:
    lines = [f"# GPU node check (`python -m gpucheck --device {result['device']}`)", "",
             f"Started {result['started']}" + (f", finished {result['finished']}" if result.get("finished") else
                                               " (not finished)") + f". Bundle {result['bundle']}.", "",
             "| stage | status | seconds | timeout (s) | started |", "|---|---|---:|---:|---|"]
    stages = result["stages"]
    for name in result["stage_order"]:
        if name in stages:
            entry = stages[name]
            lines.append(f"| {name} | {entry['status']} | {number(entry['seconds'], '.0f')} | "
                         f"{entry['timeout_s']:.0f} | {entry['started']} |")
    for name, section in SECTIONS.items():
        document = stages.get(name, {}).get("result")
        if document:
            lines += ["", *section(document)]
    return "\n".join(lines) + "\n"


def environment_section(document: dict) -> List[str]:
    info, torch_info = document.get("host", {}), document.get("torch") or {}
    gpus = "; ".join(f"{g['name']} (sm {g['capability']}, {g['memory_gib']:.0f} GiB)"
                     for g in torch_info.get("gpus", []))
    packages = ", ".join(f"{name} {p['version']}" for name, p in (document.get("packages") or {}).items() if p)
    commit = document.get("commit") or {}
    return ["## Environment", "",
            f"Python {info.get('python')}, torch {torch_info.get('torch')} (CUDA {torch_info.get('cuda')}, cuDNN "
            f"{torch_info.get('cudnn')}), {info.get('cpus_usable')} CPUs. GPUs: {gpus or 'none'}. nvidia-smi: "
            f"{document.get('nvidia_smi') or '-'}. spaCy installed: {document.get('spacy_installed')}. Commit "
            f"{commit.get('commit')} (uncommitted changes: {commit.get('uncommitted_changes')}). Missing modules: "
            f"{', '.join(document.get('missing_modules') or []) or 'none'}.", "", f"Packages: {packages}."]


def fit_section(document: dict) -> List[str]:
    lines = ["## Fit (`python -m lightning_modules.fit`, every method)", "",
             "| run | status | steps | exported step | seconds | last train/loss | samples/s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    runs = dict(document.get("runs", {}))
    if "resume" in document:
        runs[f"{RESUMED}, resumed"] = document["resume"]
    for name, run in runs.items():
        lines.append(f"| {name} | {run['status']} | {run['steps']} | {run.get('exported_step')} | "
                     f"{run['seconds']:.0f} | {number(run.get('train/loss'), '.4f')} | "
                     f"{number(run.get('train/samples_per_s'), '.0f')} |")
    export, evaluation = document.get("export"), document.get("evaluation")
    if export:
        lines += ["", f"Export: {export['status']}; plain open_clip against load_export, max relative gap image "
                      f"{number(export.get('image_gap'), '.1e')}, text {number(export.get('text_gap'), '.1e')}."]
    if evaluation:
        scores = evaluation.get("shapes_swap") or {}
        shown = ", ".join(f"{key} {value:.1f}" for key, value in scores.items() if isinstance(value, (int, float)))
        lines += ["", f"Evaluation ({evaluation['precision']}): {evaluation['status']}; shapes_swap: {shown or '-'}."]
    return lines


def numerics_section(document: dict) -> List[str]:
    lines = ["## Numerics: one step, CPU float32 against the device (float32 with TF32 off; bf16-mixed)", "",
             f"Passing: terms within {document.get('term_tolerance')} and the gradient within "
             f"{document.get('gradient_tolerance')} (relative).", "",
             "| method | status | term gap | gradient gap | bf16 loss gap | device reads per step |",
             "|---|---|---:|---:|---:|---:|"]
    for name, row in document.get("methods", {}).items():
        if "term_gap" not in row:
            lines.append(f"| {name} | {row['status']}: {row.get('error', '')} | - | - | - | - |")
            continue
        lines.append(f"| {name} | {row['status']} | {row['term_gap']:.1e} | {row['gradient_gap']:.1e} | "
                     f"{row['bf16_loss_gap']:.1e} | {number(row['device_reads_per_step'], 'd')} |")
    return lines


def throughput_section(document: dict) -> List[str]:
    device = document.get("device", {})
    lines = ["## Throughput (`python -m perf.gpu --sections training`)", "",
             f"{device.get('name')}: dense bf16 peak {device.get('bf16_peak_tflops')} TFLOP/s "
             f"({device.get('peak_source')}); measured matmul bf16 {number(device.get('matmul_bf16_tflops'), '.1f')}"
             f", tf32 {number(device.get('matmul_tf32_tflops'), '.1f')}, fp32 "
             f"{number(device.get('matmul_fp32_tflops'), '.1f')} TFLOP/s.", "",
             "| method | batch | precision | status | samples/s | peak memory (GiB) | TFLOP/s | MFU | of matmul |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for row in document.get("training", {}).values():
        lines.append(f"| {row['method']} | {row['batch_size']} | {row['precision']} | {row['status']} | "
                     f"{number(row['samples_per_s'], '.1f')} | {number(row['peak_memory_gib'], '.2f')} | "
                     f"{number(row['achieved_tflops'], '.3g')} | {number(row['mfu'], '.1%')} | "
                     f"{number(row['mfu_of_matmul'], '.1%')} |")
    return lines


SECTIONS = {"environment": environment_section, "fit": fit_section, "numerics": numerics_section,
            "throughput": throughput_section}

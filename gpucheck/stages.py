"""The GPU node check's stages: `python -m gpucheck.stages STAGE --device D --bundle B --work W --out STAGE.json`.

`python -m gpucheck` runs each in its own process under its own hard timeout (docs/gpu.md). A stage writes
its result document whole (atomically) every time one of its parts finishes, so a stage killed part-way leaves what
it finished; its exit status is 0 when every part passed, 1 otherwise (the document says which).

environment  the bundle's wheels installed (`gpucheck.bundle.install_wheels`), then versions: Python, torch, CUDA,
             cuDNN, the GPU and its driver, every package the code imports (and from where), whether spaCy is
             there (it need not be), the commit, the bundle's manifest.
fit          the real `python -m lightning_modules.fit` of every method (`FIT_RUNS`: the demo configs) on the
             bundle's shapes world, on the device in the check's precision, several at once; then one run resumed
             to more steps, its export loaded in plain open_clip against `modeling.export.load_export`, and
             `python -m evaluation.evaluate` of it on the world's swap set.
numerics     one training step of every method from the same weights and the same host batch, on the CPU in
             float32 and on the device in float32 (TF32 off) and bf16-mixed: the loss terms and the gradients
             compared, and the device reads the float32 step makes counted (torch.cuda.set_sync_debug_mode).
(The throughput stage is the timing benchmark `python -m perf.gpu --sections training` itself.)
"""
from __future__ import annotations

import argparse
import copy
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from core.cli import add_output
from core.files import atomic_write_text
from gpucheck import bundle as gpu_bundle

REPO_ROOT = Path(__file__).resolve().parent.parent
STAGES = ("environment", "fit", "numerics", "throughput")
# Every registered method, as the demo trains it on the shapes world (CAE twice: its attention attribution and a
# gradient-based one, whose double backward is the GPU path most likely to break). The attribution monitor parses
# its probe captions with spaCy, which the node need not have: off. The aligners encode the frozen features on the
# fly (no feature cache travels in the bundle).
FIT_RUNS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "clip_ft": ("configs/demo/pretrain.yaml", ()),
    "negclip": ("configs/demo/clip_ft.yaml", ()),
    "cae_attention": ("configs/demo/cae.yaml", ("monitor.every_n_steps=0",)),
    "cae_gradient": ("configs/demo/cae.yaml", ("monitor.every_n_steps=0", "method.attribution.name=gradient")),
    "macco": ("configs/demo/macco.yaml", ()),
    "smartclip": ("configs/demo/smartclip.yaml", ()),
    "tflocal": ("configs/demo/tflocal.yaml", ("data.features_cache=null",)),
    "tfglobal": ("configs/demo/tflocal.yaml", ("data.features_cache=null", "method.name=tfglobal")),
}
RESUMED = "clip_ft"
# What numerics accepts between the CPU and the device in float32 (relative): the terms, and the gradient as one
# vector. Summation order differs between the devices' kernels; both stay far below these.
TERM_TOLERANCE = 1e-4
GRADIENT_TOLERANCE = 1e-3
PACKAGES = ("torch", "torchvision", "lightning", "pytorch-lightning", "torchmetrics", "open_clip_torch", "timm",
            "omegaconf", "numpy", "pillow", "tensorboard", "matplotlib", "pyarrow", "PyYAML", "ftfy",
            "transformers", "tokenizers", "huggingface-hub", "groundingdino-py", "spacy")
REQUIRED_MODULES = ("torch", "lightning", "open_clip", "omegaconf", "tensorboard")


@dataclass(frozen=True)
class CheckSettings:
    """What differs between the check on a GPU and its tiny CPU mode."""

    device: str
    accelerator: str  # the fits' trainer.accelerator
    precision: str  # the fits' trainer.precision
    model: str
    batch_size: int
    steps: int  # each fit's trainer.max_steps
    resume_steps: int  # the resumed run's new trainer.max_steps
    parallel_fits: int
    workers: int  # each fit's data.num_workers
    part_timeout_s: float  # one fit, the resume, the evaluation
    stage_timeout_s: Dict[str, float] = field(default_factory=dict)
    throughput: Tuple[str, ...] = ()  # perf.gpu's arguments


# On a GPU: 460 s of stage timeouts in all (the whole check stays within 8 minutes). perf.gpu paces its rows to its
# own budget, which leaves its start (imports, the matmul rates) inside the stage's timeout.
GPU_CHECK = CheckSettings(
    device="cuda", accelerator="gpu", precision="bf16-mixed", model="ViT-Shapes-16-64", batch_size=64, steps=30,
    resume_steps=40, parallel_fits=4, workers=2, part_timeout_s=120,
    stage_timeout_s={"environment": 60, "fit": 190, "numerics": 70, "throughput": 140},
    throughput=("--budget-s", "110", "--methods", "lead"))
# The CPU mode (the test suite): the same stages at tiny sizes; its timeouts only stop a hung stage.
CPU_CHECK = CheckSettings(
    device="cpu", accelerator="cpu", precision="32-true", model="ViT-Tiny-16-64", batch_size=8, steps=2,
    resume_steps=3, parallel_fits=2, workers=0, part_timeout_s=900,
    stage_timeout_s={"environment": 900, "fit": 3600, "numerics": 1800, "throughput": 1800},
    throughput=("--cpu-smoke", "--no-budget", "--methods", "clip_ft,clip_ft+32-true,cae_gradient,tflocal"))
SETTINGS = {"cuda": GPU_CHECK, "cpu": CPU_CHECK}


@dataclass
class Context:
    settings: CheckSettings
    bundle: Path
    work: Path
    out: Path

    def __post_init__(self):
        self.document: dict = {}

    def update(self, **parts) -> None:
        """Add `parts` to the stage's document and rewrite it whole."""
        self.document.update(parts)
        atomic_write_text(self.out, json.dumps(self.document, indent=1, default=str))


def error_text(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ----- environment ----------------------------------------------------------------------------------------------
def package_versions() -> Dict[str, dict]:
    """Version and install location of every package the code may import (None: not installed)."""
    found = {}
    for name in PACKAGES:
        try:
            dist = importlib.metadata.distribution(name)
            found[name] = {"version": dist.version, "location": str(dist.locate_file(""))}
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def nvidia_smi() -> Optional[str]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def torch_info(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "threads": torch.get_num_threads()}
    if device == "cuda" and torch.cuda.is_available():
        info["gpus"] = [{"name": props.name, "capability": f"{props.major}.{props.minor}",
                         "memory_gib": props.total_memory / 2 ** 30, "multiprocessors": props.multi_processor_count}
                        for props in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))]
    return info


def environment(ctx: Context) -> bool:
    site = gpu_bundle.install_wheels(ctx.bundle)
    if site is not None:  # created after this process started: make the path finder look again
        sys.path_importer_cache.pop(str(site), None)
        importlib.invalidate_caches()
    ctx.update(host={"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
                     "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0))},
               bundle_site=str(site) if site else None, commit=gpu_bundle.commit(),
               bundle=read_json(ctx.bundle / gpu_bundle.MANIFEST), packages=package_versions(),
               spacy_installed=importlib.util.find_spec("spacy") is not None, nvidia_smi=nvidia_smi())
    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    ctx.update(missing_modules=missing)
    if "torch" in missing:
        return False
    info = torch_info(ctx.settings.device)
    ctx.update(torch=info)
    return not missing and (ctx.settings.device == "cpu" or info["cuda_available"])


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ----- fit: the real command, every method ----------------------------------------------------------------------
def fit_overrides(ctx: Context, name: str, steps: int) -> List[str]:
    """The overrides that point a demo config at the bundle and the check's device, precision and size."""
    s = ctx.settings
    return [f"experiment={name}", f"runs_root={ctx.work / 'runs'}", f"model.name={s.model}", "model.pretrained=null",
            f"data.root={ctx.bundle / gpu_bundle.WORLD}", f"preprocess.cache_root={ctx.bundle / gpu_bundle.CACHE}",
            f"data.batch_size={s.batch_size}", f"data.num_workers={s.workers}", f"trainer.max_steps={steps}",
            f"trainer.accelerator={s.accelerator}", "trainer.devices=1", f"trainer.precision={s.precision}",
            f"trainer.log_every_n_steps={max(1, min(5, steps // 2))}",  # the last step's loss is logged
            "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false",
            f"checkpoint.every_n_steps={max(1, steps // 2)}", "evaluation.benchmarks=[]"]


def fit_command(ctx: Context, name: str, steps: int) -> List[str]:
    config, extra = FIT_RUNS[name]
    return [sys.executable, "-m", "lightning_modules.fit", "--config", str(REPO_ROOT / config),
            *fit_overrides(ctx, name, steps), *extra]


def run_logged(command: List[str], log: Path, timeout_s: float) -> dict:
    """Run `command` (output to `log`) under a hard timeout; its return code (None: killed at the timeout)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as handle:
        handle.write(" ".join(command) + "\n")
        handle.flush()
        try:
            code: Optional[int] = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                                 timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = None
    return {"rc": code, "seconds": time.perf_counter() - start, "log": str(log)}


def last_scalars(run_dir: Path, tags: Sequence[str]) -> Dict[str, Optional[float]]:
    """The last value of each TensorBoard tag of a run (None where it logged none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb" / "version_0"))
    events.Reload()
    present = set(events.Tags().get("scalars", []))
    return {tag: events.Scalars(tag)[-1].value if tag in present else None for tag in tags}


def fit_summary(ctx: Context, name: str, ran: dict, steps: int) -> dict:
    """What one fit left: its export's step, its last logged loss and throughput, and whether it passed."""
    run_dir = ctx.work / "runs" / name
    export = read_json(run_dir / "export" / "model.json") or {}
    summary = {**ran, "steps": steps, "exported_step": export.get("global_step")}
    try:
        summary.update(last_scalars(run_dir, ("train/loss", "train/samples_per_s")))
    except Exception as error:  # no event file: the run failed early
        summary["tensorboard_error"] = error_text(error)
    loss = summary.get("train/loss")
    passed = ran["rc"] == 0 and export.get("global_step") == steps and loss is not None and math.isfinite(loss)
    summary["status"] = "ok" if passed else ("timeout" if ran["rc"] is None else "failed")
    if not passed:
        summary["output_tail"] = tail(Path(ran["log"]).read_text(errors="replace"))
    return summary


def fit(ctx: Context) -> bool:
    s, runs = ctx.settings, {}
    with ThreadPoolExecutor(max_workers=s.parallel_fits) as pool:
        futures = {pool.submit(run_logged, fit_command(ctx, name, s.steps), ctx.work / "logs" / f"fit-{name}.log",
                               s.part_timeout_s): name for name in FIT_RUNS}
        for future in as_completed(futures):
            name = futures[future]
            runs[name] = fit_summary(ctx, name, future.result(), s.steps)
            ctx.update(runs=dict(sorted(runs.items())))
    parts = [all(run["status"] == "ok" for run in runs.values())]
    if runs.get(RESUMED, {}).get("status") == "ok":
        parts += [resume(ctx), export_check(ctx), evaluation(ctx)]
    return all(parts)


def resume(ctx: Context) -> bool:
    """The same command with more steps: it must resume from the run's checkpoint and export the new step."""
    s = ctx.settings
    log = ctx.work / "logs" / f"resume-{RESUMED}.log"
    ran = run_logged(fit_command(ctx, RESUMED, s.resume_steps), log, s.part_timeout_s)
    summary = fit_summary(ctx, RESUMED, ran, s.resume_steps)
    summary["resumed"] = "Resuming from" in log.read_text(errors="replace")
    summary["status"] = "ok" if summary["status"] == "ok" and summary["resumed"] else "failed"
    ctx.update(resume=summary)
    return summary["status"] == "ok"


def export_check(ctx: Context) -> bool:
    """The resumed run's export in plain open_clip and through `load_export`: the same features on the device."""
    try:
        ctx.update(export=compare_exports(ctx.work / "runs" / RESUMED / "export", ctx.settings.device))
    except Exception as error:
        ctx.update(export={"status": "failed", "error": error_text(error)})
    return ctx.document["export"]["status"] == "ok"


def compare_exports(export_dir: Path, device: str) -> dict:
    import open_clip
    import torch

    from modeling.export import load_export

    meta = json.loads((export_dir / "model.json").read_text())
    open_clip.add_model_config(export_dir / "model_configs")
    plain, _, _ = open_clip.create_model_and_transforms(meta["model"], pretrained=str(export_dir / "open_clip.pt"))
    plain = plain.to(device).eval()
    built = load_export(export_dir)
    ours = built.model.to(device).eval()
    images = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0)).to(device)
    ids = built.tokenizer(["a red square left of a blue circle", "a small green triangle"]).to(device)
    with torch.no_grad():
        gaps = [relative_gap(plain.encode_image(images), ours.encode_image(images)),
                relative_gap(plain.encode_text(ids), ours.encode_text(ids))]
    return {"status": "ok" if max(gaps) < 1e-5 else "failed", "global_step": meta["global_step"],
            "model": meta["model"], "image_gap": gaps[0], "text_gap": gaps[1]}


def relative_gap(a, b) -> float:
    """max |a - b| / max |a|, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / a.abs().max().clamp(min=1e-30))


def evaluation(ctx: Context) -> bool:
    """`python -m evaluation.evaluate` of the resumed run's export on the world's swap set, on the device."""
    s = ctx.settings
    out = ctx.work / "eval"
    precision = "bf16-mixed" if s.device == "cuda" else "32-true"
    command = [sys.executable, "-m", "evaluation.evaluate", "--run", str(ctx.work / "runs" / RESUMED),
               "--benchmarks", "shapes_swap", f"roots.shapes_swap={ctx.bundle / gpu_bundle.WORLD}",
               "--device", s.device, "--precision", precision, "--num-workers", str(s.workers), "--no-progress",
               "--out", str(out)]
    ran = run_logged(command, ctx.work / "logs" / "evaluate.log", s.part_timeout_s)
    aggregates = (read_json(out / "aggregates.json") or {}).get("benchmarks", {}).get("shapes_swap", {}).get(
        "aggregates")
    passed = ran["rc"] == 0 and bool(aggregates)
    summary = {**ran, "precision": precision, "status": "ok" if passed else "failed", "shapes_swap": aggregates}
    if not passed:
        summary["output_tail"] = tail(Path(ran["log"]).read_text(errors="replace"))
    ctx.update(evaluation=summary)
    return passed


# ----- numerics: one step on the CPU against the device ---------------------------------------------------------
def numerics(ctx: Context) -> bool:
    rows = {}
    for name in FIT_RUNS:
        try:
            rows[name] = compare_step(ctx, name)
        except Exception as error:
            rows[name] = {"status": "failed", "error": error_text(error)}
        ctx.update(methods=rows, term_tolerance=TERM_TOLERANCE, gradient_tolerance=GRADIENT_TOLERANCE)
    return all(row["status"] == "ok" for row in rows.values())


def host_batch(ctx: Context, name: str):
    """The method's module (CPU, float32, seeded) and its first training batch as the Trainer prepares it."""
    import torch

    from lightning_modules import load_run_config
    from lightning_modules.fit import build_datamodule, build_module

    config, extra = FIT_RUNS[name]
    cfg = load_run_config([REPO_ROOT / config], [*fit_overrides(ctx, name, 1), "trainer.accelerator=cpu",
                                                 "trainer.precision=32-true", "data.num_workers=0", *extra])
    torch.manual_seed(0)
    module = build_module(cfg).train()
    datamodule = build_datamodule(cfg, module)
    datamodule.setup("fit")
    if hasattr(module, "replacement_vocabulary"):  # CAE's setup takes it from the Trainer's datamodule
        module.replacement_vocabulary = getattr(datamodule, "replacement_vocabulary", None)
    batch = next(iter(datamodule.train_dataloader()))
    return module, module.on_before_batch_transfer(batch, 0)


def forward_backward(module, batch, autocast: bool = False) -> Dict[str, object]:
    """The loss terms (tensors) of one forward, after their backward (the gradients are on the parameters)."""
    import torch

    from lightning_modules.base import total_loss

    module.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    device = next(module.parameters()).device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        terms, _ = module.compute_terms(batch)
        loss = total_loss(terms)
    loss.backward()
    return terms


def read_step(module, terms: Dict[str, object]) -> Tuple[Dict[str, float], Dict[str, object]]:
    """The terms as floats and every parameter's gradient in float64 on the CPU."""
    grads = {n: p.grad.detach().double().cpu() for n, p in module.named_parameters() if p.grad is not None}
    return {n: float(v.detach().double()) for n, v in terms.items()}, grads


def device_reads(step: Callable[[], object], device: str) -> Tuple[object, Optional[int]]:
    """`step()` and how many synchronising CUDA calls it made (None on the CPU)."""
    import torch

    if device != "cuda":
        return step(), None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


def compare_step(ctx: Context, name: str) -> dict:
    import torch
    from lightning.fabric.utilities.apply_func import move_data_to_device

    device = ctx.settings.device
    module, batch = host_batch(ctx, name)
    on_device = copy.deepcopy(module).to(device)
    device_batch = move_data_to_device(batch, torch.device(device))
    cpu_terms, cpu_grads = read_step(module, forward_backward(module, batch))
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    try:
        device_terms, reads = device_reads(lambda: forward_backward(on_device, device_batch), device)
        terms, grads = read_step(on_device, device_terms)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_tf32
    bf16_terms, _ = read_step(on_device, forward_backward(on_device, device_batch, autocast=True))
    term_gap = max(abs(terms[n] - v) / max(abs(v), 1e-6) for n, v in cpu_terms.items())
    gradient_gap = vector_gap(cpu_grads, grads)
    passed = term_gap <= TERM_TOLERANCE and gradient_gap <= GRADIENT_TOLERANCE and set(grads) == set(cpu_grads)
    return {"status": "ok" if passed else "failed", "cpu_terms": cpu_terms, "device_terms": terms,
            "bf16_terms": bf16_terms, "term_gap": term_gap, "gradient_gap": gradient_gap,
            "bf16_loss_gap": abs(sum(bf16_terms.values()) - sum(cpu_terms.values()))
            / max(abs(sum(cpu_terms.values())), 1e-6),
            "parameters_with_grad": len(grads), "device_reads_per_step": reads}


def vector_gap(reference: Dict[str, object], other: Dict[str, object]) -> float:
    """||other - reference|| / ||reference|| over every gradient taken as one vector (float64)."""
    import torch

    diff = math.sqrt(sum(float(((other[n] - g) ** 2).sum()) for n, g in reference.items() if n in other))
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in reference.values()))
    return diff / max(norm, 1e-30) if reference else float(torch.inf)


# ----- the command ----------------------------------------------------------------------------------------------
RUNNERS: Dict[str, Callable[[Context], bool]] = {"environment": environment, "fit": fit, "numerics": numerics}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=sorted(RUNNERS))
    parser.add_argument("--device", choices=sorted(SETTINGS), default="cuda")
    parser.add_argument("--bundle", type=Path, default=gpu_bundle.DEFAULT_BUNDLE)
    parser.add_argument("--work", type=Path, required=True, help="the stage's working folder (runs, logs)")
    add_output(parser, "file", required=True, help="the stage's result JSON")
    return parser.parse_args(argv)


def end_group(signum: int, frame) -> None:
    """SIGTERM (the check's timeout, or the check ended): this stage and every process it started end now."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if os.getpgrp() == os.getpid():  # the leader of its own group, as the check starts it
        signal.signal(signal.SIGTERM, end_group)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ctx = Context(SETTINGS[args.device], args.bundle.resolve(), args.work.resolve(), args.out)
    passed = RUNNERS[args.stage](ctx)
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()

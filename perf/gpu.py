"""`python -m perf.gpu`: the GPU throughput table, every method and the offline jobs timed on one GPU.

    python -m perf.gpu [--out runs/perf_gpu] [--peak-tflops T] [--budget-s 420]
    python -m perf.gpu --cpu-smoke      # the same code paths on the CPU at tiny settings (the test suite runs it)

It writes one JSON document and one Markdown table (`--out PATH`: PATH.json and PATH.md), rewritten after every
row and section, so a run killed part-way leaves what it finished. Sections run under time budgets, so the whole
run stays within `--budget-s` (default 7 minutes); a row or section that fails (out of memory, an op without
CUDA support) is recorded with its error and the rest still runs. `--no-budget` runs every row and section in
full, whatever the time (the tests: what they check must not depend on how fast the machine is). The budget is
the tool's own pacing; the GPU node check (`python -m gpucheck`) runs it as one stage under a hard timeout.

training    every row is a `perf.step` variant, built and stepped by `perf.step.Variant` (the same model builder,
            batch and step as `python -m perf.step`: CUDA synchronised around each step, timed with
            time.perf_counter): bf16-mixed (autocast bf16 over fp32 weights, as Lightning's "bf16-mixed") at
            ViT-B/32 with random weights, global batch 256 on one GPU; a row `name@B` runs the variant at batch B,
            `name+P` in precision P (Lightning's names, or `tf32`: 32-true with TF32 tensor-core matrix products).
            Each batch is prepared as the Trainer prepares it (`on_before_batch_transfer`), so the step reads
            nothing back from the device that training does not.
            The first warm-up step also checks that the loss and every gradient are finite (for the
            gradient-based CAE attributions this is their double backward). Then up to `--steps` timed steps:
            samples/s of the median step; peak memory = torch.cuda.max_memory_allocated, reset per method (and
            by `Variant` at each step's forward; every step is alike, so the last step's peak is the method's:
            weights, AdamW state and activations). For every row the FLOPs of one training step are counted by
            torch.utils.flop_counter.FlopCounterMode (forward and backward: matrix products, convolutions and the
            attention kernels it has formulas for; the optimizer's element-wise work is not counted), and the
            model FLOP utilisation is FLOPs / median step time / the device's dense peak in the row's precision
            (bf16 and fp16: the bf16 peak; tf32: half of it, the tensor cores' TF32 rate on Ampere, Ada and
            Hopper; plain fp32 has no tensor-core peak and is given against the measured fp32 matmul only).
grounding   GroundingDINO as the preprocessing job runs it (`parsers.grounding`, fp32, one prompt per phrase) at
            800 px on generated 640x480 images with 4 phrases each, random detector weights (as
            `preprocess.allow_random_detector`) and a random BERT-base (speed does not depend on the weights):
            images/s and (image, phrase) pairs/s.
evaluation  our harness (`evaluation.harness.run_benchmark` with a `ClipScorer`, 32-true as the evaluate
            CLI's default) on generated stand-in data (`perf.evaluate.write_standin`): items/s.

The device section gives the GPU's name, its dense bf16 peak (BF16_PEAK_TFLOPS, from vendor datasheets, or
`--peak-tflops`; the output says which) and the rates of bf16, tf32 and fp32 matrix products measured here (the
achievable ceilings; each row's MFU is given against its precision's too). Where spaCy is not installed, the
training batch's caption records are written beforehand where it is (`--write-records --out FILE`) and read with
`--records FILE` (the GPU node check's bundle carries them: docs/gpu.md).
A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from core.cli import add_output, output_paths, refuse_renamed
from core.files import atomic_write_text
from perf import step

SCHEMA = "perf_gpu/1"
DEFAULT_OUT = Path("runs/perf_gpu")
SECTIONS = ("training", "grounding", "evaluation")
# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from the vendors' datasheets, matched against the CUDA
# device name in this order (the first match wins, so the more specific names come first).
BF16_PEAK_TFLOPS: Tuple[Tuple[str, str, float], ...] = (
    (r"GH200", "NVIDIA GH200 (H100/H200 SXM rate)", 989.4),
    (r"H200 NVL", "NVIDIA H200 NVL", 835.5),
    (r"H200", "NVIDIA H200 SXM", 989.4),
    (r"H100 NVL", "NVIDIA H100 NVL", 835.5),
    (r"H100 PCIe", "NVIDIA H100 PCIe", 756.5),
    (r"H100|H800", "NVIDIA H100 SXM", 989.4),
    (r"A100|A800", "NVIDIA A100", 312.0),
    (r"L40S", "NVIDIA L40S", 362.05),
    (r"L40\b", "NVIDIA L40", 181.05),
    (r"\bL4\b", "NVIDIA L4", 121.0),
    (r"\bA10\b", "NVIDIA A10", 125.0),
    (r"\bB200\b", "NVIDIA B200", 2250.0),
)
# The methods first (paper configurations), then our options; `name@B` runs perf.step's `name` at batch B.
# tflocal@64 is the TFLocal recipe's batch: its full 256 x 256 grid is 65,536 aligner sequences per step.
# CLIP-FT also in TF32 and plain fp32, against bf16-mixed (`+PRECISION` rows).
LEAD_ROWS = ("clip_ft", "clip_ft+tf32", "clip_ft+32-true", "negclip", "cae_attention", "cae_gradcam",
             "cae_perturbation", "cae_gradient", "cae_grad_eclip", "macco", "smartclip", "tflocal", "tflocal@64",
             "tflocal_hard16", "tfglobal")
DEFAULT_ROWS = LEAD_ROWS + tuple(name for name in step.VARIANTS if name not in LEAD_ROWS)
# --methods may name these groups of rows.
ROW_GROUPS = {"lead": LEAD_ROWS, "all": DEFAULT_ROWS}
# A row's precision after `+`: Lightning's names perf.step runs, and TF32 (32-true with TF32 matrix products).
TF32 = "tf32"
ROW_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", TF32)
# The dense tensor-core peak of a precision as a fraction of the bf16 peak (None: no tensor-core peak, fp32).
PEAK_OF_BF16 = {"bf16-mixed": 1.0, "16-mixed": 1.0, TF32: 0.5, "32-true": None}
DOUBLE_BACKWARD = ("=gradcam", "=gradient", "=grad_eclip")  # attributions differentiated inside the loss
# The phrases every generated image is grounded with (COCO-like relation / attribute phrases).
GROUNDING_PHRASES = ("a man riding a horse", "a red umbrella", "a dog lying on the grass", "two people on a bench")
TRAINING_KEYS = ("method", "variant", "batch_size", "precision", "status", "error", "samples_per_s", "median_step_s",
                 "step_times_s", "timed_steps", "warmup_steps", "peak_memory_gib", "memory_kind", "loss",
                 "loss_finite", "grads_finite", "parameters_with_grad", "trainable_parameters", "double_backward",
                 "setup_s", "flops_per_step", "flops_by_op", "achieved_tflops", "peak_tflops", "mfu",
                 "mfu_of_matmul")


@dataclass(frozen=True)
class Settings:
    """What differs between the GPU run and its tiny CPU mode."""

    model: str
    batch_size: int
    steps: int
    warmup: int
    precision: str  # perf.step's: "bf16-mixed" = autocast bf16 over fp32 weights
    budget_s: Optional[float]  # None: no budget (--no-budget), every row and section runs in full
    grounding_budget_s: float
    evaluation_budget_s: float
    grounding_size: int
    grounding_images: int
    grounding_phrases: int
    grounding_batch: int
    grounding_passes: int  # timed passes over the images at most (fewer when the budget runs out)
    bert: str  # "base": a random BERT-base (real cost); "tiny": 1 layer of width 32
    eval_benchmarks: Tuple[str, ...]
    eval_items: int
    eval_batch: int
    eval_workers: int
    matmul_size: int


GPU = Settings(model="ViT-B-32", batch_size=256, steps=20, warmup=3, precision="bf16-mixed", budget_s=420,
               grounding_budget_s=60, evaluation_budget_s=60, grounding_size=800, grounding_images=8,
               grounding_phrases=4, grounding_batch=4, grounding_passes=5, bert="base",
               eval_benchmarks=("sugarcrepe",), eval_items=2100, eval_batch=256,
               eval_workers=min(8, os.cpu_count() or 1), matmul_size=8192)
CPU_SMOKE = Settings(model="ViT-Tiny-16-64", batch_size=4, steps=2, warmup=1, precision="bf16-mixed", budget_s=240,
                     grounding_budget_s=1, evaluation_budget_s=30, grounding_size=224, grounding_images=1,
                     grounding_phrases=1, grounding_batch=1, grounding_passes=1, bert="tiny",
                     eval_benchmarks=("sugarcrepe",), eval_items=14, eval_batch=8, eval_workers=0, matmul_size=256)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny model, batch 4, 2 steps, tiny GroundingDINO text encoder, a few evaluation items, "
                             "on the CPU: the same code paths, for tests")
    add_output(parser, "formats", help=f"the JSON document and the Markdown table, each with its own suffix "
               f"(default {DEFAULT_OUT}.json and {DEFAULT_OUT}.md); with --write-records, the records' JSON")
    parser.add_argument("--methods", help=f"comma list of rows: perf.step variants, each optionally name@BATCH and "
                                          f"+PRECISION ({', '.join(ROW_PRECISIONS)}), or the groups lead (the "
                                          f"methods' paper configurations: {','.join(LEAD_ROWS)}) and all (default: "
                                          f"all; with --cpu-smoke lead); variants: {', '.join(step.VARIANTS)}")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (overrides the table)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-s", type=float, help="the whole run's time budget (GPU default 420 s)")
    budget.add_argument("--no-budget", action="store_true", help="no time budget: every row runs its --steps "
                        "steps and every section runs, however long it takes")
    parser.add_argument("--steps", type=int, help="timed steps per method (default 20)")
    parser.add_argument("--records", type=Path, help="caption records written by --write-records (no spaCy needed)")
    parser.add_argument("--write-records", action="store_true",
                        help="parse the training batch's captions (spaCy) into --out for --records, then exit")
    parser.add_argument("--record-count", type=int, default=256, help="captions written by --write-records")
    refuse_renamed(parser, {"--json": "--out PATH (writes PATH.json and PATH.md)",
                            "--md": "--out PATH (writes PATH.json and PATH.md)"})
    args = parser.parse_args(argv)
    if args.write_records and args.out is None:
        parser.error("--write-records needs --out FILE (the records' JSON)")
    return args


# ----- the device ---------------------------------------------------------------------------------------------
def bf16_peak(name: str, override: Optional[float]) -> Tuple[Optional[float], str]:
    """(dense bf16 peak in TFLOP/s, where it came from) for a device name; None when unknown."""
    if override is not None:
        return override, "--peak-tflops"
    for pattern, label, tflops in BF16_PEAK_TFLOPS:
        if re.search(pattern, name):
            return tflops, f"datasheet table: {label}"
    return None, f"no table entry for {name!r}: pass --peak-tflops"


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_tflops(device: str, size: int, repeats: int = 10, precision: str = "bf16-mixed") -> float:
    """Rate of a size^3 matrix product on random data in `precision` (bf16 and fp16 operands, fp32 with or
    without TF32): 3 warm-ups, the mean of `repeats` timed products."""
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision, torch.float32)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    with tf32_matmuls(precision == TF32):
        for _ in range(3):
            a @ b
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        synchronize(device)
    return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e12


@contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """fp32 matrix products and convolutions on TF32 tensor cores while `enabled` (torch's settings restored)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def device_info(device: str, peak_override: Optional[float], matmul_size: int) -> dict:
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        name = props.name
        details = {"capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
                   "memory_gib": props.total_memory / 2 ** 30, "cuda": torch.version.cuda}
    else:
        name = platform.processor() or platform.machine() or "cpu"
        details = {"threads": torch.get_num_threads()}
    peak, source = bf16_peak(name, peak_override)
    return {"kind": device.split(":")[0], "name": name, **details, "torch": torch.__version__,
            "python": platform.python_version(), "bf16_peak_tflops": peak, "peak_source": source,
            "matmul_size": matmul_size, "matmul_bf16_tflops": matmul_tflops(device, matmul_size),
            "matmul_tf32_tflops": matmul_tflops(device, matmul_size, precision=TF32),
            "matmul_fp32_tflops": matmul_tflops(device, matmul_size, precision="32-true")}


def peak_of(device: dict, precision: str) -> Optional[float]:
    """The device's dense tensor-core peak in `precision` (TFLOP/s), from its bf16 peak; None for plain fp32."""
    fraction, bf16 = PEAK_OF_BF16[precision], device["bf16_peak_tflops"]
    return None if fraction is None or bf16 is None else fraction * bf16


def measured_matmul(device: dict, precision: str) -> Optional[float]:
    key = {"bf16-mixed": "matmul_bf16_tflops", "16-mixed": "matmul_bf16_tflops", TF32: "matmul_tf32_tflops",
           "32-true": "matmul_fp32_tflops"}[precision]
    return device.get(key)


# ----- time budgets -------------------------------------------------------------------------------------------
class Budget:
    """A deadline `total_s` from now (None: never), and the seconds left to it."""

    def __init__(self, total_s: Optional[float]):
        self.deadline = math.inf if total_s is None else time.perf_counter() + total_s

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def error_text(error: BaseException) -> str:
    """One line: the exception's type and its message's first line (shortened)."""
    lines = str(error).strip().splitlines()
    message = lines[0] if lines else ""
    return f"{type(error).__name__}: {message[:300]}"


def release_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ----- training -----------------------------------------------------------------------------------------------
def parse_row(label: str, batch_size: int, fixed_batch: bool, precision: str = "bf16-mixed"
              ) -> Tuple[str, int, str]:
    """(perf.step variant, batch, precision) of a row label `name[@B][+P]`; `fixed_batch` ignores B (the CPU
    mode); P defaults to `precision`."""
    name_and_batch, _, row_precision = label.partition("+")
    name, _, batch = name_and_batch.partition("@")
    if name not in step.VARIANTS:
        raise SystemExit(f"unknown perf.step variant {name!r} in --methods; known: {sorted(step.VARIANTS)}")
    if batch and not batch.isdigit():
        raise SystemExit(f"--methods row {label!r}: the batch after @ must be a positive integer")
    if row_precision and row_precision not in ROW_PRECISIONS:
        raise SystemExit(f"--methods row {label!r}: the precision after + is one of {', '.join(ROW_PRECISIONS)}")
    return name, batch_size if fixed_batch or not batch else int(batch), row_precision or precision


def empty_row(label: str, name: str, batch_size: int, precision: str) -> dict:
    row = dict.fromkeys(TRAINING_KEYS)
    row.update(method=label, variant=name, batch_size=batch_size, precision=precision, status="skipped",
               step_times_s=[], timed_steps=0,
               double_backward=any(o.endswith(DOUBLE_BACKWARD) for o in step.VARIANTS[name]))
    return row


def checked_step(variant: step.Variant) -> dict:
    """One untimed training step that checks the loss and every gradient are finite (before the optimizer)."""
    loss = variant._forward()
    loss.backward()
    params = [p for group in variant.optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params if p.grad is not None]
    grads_finite = bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()) if grads else False
    variant.optimizer.step()
    variant.optimizer.zero_grad(set_to_none=True)
    return {"loss": float(loss.detach()), "loss_finite": bool(torch.isfinite(loss.detach())),
            "grads_finite": grads_finite, "parameters_with_grad": len(grads), "trainable_parameters": len(params)}


def step_flops(variant: step.Variant) -> Tuple[int, Dict[str, int]]:
    """FLOPs of one whole training step (untimed) by torch's FlopCounterMode, in total and per operator."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        variant.step(timed=False)
    by_op = {str(op): int(count) for op, count in counter.get_flop_counts().get("Global", {}).items()}
    return int(counter.get_total_flops()), by_op


def timed_steps(variant: step.Variant, steps: int, deadline: float) -> None:
    """Up to `steps` timed steps; stops early (after at least one) when the next would pass `deadline`."""
    while len(variant.times) < steps:
        if variant.times and time.perf_counter() + statistics.median(variant.times) > deadline:
            return
        variant.step(timed=True)


def add_rates(row: dict, variant: step.Variant, device: dict) -> None:
    median = statistics.median(variant.times)
    row.update(step_times_s=list(variant.times), timed_steps=len(variant.times), median_step_s=median,
               samples_per_s=row["batch_size"] / median)
    if row["flops_per_step"]:
        achieved = row["flops_per_step"] / median / 1e12
        peak, matmul = peak_of(device, row["precision"]), measured_matmul(device, row["precision"])
        row.update(achieved_tflops=achieved, peak_tflops=peak, mfu=achieved / peak if peak else None,
                   mfu_of_matmul=achieved / matmul if matmul else None)


def peak_memory(variant: step.Variant, device: str) -> Tuple[float, str]:
    """GiB: the CUDA allocator's peak (see the module docstring); on the CPU perf.step's saved-for-backward."""
    if device.startswith("cuda"):
        return max(torch.cuda.max_memory_allocated(device), variant.memory_bytes) / 2 ** 30, "cuda_max_allocated"
    return variant.memory_bytes / 2 ** 30, "cpu_saved_for_backward"


def run_variant(row: dict, settings: Settings, device: dict, deadline: float) -> None:
    """Build, check, warm up and time one row in place (exceptions propagate to `training_row`)."""
    kind = device["kind"]
    precision = "32-true" if row["precision"] == TF32 else row["precision"]
    args = argparse.Namespace(model=settings.model, batch_size=row["batch_size"], device=kind,
                              precision=precision, overrides=[], captions=step.DEFAULT_CAPTIONS)
    start = time.perf_counter()
    with tf32_matmuls(row["precision"] == TF32):
        variant = step.Variant(row["variant"], args)
        row.update(checked_step(variant))
        for _ in range(settings.warmup - 1):
            variant.step(timed=False)
        row["flops_per_step"], row["flops_by_op"] = step_flops(variant)
        row["setup_s"] = time.perf_counter() - start
        timed_steps(variant, settings.steps, deadline)
    row["peak_memory_gib"], row["memory_kind"] = peak_memory(variant, kind)
    add_rates(row, variant, device)
    finite = row["loss_finite"] and row["grads_finite"]
    row.update(status="ok" if finite else "error",
               error=None if finite else f"non-finite loss or gradients (loss {row['loss']})")


def training_row(label: str, settings: Settings, device: dict, deadline: float, fixed_batch: bool) -> dict:
    name, batch_size, precision = parse_row(label, settings.batch_size, fixed_batch, settings.precision)
    row = empty_row(label, name, batch_size, precision)
    if deadline - time.perf_counter() <= 0:
        row["error"] = "time budget spent"
        return row
    if device["kind"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        run_variant(row, settings, device, deadline)
    except Exception as error:  # an OOM or an op without CUDA support: record it, go on with the next method
        row.update(status="error", error=error_text(error))
    finally:
        release_memory(device["kind"])
    return row


def training_section(rows: Sequence[str], settings: Settings, device: dict, budget_s: float,
                     fixed_batch: bool, finished: Callable[[Dict[str, dict]], None] = lambda rows: None
                     ) -> Dict[str, dict]:
    """Every row under its share of the section's budget: up to twice an even split of what is left, so a slow
    row early on can use what the fast ones leave (most rows take a fraction of their share). `finished` gets
    the rows so far after each one."""
    section = Budget(budget_s)
    results: Dict[str, dict] = {}
    for index, label in enumerate(rows):
        share = min(max(section.left(), 0.0), 2 * max(section.left(), 0.0) / (len(rows) - index))
        results[label] = training_row(label, settings, device, time.perf_counter() + share, fixed_batch)
        print(training_line(results[label]), flush=True)
        finished(results)
    return results


def training_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['method']:<24} {row['status']}: {row['error']}"
    return (f"{row['method']:<24} {row['samples_per_s']:10.1f} samples/s  {1000 * row['median_step_s']:9.1f} ms  "
            f"{row['peak_memory_gib']:7.2f} GiB")


# ----- records for an interpreter without spaCy --------------------------------------------------------------
def write_records(path: Path, count: int) -> None:
    """The first `count` batch captions (perf.step.real_captions) with their preprocessing records."""
    captions = step.real_captions(count)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"captions": len(captions), "records": step.cache_records(captions)}))


def use_records(path: Path) -> None:
    step.PREPARED_RECORDS[:] = json.loads(path.read_text())["records"]


# ----- grounding ----------------------------------------------------------------------------------------------
def write_tiny_bert(directory: Path, words: Sequence[str]) -> str:
    """A random 1-layer BERT of width 32 with a WordPiece vocabulary of `words` (the CPU mode's text encoder)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from perf.preprocess import BERT_SPECIAL_TOKENS

    directory.mkdir()
    vocab = BERT_SPECIAL_TOKENS + sorted(set(words) - set(BERT_SPECIAL_TOKENS))
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(directory)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    BertModel(config).save_pretrained(directory)
    return str(directory)


def grounding_section(settings: Settings, device: str, budget_s: float, workdir: Path) -> dict:
    """GroundingDINO images/s: a model load, one warm-up batch, then passes over all images until the budget."""
    from parsers.grounding import GroundingRequest, build_grounder
    from perf.preprocess import write_images, write_random_bert_base

    deadline = time.perf_counter() + budget_s
    workdir.mkdir(parents=True, exist_ok=True)
    phrases = list(GROUNDING_PHRASES[:settings.grounding_phrases])
    words = sorted({word for phrase in phrases for word in phrase.split()})
    write_bert = write_random_bert_base if settings.bert == "base" else write_tiny_bert
    text_encoder = write_bert(workdir / "bert", words)
    grounder = build_grounder("groundingdino", checkpoint=None, text_encoder=text_encoder,
                              image_size=settings.grounding_size, batch_size=settings.grounding_batch, device=device,
                              allow_random_weights=True)
    requests = [GroundingRequest(path, phrases) for path in write_images(workdir, settings.grounding_images)]
    start = time.perf_counter()
    grounder.ground(requests[:settings.grounding_batch])  # loads the model, then warms up
    setup_s = time.perf_counter() - start
    seconds = timed_passes(lambda: grounder.ground(requests), device, deadline, settings.grounding_passes)
    median = statistics.median(seconds)
    return {"status": "ok", "error": None, "image_size": settings.grounding_size, "max_size": grounder.max_size,
            "images": len(requests), "phrases_per_image": len(phrases), "batch_images": settings.grounding_batch,
            "text_encoder": "random bert-base" if settings.bert == "base" else "random tiny bert",
            "setup_s": setup_s, "pass_seconds": seconds, "images_per_s": len(requests) / median,
            "pairs_per_s": len(requests) * len(phrases) / median}


def timed_passes(run: Callable[[], object], device: str, deadline: float, passes: int) -> List[float]:
    """Seconds of each call of `run`, repeated (1..`passes` times) while the next is expected to end before
    `deadline`."""
    seconds: List[float] = []
    while not seconds or time.perf_counter() + statistics.median(seconds) < deadline:
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        if len(seconds) >= passes:
            break
    return seconds


# ----- evaluation ---------------------------------------------------------------------------------------------
def evaluation_section(settings: Settings, device: str, budget_s: float, workdir: Path) -> dict:
    """Items/s of the harness per stand-in benchmark, each with a fresh scorer after a short warm-up."""
    from evaluation.benchmarks import build_benchmark
    from evaluation.harness import run_benchmark
    from evaluation.scorers import ClipScorer
    from perf.evaluate import timed_run, write_standin

    deadline = time.perf_counter() + budget_s
    torch.manual_seed(0)
    built = ClipScorer.from_pretrained(settings.model, None, device=device)

    def fresh() -> ClipScorer:  # same weights, empty embedding caches
        return ClipScorer(built.model, built.tokenizer, built.preprocess, device=device,
                          batch_size=settings.eval_batch, num_workers=settings.eval_workers)

    rows = {}
    for name in settings.eval_benchmarks:
        if time.perf_counter() > deadline:
            rows[name] = {"status": "skipped", "error": "time budget spent"}
            continue
        benchmark = build_benchmark(name, workdir / name, **write_standin(name, workdir, settings.eval_items))
        timed_run(benchmark, benchmark.items()[:settings.eval_batch], fresh())  # workers, kernels, caches warm
        synchronize(device)
        result = run_benchmark(benchmark, fresh())
        rows[name] = {"status": "ok", "error": None, "items": len(result.outcomes), "seconds": result.seconds,
                      "items_per_s": len(result.outcomes) / result.seconds}
    return {"status": "ok", "error": None, "precision": "32-true", "batch_size": settings.eval_batch,
            "num_workers": settings.eval_workers, "benchmarks": rows}


# ----- the run ------------------------------------------------------------------------------------------------
def guarded(section: Callable[[], dict]) -> dict:
    """A section's result, or its error (the other sections still run)."""
    try:
        return section()
    except Exception as error:
        return {"status": "error", "error": error_text(error)}


def budgeted(share_s: float, section: Callable[[], dict]) -> dict:
    """`guarded(section)` when it has time left, else a skipped section (the whole run keeps its budget)."""
    if share_s <= 0:
        return {"status": "skipped", "error": "time budget spent"}
    return guarded(section)


def check_can_run(args: argparse.Namespace, sections: Sequence[str]) -> None:
    """Refuse before any work: no CUDA device (outside the CPU mode), or a batch nothing can parse."""
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("perf.gpu: no CUDA device here (torch.cuda.is_available() is False) and this benchmark times "
                         "GPU training; run `python -m perf.gpu --cpu-smoke` for its tiny CPU mode")
    if "training" in sections and args.records is None and importlib.util.find_spec("spacy") is None:
        raise SystemExit("perf.gpu: spaCy is not installed here, so the training batch's captions cannot be parsed; "
                         "write their records where it is (`python -m perf.gpu --write-records --out "
                         "records.json`) and pass --records")


def section_share(settings: Settings, cap_s: float, left_s: float) -> float:
    """A later section's time: its cap, or what the whole run has left when that is less; no limit without a
    budget."""
    return math.inf if settings.budget_s is None else min(cap_s, left_s)


def run_sections(args: argparse.Namespace, settings: Settings, sections: Sequence[str], rows: Sequence[str],
                 save: Callable[[dict], None] = lambda result: None) -> dict:
    """Every section in turn; `save` gets the result so far after each training row and each section (with
    `elapsed_s` up to then)."""
    start = time.perf_counter()

    def saved(result: dict) -> None:
        save({**result, "elapsed_s": time.perf_counter() - start})

    budget = Budget(settings.budget_s)
    kind = "cpu" if args.cpu_smoke else "cuda"
    device = device_info(kind, args.peak_tflops, settings.matmul_size)
    print(f"{device['name']}: bf16 peak {device['bf16_peak_tflops']} TFLOP/s ({device['peak_source']}); "
          f"measured {device['matmul_bf16_tflops']:.1f} TFLOP/s", flush=True)
    result = {"schema": SCHEMA, "mode": "cpu_smoke" if args.cpu_smoke else "gpu", "device": device,
              "settings": {**settings.__dict__, "sections": list(sections)}}
    saved(result)
    later = {"grounding": settings.grounding_budget_s, "evaluation": settings.evaluation_budget_s}
    with tempfile.TemporaryDirectory(prefix="perf_gpu_") as tmp:
        if "training" in sections:
            reserved = sum(later[name] for name in sections if name in later)
            result["training"] = training_section(rows, settings, device, budget.left() - reserved, args.cpu_smoke,
                                                  lambda rows_so_far: saved({**result, "training": rows_so_far}))
            saved(result)
        if "grounding" in sections:
            share = section_share(settings, settings.grounding_budget_s,
                                  budget.left() - later["evaluation"] * ("evaluation" in sections))
            result["grounding"] = budgeted(share, lambda: grounding_section(settings, kind, share,
                                                                             Path(tmp) / "grounding"))
            saved(result)
        if "evaluation" in sections:
            share = section_share(settings, settings.evaluation_budget_s, budget.left())
            result["evaluation"] = budgeted(share, lambda: evaluation_section(settings, kind, share,
                                                                               Path(tmp) / "evaluation"))
    result["elapsed_s"] = time.perf_counter() - start
    return result


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    if args.write_records:
        records = output_paths(args.out, [".json"])[".json"]
        write_records(records, args.record_count)
        print(f"wrote {args.record_count} caption records to {records}")
        return {}
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {list(SECTIONS)}")
    check_can_run(args, sections)
    settings = CPU_SMOKE if args.cpu_smoke else GPU
    overrides = {"budget_s": args.budget_s, "steps": args.steps}
    settings = Settings(**{**settings.__dict__, **{k: v for k, v in overrides.items() if v is not None},
                           **({"budget_s": None} if args.no_budget else {})})
    given = args.methods or ("lead" if args.cpu_smoke else "all")
    rows = [row for label in given.split(",") if label.strip()
            for row in ROW_GROUPS.get(label.strip(), (label.strip(),))]
    for label in rows:
        parse_row(label, settings.batch_size, args.cpu_smoke)  # a bad name fails before any work
    if args.records is not None:
        use_records(args.records)
    paths = output_paths(args.out or DEFAULT_OUT, [".json", ".md"])
    result = run_sections(args, settings, sections, rows, lambda so_far: write_result(so_far, paths))
    write_result(result, paths)
    print(f"\n{markdown_report(result)}\nwrote {paths['.json']} and {paths['.md']}", flush=True)
    return result


def write_result(result: dict, paths: Dict[str, Path]) -> None:
    """The JSON document and the Markdown table of `result` (so far), each replaced whole (atomically)."""
    paths[".json"].parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths[".json"], json.dumps(result, indent=2))
    atomic_write_text(paths[".md"], markdown_report(result))


# ----- the Markdown table -------------------------------------------------------------------------------------
def number(value: Optional[float], form: str) -> str:
    return "-" if value is None else format(value, form)


def cell(text: Optional[str]) -> str:
    return "" if not text else text.replace("|", "\\|")


def budget_text(budget_s: Optional[float]) -> str:
    return "(no time budget)" if budget_s is None else f"of a {budget_s:.0f} s budget"


def markdown_report(result: dict) -> str:
    device = result["device"]
    lines = [f"# GPU throughput (`python -m perf.gpu`, mode {result['mode']})", "",
             f"Device: {device['name']} ({device['kind']}), torch {device['torch']}. Dense bf16 peak: "
             f"{number(device['bf16_peak_tflops'], '.1f')} TFLOP/s ({device['peak_source']}); a "
             f"{device['matmul_size']}^3 matrix product measured {device['matmul_bf16_tflops']:.1f} TFLOP/s in bf16, "
             f"{device['matmul_tf32_tflops']:.1f} in tf32, {device['matmul_fp32_tflops']:.1f} in fp32. "
             f"Whole run {result['elapsed_s']:.0f} s {budget_text(result['settings']['budget_s'])}.", ""]
    for name, section in (("training", training_table), ("grounding", grounding_table),
                          ("evaluation", evaluation_table)):
        if name in result:
            lines += section(result) + [""]
    return "\n".join(lines)


def training_table(result: dict) -> List[str]:
    s = result["settings"]
    lines = [f"## Training: {s['model']}, random weights, precision {s['precision']} unless the row says (bf16-mixed: "
             f"autocast over fp32 weights), median of up to {s['steps']} timed steps after {s['warmup']} warm-up", "",
             "MFU: FLOPs of a step (FlopCounterMode) / median step time / the dense peak of the row's precision; "
             "of matmul: / the rate of a matrix product in that precision measured here.", "",
             "| method | batch | precision | status | samples/s | step (ms) | peak memory (GiB) | GFLOP/step | "
             "TFLOP/s | MFU | of matmul | notes |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in result.get("training", {}).values():
        notes = [row["error"]] if row["error"] else []
        if row["timed_steps"] and row["timed_steps"] < s["steps"]:
            notes.append(f"{row['timed_steps']} timed steps (budget)")
        if row["double_backward"] and row["grads_finite"]:
            notes.append("double backward ran, gradients finite")
        step_ms = row["median_step_s"] and 1000 * row["median_step_s"]
        gflop = row["flops_per_step"] and row["flops_per_step"] / 1e9
        lines.append(f"| {row['method']} | {row['batch_size']} | {row['precision']} | {row['status']} | "
                     f"{number(row['samples_per_s'], '.1f')} | {number(step_ms, '.1f')} | "
                     f"{number(row['peak_memory_gib'], '.2f')} | {number(gflop, ',.1f')} | "
                     f"{number(row['achieved_tflops'], '.3g')} | {number(row['mfu'], '.1%')} | "
                     f"{number(row['mfu_of_matmul'], '.1%')} | {cell('; '.join(notes))} |")
    return lines


def grounding_table(result: dict) -> List[str]:
    g = result["grounding"]
    if g["status"] != "ok":
        return ["## GroundingDINO preprocessing", "", f"status {g['status']}: {cell(g['error'])}"]
    return ["## GroundingDINO preprocessing (parsers.grounding, fp32, one prompt per phrase, random weights)", "",
            "| image size | images | phrases/image | images per forward | images/s | pairs/s | text encoder |",
            "|---:|---:|---:|---:|---:|---:|---|",
            f"| {g['image_size']} (max {g['max_size']}) | {g['images']} | {g['phrases_per_image']} | "
            f"{g['batch_images']} | {g['images_per_s']:.2f} | {g['pairs_per_s']:.2f} | {g['text_encoder']} |"]


def evaluation_table(result: dict) -> List[str]:
    e = result["evaluation"]
    if e["status"] != "ok":
        return ["## Evaluation harness", "", f"status {e['status']}: {cell(e['error'])}"]
    lines = [f"## Evaluation harness (ClipScorer {e['precision']}, batch {e['batch_size']}, {e['num_workers']} "
             f"workers, generated stand-in data)", "", "| benchmark | status | items | items/s | seconds |",
             "|---|---|---:|---:|---:|"]
    for name, row in e["benchmarks"].items():
        if row["status"] != "ok":
            lines.append(f"| {name} | {row['status']} | - | - | - |")
            continue
        lines.append(f"| {name} | ok | {row['items']} | {row['items_per_s']:.1f} | {row['seconds']:.2f} |")
    return lines


if __name__ == "__main__":
    main()

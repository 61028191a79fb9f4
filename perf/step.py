"""`python -m perf.step`: training-step time of methods relative to CLIP-FT, measured side by side.

Every variant builds the same model (same seed) and trains on the same batch; steps are interleaved
(A B C A B C ...) so machine noise hits every variant alike, and the report gives medians and ratios to
CLIP-FT rather than absolute claims. Memory: on CUDA the peak allocated bytes of a step; on the CPU the
bytes autograd saves for backward during the forward (the activation memory, which is what differs
between methods). The frozen-backbone aligners (TFLocal / TFGlobal) time the step they train with, on cached
features (`cached_feature_batch`): the aligner alone, no backbone forward. With `--peak-rss` every variant runs
alone in a fresh process instead, one after another, and the report adds that process's peak resident memory
(everything a machine must hold: libraries, weights, gradients, optimizer state, activations); its times are then
sequential, not interleaved. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from core.cli import add_key_values, add_output, add_precision, autocast_dtype
from datamodules.annotations import read_negclip_tsv
from datamodules.features import TOKEN_DTYPE
from datamodules.masks import CaptionMasks
from datamodules.word_vocabulary import WordVocabulary
from lightning_modules import load_run_config, method_class
from lightning_modules.base import total_loss
from parsers.scene_graph import SceneGraphParser

PAPER_ALIGNER = ["method.aligner_width=512", "method.aligner_layers=4", "method.aligner_heads=8"]
# name -> config overrides. Later methods add their variants here.
VARIANTS: Dict[str, List[str]] = {
    "clip_ft": [],
    "negclip": ["method.hard_negatives.captions=1"],
    **{f"cae_{name}": ["method.name=clip_cae", f"method.attribution.name={name}"]
       for name in ("attention", "gradcam", "perturbation", "gradient", "grad_eclip")},
    # [ours] options of CAE's attribution: last-layer GradCAM, one replacement token per word, Grad-ECLIP on the
    # model as it is with lambda up to EOS (a trimmed text forward)
    "cae_gradcam_last": ["method.name=clip_cae", "method.attribution.name=gradcam",
                         "method.attribution.start_layer=-1"],
    "cae_perturbation_token": ["method.name=clip_cae", "method.attribution.name=perturbation",
                               "method.attribution.replacement=token"],
    "cae_grad_eclip_ours": ["method.name=clip_cae", "method.attribution.name=grad_eclip",
                            "method.attribution.heads=multi", "method.attribution.text_lambda_range=up_to_eos"],
    "macco": ["method.name=macco"],
    "macco_ours": ["method.name=macco"],
    "smartclip": ["method.name=smartclip"],
    "smartclip_soft": ["method.name=smartclip", "method.hard_mask=false"],
    # TFLocal / TFGlobal at the paper's aligner (d 512, 4 layers, 8 heads), trained on cached features: every
    # pair of the B x B grid, or (`_hardN`) the diagonal plus each anchor's N hardest in-batch partners
    **{f"{kind}{suffix}": [f"method.name={kind}", *PAPER_ALIGNER, *negatives]
       for kind in ("tflocal", "tfglobal")
       for suffix, negatives in (("", []), ("_hard4", ["method.aligner_negatives=4"]),
                                 ("_hard16", ["method.aligner_negatives=16"]))},
}
# Variants measured with a recipe's method and optim settings (its model, data and trainer sections are replaced
# by perf.step's: random weights of --model, the perf batch). macco = the paper config (the official code's).
CONFIG_FILES: Dict[str, str] = {"macco": "configs/macco.yaml", "macco_ours": "configs/macco_ours.yaml"}
REFERENCE = "clip_ft"
REPO_ROOT = Path(__file__).resolve().parent.parent
# The batch's captions: the first of the NegCLIP validation TSV where configs/negclip.yaml reads it (real COCO
# captions, their lengths and parses), else the few below, said in the report.
DEFAULT_CAPTIONS = REPO_ROOT / "data" / "coco" / "negclip" / "valid_neg_clip.tsv"
BUILT_IN = "built-in"
FALLBACK_CAPTIONS = ["a red square to the left of a blue circle", "a man riding a horse on a beach",
                     "two dogs playing with a frisbee in the park", "a plate of food next to a cup of coffee"]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(VARIANTS), help=f"comma list of {sorted(VARIANTS)}")
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--captions", type=Path, default=DEFAULT_CAPTIONS, metavar="FILE",
                        help="a NegCLIP-format TSV whose first captions make the batch (default: "
                             "data/coco/negclip/valid_neg_clip.tsv when present, else a few built-in captions)")
    add_precision(parser, ["32-true", "bf16-mixed"], default="32-true", help="bf16-mixed: autocast over fp32 weights")
    add_output(parser, "file", default=Path("runs/perf_step.json"), help="the JSON report")
    parser.add_argument("--peak-rss", action="store_true",
                        help="run each variant alone in a fresh process (one after another) and report its peak "
                             "resident memory beside its step times")
    parser.add_argument("--single", help=argparse.SUPPRESS)  # the child process of --peak-rss: one variant
    add_key_values(parser, help="config overrides applied to every variant, e.g. method.hard_negatives.captions=2")
    # Options and overrides may interleave (`k=v --model M k2=v2`): overrides apply in the order given.
    return parser.parse_intermixed_args(argv)


# Cache records written elsewhere (`python -m perf.gpu --write-records`), read first when set: where perf.gpu runs
# (a GPU node without a package index) may have neither spaCy nor the captions file.
PREPARED_RECORDS: List[dict] = []


PREPARED = "prepared records"


def batch_captions(n: int, path: Path = DEFAULT_CAPTIONS) -> Tuple[List[str], str]:
    """`n` captions and where they come from: the prepared records, `path` when it holds `n` (read once), else the
    built-in ones."""
    if len(PREPARED_RECORDS) >= n:
        return [record["caption"] for record in PREPARED_RECORDS[:n]], PREPARED
    records = read_negclip_tsv(str(path)) if Path(path).is_file() else []
    if len(records) >= n:
        return [record.caption for record in records[:n]], str(path)
    return [FALLBACK_CAPTIONS[i % len(FALLBACK_CAPTIONS)] for i in range(n)], BUILT_IN


def real_captions(n: int, path: Path = DEFAULT_CAPTIONS) -> List[str]:
    return batch_captions(n, path)[0]


def check_captions(args: argparse.Namespace) -> None:
    """A --captions given by hand must be a TSV holding a whole batch (the default may be absent: built-in)."""
    if args.captions == DEFAULT_CAPTIONS:
        return
    if not Path(args.captions).is_file():
        raise SystemExit(f"perf.step error: --captions {args.captions} is not a file")
    if batch_captions(args.batch_size, args.captions)[1] != str(args.captions):
        raise SystemExit(f"perf.step error: --captions {args.captions} holds fewer than --batch-size "
                         f"{args.batch_size} captions")


def make_batch(module, batch_size: int, device: str, captions_file: Path = DEFAULT_CAPTIONS) -> dict:
    size = module.clip.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    captions = real_captions(batch_size, captions_file)
    generator = torch.Generator().manual_seed(0)
    grid = module.encoders.grid_size
    patches = grid[0] * grid[1]
    if getattr(module, "uses_word_replacements", False):  # CAE's perturbation: the captions' own words
        module.replacement_vocabulary = WordVocabulary.from_records(cache_records(captions), module.tokenizer)
    return {
        "image": torch.randn(batch_size, 3, size, size, generator=generator).to(device),
        "text": module.tokenizer(captions).to(device),
        "neg_text": module.tokenizer(list(reversed(captions))).unsqueeze(1).to(device),
        **{name: mask.to(device) for name, mask in token_masks(captions, module.tokenizer).items()},
        "caption_id": torch.arange(batch_size),
        # MACCO's image mask: a quarter of the patches per sample (a phrase's boxes cover about that on COCO)
        "patch_mask": (torch.rand(batch_size, patches, generator=generator) < 0.25).to(device),
    }


@functools.lru_cache(maxsize=4)
def _parsed(captions: tuple) -> list:
    return SceneGraphParser().parse(list(captions))


def cache_records(captions: List[str]) -> List[dict]:
    """The preprocessing cache's records of the captions (spans and graph; no boxes)."""
    prepared = {record["caption"]: record for record in PREPARED_RECORDS}
    if all(caption in prepared for caption in captions):
        return [prepared[caption] for caption in captions]
    return [{"caption": caption, "obj_spans": [[s.start, s.end] for s in graph.object_spans()],
             "comp_spans": [[s.start, s.end] for s in graph.composition_spans()], "phrases": [],
             "graph": graph.to_dict()} for caption, graph in zip(captions, _parsed(tuple(captions)))]


def token_masks(captions: List[str], tokenizer) -> Dict[str, torch.Tensor]:
    """obj_mask, comp_mask, attr_mask, rel_mask from the real scene-graph parser (as the DataModule gives them)."""
    masks = CaptionMasks(cache_records(captions), tokenizer, tokenizer.context_length)
    rows = [masks.sample_token_masks(index, tokenizer.context_length) for index in range(len(captions))]
    return {name: torch.from_numpy(np.stack([row[name] for row in rows])) for name in rows[0]}


def cached_feature_batch(module, batch: dict, num_hard_negatives: int) -> dict:
    """A frozen-backbone method's batch as the feature cache serves it (datamodules.features), so the timed step
    is the step they train with: the frozen CLIP encodes once, here, outside the timed steps; tokens are in the
    cache's float16 (globals float32); hard-negative captions only with `method.hard_negatives.captions` > 0 (the
    recipes have none; then each image gets the batch's one negative caption)."""
    if num_hard_negatives <= 0:
        batch = {key: value for key, value in batch.items() if key != "neg_text"}
    with torch.no_grad():
        features = module.encode_batch(batch)
    for key in ("image", "text", "neg_text"):
        if key in features:
            features[key] = features[key].to(TOKEN_DTYPE)
    return features


class Variant:
    """One method configuration with its own model copy and optimizer."""

    def __init__(self, name: str, args: argparse.Namespace):
        overrides = [f"model.name={args.model}", "model.pretrained=null", *args.overrides, *VARIANTS[name]]
        cfg = load_run_config([REPO_ROOT / CONFIG_FILES[name]] if name in CONFIG_FILES else [], overrides)
        torch.manual_seed(0)
        self.name = name
        self.module = method_class(cfg.method.name)(cfg).to(args.device).train()
        self.optimizer = torch.optim.AdamW(self.module.param_groups(), lr=1e-6)
        self.batch = make_batch(self.module, args.batch_size, args.device, args.captions)
        if getattr(self.module, "reads_cached_features", False):
            self.batch = cached_feature_batch(self.module, self.batch, cfg.method.hard_negatives.captions)
        # What the Trainer measures on each host batch before it moves (caption lengths, CAE's replacement words);
        # measured here once, outside the timed steps, as training does it outside the device's queue.
        self.batch = self.module.on_before_batch_transfer(self.batch, 0)
        self.device, self.autocast = args.device, autocast_dtype(args.precision)
        self.times: List[float] = []
        self.memory_bytes = 0

    def _forward(self) -> torch.Tensor:
        with torch.autocast(self.device.split(":")[0], dtype=self.autocast or torch.bfloat16,
                            enabled=self.autocast is not None):
            terms, _ = self.module.compute_terms(self.batch)
            return total_loss(terms)

    def step(self, timed: bool) -> None:
        self._synchronize()
        start = time.perf_counter()
        loss = self._forward_measuring_memory()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._synchronize()
        if timed:
            self.times.append(time.perf_counter() - start)

    def _forward_measuring_memory(self) -> torch.Tensor:
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            loss = self._forward()
            self.memory_bytes = max(self.memory_bytes, torch.cuda.max_memory_allocated())
            return loss
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
            loss = self._forward()
        self.memory_bytes = max(self.memory_bytes, sum(saved))
        return loss

    def _synchronize(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def measure(variants: List[Variant], repeats: int, warmup: int) -> None:
    """Interleaved steps: every round runs each variant once."""
    for round_index in range(warmup + repeats):
        for variant in variants:
            variant.step(timed=round_index >= warmup)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (getrusage's ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class Measured:
    """What one variant's steps gave: step times, the memory of `memory_kind`, the process's peak RSS."""

    name: str
    times: List[float]
    memory_bytes: int
    peak_rss_bytes: Optional[int] = None


def run_single(args: argparse.Namespace) -> None:
    """The child of --peak-rss: one variant alone in this process; its measurements as JSON on the last line."""
    variant = Variant(args.single, args)
    measure([variant], args.repeats, args.warmup)
    print(json.dumps({"times": variant.times, "memory_bytes": variant.memory_bytes,
                      "peak_rss_bytes": peak_rss_bytes()}))


def measure_in_fresh_processes(names: List[str], args: argparse.Namespace) -> List[Measured]:
    """Each variant in its own `python -m perf.step --single NAME` process, one at a time (never two models'
    memory at once), with this run's settings."""
    settings = ["--model", args.model, "--batch-size", str(args.batch_size), "--repeats", str(args.repeats),
                "--warmup", str(args.warmup), "--device", args.device, "--precision", args.precision,
                "--captions", str(args.captions)]
    results = []
    for name in names:
        command = [sys.executable, "-m", "perf.step", "--single", name, *settings, *args.overrides]
        done = subprocess.run(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise SystemExit(f"perf.step --single {name} failed with exit code {done.returncode}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(Measured(name, row["times"], row["memory_bytes"], row["peak_rss_bytes"]))
        print(f"{name}: peak RSS {row['peak_rss_bytes'] / 2 ** 30:.2f} GiB", flush=True)
    return results


def report(measured: List[Measured], args: argparse.Namespace) -> dict:
    medians = {m.name: statistics.median(m.times) for m in measured}
    reference = medians.get(REFERENCE)
    memory_kind = "cuda_peak_allocated" if args.device.startswith("cuda") else "saved_for_backward"
    methods = {}
    for m in measured:
        methods[m.name] = {"median_step_s": medians[m.name],
                           "ratio_to_clip_ft": medians[m.name] / reference if reference else None,
                           "memory_mib": m.memory_bytes / 2 ** 20, "step_times_s": m.times}
        if m.peak_rss_bytes is not None:
            methods[m.name]["peak_rss_gib"] = m.peak_rss_bytes / 2 ** 30
    return {
        "model": args.model, "batch_size": args.batch_size, "device": args.device, "precision": args.precision,
        "repeats": args.repeats, "memory_kind": memory_kind,
        "captions": batch_captions(args.batch_size, args.captions)[1],
        "timing": "sequential, one fresh process per variant" if args.peak_rss else "interleaved, one process",
        "methods": methods,
    }


def print_table(result: dict) -> None:
    print(f"\n{result['model']}, batch {result['batch_size']}, {result['device']}, precision {result['precision']}, "
          f"median of {result['repeats']} steps ({result['timing']}); memory = {result['memory_kind']}; "
          f"captions: {result['captions']}")
    with_rss = any("peak_rss_gib" in row for row in result["methods"].values())
    print(f"{'method':<24}{'step (s)':>10}{'x CLIP-FT':>11}{'memory (MiB)':>14}"
          + (f"{'peak RSS (GiB)':>16}" if with_rss else ""))
    for name, row in result["methods"].items():
        ratio = f"{row['ratio_to_clip_ft']:.2f}" if row["ratio_to_clip_ft"] is not None else "-"
        rss = f"{row['peak_rss_gib']:>16.2f}" if with_rss else ""
        print(f"{name:<24}{row['median_step_s']:>10.3f}{ratio:>11}{row['memory_mib']:>14.0f}{rss}")


def main(argv: Optional[Sequence[str]] = None) -> Optional[dict]:
    args = parse_args(argv)
    check_captions(args)
    if args.single:
        return run_single(args)
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown perf variants {unknown}; known: {sorted(VARIANTS)}")
    if REFERENCE not in names:
        names.insert(0, REFERENCE)
    if args.peak_rss:
        measured = measure_in_fresh_processes(names, args)
    else:
        variants = [Variant(name, args) for name in names]
        measure(variants, args.repeats, args.warmup)
        measured = [Measured(v.name, v.times, v.memory_bytes) for v in variants]
    result = report(measured, args)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()

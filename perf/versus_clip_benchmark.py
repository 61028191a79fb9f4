"""Our evaluation harness against LAION's clip_benchmark on the same SugarCrepe stand-in (`perf.evaluate
--clip-benchmark`).

clip_benchmark is what researchers run today (`clip_benchmark eval --dataset sugar_crepe --task
image_caption_selection`). For each of the 7 `sugar_crepe/<subset>` datasets its CLI builds the dataset with
`build_dataset`, wraps it in a DataLoader with `get_dataset_collate_fn`, and calls
`image_caption_selection.evaluate`, which encodes every item's image and both captions, batch by batch: an image
that several items share is encoded again for each. We drive those same functions, with the same model object,
transform and tokenizer as our harness (the CLI would also load the model per dataset; both sides here skip
model loading). Our harness (`run_benchmark` with a fresh `ClipScorer`) encodes each distinct image and text
once.

The stand-in (`write_sugarcrepe_sample`): the real annotation files restricted to a seeded sample of their images
with every item of each, and generated COCO-sized JPEGs; without the real files, generated captions (which repeat
far more than real ones, so our side is then favoured: said in the output).

Agreement: before the timed rounds (it doubles as the warm-up) both score every item once; clip_benchmark's
embeddings are read by a recording wrapper around the model (its `evaluate` returns accuracies only), and the
two cosines of every item are compared with ours. The outcomes can differ only on exact ties: clip_benchmark
takes the argmax (a tie counts as correct), we count a tie as wrong.

clip_benchmark is not a project dependency. `pip install --no-deps --target runs/clip_benchmark_site
clip_benchmark==1.6.2` and `PYTHONPATH=runs/clip_benchmark_site` is enough: the two modules used need only
torch, torchvision and PIL. A plain `pip install clip_benchmark==1.6.2` into the venv works too (it adds
scikit-learn, scipy, webdataset, pycocoevalcap and leaves torch, open_clip and transformers as they are).
"""
from __future__ import annotations

import json
import statistics
import time
from functools import partial
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

from evaluation.benchmarks import build_benchmark
from evaluation.benchmarks.base import unique
from testkit.fixtures import fixture
from testkit.standin.sugarcrepe import write_sugarcrepe, write_sugarcrepe_sample
from evaluation.benchmarks.sugarcrepe import SUBSETS
from evaluation.harness import run_benchmark
from evaluation.scorers import ClipScorer

CLIP_BENCHMARK_VERSION = "1.6.2"
# The default annotations: the repository's copy of the 7 official files (tests/data/), resolved when used.
SUGARCREPE_FIXTURE = "sugarcrepe"
INSTALL_HINT = (
    f"clip_benchmark is not installed; it is needed for this comparison only (not a project dependency). "
    f"Either `pip install --no-deps --target runs/clip_benchmark_site clip_benchmark=={CLIP_BENCHMARK_VERSION}` "
    f"and run with PYTHONPATH=runs/clip_benchmark_site, or `pip install clip_benchmark=={CLIP_BENCHMARK_VERSION}` "
    f"into the venv (it adds scikit-learn, scipy, webdataset and pycocoevalcap; torch, open_clip and "
    f"transformers stay as they are).")


def import_clip_benchmark() -> SimpleNamespace:
    """clip_benchmark's dataset builder, collate choice and SugarCrepe metric, or SystemExit with the install hint."""
    try:
        from clip_benchmark.datasets.builder import build_dataset, get_dataset_collate_fn
        from clip_benchmark.metrics import image_caption_selection
    except ImportError as error:
        raise SystemExit(f"{INSTALL_HINT}\n(import failed: {error})") from None
    # Its metric wraps the loader in tqdm; the bars only clutter the output (the loop is the same without them).
    image_caption_selection.tqdm = partial(image_caption_selection.tqdm, disable=True)
    try:
        version = metadata.version("clip_benchmark")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return SimpleNamespace(build_dataset=build_dataset, collate_fn=get_dataset_collate_fn,
                           evaluate=image_caption_selection.evaluate, version=version)


def write_standin(root: Path, n_images: int, annotations: Optional[Path], seed: int = 0) -> Dict[str, object]:
    """The stand-in under `root` (rewritten when the request changes) and what it is made of."""
    source = str(annotations) if annotations and annotations.is_dir() else "generated"
    marker = root / f".standin-{n_images}-{seed}-{Path(source).name}"
    if not marker.is_file():
        if source == "generated":
            write_sugarcrepe(root, n_items=round(n_images * 7511 / 1560), seed=seed)
        else:
            write_sugarcrepe_sample(root, Path(source), n_images, seed=seed)
        marker.write_text(source)
    benchmark = build_benchmark("sugarcrepe", root)
    items = benchmark.items()
    texts = [text for item in items for text in item.texts]
    return {"annotations": source, "items": len(items),
            "distinct_images": len(unique(ref for item in items for ref in item.images)),
            "texts": len(texts), "distinct_texts": len(unique(texts))}


def clip_benchmark_loaders(cb: SimpleNamespace, root: Path, transform: Callable, batch_size: int,
                           num_workers: int) -> Iterator[Tuple[str, DataLoader]]:
    """Per non-empty subset, the DataLoader clip_benchmark's CLI builds for `sugar_crepe/<subset>`."""
    for subset in SUBSETS:
        name = f"sugar_crepe/{subset}"
        dataset = cb.build_dataset(dataset_name=name, root=str(root), transform=transform, split="test",
                                   download=True, task="image_caption_selection")
        if len(dataset):
            yield subset, DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                                     collate_fn=cb.collate_fn(name))


def clip_benchmark_run(cb: SimpleNamespace, root: Path, scorer: ClipScorer, batch_size: int, num_workers: int,
                       amp: bool) -> Dict[str, Dict[str, float]]:
    """What `clip_benchmark eval --dataset sugar_crepe --task image_caption_selection` computes, per subset, with
    the scorer's model, transform and tokenizer."""
    return {subset: cb.evaluate(scorer.model, loader, scorer.tokenizer, device=scorer.device.type, amp=amp)
            for subset, loader in clip_benchmark_loaders(cb, root, scorer.preprocess, batch_size, num_workers)}


class RecordingModel(nn.Module):
    """Passes `encode_image` / `encode_text` through and keeps their outputs, in call order."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.images: List[Tensor] = []
        self.texts: List[Tensor] = []

    def encode_image(self, pixels: Tensor) -> Tensor:
        out = self.model.encode_image(pixels)
        self.images.append(out.detach().float().cpu())
        return out

    def encode_text(self, tokens: Tensor) -> Tensor:
        out = self.model.encode_text(tokens)
        self.texts.append(out.detach().float().cpu())
        return out


def clip_benchmark_cosines(cb: SimpleNamespace, root: Path, scorer: ClipScorer, batch_size: int, num_workers: int,
                           amp: bool) -> Tuple[Dict[str, np.ndarray], Dict[str, Dict[str, float]]]:
    """Per subset, [items, 2]: clip_benchmark's cos(image, caption) and cos(image, negative) of every item (read
    from the embeddings its `evaluate` computed), and its metrics."""
    cosines, metrics = {}, {}
    for subset, loader in clip_benchmark_loaders(cb, root, scorer.preprocess, batch_size, num_workers):
        recorder = RecordingModel(scorer.model)
        metrics[subset] = cb.evaluate(recorder, loader, scorer.tokenizer, device=scorer.device.type, amp=amp)
        image = F.normalize(torch.cat(recorder.images), dim=-1)                         # [n, D]
        text = F.normalize(torch.cat(recorder.texts), dim=-1).view(len(image), 2, -1)  # caption, negative
        cosines[subset] = torch.einsum("nd,ntd->nt", image, text).numpy()
    return cosines, metrics


def harness_run(root: Path, make_scorer: Callable[[], ClipScorer]):
    """Our harness end to end with a fresh scorer (every image and text encoded): the `BenchmarkResult`."""
    return run_benchmark(build_benchmark("sugarcrepe", root), make_scorer())


def agreement(root: Path, cb: SimpleNamespace, make_scorer: Callable[[], ClipScorer], batch_size: int,
              num_workers: int, amp: bool) -> Dict[str, object]:
    """Both score every item once; their cosines and outcomes compared item by item (ties explained)."""
    scorer = make_scorer()
    result = run_benchmark(build_benchmark("sugarcrepe", root), scorer)
    theirs, metrics = clip_benchmark_cosines(cb, root, scorer, batch_size, num_workers, amp)
    benchmark = build_benchmark("sugarcrepe", root)
    differences, outcome_mismatches, ties = [], 0, 0
    for subset, cosines in theirs.items():
        items = [item for item in benchmark.items() if item.meta["subset"] == subset]
        ours = np.stack([scorer.score(item.images, item.texts)[0] for item in items])
        differences.append(np.abs(ours - cosines).max())
        ours_correct = ours[:, 0] > ours[:, 1]              # ties wrong
        theirs_correct = cosines.argmax(axis=1) == 0        # ties right (argmax takes the first)
        outcome_mismatches += int((ours_correct != theirs_correct).sum())
        ties += int((ours[:, 0] == ours[:, 1]).sum())
    ours_accuracy = {s: result.aggregates[s] for s in theirs}
    theirs_accuracy = {s: 100.0 * m["text_acc"] for s, m in metrics.items()}
    return {"max_abs_cosine_difference": float(max(differences)), "outcome_mismatches": outcome_mismatches,
            "exact_ties_ours": ties, "accuracy_ours": ours_accuracy, "accuracy_clip_benchmark": theirs_accuracy}


def compare(root: Path, cb: SimpleNamespace, make_scorer: Callable[[], ClipScorer], batch_size: int,
            num_workers: int, amp: bool, rounds: int) -> Dict[str, object]:
    """Seconds of each side over `rounds` interleaved rounds (ours, theirs, ours, theirs, ...), after the
    agreement pass (which also warms both up); items/s from the medians and their ratio."""
    report: Dict[str, object] = {"agreement": agreement(root, cb, make_scorer, batch_size, num_workers, amp)}
    items = len(build_benchmark("sugarcrepe", root).items())
    ours, theirs = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        harness_run(root, make_scorer)
        ours.append(time.perf_counter() - start)
        scorer = make_scorer()
        start = time.perf_counter()
        clip_benchmark_run(cb, root, scorer, batch_size, num_workers, amp)
        theirs.append(time.perf_counter() - start)
    report.update({"items": items, "rounds": rounds, "ours_seconds": ours, "clip_benchmark_seconds": theirs,
                   "ours_items_per_s": items / statistics.median(ours),
                   "clip_benchmark_items_per_s": items / statistics.median(theirs),
                   "speedup": statistics.median(theirs) / statistics.median(ours)})
    return report


def format_report(standin: Dict[str, object], report: Dict[str, object], setting: str) -> str:
    """A Markdown table of both sides, the agreement line and what the stand-in holds."""
    agree = report["agreement"]
    return "\n".join([
        f"SugarCrepe stand-in ({standin['annotations']}): {standin['items']} items, {standin['distinct_images']} "
        f"distinct images, {standin['distinct_texts']} distinct of {standin['texts']} texts; {setting}",
        "",
        "| harness | items/s | seconds per round |",
        "|---|---:|---|",
        f"| ours (`run_benchmark`, `ClipScorer`) | {report['ours_items_per_s']:.2f} | "
        + ", ".join(f"{s:.1f}" for s in report["ours_seconds"]) + " |",
        f"| clip_benchmark {report['clip_benchmark_version']} (`image_caption_selection.evaluate`) | "
        f"{report['clip_benchmark_items_per_s']:.2f} | "
        + ", ".join(f"{s:.1f}" for s in report["clip_benchmark_seconds"]) + " |",
        "",
        f"speed-up (median seconds, theirs / ours): {report['speedup']:.2f}x",
        f"agreement: max |cosine difference| {agree['max_abs_cosine_difference']:.2e}, outcome mismatches "
        f"{agree['outcome_mismatches']} (exact ties {agree['exact_ties_ours']})"])


def main(args) -> Dict[str, object]:
    """`perf.evaluate --clip-benchmark`: stand-in, agreement, interleaved rounds, table, JSON."""
    cb = import_clip_benchmark()  # refuse before any work
    if args.threads:
        torch.set_num_threads(args.threads)
    root = args.data_root / "sugarcrepe_vs_clip_benchmark"
    annotations = args.annotations if args.annotations is not None else fixture(SUGARCREPE_FIXTURE)
    standin = write_standin(root, args.cb_images, annotations, seed=0)
    torch.manual_seed(0)
    base = ClipScorer.from_pretrained(args.model, None, device=args.device, precision=args.precision,
                                      batch_size=args.batch_size, num_workers=args.num_workers)
    base.model.to(args.device)

    def make_scorer() -> ClipScorer:  # same weights, empty embedding caches
        return ClipScorer(base.model, base.tokenizer, base.preprocess, device=args.device, precision=args.precision,
                          batch_size=args.batch_size, num_workers=args.num_workers)

    amp = args.precision != "32-true"  # clip_benchmark's autocast (its default; --no_amp for fp32)
    report = compare(root, cb, make_scorer, args.batch_size, args.num_workers, amp, args.rounds)
    setting = (f"{args.model} (random weights), {args.precision}, {args.device}, torch threads "
               f"{torch.get_num_threads()}, batch {args.batch_size}, {args.num_workers} DataLoader workers on both "
               f"sides, {args.rounds} interleaved rounds")
    report.update({"clip_benchmark_version": cb.version, "standin": standin, "setting": setting,
                   "model": args.model, "precision": args.precision, "device": args.device,
                   "threads": torch.get_num_threads(), "batch_size": args.batch_size,
                   "num_workers": args.num_workers})
    print(format_report(standin, report, setting))
    if standin["annotations"] == "generated":
        print("note: generated captions repeat far more than SugarCrepe's, which favours our side; pass "
              "--annotations DIR (the 7 official JSON files) for a representative stand-in")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report

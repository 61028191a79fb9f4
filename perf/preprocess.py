"""`python -m perf.preprocess`: throughput of the offline preprocessing stages on real captions.

Parsing: the scene-graph parser (spaCy + rules) on the NegCLIP validation captions (real COCO captions), on
one CPU core, best of `--repeats` runs after a warmup; spaCy alone is timed the same way so the rules' own
cost is visible.

Grounding (skipped with `--parse-only`): GroundingDINO through `parsers.grounding` at 512 px on `--images`
generated 640x480 images, each with the first phrases of a real caption (the first captions with at least
four phrases), for 1 and 4 phrases per image and 1 and 4 images per forward pass, on every allowed core (or
`--device cuda`). Offline there is no BERT, so by default the text encoder is a random BERT-base (same
dimensions, so the same cost) saved to a temporary directory, and GroundingDINO has random weights: the
boxes are meaningless, the time is not. `--text-encoder` and `--checkpoint` use real ones.

A benchmark, not a test: it asserts nothing and writes JSON to `--out`.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from parsers.scene_graph import DEFAULT_MODEL, SceneGraphParser

# Nothing here imports numpy or torch at module level: `pin_to_one_core` must cap their thread pools first.

NEGCLIP_TSV = Path(__file__).resolve().parents[2] / "shared" / "data" / "negclip" / "valid_neg_clip.tsv"
GROUNDING_IMAGE_SIZE = 512
IMAGE_WIDTH, IMAGE_HEIGHT = 640, 480
PHRASES_PER_IMAGE = (1, 4)
GROUNDING_BATCH_SIZES = (1, 4)
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?"]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parse-only", action="store_true", help="time the scene-graph parser alone")
    parser.add_argument("--captions", type=Path, default=NEGCLIP_TSV, help="TSV with a `title` column")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs; the best one is reported")
    parser.add_argument("--all-cores", action="store_true", help="do not pin the parser to one core")
    parser.add_argument("--images", type=int, default=4,
                        help="generated images for the grounding timings (4 fills one batch of 4; on a 2-core "
                             "CPU each (image, phrase) pair takes ~4 s, 10 pairs per image over the settings)")
    parser.add_argument("--text-encoder", type=Path, help="local BERT directory (default: a random BERT-base)")
    parser.add_argument("--checkpoint", type=Path, help="GroundingDINO checkpoint (default: random weights)")
    parser.add_argument("--device", default="cpu", help="GroundingDINO device: cpu or cuda")
    parser.add_argument("--out", type=Path, default=Path("runs/perf_preprocess.json"))
    args = parser.parse_args(argv)
    if args.checkpoint and not args.text_encoder:
        parser.error("--checkpoint needs --text-encoder: the checkpoint's BERT has the bert-base-uncased vocabulary")
    return args


def read_captions(path: Path) -> List[str]:
    """The `title` column; the csv module, because some captions hold quoted newlines."""
    with open(path, newline="", encoding="utf-8") as f:
        return [row["title"] for row in csv.DictReader(f, delimiter="\t")]


def allowed_cores() -> Optional[Set[int]]:
    """The cores this process may run on (Linux), or None where affinity is unsupported."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def pin_to_one_core() -> Optional[int]:
    """Pin this process to one allowed core (Linux); returns it, or None where affinity is unsupported.

    Thread pools are capped at one thread too (before spaCy, and through thinc torch, start theirs): on one
    core, extra BLAS/OpenMP threads only contend with each other.
    """
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    if not hasattr(os, "sched_setaffinity"):
        return None
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return core


def use_cores(cores: Optional[Set[int]]) -> int:
    """Undo `pin_to_one_core` for GroundingDINO: run on `cores` with one torch thread each.

    `cores` None (no affinity support) means every CPU. Returns torch's intra-op thread count.
    """
    import torch

    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores) if cores else os.cpu_count() or 1)
    return torch.get_num_threads()


def timed(run: Callable[[], object]) -> float:
    """Seconds one call of ``run`` takes."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def best_rate(run: Callable[[], object], n: int, repeats: int) -> Dict[str, object]:
    """Items per second of the fastest of ``repeats`` calls of ``run`` (each processes ``n`` items)."""
    seconds = [timed(run) for _ in range(repeats)]
    return {"items_per_s": n / min(seconds), "seconds": seconds}


def graph_stats(graphs: Sequence) -> Dict[str, float]:
    """What the parser found, so a speed-up that drops output shows up here."""
    n = max(len(graphs), 1)
    return {"empty_graphs": sum(1 for g in graphs if not g.entities) / n,
            "entities_per_caption": sum(len(g.entities) for g in graphs) / n,
            "relations_per_caption": sum(len(g.relations) for g in graphs) / n,
            "phrases_per_caption": sum(len(g.phrases) for g in graphs) / n}


def benchmark_parsing(captions: Sequence[str], model: str = DEFAULT_MODEL, batch_size: int = 256,
                      repeats: int = 2) -> Dict[str, object]:
    """Captions per second of `SceneGraphParser.parse`, and of spaCy alone, after one warmup batch.

    Args:
        captions: The captions to parse (all of them per timed run).
        model: spaCy pipeline name.
        batch_size: ``nlp.pipe`` batch size.
        repeats: Timed runs per measurement; the fastest is reported.
    """
    parser = SceneGraphParser(model=model, batch_size=batch_size)
    parser.parse(captions[:batch_size])   # loads the model and warms the pipeline
    spacy_only = best_rate(lambda: list(parser.nlp.pipe(captions, batch_size=batch_size)), len(captions), repeats)
    graphs: List = []
    full = best_rate(lambda: graphs.__setitem__(slice(None), parser.parse(captions)), len(captions), repeats)
    return {"captions": len(captions), "captions_per_s": full["items_per_s"], "seconds": full["seconds"],
            "spacy_only_captions_per_s": spacy_only["items_per_s"],
            "rules_ms_per_caption": 1000 * (min(full["seconds"]) - min(spacy_only["seconds"])) / len(captions),
            "settings": parser.settings(), "batch_size": batch_size, "output": graph_stats(graphs)}


def captions_with_phrases(captions: Sequence[str], n: int, min_phrases: int,
                          model: str = DEFAULT_MODEL) -> List[Tuple[str, List[str]]]:
    """The first ``n`` captions whose scene graph has at least ``min_phrases`` phrases, with their phrases."""
    parser = SceneGraphParser(model=model)
    chosen: List[Tuple[str, List[str]]] = []
    for start in range(0, len(captions), 256):
        graphs = parser.parse(captions[start:start + 256])
        chosen += [(g.caption, [p.text for p in g.phrases]) for g in graphs if len(g.phrases) >= min_phrases]
        if len(chosen) >= n:
            return chosen[:n]
    raise ValueError(f"only {len(chosen)} captions have {min_phrases} phrases; {n} requested")


def write_images(directory: Path, n: int) -> List[str]:
    """``n`` seeded JPEGs of IMAGE_WIDTH x IMAGE_HEIGHT with random filled rectangles and ellipses."""
    from PIL import Image, ImageDraw

    rng = random.Random(0)
    paths = []
    for index in range(n):
        image = Image.new("RGB", (IMAGE_WIDTH, IMAGE_HEIGHT), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(8):
            x0, y0 = rng.randrange(IMAGE_WIDTH - 40), rng.randrange(IMAGE_HEIGHT - 40)
            box = (x0, y0, rng.randrange(x0 + 20, IMAGE_WIDTH), rng.randrange(y0 + 20, IMAGE_HEIGHT))
            shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
            shape(box, fill=tuple(rng.randrange(256) for _ in range(3)))
        paths.append(str(directory / f"{index}.jpg"))
        image.save(paths[-1], quality=90)
    return paths


def write_random_bert_base(directory: Path, words: Sequence[str]) -> str:
    """A random BERT-base (hidden 768, 12 layers, 12 heads, intermediate 3072) saved like a hub checkpoint.

    The vocabulary is the special tokens plus ``words``, so the phrases tokenise to about as many tokens as
    with bert-base-uncased; the vocabulary size changes no forward cost but the embedding lookup.
    """
    from transformers import BertConfig, BertModel, BertTokenizerFast

    directory.mkdir()
    vocab = BERT_SPECIAL_TOKENS + sorted(set(words) - set(BERT_SPECIAL_TOKENS))
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(directory)
    config = BertConfig(vocab_size=len(vocab), hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072)
    BertModel(config).save_pretrained(directory)
    return str(directory)


def time_grounding(grounder, images: Sequence[str], phrases: Sequence[List[str]], batch_size: int,
                   per_image: int) -> Dict[str, object]:
    """One timed `ground` call over every image with its first ``per_image`` phrases."""
    from parsers.grounding import GroundingRequest

    grounder.batch_size = batch_size  # the same loaded model for every setting; ground() reads it per call
    requests = [GroundingRequest(path, list(p[:per_image])) for path, p in zip(images, phrases)]
    seconds = timed(lambda: grounder.ground(requests))
    pairs = sum(len(r.phrases) for r in requests)
    return {"batch_size": batch_size, "phrases_per_image": per_image, "images": len(requests), "pairs": pairs,
            "seconds": seconds, "images_per_s": len(requests) / seconds, "s_per_pair": seconds / pairs}


def benchmark_grounding(images: Sequence[str], phrases: Sequence[List[str]], text_encoder: str,
                        checkpoint: Optional[str], device: str) -> Dict[str, object]:
    """GroundingDINO's model load, a one-pair warmup, then every (batch size, phrases per image) setting.

    Args:
        images: image paths.
        phrases: per image, at least max(PHRASES_PER_IMAGE) phrases.
        text_encoder: BERT directory.
        checkpoint: GroundingDINO checkpoint, or None for random weights.
        device: "cpu" or "cuda".
    """
    from parsers.grounding import GroundingRequest, build_grounder

    # Speed does not depend on the weights: random ones are fine here, and must be asked for explicitly.
    grounder = build_grounder("groundingdino", checkpoint=checkpoint, text_encoder=text_encoder,
                              image_size=GROUNDING_IMAGE_SIZE, batch_size=1, device=device,
                              allow_random_weights=checkpoint is None)
    load_s = timed(lambda: grounder.model)
    warmup_s = timed(lambda: grounder.ground([GroundingRequest(images[0], phrases[0][:1])]))
    runs = [time_grounding(grounder, images, phrases, batch_size, per_image)
            for per_image in PHRASES_PER_IMAGE for batch_size in GROUNDING_BATCH_SIZES]
    return {"load_s": load_s, "warmup_s": warmup_s, "runs": runs, "unreadable_images": grounder.unreadable_images}


def grounding_report(args: argparse.Namespace, captions: Sequence[str], cores: Optional[Set[int]]) -> dict:
    """Sets up images, phrases and text encoder per ``args``, then `benchmark_grounding` on ``cores``."""
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available")
    threads = use_cores(cores)
    samples = captions_with_phrases(captions, args.images, max(PHRASES_PER_IMAGE), args.model)
    phrases = [p for _, p in samples]
    with tempfile.TemporaryDirectory(prefix="perf_preprocess_") as tmp:
        images = write_images(Path(tmp), args.images)
        words = {word for p in phrases for text in p for word in text.lower().split()}
        text_encoder = str(args.text_encoder) if args.text_encoder else write_random_bert_base(Path(tmp) / "bert",
                                                                                                sorted(words))
        result = benchmark_grounding(images, phrases, text_encoder,
                                     str(args.checkpoint) if args.checkpoint else None, args.device)
    return {"device": args.device, "torch_threads": threads, "image_size": GROUNDING_IMAGE_SIZE,
            "image_wh": [IMAGE_WIDTH, IMAGE_HEIGHT],
            "text_encoder": str(args.text_encoder) if args.text_encoder else "random bert-base",
            "checkpoint": str(args.checkpoint) if args.checkpoint else None,
            "captions": [caption for caption, _ in samples], "phrases": phrases, **result}


def print_parsing(parsing: dict) -> None:
    print(f"parsing: {parsing['captions_per_s']:.0f} captions/s on {parsing['captions']} captions "
          f"(spaCy alone {parsing['spacy_only_captions_per_s']:.0f}/s, rules "
          f"{parsing['rules_ms_per_caption']:.3f} ms/caption; runs {statistics.mean(parsing['seconds']):.2f} s)")


def print_grounding(grounding: dict) -> None:
    print(f"grounding: GroundingDINO at {grounding['image_size']} px on {grounding['device']} "
          f"({grounding['torch_threads']} torch threads), {grounding['text_encoder']}, checkpoint "
          f"{grounding['checkpoint']}; load {grounding['load_s']:.1f} s, warmup {grounding['warmup_s']:.1f} s")
    for run in grounding["runs"]:
        print(f"  batch {run['batch_size']}, {run['phrases_per_image']} phrase(s)/image: "
              f"{run['images_per_s']:.3f} images/s, {run['s_per_pair']:.3f} s/pair "
              f"({run['images']} images, {run['pairs']} pairs, {run['seconds']:.1f} s)")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    cores = allowed_cores()
    core = None if args.all_cores else pin_to_one_core()
    captions = read_captions(args.captions)
    report = {"parse_only": args.parse_only, "core": core, "python": platform.python_version(),
              "parsing": benchmark_parsing(captions, args.model, args.batch_size, args.repeats)}
    print_parsing(report["parsing"])
    if not args.parse_only:
        report["grounding"] = grounding_report(args, captions, cores)
        print_grounding(report["grounding"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

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

Prompt modes (`--grounding modes`, part of the default `all`): GroundingDINO's `per_phrase` and `joint` prompts
on `--mode-images` generated images, each with the distinct phrases our parser finds in five real COCO captions
of one image (SugarCrepe's positive captions are COCO val2017's own; the images with at least five), one image
per forward pass, the modes alternating image by image; images/s, forwards per image and seconds per forward of
each. Then the FLOPs of one forward of each mode at 800 px (torch's FlopCounterMode: matmuls and convolutions;
the PyTorch fallback of deformable attention is not counted) and, from them, an ESTIMATE of the GPU-hours for
COCO train2017 (118,287 images x 5 captions) at an assumed sustained `--gpu-tflops`: compute-bound, no data
loading, no Python overhead. Not a GPU measurement.

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

from core.cli import add_output
from parsers.scene_graph import DEFAULT_MODEL, SceneGraphParser
from testkit.fixtures import fixture

# Nothing here imports numpy or torch at module level: `pin_to_one_core` must cap their thread pools first.

# The default real captions: the repository's fixtures (tests/data/, resolved when used, so `--help` needs neither).
NEGCLIP_TSV = "negclip/valid_neg_clip.tsv"
SUGARCREPE_DIR = "sugarcrepe"
CAPTIONS_PER_IMAGE = 5  # COCO's captions per image
COCO_TRAIN2017_IMAGES = 118_287
FLOPS_IMAGE_SIZE = 800  # the preprocessing default (preprocess.grounding_image_size)
# Assumed sustained fp32 rate of one data-centre GPU for the estimate (about 75% of an A100's 19.5 TFLOP/s fp32
# peak, 22% of an H100 SXM's 67): a stated assumption, to be replaced by `perf.gpu` measurements.
DEFAULT_GPU_TFLOPS = 15.0
GROUNDING_IMAGE_SIZE = 512
IMAGE_WIDTH, IMAGE_HEIGHT = 640, 480
PHRASES_PER_IMAGE = (1, 4)
GROUNDING_BATCH_SIZES = (1, 4)
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?"]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parse-only", action="store_true", help="time the scene-graph parser alone")
    parser.add_argument("--captions", type=Path,
                        help=f"TSV with a `title` column (default: the fixture tests/data/{NEGCLIP_TSV})")
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
    parser.add_argument("--grounding", default="all", choices=("all", "grid", "modes"),
                        help="grid: phrases per image x images per forward; modes: per_phrase vs joint prompts")
    parser.add_argument("--caption-groups", type=Path,
                        help="SugarCrepe annotation folder: real COCO captions grouped by image (prompt modes; "
                             f"default: the fixture tests/data/{SUGARCREPE_DIR})")
    parser.add_argument("--mode-images", type=int, default=2, help="images in the prompt-mode comparison")
    parser.add_argument("--gpu-tflops", type=float, default=DEFAULT_GPU_TFLOPS,
                        help="ASSUMED sustained GPU TFLOP/s for the COCO train2017 GPU-hour estimate")
    add_output(parser, "file", default=Path("runs/perf_preprocess.json"), help="the JSON report")
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


def coco_caption_groups(directory: Path, per_image: int = CAPTIONS_PER_IMAGE) -> List[List[str]]:
    """Real COCO val2017 captions grouped by image: SugarCrepe's positive captions (COCO's own), for the images
    with at least `per_image` distinct ones, the first `per_image` of each in sorted order."""
    by_image: Dict[str, Set[str]] = {}
    for path in sorted(Path(directory).glob("*.json")):
        for entry in json.loads(path.read_text()).values():
            by_image.setdefault(entry["filename"], set()).add(entry["caption"].strip())
    return [sorted(captions)[:per_image] for _, captions in sorted(by_image.items()) if len(captions) >= per_image]


def image_phrase_sets(groups: Sequence[Sequence[str]], model: str = DEFAULT_MODEL) -> List[List[str]]:
    """Per image, the distinct phrase texts of its captions in first-seen order: what the preprocessing job
    grounds per image (`datamodules.preprocess.grounding_requests`)."""
    parser = SceneGraphParser(model=model)
    graphs = iter(parser.parse([caption for group in groups for caption in group]))
    sets = []
    for group in groups:
        phrases: List[str] = []
        for _ in group:
            phrases.extend(p.text for p in next(graphs).phrases if p.text not in phrases)
        sets.append(phrases)
    return sets


def phrase_set_stats(phrase_sets: Sequence[List[str]], phrases_per_caption: float,
                     token_count: Callable[[str], int]) -> Dict[str, float]:
    """Forwards per image of each prompt mode: distinct phrases (per_phrase) and joint prompts (joint)."""
    from parsers.grounding import joint_prompts

    planned = [joint_prompts(phrases, token_count)[0] for phrases in phrase_sets]
    tokens = [token_count(prompt.text) + 2 for prompts in planned for prompt in prompts]  # with [CLS], [SEP]
    distinct = [len(phrases) for phrases in phrase_sets]
    return {"images": len(phrase_sets), "phrases_per_caption": phrases_per_caption,
            "distinct_phrases_per_image": statistics.mean(distinct), "max_distinct_phrases_per_image": max(distinct),
            "joint_prompts_per_image": statistics.mean(len(prompts) for prompts in planned),
            "joint_prompt_tokens_mean": statistics.mean(tokens), "joint_prompt_tokens_max": max(tokens)}


def forwards_per_image(grounder, phrases: Sequence[str]) -> int:
    """Rows of GroundingDINO's batch one image costs in the grounder's current prompt mode."""
    from parsers.grounding import joint_prompts

    if grounder.prompt == "per_phrase":
        return len(phrases)
    tokenizer = grounder.model.tokenizer
    return len(joint_prompts(phrases, lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"]))[0])


def benchmark_prompt_modes(grounder, images: Sequence[str], phrase_sets: Sequence[List[str]]) -> Dict[str, object]:
    """Images/s of `per_phrase` and `joint` prompts, one image per forward pass, the modes alternating image by
    image (so that a change of machine load hits both alike)."""
    from parsers.grounding import GroundingRequest

    modes = ("per_phrase", "joint")
    grounder.batch_size = 1
    seconds = {mode: 0.0 for mode in modes}
    forwards = {mode: 0 for mode in modes}
    for path, phrases in zip(images, phrase_sets):
        request = GroundingRequest(path, list(phrases))
        for mode in modes:
            grounder.prompt = mode  # the same loaded model; ground() reads the mode per call
            forwards[mode] += forwards_per_image(grounder, phrases)
            seconds[mode] += timed(lambda: grounder.ground([request]))
    grounder.prompt = "per_phrase"
    runs = {mode: {"images": len(images), "forwards": forwards[mode], "seconds": seconds[mode],
                   "images_per_s": len(images) / seconds[mode], "s_per_forward": seconds[mode] / forwards[mode]}
            for mode in modes}
    return {**runs, "speedup": seconds["per_phrase"] / seconds["joint"]}


def forward_flops(grounder, image_path: str, prompts: Dict[str, str], image_size: int = FLOPS_IMAGE_SIZE
                  ) -> Dict[str, float]:
    """FLOPs of one GroundingDINO forward (one image, one prompt) per named prompt, at `image_size`."""
    from torch.utils.flop_counter import FlopCounterMode
    from parsers.grounding import groundingdino_image_tensor
    from parsers.images import read_rgb_file

    tensor = groundingdino_image_tensor(read_rgb_file(image_path), image_size, round(image_size * 1333 / 800))
    flops = {}
    for name, prompt in prompts.items():
        with FlopCounterMode(display=False) as counter:
            grounder._forward([tensor], [prompt])
        flops[name] = float(counter.get_total_flops())
    return flops


def gpu_hours_estimate(images: int, forwards: Dict[str, float], flops: Dict[str, float],
                       tflops: float) -> Dict[str, float]:
    """ESTIMATED GPU-hours per prompt mode: images x forwards per image x FLOPs per forward / assumed rate."""
    return {mode: images * forwards[mode] * flops[mode] / (tflops * 1e12) / 3600 for mode in forwards}


def prompt_modes_report(args: argparse.Namespace, parsing: dict, directory: Path) -> dict:
    """Real phrase sets, the timed modes, one forward's FLOPs per mode, and the COCO train2017 estimate."""
    from parsers.grounding import GroundingRequest, build_grounder, joint_prompts, phrase_prompt

    phrase_sets = image_phrase_sets(coco_caption_groups(args.caption_groups or fixture(SUGARCREPE_DIR)), args.model)
    chosen = phrase_sets[: args.mode_images]
    images = write_images(directory, len(chosen))
    words = {word for p in phrase_sets for text in p for word in text.lower().split()}
    text_encoder = str(args.text_encoder) if args.text_encoder else write_random_bert_base(
        directory / "bert_modes", sorted(words))
    grounder = build_grounder("groundingdino", checkpoint=str(args.checkpoint) if args.checkpoint else None,
                              text_encoder=text_encoder, image_size=GROUNDING_IMAGE_SIZE, batch_size=1,
                              device=args.device, allow_random_weights=args.checkpoint is None)
    tokenizer = grounder.model.tokenizer
    count = lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    stats = phrase_set_stats(phrase_sets, parsing["output"]["phrases_per_caption"], count)
    grounder.ground([GroundingRequest(images[0], chosen[0][:1])])  # warm-up (the model is loaded above)
    runs = benchmark_prompt_modes(grounder, images, chosen)
    prompts = {"per_phrase": phrase_prompt(chosen[0][0]), "joint": joint_prompts(chosen[0], count)[0][0].text}
    flops = forward_flops(grounder, images[0], prompts)
    forwards = {"per_phrase": stats["distinct_phrases_per_image"], "joint": stats["joint_prompts_per_image"]}
    hours = gpu_hours_estimate(COCO_TRAIN2017_IMAGES, forwards, flops, args.gpu_tflops)
    return {"phrase_sets": stats, "cpu_image_size": GROUNDING_IMAGE_SIZE, "timed_phrases": chosen, "runs": runs,
            "flops_image_size": FLOPS_IMAGE_SIZE, "flops_per_forward": flops, "flops_prompts": prompts,
            "estimate": {"images": COCO_TRAIN2017_IMAGES, "captions_per_image": CAPTIONS_PER_IMAGE,
                         "forwards_per_image": forwards, "assumed_gpu_tflops": args.gpu_tflops,
                         "gpu_hours": hours}}


def print_prompt_modes(report: dict) -> None:
    stats, runs, estimate = report["phrase_sets"], report["runs"], report["estimate"]
    print(f"prompt modes: {stats['phrases_per_caption']:.2f} phrases per caption; {stats['images']} images with "
          f"{CAPTIONS_PER_IMAGE} real COCO captions: {stats['distinct_phrases_per_image']:.2f} distinct phrases per "
          f"image (max {stats['max_distinct_phrases_per_image']}), {stats['joint_prompts_per_image']:.2f} joint "
          f"prompts per image ({stats['joint_prompt_tokens_mean']:.0f} tokens on average, max "
          f"{stats['joint_prompt_tokens_max']} of 256)")
    for mode in ("per_phrase", "joint"):
        run = runs[mode]
        print(f"  {mode}: {run['images_per_s']:.3f} images/s at {report['cpu_image_size']} px, {run['forwards']} "
              f"forwards for {run['images']} images, {run['s_per_forward']:.2f} s per forward; one forward at "
              f"{report['flops_image_size']} px: {report['flops_per_forward'][mode] / 1e9:.0f} GFLOP")
    print(f"  joint / per_phrase speed-up: {runs['speedup']:.2f}x")
    print(f"  ESTIMATE (not a measurement), COCO train2017 ({estimate['images']} images x "
          f"{estimate['captions_per_image']} captions) at an assumed {estimate['assumed_gpu_tflops']:.0f} TFLOP/s "
          "sustained: " + ", ".join(f"{mode} {hours:.1f} GPU-hours" for mode, hours in estimate["gpu_hours"].items()))


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
    captions = read_captions(args.captions or fixture(NEGCLIP_TSV))
    report = {"parse_only": args.parse_only, "core": core, "python": platform.python_version(),
              "parsing": benchmark_parsing(captions, args.model, args.batch_size, args.repeats)}
    print_parsing(report["parsing"])
    if not args.parse_only and args.grounding in ("all", "grid"):
        report["grounding"] = grounding_report(args, captions, cores)
        print_grounding(report["grounding"])
    if not args.parse_only and args.grounding in ("all", "modes"):
        report["grounding_threads"] = use_cores(cores)
        with tempfile.TemporaryDirectory(prefix="perf_preprocess_modes_") as tmp:
            report["prompt_modes"] = prompt_modes_report(args, report["parsing"], Path(tmp))
        print_prompt_modes(report["prompt_modes"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

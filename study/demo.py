"""`python -m study.demo --data-root DIR runs.LABEL=RUN_DIR ...`: the demo's results table.

The shapes world is scored with the evaluation harness: the swap set (`shapes_swap`) and image-text
retrieval over the validation captions (`coco_retrieval` reading the shapes world's COCO-format JSON); the
attention attribution gap (relation/attribute words minus object words) is measured as the monitor does.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch

from core.cli import add_data_root, add_key_values, add_output, key_value_sections, refuse_renamed
from modeling.encoders import CLIPEncoders
from evaluation.aligner import AlignerScorer, is_aligner_export
from evaluation.benchmarks.base import ImageRef
from evaluation.benchmarks.images import load_image
from evaluation.benchmarks.retrieval import CocoRetrieval
from evaluation.benchmarks.two_by_two import ShapesSwap
from evaluation.evaluate import SCORERS
from evaluation.harness import run_benchmark
from evaluation.scorers import ClipScorer
from lightning_modules.monitor import image_embeddings, make_probe, probe_attribution, summarise
from modeling.attribution import AttributionOptions
from parsers.scene_graph import SceneGraphParser

SWAP_TYPES = ("attribute", "relation", "object")
COLUMNS = [("text", "swap text"), ("image", "swap image"), ("group", "swap group")] + \
          [(f"acc_{t}", f"2-way {t}") for t in SWAP_TYPES] + [("i2t_r1", "I2T R@1"), ("t2i_r1", "T2I R@1"),
                                                                ("attr_gap", "attr gap x100")]
# Validation captions of the attribution-gap probe (the attention attribution, as CAE's demo trains it).
PROBE_SIZE = 200
STUDY_REPORT = "runs/study/sweep/report"
ROW_SETTINGS = {"runs": "runs.LABEL=RUN_DIR[@SCORER]"}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_root(parser, required=True, help="the shapes world")
    add_key_values(parser, dest="rows", help="runs.LABEL=RUN_DIR or runs.LABEL=RUN_DIR@SCORER (e.g. @sgi): one "
                   "row each, in the order given. Aligner runs (TFLocal / TFGlobal) are scored by their aligner")
    parser.add_argument("--split", default="test", help="the split scored (test: val is kept for selection)")
    add_output(parser, "file", help="also write the results as JSON here")
    refuse_renamed(parser, {"--data": "--data-root DIR", "--run": "runs.LABEL=RUN_DIR (a key=value argument)"})
    args = parser.parse_intermixed_args(argv)
    args.runs = key_value_sections(parser, args.rows, ROW_SETTINGS)["runs"]
    if not args.runs:
        parser.error(f"give the runs to score: {ROW_SETTINGS['runs']} ...")
    return args


def parse_run(label: str, target: str) -> Tuple[str, Path, str]:
    """`runs.LABEL=TARGET`: (label, run directory, scorer); TARGET is RUN_DIR or RUN_DIR@SCORER."""
    run_dir, _, scorer = target.partition("@")
    if scorer and scorer not in SCORERS:
        raise SystemExit(f"runs.{label}={target}: unknown scorer {scorer!r}; registered: {', '.join(SCORERS)}")
    return label, Path(run_dir), scorer or "clip"


def build_scorer(export_dir: Path, scorer: str):
    if scorer == "clip" and is_aligner_export(export_dir):
        return AlignerScorer.from_export(export_dir)
    return SCORERS[scorer].from_export(export_dir)


def evaluate_export(export_dir: Path, data_root: Path, split: str = "val", scorer_name: str = "clip"
                    ) -> Dict[str, float]:
    """Swap-set scores, retrieval R@K and (for a CLIP scored by global cosine) the attention attribution gap."""
    scorer = build_scorer(Path(export_dir), scorer_name)
    swap = ShapesSwap(data_root, split=split)
    captions_file = Path(data_root) / "annotations" / f"captions_{split}.json"
    retrieval = CocoRetrieval(data_root, annotation_file=f"annotations/captions_{split}.json",
                              images=Path(data_root) / "images" / split)
    result = {**run_benchmark(swap, scorer).aggregates, **run_benchmark(retrieval, scorer).aggregates}
    if isinstance(scorer, ClipScorer):  # the gap is a property of the CLIP text tower, not of other scorers
        result["attr_gap"] = attribution_gap(scorer, captions_file, Path(data_root) / "images" / split)
    return result


def attribution_gap(scorer: ClipScorer, captions_file: Path, image_dir: Path, method: str = "attention",
                    probe_size: int = PROBE_SIZE) -> float:
    """Mean A_comp - A_obj (x 100) over the first validation captions, as the attribution monitor measures it."""
    coco = json.loads(Path(captions_file).read_text())
    file_names = {image["id"]: image["file_name"] for image in coco["images"]}
    annotations = coco["annotations"][:probe_size]
    captions = [annotation["caption"].strip() for annotation in annotations]
    images = torch.stack([scorer.preprocess(load_image(ImageRef(str(image_dir / file_names[a["image_id"]]))))
                          for a in annotations])
    probe = make_probe(captions, images, scorer.tokenizer(captions), scorer.tokenizer,
                       SceneGraphParser().parse(captions), "val")
    encoders = CLIPEncoders(scorer.model.eval())
    attribution = probe_attribution(encoders, probe, image_embeddings(encoders, probe.images), method,
                                    AttributionOptions())
    return 100.0 * summarise(attribution, probe).scalars()["gap"]


def markdown_table(results: Dict[str, Dict[str, float]]) -> str:
    header = "| model | " + " | ".join(title for _, title in COLUMNS) + " |"
    rule = "|---|" + "---:|" * len(COLUMNS)
    rows = [f"| {label} | " + " | ".join(_cell(scores.get(key)) for key, _ in COLUMNS) + " |"
            for label, scores in results.items()]
    return "\n".join([header, rule, *rows])


def _cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def check_inputs(data: Path, runs: Sequence[Tuple[str, Path, str]]) -> None:
    """Every row's export and the shapes world exist: found before the first row's minutes of scoring."""
    missing = [f"--data-root {data}: no directory"] if not Path(data).is_dir() else []
    missing += [f"runs.{label}={run_dir}: no export at {run_dir / 'export'} (train it with lightning_modules.fit)"
                for label, run_dir, _ in runs if not (run_dir / "export").is_dir()]
    if missing:
        raise SystemExit("the demo table cannot start:\n  - " + "\n  - ".join(missing))


def score_rows(runs: Sequence[Tuple[str, Path, str]], data: Path, split: str) -> Dict[str, Dict[str, float]]:
    """Each row's scores, with a line as each row starts and finishes (a row takes up to minutes on a CPU)."""
    results = {}
    for number, (label, run_dir, scorer) in enumerate(runs, start=1):
        print(f"[{number}/{len(runs)}] {label}: scoring {run_dir / 'export'} ({scorer}) ...", flush=True)
        start = time.perf_counter()
        results[label] = evaluate_export(run_dir / "export", data, split, scorer)
        print(f"[{number}/{len(runs)}] {label}: done in {time.perf_counter() - start:.0f} s", flush=True)
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    runs = [parse_run(label, target) for label, target in args.runs.items()]
    check_inputs(args.data_root, runs)
    results = score_rows(runs, args.data_root, args.split)
    print(f"\nShapes world ({args.split} split): swap scores and 2-way accuracy by swap type, retrieval R@1 (%), "
          f"attention attribution gap (mean A_comp - A_obj over {PROBE_SIZE} captions, x100)\n")
    print(markdown_table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print("\nTensorBoard: tensorboard --logdir runs (CUSTOM SCALARS: every row's attribution gap over its steps; "
          "docs/monitoring.md)")
    print(f"The demo is a quick tour (one seed, no selection). The controlled method study (every method under "
          f"equal conditions, learning rates chosen on validation, 3 seeds, intervals, paired bootstrap against "
          f"CLIP-FT): `make study`, table and plots in {STUDY_REPORT}/results.md (docs/study.md).")


if __name__ == "__main__":
    main()

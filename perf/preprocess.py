"""`python -m perf.preprocess`: throughput of the offline preprocessing stages on real captions.

`--parse-only` times the scene-graph parser (spaCy + rules) on the NegCLIP validation captions (real COCO
captions), on one CPU core, best of `--repeats` runs after a warmup; spaCy alone is timed the same way so the
rules' own cost is visible. Grounding is not timed yet (the flag is how a run asks for parsing alone once it
is). A benchmark, not a test: it asserts nothing and writes JSON to `--out`.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from parsers.scene_graph import DEFAULT_MODEL, SceneGraphParser

NEGCLIP_TSV = Path(__file__).resolve().parents[2] / "shared" / "data" / "negclip" / "valid_neg_clip.tsv"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parse-only", action="store_true", help="time the scene-graph parser alone")
    parser.add_argument("--captions", type=Path, default=NEGCLIP_TSV, help="TSV with a `title` column")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs; the best one is reported")
    parser.add_argument("--all-cores", action="store_true", help="do not pin the process to one core")
    parser.add_argument("--out", type=Path, default=Path("runs/perf_preprocess.json"))
    return parser.parse_args(argv)


def read_captions(path: Path) -> List[str]:
    """The `title` column; the csv module, because some captions hold quoted newlines."""
    with open(path, newline="", encoding="utf-8") as f:
        return [row["title"] for row in csv.DictReader(f, delimiter="\t")]


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


def best_rate(run: Callable[[], object], n: int, repeats: int) -> Dict[str, object]:
    """Items per second of the fastest of ``repeats`` calls of ``run`` (each processes ``n`` items)."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
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


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    core = None if args.all_cores else pin_to_one_core()
    captions = read_captions(args.captions)
    report = {"parse_only": args.parse_only, "core": core, "python": platform.python_version(),
              "parsing": benchmark_parsing(captions, args.model, args.batch_size, args.repeats)}
    parsing = report["parsing"]
    print(f"parsing: {parsing['captions_per_s']:.0f} captions/s on {parsing['captions']} captions "
          f"(spaCy alone {parsing['spacy_only_captions_per_s']:.0f}/s, rules "
          f"{parsing['rules_ms_per_caption']:.3f} ms/caption; runs {statistics.mean(parsing['seconds']):.2f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

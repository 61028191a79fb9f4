"""`python -m perf.monitor`: what the attribution monitor costs, each run trained with and without it, side by side.

Every row is a real `fit` of its config: once as configured (the monitor on, as every method ships) and once with
`monitor.every_n_steps=0`, the two in alternating order over `--repeats` rounds (with, without; without, with; ...)
so that machine noise hits both alike. The report gives per row the median wall time of each run (all of `fit`:
model, data, training, export), their ratio, and the monitor's own time (probe, measurements, figures, as the
callback clocks it) as a share of the run without it. A benchmark, not a test.

The default rows are the shapes-world recipes (configs/demo/*.yaml), which read the 64 px shapes world, its
preprocessing cache, the stage-1 backbone and TFLocal's features: make them first with the commands of
docs/performance.md#attribution-monitor. `--config FILE` (repeatable, merged
as fit merges them) measures one other config instead, e.g. a paper recipe on a GPU machine. Key=value settings
are overrides applied to every run (`trainer.max_steps=50`). Each run trains in a fresh folder under a temporary
directory; the recipes' own runs are not touched.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from core.cli import add_key_values, add_output
from lightning_modules import load_run_config
from lightning_modules.fit import run
from lightning_modules.monitor import AttributionMonitor

# The shapes-world recipes' rows: label -> config files.
ROWS: Dict[str, List[str]] = {row: [f"configs/demo/{config}.yaml"] for row, config in (
    ("pretrain", "pretrain"), ("clip_ft", "clip_ft"), ("cae", "cae"), ("macco", "macco"), ("smartclip", "smartclip"),
    ("tflocal", "tflocal"))}
WITHOUT = "monitor.every_n_steps=0"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of the demo's rows {sorted(ROWS)}")
    parser.add_argument("--config", action="append", default=[],
                        help="measure this config instead of the demo's rows (repeatable: merged in order)")
    parser.add_argument("--repeats", type=int, default=3, help="runs with and runs without the monitor, per row")
    add_output(parser, "file", default=Path("runs/perf_monitor.json"), help="the JSON report")
    add_key_values(parser, help="config overrides applied to every run, e.g. trainer.max_steps=50")
    return parser.parse_intermixed_args(argv)


def chosen_rows(args: argparse.Namespace) -> Dict[str, List[str]]:
    if args.config:
        return {"config": list(args.config)}
    names = [name.strip() for name in args.rows.split(",") if name.strip()]
    unknown = sorted(set(names) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; the demo's rows: {', '.join(ROWS)}")
    return {name: ROWS[name] for name in names}


def timed_fit(configs: List[str], overrides: List[str], runs_root: Path) -> dict:
    """One fit in a fresh folder: its wall time, steps, and the monitor's own time and measured steps."""
    cfg = load_run_config(configs, [*overrides, f"runs_root={runs_root}", "trainer.enable_progress_bar=false"])
    start = time.perf_counter()
    trainer = run(cfg)
    seconds = time.perf_counter() - start
    monitor = next((c for c in trainer.callbacks if isinstance(c, AttributionMonitor)), None)
    return {"seconds": seconds, "steps": trainer.global_step,
            "monitor_seconds": monitor.seconds if monitor else 0.0,
            "measured_steps": monitor.measured_steps if monitor else []}


def measure_row(configs: List[str], overrides: List[str], repeats: int, scratch: Path) -> Dict[str, List[dict]]:
    """`repeats` fits with and without the monitor, alternating which goes first."""
    samples: Dict[str, List[dict]] = {"with": [], "without": []}
    for repeat in range(repeats):
        order = ("with", "without") if repeat % 2 == 0 else ("without", "with")
        for variant in order:
            extra = [] if variant == "with" else [WITHOUT]
            samples[variant].append(timed_fit(configs, [*overrides, *extra], scratch / f"{variant}-{repeat}"))
    return samples


def summarise_row(samples: Dict[str, List[dict]]) -> dict:
    with_monitor = statistics.median(s["seconds"] for s in samples["with"])
    without = statistics.median(s["seconds"] for s in samples["without"])
    own = statistics.median(s["monitor_seconds"] for s in samples["with"])
    return {"steps": samples["with"][0]["steps"], "measured_steps": samples["with"][0]["measured_steps"],
            "with_s": with_monitor, "without_s": without, "ratio": with_monitor / without,
            "monitor_s": own, "monitor_share": own / without, "samples": samples}


def print_table(rows: Dict[str, dict]) -> None:
    print("| row | steps | points | fit without (s) | fit with (s) | with / without | monitor's own time |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['steps']} | {len(row['measured_steps'])} | {row['without_s']:.1f} | "
              f"{row['with_s']:.1f} | {row['ratio']:.3f} | {row['monitor_s']:.1f} s = "
              f"{100 * row['monitor_share']:.1f}% |")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    rows = chosen_rows(args)
    results = {}
    with tempfile.TemporaryDirectory(prefix="perf_monitor_") as scratch:
        for name, configs in rows.items():
            print(f"{name}: {args.repeats} runs with and {args.repeats} without the monitor ...", flush=True)
            results[name] = summarise_row(measure_row(configs, list(args.overrides), args.repeats,
                                                      Path(scratch) / name))
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"overrides": list(args.overrides), "repeats": args.repeats, "rows": results},
                                   indent=2))
    return results


if __name__ == "__main__":
    main()

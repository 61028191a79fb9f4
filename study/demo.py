"""`python -m study.demo --data-root DIR --bundle DIR runs.LABEL=RUN_DIR ...`: the demo's table.

`make demo` fine-tunes the method study's fine-tuning methods from its carried backbone on its world, all at one small
budget (configs/sweeps/demo.yaml), and this command scores them on the world's `test` split: the swap set
(`shapes_swap`), image-text retrieval over the split's captions and the attention attribution gap (relation /
attribute words minus object words, as the monitor measures it). Every row is compared with the reference row (the
pretrained backbone) on the same swap items: the difference with a paired bootstrap interval over items, and for the
swap group score the items only the row gets right against those only the reference gets right, with an exact sign
test. The positive control of the study (its `validity.control`, CLIP-FT with hard negatives) must gain beyond
noise, or the table shows nothing about the methods. Below the table, the committed study's own numbers at full
budget, read from the bundle's `report.json`.

`--check` checks, before any training, that the world is the one the bundle was made on (its checksums against the
bundle's `sweep.json`) and, with a reference row, that the row's weights are the bundle's carried backbone.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from core.cli import add_data_root, add_key_values, add_output, key_value_sections, refuse_renamed
from core.run_records import RECORD_SUFFIX, file_sha256, read_json_gz
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
from study.records import CARRIED_SOURCE, carried_backbones, weights_sha256
from study.stats import Interval, paired_bootstrap

# Captions of the scored split in the attribution-gap probe (the attention attribution, as the monitor measures it).
PROBE_SIZE = 200
ROW_SETTINGS = {"runs": "runs.LABEL=RUN_DIR[@SCORER]"}
# The paired comparisons against the reference row: the swap group score (the study's headline) and 2-way relation
# accuracy (the study's criterion for the positive control).
PAIRED = ("group", "acc_relation")
RESAMPLES = 10_000  # the study's bootstrap (report.json `bootstrap`)
SIGNIFICANCE = 0.05


# ----- arguments --------------------------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_data_root(parser, required=True, help="the shapes world")
    add_key_values(parser, dest="rows", help="runs.LABEL=RUN_DIR or runs.LABEL=RUN_DIR@SCORER (e.g. @sgi): one "
                   "row each, in the order given. Aligner runs (TFLocal / TFGlobal) are scored by their aligner")
    parser.add_argument("--bundle", type=Path, help="the study's results bundle (e.g. results/study): its world "
                        "is checked, its control named and its headline printed")
    parser.add_argument("--reference", default="pretrained", help="the row every other row is compared with")
    parser.add_argument("--control", help="the positive control's row (default: the bundle's control method)")
    parser.add_argument("--split", default="test", help="the split scored (test: val is kept for selection)")
    parser.add_argument("--check", action="store_true", help="only check the world (and the reference row's "
                        "weights) against the bundle, then stop")
    add_output(parser, "file", help="also write the results as JSON here")
    refuse_renamed(parser, {"--data": "--data-root DIR", "--run": "runs.LABEL=RUN_DIR (a key=value argument)"})
    args = parser.parse_intermixed_args(argv)
    args.runs = key_value_sections(parser, args.rows, ROW_SETTINGS)["runs"]
    if not args.runs and not args.check:
        parser.error(f"give the runs to score: {ROW_SETTINGS['runs']} ...")
    if args.check and not args.bundle:
        parser.error("--check needs --bundle")
    return args


def parse_run(label: str, target: str) -> Tuple[str, Path, str]:
    """`runs.LABEL=TARGET`: (label, run directory, scorer); TARGET is RUN_DIR or RUN_DIR@SCORER."""
    run_dir, _, scorer = target.partition("@")
    if scorer and scorer not in SCORERS:
        raise SystemExit(f"runs.{label}={target}: unknown scorer {scorer!r}; registered: {', '.join(SCORERS)}")
    return label, Path(run_dir), scorer or "clip"


# ----- the bundle: whose world, whose backbone --------------------------------------------------------------------
def study_folder(bundle: Path) -> Path:
    """The bundle's study: the sweep folder that holds a report (its checks' folder has none)."""
    reports = sorted(Path(bundle).glob("*/report.json"))
    if not reports:
        raise SystemExit(f"--bundle {bundle}: no <sweep>/report.json (is it a results bundle?)")
    return reports[0].parent


def read_document(bundle: Path, name: str) -> dict:
    return json.loads((study_folder(bundle) / name).read_text())


def world_problems(bundle: Path, data: Path) -> List[str]:
    """How the world at `data` differs from the one the bundle was made on (the sha256 of its annotation files)."""
    stored = (read_document(bundle, "sweep.json").get("world") or {}).get("files") or {}
    if not stored:
        return ["the bundle records no world checksums"]
    problems = []
    for name, sha256 in sorted(stored.items()):
        path = Path(data) / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif file_sha256(path) != sha256:
            problems.append(f"{name}: other contents")
    return problems


def carried_sha256(bundle: Path) -> List[str]:
    """sha256 of the backbones the bundle carries (`<sweep>/backbones/<sha16>/source.json`)."""
    return [json.loads((folder / CARRIED_SOURCE).read_text())["sha256"] for folder in carried_backbones(bundle)]


def check_bundle(bundle: Path, data: Path, reference: Optional[Path]) -> None:
    """Stop, saying why, unless the world is the bundle's and the reference export holds its carried backbone."""
    differences = world_problems(bundle, data)
    problems = [f"--data-root {data}: not the world of {bundle} ({', '.join(differences)}); generate it as the "
                "Makefile's study world rule does (its seed decides the held-out combinations)"] if differences else []
    if reference is not None:
        found = weights_sha256(reference / "export") if (reference / "export").is_dir() else None
        if found not in carried_sha256(bundle):
            problems.append(f"{reference / 'export'}: not the backbone {bundle} carries (sha256 {found}); "
                            f"put it back with python -m study.restore --bundle {bundle}")
    if problems:
        raise SystemExit("the demo cannot start:\n  - " + "\n  - ".join(problems))


# ----- scoring ----------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """A scored row: its aggregates (x100) and its swap items' outcomes by id (0/1 flags, as the study stores them)."""

    scores: Dict[str, float]
    swap: Dict[str, dict] = field(default_factory=dict)
    steps: Optional[int] = None  # the export's global step


def build_scorer(export_dir: Path, scorer: str):
    if scorer == "clip" and is_aligner_export(export_dir):
        return AlignerScorer.from_export(export_dir)
    return SCORERS[scorer].from_export(export_dir)


def evaluate_export(export_dir: Path, data_root: Path, split: str = "val", scorer_name: str = "clip") -> Row:
    """Swap-set scores and outcomes, retrieval R@K and (for a CLIP scored by global cosine) the attention gap."""
    from study.analysis import compact_outcome  # here: study.analysis imports this module's build_scorer

    scorer = build_scorer(Path(export_dir), scorer_name)
    swap = run_benchmark(ShapesSwap(data_root, split=split), scorer)
    captions_file = Path(data_root) / "annotations" / f"captions_{split}.json"
    retrieval = CocoRetrieval(data_root, annotation_file=f"annotations/captions_{split}.json",
                              images=Path(data_root) / "images" / split)
    scores = {**swap.aggregates, **run_benchmark(retrieval, scorer).aggregates}
    if isinstance(scorer, ClipScorer):  # the gap is a property of the CLIP text tower, not of other scorers
        scores["attr_gap"] = attribution_gap(scorer, captions_file, Path(data_root) / "images" / split)
    model_file = Path(export_dir) / "model.json"
    steps = json.loads(model_file.read_text()).get("global_step") if model_file.is_file() else None
    return Row(scores, {str(o["id"]): compact_outcome(o) for o in swap.outcomes}, steps)


@lru_cache(maxsize=1)
def caption_parser() -> SceneGraphParser:
    """One parser for every row (loading its spaCy model costs seconds)."""
    return SceneGraphParser()


def attribution_gap(scorer: ClipScorer, captions_file: Path, image_dir: Path, method: str = "attention",
                    probe_size: int = PROBE_SIZE) -> float:
    """Mean A_comp - A_obj (x 100) over the first captions of a split, as the attribution monitor measures it."""
    coco = json.loads(Path(captions_file).read_text())
    file_names = {image["id"]: image["file_name"] for image in coco["images"]}
    annotations = coco["annotations"][:probe_size]
    captions = [annotation["caption"].strip() for annotation in annotations]
    images = torch.stack([scorer.preprocess(load_image(ImageRef(str(image_dir / file_names[a["image_id"]]))))
                          for a in annotations])
    probe = make_probe(captions, images, scorer.tokenizer(captions), scorer.tokenizer,
                       caption_parser().parse(captions), "val")
    encoders = CLIPEncoders(scorer.model.eval())
    attribution = probe_attribution(encoders, probe, image_embeddings(encoders, probe.images), method,
                                    AttributionOptions())
    return 100.0 * summarise(attribution, probe).scalars()["gap"]


def check_inputs(data: Path, runs: Sequence[Tuple[str, Path, str]]) -> None:
    """Every row's export and the shapes world exist: found before the first row's minutes of scoring."""
    missing = [f"--data-root {data}: no directory"] if not Path(data).is_dir() else []
    missing += [f"runs.{label}={run_dir}: no export at {run_dir / 'export'} (train it with lightning_modules.fit)"
                for label, run_dir, _ in runs if not (run_dir / "export").is_dir()]
    if missing:
        raise SystemExit("the demo table cannot start:\n  - " + "\n  - ".join(missing))


def score_rows(runs: Sequence[Tuple[str, Path, str]], data: Path, split: str) -> Dict[str, Row]:
    """Each row's scores, with a line as each row starts and finishes (a row takes up to a minute on a CPU)."""
    results = {}
    for number, (label, run_dir, scorer) in enumerate(runs, start=1):
        print(f"[{number}/{len(runs)}] {label}: scoring {run_dir / 'export'} ({scorer}) ...", flush=True)
        start = time.perf_counter()
        results[label] = evaluate_export(run_dir / "export", data, split, scorer)
        print(f"[{number}/{len(runs)}] {label}: done in {time.perf_counter() - start:.0f} s", flush=True)
    return results


# ----- paired comparisons -----------------------------------------------------------------------------------------
@dataclass
class Paired:
    """A row against the reference on the same swap items: the difference of a metric with its bootstrap interval;
    for the group score also the discordant items (`wins`: only the row right; `losses`: only the reference) and
    the exact two-sided sign test over them."""

    difference: Interval
    items: int
    wins: Optional[int] = None
    losses: Optional[int] = None
    p_value: Optional[float] = None


def item_values(outcomes: Mapping[str, dict], metric: str) -> Dict[str, float]:
    """Per item, its share (x100) of `metric`, whose mean over the items is the benchmark's aggregate."""
    from study.analysis import item_values as study_item_values  # as compact_outcome: imported where used

    return study_item_values(list(outcomes.values()), metric)


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided sign test: P(a split at least this uneven) of wins + losses fair coin flips."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1))
    return min(1.0, 2 * tail / 2 ** n)


def compare(row: Row, reference: Row, metric: str, resamples: int = RESAMPLES) -> Paired:
    """`row` - `reference` on the swap items both hold (a paired bootstrap over items, the study's seed 0)."""
    mine, theirs = item_values(row.swap, metric), item_values(reference.swap, metric)
    items = sorted(set(mine) & set(theirs))
    if not items:
        raise SystemExit(f"no swap item of {metric} is scored in both rows: are they scored on one split?")
    first = np.array([[mine[item] for item in items]])
    second = np.array([[theirs[item] for item in items]])
    paired = Paired(paired_bootstrap(first, second, resamples=resamples), len(items))
    if metric == "group":
        paired.wins = int((first > second).sum())
        paired.losses = int((first < second).sum())
        paired.p_value = sign_test(paired.wins, paired.losses)
    return paired


def comparisons(results: Mapping[str, Row], reference: str, resamples: int = RESAMPLES
                ) -> Dict[str, Dict[str, Paired]]:
    """Every row but the reference against it, per paired metric."""
    if reference not in results:
        raise SystemExit(f"--reference {reference}: no such row (rows: {', '.join(results)})")
    return {label: {metric: compare(row, results[reference], metric, resamples) for metric in PAIRED}
            for label, row in results.items() if label != reference}


# ----- the table --------------------------------------------------------------------------------------------------
def signed(interval: Interval) -> str:
    return f"{interval.estimate:+.1f} [{interval.low:+.1f}, {interval.high:+.1f}]"


def p_text(p_value: float) -> str:
    return f"{p_value:.2g}" if p_value >= 1e-4 else "< 1e-4"


def p_clause(p_value: float) -> str:
    """`= 0.0033` or `< 1e-4`, to follow a `p` in a sentence."""
    return f"= {p_text(p_value)}" if p_value >= 1e-4 else p_text(p_value)


def _cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f}"


def table_row(label: str, row: Row, paired: Optional[Mapping[str, Paired]]) -> List[str]:
    group, relation = (paired or {}).get("group"), (paired or {}).get("acc_relation")
    scores = row.scores
    return [label, "-" if paired is None or row.steps is None else str(row.steps),
            _cell(scores.get("group")), signed(group.difference) if group else "-",
            f"{group.wins} / {group.losses}" if group else "-", p_text(group.p_value) if group else "-",
            _cell(scores.get("acc_relation")), signed(relation.difference) if relation else "-",
            _cell(scores.get("acc_attribute")),
            f"{_cell(scores.get('i2t_r1'))} / {_cell(scores.get('t2i_r1'))}", _cell(scores.get("attr_gap"))]


def markdown_table(results: Mapping[str, Row], paired: Mapping[str, Mapping[str, Paired]], reference: str) -> str:
    header = ["model", "steps", "swap group", f"group - {reference}", "right only here / only there",
              "sign test p", "2-way relation", f"relation - {reference}", "2-way attribute", "R@1 I2T / T2I",
              "attr gap x100"]
    rows = [table_row(label, row, paired.get(label)) for label, row in results.items()]
    # The model column left-aligned, the numbers right-aligned.
    return "\n".join(["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)] +
                     ["| " + " | ".join(row) + " |" for row in rows])


def verdict(control: str, reference: str, paired: Mapping[str, Paired], steps: Optional[int]) -> str:
    """Whether the positive control's swap group gain is beyond noise, in words."""
    group = paired["group"]
    beyond = group.difference.low > 0 and group.p_value < SIGNIFICANCE
    budget = f"after {steps} steps" if steps is not None else "at this budget"
    reading = ("a gain beyond noise: the testbed can register what a method adds" if beyond else
               "not distinguishable from noise at this budget: the other rows say nothing yet (train longer)")
    return (f"The positive control `{control}` gains {group.difference.estimate:+.1f} swap group points "
            f"[{group.difference.low:+.1f}, {group.difference.high:+.1f}] over `{reference}` {budget}: "
            f"{group.wins} of the {group.items} items are right only with it, {group.losses} only without it "
            f"(exact sign test p {p_clause(group.p_value)}), {reading}.")


# ----- the committed study's headline -----------------------------------------------------------------------------
def control_of(report: Mapping[str, object]) -> Dict[str, str]:
    return dict((report.get("validity") or {}).get("control") or {})


def full_budget_steps(bundle: Path, control: Mapping[str, str]) -> Optional[int]:
    """`trainer.max_steps` of the control's runs, from the first of their records."""
    folder = study_folder(bundle)
    for run in read_document(bundle, "sweep.json").get("runs") or []:
        choices = {axis: label.split("-", 1)[1] for axis, label in (run.get("choices") or {}).items()}
        record = folder / "runs" / f"{run['name']}{RECORD_SUFFIX}"
        if all(choices.get(axis) == control.get(axis) for axis in ("method", "negatives")) and record.is_file():
            return (read_json_gz(record).get("config") or {}).get("trainer.max_steps")
    return None


def _measure(entry: Mapping[str, float]) -> str:
    return f"{entry['mean']:+.1f} [{entry['low']:+.1f}, {entry['high']:+.1f}]"


def validity_line(report: Mapping[str, object], split: str) -> str:
    """The study's own verdict on its testbed: every check passed on `split`, or the ones that did not."""
    validity = report.get("validity") or {}
    if validity.get("passed"):
        return "  testbed validity: every check passes"
    missed = [f"({c['check']}) {c['title']}: {'not measured' if c.get('passed') is None else 'no'}"
              for c in validity.get("checks") or [] if c.get("split") in (split, None) and c.get("passed") is not True]
    return (f"  testbed validity: not shown valid ({'; '.join(missed) or 'see the report'}): every comparison is "
            "provisional, a measurement of this testbed, not a conclusion about the methods")


def claimed(report: Mapping[str, object], comparison: Mapping[str, object]) -> bool:
    """Whether the report reads `comparison` as a claim (its `claims.rule`: both intervals exclude 0 on one side)."""
    keys = ("method", "negatives", "reference", "split", "metric")
    return any(all(claim.get(key) == comparison.get(key) for key in keys)
               for claim in (report.get("claims") or {}).get("read") or [])


def comparison_text(report: Mapping[str, object], c: Mapping[str, object]) -> str:
    seed_t = c.get("seed_t")
    seeds = f"; seed-level t {seed_t['estimate']:+.1f} [{seed_t['low']:+.1f}, {seed_t['high']:+.1f}]" if seed_t else ""
    verdict = (": a claim" if claimed(report, c) else ": no claim") if "claims" in report else ""
    return f"{c['estimate']:+.1f} [{c['low']:+.1f}, {c['high']:+.1f}] (items x seeds bootstrap{seeds}){verdict}"


def study_headline(bundle: Path, methods: Sequence[str], split: str) -> List[str]:
    """The committed study's numbers at full budget, from its report.json: the control's gain over the pretrained
    backbones (the validity table), the study's verdict on its testbed, and every demo method's swap group difference
    with the control, with the report's reading of it."""
    report = read_document(bundle, "report.json")
    control = control_of(report)
    condition = control.get("negatives")
    name = f"{control.get('method')} ({condition})"
    gain = ((report.get("validity") or {}).get("splits") or {}).get(split, {}).get("gain") or {}
    found = {c["method"]: c for c in report.get("comparisons") or []
             if c["split"] == split and c["metric"] == "group" and c["reference"] == name
             and c["negatives"] == condition and c["method"] in methods}
    seeds = max((c["n_seeds"] for c in found.values()), default=None)
    steps = full_budget_steps(bundle, control)
    lines = [f"The committed study at full budget ({steps} steps, {seeds or '?'} seeds, lr chosen on val; "
             f"{study_folder(bundle) / 'report.json'}), on {split}:"]
    if gain:
        lines.append(f"  {name}, the positive control, over the pretrained backbones: swap group "
                     f"{_measure(gain['group'])}, 2-way relation {_measure(gain['acc_relation'])}")
    if report.get("validity"):
        lines.append(validity_line(report, split))
    lines += [f"  {method} ({condition}) - {name}, swap group: {comparison_text(report, found[method])}"
              for method in methods if method in found]
    return lines


# ----- the command ------------------------------------------------------------------------------------------------
def results_document(results: Mapping[str, Row], paired: Mapping[str, Mapping[str, Paired]]) -> dict:
    return {label: {"scores": row.scores, "steps": row.steps,
                    "paired": {metric: {**p.difference.as_dict(), "items": p.items, "wins": p.wins,
                                        "losses": p.losses, "p": p.p_value}
                               for metric, p in paired.get(label, {}).items()}}
            for label, row in results.items()}


def report_lines(results: Mapping[str, Row], paired: Mapping[str, Mapping[str, Paired]], reference: str,
                 control: Optional[str], split: str) -> List[str]:
    lines = [f"Shapes world ({split} split): swap group score, 2-way accuracy by swap type, retrieval R@1 (%), "
             f"attention attribution gap (mean A_comp - A_obj over {PROBE_SIZE} captions, x100). Differences "
             f"against `{reference}` on the same swap items, 95% paired bootstrap interval over items; "
             "`right only here / only there`: swap items whose group is right with the row and wrong with the "
             "reference, and the reverse.", "", markdown_table(results, paired, reference), ""]
    if control in paired:
        lines.append(verdict(control, reference, paired[control], results[control].steps))
    lines.append("Every row starts from the same backbone with the same data, batch, steps and learning rate: "
                 "one seed each, a tour, not a comparison (the study's is below).")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Row]:
    args = parse_args(argv)
    runs = [parse_run(label, target) for label, target in args.runs.items()]
    reference_dir = next((run_dir for label, run_dir, _ in runs if label == args.reference), None)
    if args.bundle:
        check_bundle(args.bundle, args.data_root, reference_dir)
        if args.check:
            print(f"{args.data_root}: the world of {args.bundle}" +
                  (f"; {reference_dir}: its backbone" if reference_dir else ""))
            return {}
    check_inputs(args.data_root, runs)
    results = score_rows(runs, args.data_root, args.split)
    paired = comparisons(results, args.reference)
    control = args.control
    if control is None and args.bundle:  # the study's positive control (report.json `validity.control`)
        control = control_of(read_document(args.bundle, "report.json")).get("method")
    print("\n" + "\n".join(report_lines(results, paired, args.reference, control, args.split)))
    if args.bundle:
        print("\n" + "\n".join(study_headline(args.bundle, [label for label in results if label != args.reference],
                                              args.split)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results_document(results, paired), indent=2))
    print("\nTensorBoard: tensorboard --logdir runs/demo (CUSTOM SCALARS: every row's attribution gap over its steps; "
          "docs/monitoring.md). The whole study: make study (docs/study.md).")
    return results


if __name__ == "__main__":
    main()

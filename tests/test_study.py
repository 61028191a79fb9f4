"""The study report: selection on validation only, intervals over seeds, paired differences, files, caching.

Most tests build a sweep directory by hand: sweep.json and, per run, an export folder and a `study_eval.json`
holding per-item outcomes drawn here, so every number the report prints can be recomputed in the test from the
stored outcomes. One test scores real (random-weight, tiny) exports end to end through the command line.
"""
from __future__ import annotations

import csv
import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from evaluation.benchmarks.two_by_two import ShapesSwap
from study import cli as study_cli
from study.analysis import (Evaluations, cached_scores, evaluate_study, export_fingerprint, item_values,
                            select_settings, split_fingerprint)
from study.settings import (CACHE_FILE, CACHE_VERSION, FROZEN_DIR, OUTCOME_FLAGS, StudyError, StudySettings, load_study,
                            parse_settings)
from study.analysis import read_curves
from study.report import write_report
from study.stats import seed_interval

REPO = Path(__file__).resolve().parents[1]
SPLITS = ("val", "test", "test_unseen")
TYPES = ("attribute", "relation", "object")
ITEMS = 30
RESAMPLES = 400
FLAGS = ("text_i0", "text_i1", "image_c0", "image_c1")


# ----- a hand-made sweep ----------------------------------------------------------------------------------------
def make_world(root: Path) -> Path:
    """A world folder with the annotation files the cache fingerprints (their contents are not read here)."""
    (root / "annotations").mkdir(parents=True)
    for split in SPLITS:
        for kind in ("captions", "swap"):
            (root / "annotations" / f"{kind}_{split}.json").write_text(f"{kind} {split}")
    return root


def draw_outcomes(quality: float, rng: np.random.Generator) -> list:
    """ITEMS swap outcomes (ids shuffled: the report must pair items by id), each decision right w.p. quality."""
    outcomes = []
    for index in rng.permutation(ITEMS):
        flags = {flag: int(rng.random() < quality) for flag in FLAGS}
        text, image = flags["text_i0"] & flags["text_i1"], flags["image_c0"] & flags["image_c1"]
        outcomes.append({"id": f"{index:03d}", "type": TYPES[index % 3], **flags, "text": text, "image": image,
                         "group": text & image, "tie": 0})
    return outcomes


def split_scores(outcomes: list, data: Path, split: str, rng: np.random.Generator) -> dict:
    """A scoring as the cache stores it: the swap outcomes given, and drawn retrieval and zero-shot outcomes (ITEMS
    queries each way; ITEMS objects, each with a shape and a colour decision), their aggregates computed here."""
    own = np.random.default_rng([int(rng.integers(0, 100)), int(rng.integers(0, 100))])  # two draws, as always
    retrieval = [[direction, int(own.integers(0, 3)), 0] for direction in ("i2t", "t2i") for _ in range(ITEMS)]
    zeroshot = [[f"{attribute}:{index}:1", 0, int(own.integers(0, 3)), 0] for attribute in ("shape", "color")
                for index in range(ITEMS)]

    def top1(outcomes: list) -> float:
        return 100.0 * sum(rank == 0 for *_, rank, _ in outcomes) / len(outcomes)

    return {"data": split_fingerprint(data, split), "swap_outcomes": outcomes,
            "swap": ShapesSwap.aggregate(outcomes), "retrieval_outcomes": retrieval,
            "retrieval": {f"{d}_r1": top1([o for o in retrieval if o[0] == d]) for d in ("i2t", "t2i")},
            "zeroshot_outcomes": zeroshot,
            "zeroshot": {f"{a}_top1": top1([o for o in zeroshot if o[0].startswith(a)]) for a in ("shape", "color")},
            "mechanisms": None}


def write_export(directory: Path, method: str | None = None, config: dict | None = None) -> Path:
    """A run's export (model.json; aligner.json for an aligner method) and, with `config`, its config.yaml."""
    (directory / "export").mkdir(parents=True, exist_ok=True)
    (directory / "export" / "model.json").write_text('{"model": "fake"}')
    if method in ("tflocal", "tfglobal"):
        (directory / "export" / "aligner.json").write_text("{}")
    if config is not None:
        (directory / "config.yaml").write_text(yaml.safe_dump(config))
    return directory / "export"


def run_config(tmp_path: Path, name: str, method: str, lr: str, seed: int, negatives: str = "without",
               **extra) -> dict:
    """The config.yaml of a hand-made run: what the bundle's digest covers (and keys it leaves out)."""
    return {"experiment": name, "seed": seed, "runs_root": "runs/x",
            "model": {"name": "ViT-Tiny-16-64", "pretrained": str(tmp_path / "backbone" / "export")},
            "method": {"name": method, "hard_negatives": {"captions": 3 if negatives == "with" else 0}},
            "optim": {"lr": float(lr)}, "data": {"batch_size": 32, "num_workers": 0, "per_device_batch_size": 32},
            "trainer": {"devices": 1, "max_steps": 600}, **extra}


def write_backbone(tmp_path: Path) -> Path:
    export = write_export(tmp_path / "backbone")
    (export / "open_clip.pt").write_bytes(b"the backbone's weights")
    return export


def write_cached(directory: Path, scorer: str, scores: dict, export: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    document = {"version": CACHE_VERSION, "scorer": scorer, "export": export_fingerprint(export),
                "splits": scores}
    (directory / CACHE_FILE).write_text(json.dumps(document))


# Validation prefers lr 0.001 for macco; the test splits would prefer lr 0.0001: selection must not see them.
def quality(method: str, negatives: str, lr: str, split: str) -> float:
    base = {"clip_ft": 0.6, "macco": 0.7, "tflocal": 0.65, "frozen_cosine": 0.55, "sgi": 0.6}[method]
    base += 0.1 if negatives == "with" else 0.0
    better_lr = "0.001" if split == "val" else "0.0001"
    return base + (0.1 if lr == better_lr else 0.0)


def make_sweep(tmp_path: Path, study: dict | None = None, missing: tuple = ("method-macco_negatives-without_"
                                                                            "lr-0.001_seed-2",)) -> Path:
    data = make_world(tmp_path / "world")
    sweep = tmp_path / "sweep"
    rng = np.random.default_rng(0)
    runs = []
    for method in ("clip_ft", "macco", "tflocal"):
        for negatives in ("with", "without"):
            for lr in ("0.0001", "0.001"):
                for seed in (0, 1, 2):
                    choices = {"method": f"method-{method}", "negatives": f"negatives-{negatives}",
                               "lr": f"lr-{lr}", "seed": f"seed-{seed}"}
                    name = "_".join(choices.values())
                    runs.append({"name": name, "configs": [], "overrides": [], "choices": choices})
                    if name in missing:
                        continue
                    export = write_export(sweep / name, method, run_config(tmp_path, name, method, lr, seed,
                                                                           negatives))
                    scores = {split: split_scores(draw_outcomes(quality(method, negatives, lr, split), rng), data,
                                                  split, rng) for split in SPLITS}
                    write_cached(sweep / name, "clip", scores, export)
    backbone = write_backbone(tmp_path)
    for label, scorer in (("frozen_cosine", "clip"), ("sgi", "sgi")):
        scores = {split: split_scores(draw_outcomes(quality(label, "-", "-", split), rng), data, split, rng)
                  for split in SPLITS}
        write_cached(sweep / FROZEN_DIR / label, scorer, scores, backbone)
    settings = {"data": str(data), "baseline": "clip_ft", "splits": ["test", "test_unseen"],
                "frozen": {"backbone": str(tmp_path / "backbone"), "rows": {"frozen_cosine": "clip", "sgi": "sgi"},
                           "methods": ["tflocal"]},
                "bootstrap": {"resamples": RESAMPLES, "seed": 3}}
    settings.update(study or {})
    (sweep / "sweep.json").write_text(json.dumps({"name": "study", "runs_root": str(sweep), "runs": runs,
                                                  "study": settings}))
    return sweep


def no_scoring(*args):
    raise AssertionError(f"scored {args}, but every split was cached")


def gap_mechanism(run_dir: Path, data: Path, split: str) -> dict:
    """A stand-in mechanism metric that depends on the run and split (seed number + split length)."""
    return {"gap": float(run_dir.name[-1]) + len(split)}


def stored(sweep: Path, name: str, split: str) -> list:
    return json.loads((sweep / name / CACHE_FILE).read_text())["splits"][split]["swap_outcomes"]


def read_csv(path: Path) -> list:
    with open(path) as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """One hand-made sweep reported once; the tests read it (none of them writes)."""
    sweep = make_sweep(tmp_path_factory.mktemp("reported"))
    study = load_study(sweep)
    lines = []
    evaluations, selections = evaluate_study(study, no_scoring, gap_mechanism, progress=lines.append)
    results = write_report(study, evaluations, selections, sweep / "report")
    return sweep, study, evaluations, selections, results, lines


# ----- selection ------------------------------------------------------------------------------------------------
def test_selection_takes_the_validation_best_setting_and_reads_only_validation(reported):
    sweep, study, evaluations, selections, _, _ = reported
    for (method, negatives), selection in selections.items():
        assert selection.chosen == "lr=0.001", (method, negatives)  # what validation prefers (test would not)
        for lr in ("0.0001", "0.001"):
            names = [f"method-{method}_negatives-{negatives}_lr-{lr}_seed-{seed}" for seed in range(3)]
            groups = [ShapesSwap.aggregate(stored(sweep, name, "val"))["group"] for name in names
                      if (sweep / name / CACHE_FILE).is_file()]
            assert selection.validation[f"lr={lr}"] == pytest.approx((np.mean(groups), len(groups)))
    assert selections[("macco", "without")].validation["lr=0.001"][1] == 2  # its seed 2 is missing

    class ValidationOnly(Evaluations):
        def metric(self, name, split, metric):
            assert split == "val", f"selection read {split}"
            return super().metric(name, split, metric)

    spy = ValidationOnly(evaluations.scores, evaluations.missing, evaluations.errors)
    assert {key: s.chosen for key, s in select_settings(study, spy).items()} == \
           {key: s.chosen for key, s in selections.items()}


def test_reporting_splits_are_scored_only_for_the_chosen_setting(tmp_path):
    sweep = make_sweep(tmp_path)
    for cache in sweep.glob("method-*/" + CACHE_FILE):  # only validation scores stored: the rest must be scored
        document = json.loads(cache.read_text())
        document["splits"] = {"val": document["splits"]["val"]}
        cache.write_text(json.dumps(document))
    scored = []

    def evaluator(export, scorer, data, splits):
        scored.append((export.parent.name, tuple(splits)))
        rng = np.random.default_rng(len(scored))
        return {split: split_scores(draw_outcomes(0.5, rng), data, split, rng) for split in splits}

    evaluate_study(load_study(sweep), evaluator, progress=lambda line: None)
    assert scored and all(splits == ("test", "test_unseen") and "lr-0.001" in name for name, splits in scored)
    assert len(scored) == 3 * 2 * 3 - 1  # methods x conditions x seeds at the chosen lr, one run missing


def test_a_run_that_cannot_be_scored_is_listed_and_the_others_are_reported(tmp_path):
    sweep = make_sweep(tmp_path)
    broken = "method-clip_ft_negatives-with_lr-0.001_seed-1"
    (sweep / broken / CACHE_FILE).unlink()

    def evaluator(export, scorer, data, splits):
        raise RuntimeError("corrupt weights")

    study = load_study(sweep)
    lines = []
    evaluations, selections = evaluate_study(study, evaluator, progress=lines.append)
    assert f"[val 5/35] {broken}: FAILED, scoring on val failed: RuntimeError: corrupt weights" in lines
    assert selections[("clip_ft", "with")].validation["lr=0.001"][1] == 2  # chosen from the two seeds scored
    text = write_report(study, evaluations, selections, tmp_path / "report").read_text()
    assert f"- `{broken}`: scoring on val failed: RuntimeError: corrupt weights" in text
    assert "scored: 34; missing or failed: 2" in text


# ----- summaries and differences ----------------------------------------------------------------------------------
def test_intervals_are_seed_intervals_of_the_stored_outcomes(reported):
    sweep, _, _, _, results, _ = reported
    rows = {(r["method"], r["negatives"], r["split"], r["metric"]): r for r in read_csv(results.parent / "results.csv")}
    for method, negatives, split, metric in [("macco", "with", "test", "group"), ("macco", "without", "test", "group"),
                                              ("clip_ft", "with", "test_unseen", "acc_relation"),
                                              ("tflocal", "without", "test", "text")]:
        names = [f"method-{method}_negatives-{negatives}_lr-0.001_seed-{seed}" for seed in range(3)]
        per_seed = []
        for name in names:
            if (sweep / name / CACHE_FILE).is_file():
                outcomes = stored(sweep, name, split)
                if metric == "acc_relation":
                    hits = [o[flag] for o in outcomes if o["type"] == "relation" for flag in ("text_i0", "text_i1")]
                else:
                    hits = [o[metric] for o in outcomes]
                per_seed.append(100.0 * sum(hits) / len(hits))
        expected = seed_interval(per_seed)
        row = rows[(method, negatives, split, metric)]
        assert (float(row["mean"]), float(row["low"]), float(row["high"])) == \
               pytest.approx((expected.estimate, expected.low, expected.high), rel=1e-9)
        assert int(row["n_seeds"]) == len(per_seed) and row["lr"] == "lr=0.001"
    frozen = rows[("sgi", "-", "test", "group")]
    assert frozen["n_seeds"] == "1" and frozen["low"] == "" and frozen["high"] == ""  # scored once: no interval
    mechanism = rows[("macco", "with", "test", "mechanism/gap")]
    assert float(mechanism["mean"]) == pytest.approx(1.0 + 4)  # seeds 0, 1, 2 + len("test")


def slow_paired_bootstrap(method: list, reference: list, resamples: int, seed: int) -> tuple:
    """The items x seeds bootstrap spelled out with loops, on per-item values matched by id here."""
    ids = sorted(method[0])
    rng = np.random.default_rng(seed)
    difference = [[method[s][i] - reference[s][i] for i in ids] for s in range(len(method))]
    draws = []
    for _ in range(resamples):
        rows = rng.integers(len(method), size=len(method))
        columns = rng.integers(len(ids), size=len(ids))
        total = sum(difference[r][c] for r in rows for c in columns)
        draws.append(total / (len(rows) * len(columns)))
    estimate = sum(map(sum, difference)) / (len(difference) * len(ids))
    return estimate, float(np.quantile(draws, 0.025)), float(np.quantile(draws, 0.975))


def per_item(outcomes: list, metric: str) -> dict:
    if metric == "group":
        return {o["id"]: 100.0 * o["group"] for o in outcomes}
    return {o["id"]: 100.0 * (o["text_i0"] + o["text_i1"]) / 2 for o in outcomes if o["type"] == "relation"}


def test_paired_differences_equal_a_slow_reference(reported):
    sweep, _, _, _, results, _ = reported
    rows = {(r["method"], r["negatives"], r["reference"], r["split"], r["metric"]): r
            for r in read_csv(results.parent / "differences.csv")}
    cases = [("macco", "with", "clip_ft (with)", "test", "group", (0, 1, 2), "method-clip_ft_negatives-with"),
             ("macco", "without", "clip_ft (without)", "test_unseen", "acc_relation", (0, 1),
              "method-clip_ft_negatives-without"),  # seed 2 of macco is missing: 2 pairs
             ("tflocal", "with", "frozen_cosine", "test", "acc_relation", (0, 1, 2), None)]
    for method, negatives, reference, split, metric, seeds, reference_prefix in cases:
        mine = [per_item(stored(sweep, f"method-{method}_negatives-{negatives}_lr-0.001_seed-{s}", split), metric)
                for s in seeds]
        if reference_prefix:
            theirs = [per_item(stored(sweep, f"{reference_prefix}_lr-0.001_seed-{s}", split), metric) for s in seeds]
        else:  # the frozen cosine was scored once: it pairs with every seed
            theirs = [per_item(stored(sweep / FROZEN_DIR, reference, split), metric)] * len(seeds)
        expected = slow_paired_bootstrap(mine, theirs, RESAMPLES, seed=3)
        row = rows[(method, negatives, reference, split, metric)]
        assert (float(row["difference"]), float(row["low"]), float(row["high"])) == pytest.approx(expected, rel=1e-9)
        assert int(row["n_seeds"]) == len(seeds) and int(row["n_items"]) == len(mine[0])
    manifest = json.loads((results.parent / "cells.json").read_text())
    assert manifest["test"]["macco|without"]["seeds"] == {
        str(s): str(sweep / f"method-macco_negatives-without_lr-0.001_seed-{s}" / CACHE_FILE) for s in (0, 1)}
    assert manifest["test"]["sgi|-"]["seeds"] == {"-": str(sweep / FROZEN_DIR / "sgi" / CACHE_FILE)}
    references = {(r["method"], r["reference"]) for r in rows.values()}
    assert ("sgi", "frozen_cosine") in references and not any(m == "clip_ft" for m, _ in references)
    assert not any(m == "tflocal" and ref.startswith("clip_ft") for m, ref in references)
    assert not any(m == "frozen_cosine" for m, _ in references)


def test_the_contrast_pairs_each_method_with_itself_in_the_other_condition(tmp_path):
    sweep = make_sweep(tmp_path, study={"contrast": {"condition": "with", "reference": "without"}})
    study = load_study(sweep)
    evaluations, selections = evaluate_study(study, no_scoring, progress=lambda line: None)
    results = write_report(study, evaluations, selections, tmp_path / "report")
    rows = {(r["method"], r["negatives"], r["reference"], r["split"], r["metric"]): r
            for r in read_csv(results.parent / "differences.csv")}
    # macco's seed 2 is missing without negatives: the pairs are its seeds 0 and 1 in both conditions.
    for method, split, metric, seeds in [("macco", "test", "group", (0, 1)), ("clip_ft", "test_unseen", "acc_relation",
                                                                             (0, 1, 2))]:
        mine = [per_item(stored(sweep, f"method-{method}_negatives-with_lr-0.001_seed-{s}", split), metric)
                for s in seeds]
        theirs = [per_item(stored(sweep, f"method-{method}_negatives-without_lr-0.001_seed-{s}", split), metric)
                  for s in seeds]
        expected = slow_paired_bootstrap(mine, theirs, RESAMPLES, seed=3)
        row = rows[(method, "with", f"{method} (without)", split, metric)]
        assert (float(row["difference"]), float(row["low"]), float(row["high"])) == pytest.approx(expected, rel=1e-9)
        assert int(row["n_seeds"]) == len(seeds)
    # The baseline comparisons are still there; frozen rows and the reference condition get no contrast.
    assert ("macco", "with", "clip_ft (with)", "test", "group") in rows
    contrasted = {(method, negatives) for method, negatives, reference, _, _ in rows
                  if reference == f"{method} (without)"}
    assert contrasted == {("clip_ft", "with"), ("macco", "with"), ("tflocal", "with")}
    assert "| macco (without) |" in results.read_text()


@pytest.mark.parametrize("contrast, message", [
    ({"condition": "with", "reference": "none"}, r"study.contrast names conditions \['none'\]"),
    ({"condition": "with", "reference": "with"}, "compares a condition with itself"),
    ({"condition": "with"}, "needs condition and reference"),
    ({"condition": "with", "reference": "without", "metric": "group"}, "unknown keys"),
])
def test_a_bad_contrast_is_named(tmp_path, contrast, message):
    with pytest.raises(StudyError, match=message):
        load_study(make_sweep(tmp_path, study={"contrast": contrast}))


def test_item_values_average_to_the_aggregates():
    outcomes = draw_outcomes(0.6, np.random.default_rng(1))
    aggregates = ShapesSwap.aggregate(outcomes)
    for metric in ("text", "image", "group", "acc_attribute", "acc_relation", "acc_object"):
        assert np.mean(list(item_values(outcomes, metric).values())) == pytest.approx(aggregates[metric])


# ----- report files ---------------------------------------------------------------------------------------------
def test_report_files_and_missing_runs(reported):
    sweep, _, evaluations, _, results, lines = reported
    report = results.parent
    text = results.read_text()
    assert "## Scores on `test`" in text and "## Scores on `test_unseen`" in text and "## Selection on `val`" in text
    assert "## Paired differences" in text and "## Mechanisms on `test`" in text
    missing = "method-macco_negatives-without_lr-0.001_seed-2"
    assert f"- `{missing}`: not run (no run directory)" in text and "missing or failed: 1" in text
    assert evaluations.missing == {missing: "not run (no run directory)"}
    assert any("| macco | with | lr=0.001 (not bracketed" in line and " | 3 |" in line for line in text.splitlines())
    assert "**" in text.split("## Selection")[1].split("## Paired")[0]  # the chosen setting in bold
    for name in ("scores_test.png", "scores_test_unseen.png", "validation_curves.png"):
        assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    check_hparams_view(report / "tb_hparams", sessions=3 * 2 * 2 * 3 - 1 + 2)  # scored runs and frozen rows
    assert lines and all(line.endswith("cached") for line in lines if line.startswith(("[val", "[frozen")))
    assert all("cached, mechanisms measured in" in line for line in lines if line.startswith("[report"))
    header = (report / "results.csv").read_text().splitlines()[0]
    assert header == "method,negatives,split,metric,mean,low,high,n_seeds,lr"
    selection = read_csv(report / "selection.csv")
    assert len(selection) == 3 * 2 * 2 and all(row["split"] == "val" for row in selection)


def check_hparams_view(log_dir: Path, sessions: int) -> None:
    """What TensorBoard's hparams tab reads: one experiment (every metric of every split) and a session per run
    whose metric values are scalars of the run."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import plugin_data_pb2

    multiplexer = EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(log_dir))
    multiplexer.Reload()
    runs = multiplexer.PluginRunToTagToContent("hparams")
    experiments = [plugin_data_pb2.HParamsPluginData.FromString(tags["_hparams_/experiment"]).experiment
                   for tags in runs.values() if "_hparams_/experiment" in tags]
    assert len(experiments) == 1
    metrics = {info.name.tag for info in experiments[0].metric_infos}
    assert {"val/group", "test/group", "test_unseen/acc_relation"} <= metrics
    assert {info.name for info in experiments[0].hparam_infos} == {"method", "negatives", "lr", "seed", "chosen"}
    session_runs = [run for run, tags in runs.items() if "_hparams_/session_start_info" in tags]
    assert len(session_runs) == sessions
    for run in session_runs:  # grid runs all have validation scores, frozen rows only reporting-split scores
        assert multiplexer.Scalars(run, "val/group" if run.startswith("method-") else "test/group"), run


def test_validation_curves_are_read_from_the_runs_tensorboard_events(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    with SummaryWriter(str(run / "tb" / "version_0")) as writer:
        for step, value in ((10, 20.0), (20, 30.0), (30, 35.0)):
            writer.add_scalar("eval/shapes_swap/group", value, step)
            writer.add_scalar("train/loss", 1.0, step)
    with SummaryWriter(str(run / "tb" / "version_0")) as writer:  # a resumed run logs step 30 again
        writer.add_scalar("eval/shapes_swap/group", 36.0, 30)
    assert read_curves(run) == {"group": ([10, 20, 30], [20.0, 30.0, 36.0])}
    assert read_curves(tmp_path / "no_run") == {}


# ----- settings -----------------------------------------------------------------------------------------------------
def test_bad_study_settings_are_named(tmp_path):
    with pytest.raises(StudyError, match=r"unknown keys \['selections'\]"):
        parse_settings({"data": "x", "selections": {}})
    with pytest.raises(StudyError, match=r"study.selection: unknown keys \['metrc'\]"):
        parse_settings({"data": "x", "selection": {"metrc": "group"}})
    with pytest.raises(StudyError, match="also a reporting split"):
        parse_settings({"data": "x", "splits": ["val", "test"]})
    with pytest.raises(StudyError, match="set study.data"):
        parse_settings({})
    with pytest.raises(StudyError, match="unknown scorers"):
        parse_settings({"data": "x", "frozen": {"backbone": "b", "rows": {"f": "nope"}}})
    assert parse_settings({}, data=Path("w")).data == Path("w")  # --data stands in for study.data
    with pytest.raises(StudyError, match=r"methods \['cae'\] that the grid does not have"):
        load_study(make_sweep(tmp_path, {"baseline": "cae"}))


# ----- the cache --------------------------------------------------------------------------------------------------
def test_the_cache_is_invalidated_by_the_export_and_the_data(tmp_path):
    data = make_world(tmp_path / "world")
    export = write_export(tmp_path / "run")
    cache = tmp_path / "run" / CACHE_FILE
    calls = []

    def evaluator(export_dir, scorer, root, splits):
        calls.append(tuple(splits))
        rng = np.random.default_rng(len(calls))
        return {split: split_scores(draw_outcomes(0.5, rng), root, split, rng) for split in splits}

    def score(mechanisms=None):
        return cached_scores(cache, export, "clip", data, SPLITS, evaluator, mechanisms, tmp_path / "run")

    first = score()
    assert calls == [SPLITS] and first.scored
    assert not score().scored and calls == [SPLITS]  # all from the cache
    (data / "annotations" / "swap_test.json").write_text("regenerated, longer than before")
    again = score()
    assert calls[-1] == ("test",) and again.splits["val"] == first.splits["val"]  # only the changed split
    (export / "open_clip.pt").write_bytes(b"new weights")
    score()
    assert calls[-1] == SPLITS  # a changed export: everything again

    def broken(run_dir, root, split):
        raise RuntimeError("no probe")

    failed = score(broken)
    assert failed.errors and all(scores["mechanisms"] is None for scores in failed.splits.values())
    measured = score(lambda run_dir, root, split: {"gap": len(split)})  # a failure is not cached: tried again
    assert measured.measured and not measured.scored and not measured.errors and len(calls) == 3
    assert {split: scores["mechanisms"] for split, scores in json.loads(cache.read_text())["splits"].items()} == \
           {split: {"gap": float(len(split))} for split in SPLITS}


# ----- end to end ---------------------------------------------------------------------------------------------------
def tiny_world(root: Path) -> Path:
    """A generated shapes world whose `test` and `test_unseen` splits are made copies of `val` (same layout)."""
    from datamodules.shapes import generate

    generate(root, n_train=4, n_val=6, image_size=64, seed=0, n_swap=6)
    for split in ("test", "test_unseen"):
        for kind in ("captions", "swap"):
            shutil.copy(root / "annotations" / f"{kind}_val.json", root / "annotations" / f"{kind}_{split}.json")
        shutil.copytree(root / "images" / "val", root / "images" / split, dirs_exist_ok=True)  # over its own
    return root


def test_the_command_scores_real_exports_end_to_end(tmp_path, monkeypatch, capsys):
    from modeling.encoders import build_model
    from modeling.export import export_model
    from datamodules.shapes import load_scene_graphs

    data = tiny_world(tmp_path / "world")
    sweep = tmp_path / "sweep"
    runs = []
    for index, (method, seed) in enumerate([("clip_ft", 0), ("clip_ft", 1), ("macco", 0), ("macco", 1)]):
        choices = {"method": f"method-{method}", "seed": f"seed-{seed}"}
        runs.append({"name": f"method-{method}_seed-{seed}", "configs": [], "overrides": [], "choices": choices})
        if index < 3:  # macco seed 1 never ran
            torch.manual_seed(index)
            built = build_model("ViT-Tiny-16-64", None, str(REPO / "configs" / "models"))
            export_model(built.model, built.name, sweep / runs[-1]["name"] / "export")
    export_model(built.model, built.name, tmp_path / "backbone" / "export")
    study = {"data": str(data), "frozen": {"backbone": str(tmp_path / "backbone"), "rows": {"cosine": "clip"}},
             "bootstrap": {"resamples": 200}}
    (sweep / "sweep.json").write_text(json.dumps({"name": "e2e", "runs_root": str(sweep), "runs": runs,
                                                  "study": study}))
    monkeypatch.setattr(study_cli, "load_mechanisms", lambda *args: gap_mechanism)
    results = study_cli.main(["--sweep", str(sweep), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert results == tmp_path / "out" / "results.md" and f"report: {results}" in out
    assert "[val 1/3] method-clip_ft_seed-0 (val): scored in" in out
    cache = json.loads((sweep / "method-clip_ft_seed-0" / CACHE_FILE).read_text())
    assert set(cache["splits"]) == set(SPLITS)
    val = cache["splits"]["val"]
    assert len(val["swap_outcomes"]) == 6
    assert set(val["swap_outcomes"][0]) == {"id", "type", *OUTCOME_FLAGS}
    assert val["swap"]["group"] == pytest.approx(ShapesSwap.aggregate(val["swap_outcomes"])["group"])
    assert len([o for o in val["retrieval_outcomes"] if o[0] == "i2t"]) == 6
    objects = sum(len(record["objects"]) for record in load_scene_graphs(data, "val"))
    assert len(val["zeroshot_outcomes"]) == 2 * objects and val["zeroshot"]["objects"] == objects
    assert val["zeroshot"]["shape_top1"] == pytest.approx(
        100.0 * np.mean([rank == 0 for item, _, rank, _ in val["zeroshot_outcomes"] if item.startswith("shape:")]))
    # test is a copy of val, so a real scorer gives the same outcomes on both: the splits were really scored
    assert cache["splits"]["test"]["swap_outcomes"] == val["swap_outcomes"]
    text = results.read_text()
    assert "`method-macco_seed-1`: not run" in text and "| macco | - | - | 1 |" in text
    assert "| clip_ft | - | - | 2 |" in text and "| cosine | - | - | 1 |" in text
    rows = read_csv(results.parent / "differences.csv")
    assert {(r["method"], r["reference"], r["split"]) for r in rows} == \
           {("macco", "clip_ft", split) for split in ("test", "test_unseen")}
    assert all(r["n_seeds"] == "1" and r["n_items"] in ("6", "2") for r in rows)
    capsys.readouterr()
    study_cli.main(["--sweep", str(sweep), "--out", str(tmp_path / "out")])
    assert "scored in" not in capsys.readouterr().out  # the second report reads every cache


# ----- testbed validity -----------------------------------------------------------------------------------------------
BACKBONE_SEEDS = 3


def add_validity(tmp_path: Path, sweep: Path, validity: dict | None = None) -> Path:
    """Three backbone exports (run dirs), their global-cosine scores cached under study_frozen/validity_<i>/, and
    a `validity` block naming them with clip_ft (with) as the control."""
    document = json.loads((sweep / "sweep.json").read_text())
    data = Path(document["study"]["data"])
    rng = np.random.default_rng(7)
    backbones = []
    for index in range(BACKBONE_SEEDS):
        export = write_export(tmp_path / f"pretrain_seed{index}")
        scores = {split: split_scores(draw_outcomes(0.5, rng), data, split, rng) for split in ("test", "test_unseen")}
        write_cached(sweep / FROZEN_DIR / f"validity_{index}", "clip", scores, export)
        backbones.append(str(tmp_path / f"pretrain_seed{index}"))
    document["study"]["validity"] = {"backbones": backbones, "control": {"method": "clip_ft", "negatives": "with"},
                                     **(validity or {})}
    (sweep / "sweep.json").write_text(json.dumps(document))
    return sweep


def hand_metric(outcomes: list, metric: str) -> float:
    """A metric of one scoring from its stored outcomes, spelled out (2-way: both caption choices per item)."""
    if metric == "group":
        return 100.0 * sum(o["group"] for o in outcomes) / len(outcomes)
    kind = metric[len("acc_"):]
    hits = [o[flag] for o in outcomes if o["type"] == kind for flag in ("text_i0", "text_i1")]
    return 100.0 * sum(hits) / len(hits)


def welch(first: list, second: list) -> tuple:
    """Welch's difference interval written out (95%)."""
    from study.stats import student_t_quantile

    a, b = np.var(first, ddof=1) / len(first), np.var(second, ddof=1) / len(second)
    df = (a + b) ** 2 / (a ** 2 / (len(first) - 1) + b ** 2 / (len(second) - 1))
    half = student_t_quantile(0.975, df) * np.sqrt(a + b)
    difference = np.mean(first) - np.mean(second)
    return difference, difference - half, difference + half


@pytest.fixture(scope="module")
def validity_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("validity")
    sweep = add_validity(root, make_sweep(root))
    study = load_study(sweep)
    evaluations, selections = evaluate_study(study, no_scoring, progress=lambda line: None)  # every split cached
    printed = []
    results = write_report(study, evaluations, selections, sweep / "report", progress=printed.append)
    return sweep, study, evaluations, selections, results, printed


def test_difference_interval_matches_the_t_table():
    from study.stats import difference_interval

    # n = 3 + 3, both variances 1: standard error sqrt(2/3), Welch df = 4, t_0.975(4) = 2.776445 (tables)
    interval = difference_interval([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    half = 2.776445 * np.sqrt(2 / 3)
    assert (interval.estimate, interval.low, interval.high) == pytest.approx((-3.0, -3.0 - half, -3.0 + half),
                                                                             rel=1e-5)
    assert np.isnan(difference_interval([1.0], [2.0, 3.0]).low)  # one value: no interval


def test_validity_numbers_are_seed_intervals_of_the_stored_outcomes(validity_report):
    sweep, _, _, _, results, _ = validity_report
    rows = {(r["method"], r["split"], r["metric"]): r for r in read_csv(results.parent / "results.csv")}
    document = json.loads((results.parent / "validity.json").read_text())
    for split in ("test", "test_unseen"):
        for metric in ("acc_relation", "acc_attribute", "acc_object", "group"):
            backbone = [hand_metric(stored(sweep / FROZEN_DIR, f"validity_{i}", split), metric)
                        for i in range(BACKBONE_SEEDS)]
            control = [hand_metric(stored(sweep, f"method-clip_ft_negatives-with_lr-0.001_seed-{s}", split), metric)
                       for s in range(3)]
            for who, values in (("backbone", backbone), ("control", control)):
                expected = seed_interval(values)
                row = rows[(f"validity/{who}", split, metric)]
                assert (float(row["mean"]), float(row["low"]), float(row["high"])) == \
                       pytest.approx((expected.estimate, expected.low, expected.high), rel=1e-9)
                assert document["splits"][split][who][metric]["values"] == pytest.approx(values, rel=1e-12)
            gain = rows[("validity/gain", split, metric)]
            assert (float(gain["mean"]), float(gain["low"]), float(gain["high"])) == \
                   pytest.approx(welch(control, backbone), rel=1e-6)
            assert gain["n_seeds"] == "3 + 3" and gain["lr"] == "lr=0.001"
    for metric in ("acc_relation", "group"):  # the control's gap, paired by seed
        per_seed = [hand_metric(stored(sweep, f"method-clip_ft_negatives-with_lr-0.001_seed-{s}", "test"), metric)
                    - hand_metric(stored(sweep, f"method-clip_ft_negatives-with_lr-0.001_seed-{s}", "test_unseen"),
                                  metric) for s in range(3)]
        row = rows[("validity/gap", "test-test_unseen", metric)]
        assert float(row["mean"]) == pytest.approx(seed_interval(per_seed).estimate, rel=1e-9)
        assert float(row["high"]) == pytest.approx(seed_interval(per_seed).high, rel=1e-9)


def test_validity_section_is_written_and_printed_and_shows_every_check(validity_report):
    _, study, _, _, results, printed = validity_report
    text = results.read_text()
    section = text.split("## Testbed validity")[1].split("\n## ")[0]
    assert len(printed) == 1 and printed[0] in text and printed[0].startswith("## Testbed validity")
    assert "### `test`" in section and "### `test_unseen`" in section
    assert "| control: clip_ft (with) | 3 |" in section and "| backbone (global cosine) | 3 |" in section
    document = json.loads((results.parent / "validity.json").read_text())
    checks = document["checks"]
    assert [(c["check"], c["split"]) for c in checks] == [("a", "test"), ("b", "test"), ("a", "test_unseen"),
                                                          ("b", "test_unseen"), ("c", None)] + \
        [(key, split) for split in ("test", "test_unseen") for key in "def"]
    for check in checks:
        assert check["status"] == {True: "PASS", False: "FAIL", None: "NOT MEASURED"}[check["passed"]]
        assert f"**{check['status']}** ({check['check']})" in section
    assert document["passed"] == all(c["passed"] is True for c in checks)
    generalisation = next(c for c in checks if c["check"] == "c")
    assert generalisation["passed"] and "gap `test` - `test_unseen` (paired over 3 seeds)" in generalisation["detail"]


def test_validity_checks_pass_and_fail_at_their_criteria(validity_report):
    from dataclasses import replace

    from study.analysis import study_cells
    from study.validity import measure_validity

    _, study, evaluations, selections, _, _ = validity_report
    cells = study_cells(study, evaluations, selections)
    measured = measure_validity(study, evaluations, cells).splits[0]  # test
    relation = measured.backbone["acc_relation"].interval.estimate
    attribute = measured.backbone["acc_attribute"].interval.estimate
    gains = measured.gains["acc_relation"].estimate, measured.gains["group"].estimate
    assert abs(relation - 50) > 0.2 and min(gains) > 0.2  # room for the thresholds either side

    def checks(settings: StudySettings | None = None, **criteria) -> dict:
        measured_study = replace(study, settings=replace(study.settings, validity=replace(
            study.settings.validity, **criteria)) if settings is None else settings)
        found = measure_validity(measured_study, evaluations, study_cells(measured_study, evaluations, selections))
        return {(c.key, c.split): c for c in found.checks}

    near = dict(chance_margin=abs(relation - 50) + 0.1, ceiling=attribute + 0.1)
    assert checks(**near)[("a", "test")].passed
    assert not checks(**{**near, "chance_margin": abs(relation - 50) - 0.1})[("a", "test")].passed
    failed = checks(**{**near, "ceiling": attribute - 0.1})[("a", "test")]
    assert not failed.passed and f"< {attribute - 0.1:g}: no" in failed.detail
    reach = dict(relation_gain=gains[0] - 0.1, group_gain=gains[1] - 0.1)
    assert checks(**reach)[("b", "test")].passed
    assert not checks(**{**reach, "relation_gain": gains[0] + 0.1})[("b", "test")].passed
    failed = checks(**{**reach, "group_gain": gains[1] + 0.1})[("b", "test")]
    assert not failed.passed and "swap group gain" in failed.detail and ": no)" in failed.detail
    without_unseen = checks(replace(study.settings, splits=("test",)))
    assert not without_unseen[("c", None)].passed
    assert "`test_unseen` is not a reporting split" in without_unseen[("c", None)].detail


def test_bad_validity_settings_are_named(tmp_path):
    block = {"backbones": ["b0"], "control": {"method": "clip_ft", "negatives": "with"}}
    with pytest.raises(StudyError, match=r"study.validity: unknown keys \['controls'\]"):
        parse_settings({"data": "x", "validity": {**block, "controls": {}}})
    with pytest.raises(StudyError, match=r"study.validity.criteria: unknown keys \['relation'\]"):
        parse_settings({"data": "x", "validity": {**block, "criteria": {"relation": 15}}})
    with pytest.raises(StudyError, match="criteria must be numbers"):
        parse_settings({"data": "x", "validity": {**block, "criteria": {"ceiling": "high"}}})
    with pytest.raises(StudyError, match="backbones must be a non-empty list"):
        parse_settings({"data": "x", "validity": {**block, "backbones": []}})
    with pytest.raises(StudyError, match="control needs the method"):
        parse_settings({"data": "x", "validity": {**block, "control": {"negatives": "with"}}})
    with pytest.raises(StudyError, match=r"control \{method: clip_ft, negatives: sometimes\} is not a cell"):
        load_study(add_validity(tmp_path / "a", make_sweep(tmp_path / "a"),
                                {"control": {"method": "clip_ft", "negatives": "sometimes"}}))
    sweep = add_validity(tmp_path / "b", make_sweep(tmp_path / "b"))
    shutil.rmtree(tmp_path / "b" / "pretrain_seed1")
    with pytest.raises(StudyError, match="validity.backbones: no export at .*pretrain_seed1"):
        evaluate_study(load_study(sweep), no_scoring, progress=lambda line: None)


def test_mechanisms_are_measured_on_the_chosen_splits_with_the_chosen_limit(monkeypatch):
    import study.mechanisms as mechanisms_module

    calls = []
    monkeypatch.setattr(mechanisms_module, "measure",
                        lambda run_dir, data, split, limit=256: calls.append((split, limit)) or {"x": 1.0})
    measured = study_cli.load_mechanisms(limit=32, splits=["test"])
    assert measured(Path("r"), Path("d"), "test") == {"x": 1.0}
    assert measured(Path("r"), Path("d"), "test_unseen") == {}
    assert calls == [("test", 32)]
    study_cli.load_mechanisms()(Path("r"), Path("d"), "test_unseen")
    assert calls[-1] == ("test_unseen", 256)


# ----- the results bundle and the page made from it alone ---------------------------------------------------------
CHECKS = {"x0.3": 0.55, "x3": 0.8}  # check label -> quality of its outcomes (macco's own value at lr 0.001: 0.8)


def add_checks(tmp_path: Path, sweep: Path) -> Path:
    """A checks sweep (one seed of macco without negatives at lr 0.001, two variants), scored on val, named in
    the study block."""
    data = Path(json.loads((sweep / "sweep.json").read_text())["study"]["data"])
    checks = tmp_path / "checks"
    rng = np.random.default_rng(11)
    runs = []
    for label, check_quality in CHECKS.items():
        choices = {"negatives": "negatives-without", "method": "method-macco", "check": f"check-{label}",
                   "lr": "lr-0.001", "seed": "seed-0"}
        name = "_".join(choices.values())
        runs.append({"name": name, "configs": [], "overrides": [], "choices": choices})
        export = write_export(checks / name, "macco", run_config(tmp_path, name, "macco", "0.001", 0,
                                                                 check={"weight": label}))
        write_cached(checks / name, "clip", {"val": split_scores(draw_outcomes(check_quality, rng), data, "val", rng)},
                     export)
    (checks / "sweep.json").write_text(json.dumps({"name": "checks", "runs_root": str(checks), "runs": runs}))
    document = json.loads((sweep / "sweep.json").read_text())
    document["study"]["checks"] = str(checks)
    (sweep / "sweep.json").write_text(json.dumps(document))
    return checks


def report_with_bundle(sweep: Path, bundle: Path, out: Path) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(study_cli, "load_mechanisms", lambda *args: gap_mechanism)
        return study_cli.main(["--sweep", str(sweep), "--bundle", str(bundle), "--out", str(out)])


@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """The hand-made sweep with validity backbones and checks, reported with a bundle."""
    root = tmp_path_factory.mktemp("bundled")
    sweep = add_validity(root, make_sweep(root, study={"contrast": {"condition": "with", "reference": "without"}}))
    add_checks(root, sweep)
    bundle = root / "results"
    results = report_with_bundle(sweep, bundle, root / "report")
    return root, sweep, bundle, results


def test_the_bundle_holds_each_run_with_its_digest_backbone_and_outcomes(bundled):
    from lightning_modules.resume import config_digest, result_keys
    from core.run_records import file_sha256, read_json_gz

    root, sweep, bundle, _ = bundled
    name = "method-macco_negatives-with_lr-0.0001_seed-1"  # a setting not chosen: its test scores are kept too
    record = read_json_gz(bundle / "study" / "runs" / f"{name}.json.gz")
    config = yaml.safe_load((sweep / name / "config.yaml").read_text())
    assert record["config_digest"] == config_digest(config) and record["config"] == result_keys(config)
    assert "data.num_workers" not in record["config"] and "trainer.devices" not in record["config"]
    assert "data.per_device_batch_size" not in record["config"] and record["config"]["trainer.max_steps"] == 600
    assert record["backbone"] == {"path": str(root / "backbone" / "export"),
                                  "sha256": file_sha256(root / "backbone" / "export" / "open_clip.pt")}
    cached = json.loads((sweep / name / CACHE_FILE).read_text())["splits"]
    assert set(record["splits"]) == set(SPLITS)
    for split in SPLITS:
        for key in ("swap_outcomes", "retrieval_outcomes", "zeroshot_outcomes", "swap", "mechanisms"):
            assert record["splits"][split][key] == cached[split][key], (split, key)
        assert "data" not in record["splits"][split]  # local file fingerprints stay out
    assert record["splits"]["test"]["mechanisms"] == {"gap": 1.0 + len("test")}
    frozen = read_json_gz(bundle / "study" / "frozen" / "frozen_cosine.json.gz")
    assert frozen["export"]["sha256"] == record["backbone"]["sha256"]
    assert {path.name for path in (bundle / "study" / "frozen").iterdir()} == \
           {f"{label}.json.gz" for label in ("frozen_cosine", "sgi", "validity_0", "validity_1", "validity_2")}
    assert len(list((bundle / "checks" / "runs").iterdir())) == len(CHECKS)
    assert (bundle / "README.md").read_text().startswith("# The method study's results bundle")
    document = json.loads((bundle / "study" / "sweep.json").read_text())
    assert document["checks"] == "checks" and document["study"]["frozen"]["backbone"] == str(
        root / "backbone" / "export")
    assert set(document["world"]["files"]) == {f"annotations/{kind}_{split}.json" for kind in ("captions", "swap")
                                               for split in SPLITS}
    report = json.loads((bundle / "study" / "report.json").read_text())
    assert report["validity"]["checks"] and report["tradeoffs"] and report["checks"]
    assert report["missing"] == {"method-macco_negatives-without_lr-0.001_seed-2": "not run (no run directory)"}


def test_writing_the_bundle_again_changes_no_byte(bundled, tmp_path):
    root, sweep, bundle, _ = bundled
    before = {path: path.read_bytes() for path in bundle.rglob("*") if path.is_file()}
    report_with_bundle(sweep, bundle, tmp_path / "report")
    assert {path: path.read_bytes() for path in bundle.rglob("*") if path.is_file()} == before


def test_the_page_from_the_bundle_alone_is_the_report_and_comes_out_the_same_everywhere(bundled, tmp_path):
    from study.page import make_page

    root, sweep, bundle, results = bundled
    copy = tmp_path / "results"
    shutil.copytree(bundle, copy)  # a clean clone: the bundle without the run folders, the world or the backbone
    page = make_page(copy, tmp_path / "docs" / "study_results.md")
    assert (tmp_path / "docs" / "study_results.md").read_text() == page
    for name in ("scores_test", "tradeoff_test", "tradeoff_test_unseen", "validation_curves"):
        assert (tmp_path / "docs" / "images" / f"study_{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(images/study_{name}.png)" in page
    report = results.read_text()
    for section in ("## Testbed validity", "## Scores on `test`", "## Selection on `val`", "## Paired differences",
                    "## Composition against recognition", "## Checks beside each row", "## Mechanisms on `test`"):
        # every number of the report's section is the page's: made from the bundle, not from the run folders
        assert section_of(report, section) == section_of(page, section).replace(str(copy), str(bundle)), section
    again = make_page(copy, tmp_path / "elsewhere" / "study_results.md", plots=False)
    assert again == page.replace(str(tmp_path / "docs"), str(tmp_path / "elsewhere"))
    assert "no record in the bundle" in page and "method-macco_negatives-without_lr-0.001_seed-2" in page


def test_the_readme_headline_is_the_pages_numbers_and_a_readme_without_its_block_is_refused(bundled, tmp_path):
    from study.headline import BLOCK_END, BLOCK_START
    from study.page import make_page

    _, _, bundle, _ = bundled
    readme = tmp_path / "README.md"
    readme.write_text(f"# A project\n\nbefore\n\n{BLOCK_START}\nan old table\n{BLOCK_END}\n\nafter\n")
    page = make_page(bundle, tmp_path / "docs" / "page.md", plots=False, readme=readme)
    text = readme.read_text()
    assert text.startswith("# A project\n\nbefore\n\n" + BLOCK_START) and text.endswith(BLOCK_END + "\n\nafter\n")
    assert "an old table" not in text and f"`{bundle}` (" in text
    block = text.split(BLOCK_START, 1)[1].split(BLOCK_END, 1)[0]
    scores = section_of(page, "## Scores on `test`")
    rows = [line for line in block.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows
    for row in rows:  # each headline row carries its page row's swap group and 2-way relation, to the digit
        method, condition, setting, group, relation = [cell.strip() for cell in row.strip("|").split("|")][:5]
        page_row = next(line for line in scores.splitlines() if line.startswith(f"| {method} | {condition} |"))
        assert f"| {setting} |" in page_row and group in page_row and relation in page_row, (row, page_row)
    differences = section_of(page, "## Paired differences")
    macco = next(row for row in rows if row.startswith("| macco | with |")).split("|")
    against_baseline = next(line for line in differences.splitlines()
                            if line.startswith("| test | macco | with | clip_ft (with) | swap group |"))
    against_itself = next(line for line in differences.splitlines()
                          if line.startswith("| test | macco | with | macco (without) | swap group |"))
    assert "-" not in (macco[6].strip(), macco[7].strip())
    assert macco[6].strip() in against_baseline and macco[7].strip() in against_itself
    assert macco[8].strip() == "clip_ft (with)"

    without = tmp_path / "PLAIN.md"
    without.write_text("# no block here\n")
    with pytest.raises(StudyError, match="has no headline block"):
        make_page(bundle, tmp_path / "none" / "page.md", plots=False, readme=without)
    assert without.read_text() == "# no block here\n" and not (tmp_path / "none").exists()


def section_of(text: str, title: str) -> str:
    """A section of a report without its figure links (the report's and the page's figures lie elsewhere)."""
    section = title + text.split(title, 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if not line.startswith("!["))


def test_an_interval_is_recomputed_from_the_bundle_as_its_readme_says(bundled):
    """The README's own recipe (standard library and numpy), run on the bundle, gives report.json's interval,
    and so does a bootstrap written here for a comparison with a frozen reference."""
    import gzip
    import re

    root, _, bundle, _ = bundled
    recipe = re.search(r"```python\n(.*?)```", (bundle / "README.md").read_text(), re.S).group(1)
    namespace = {}
    exec(recipe.replace('root = "results/study/sweep"', f'root = {str(bundle / "study")!r}'), namespace)
    c = namespace["c"]
    assert (namespace["D"].mean(), *np.quantile(namespace["draws"], [0.025, 0.975])) == \
           pytest.approx((c["estimate"], c["low"], c["high"]), rel=1e-9)
    report = json.loads((bundle / "study" / "report.json").read_text())
    trade = next(t for t in report["tradeoffs"] if (t["method"], t["negatives"], t["split"], t["metric"])
                 == ("tflocal", "with", "test", "zeroshot_top1"))

    def top1(path: Path) -> dict:
        outcomes = json.loads(gzip.decompress(path.read_bytes()))["splits"]["test"]["zeroshot_outcomes"]
        return {item: 100.0 * (rank == 0) for item, _, rank, _ in outcomes}

    mine = [top1(bundle / "study" / "runs" / f"method-tflocal_negatives-with_lr-0.001_seed-{s}.json.gz")
            for s in range(3)]
    theirs = [top1(bundle / "study" / "frozen" / "frozen_cosine.json.gz")] * 3
    expected = slow_paired_bootstrap(mine, theirs, RESAMPLES, seed=3)
    assert (trade["estimate"], trade["low"], trade["high"]) == pytest.approx(expected, rel=1e-9)
    assert trade["n_items"] == 2 * ITEMS and trade["n_seeds"] == 3


def test_each_check_stands_beside_the_run_it_varies(bundled):
    root, _, bundle, results = bundled
    report = json.loads((bundle / "study" / "report.json").read_text())
    checks = {(c["check"], c["metric"]): c for c in report["checks"]}
    assert len(checks) == len(CHECKS) * 2
    reference = "method-macco_negatives-without_lr-0.001_seed-0"
    for label in CHECKS:
        name = f"negatives-without_method-macco_check-{label}_lr-0.001_seed-0"
        check = checks[(name, "group")]
        assert check["reference"] == reference and check["row_setting_chosen"]
        mine = [per_item(stored(root / "checks", name, "val"), "group")]
        theirs = [per_item(stored(root / "sweep", reference, "val"), "group")]
        assert (check["estimate"], check["low"], check["high"]) == \
               pytest.approx(slow_paired_bootstrap(mine, theirs, RESAMPLES, seed=3), rel=1e-9)
        assert check["value"] == pytest.approx(np.mean(list(mine[0].values())))
    assert "| macco | without | lr=0.001 | x0.3 | 0 | yes |" in results.read_text()


def test_a_later_sitting_reads_the_runs_whose_folders_are_gone_from_the_bundle(tmp_path):
    sweep = make_sweep(tmp_path)
    bundle = tmp_path / "results"
    first = report_with_bundle(sweep, bundle, tmp_path / "first").read_text()
    gone = ["method-clip_ft_negatives-with_lr-0.001_seed-0", "method-tflocal_negatives-with_lr-0.0001_seed-2"]
    records = {name: (bundle / "study" / "runs" / f"{name}.json.gz").read_bytes() for name in gone}
    for name in gone:
        shutil.rmtree(sweep / name)
    second = report_with_bundle(sweep, bundle, tmp_path / "second").read_text()
    assert "missing or failed: 1" in second  # only the run that never ran
    assert {name: (bundle / "study" / "runs" / f"{name}.json.gz").read_bytes() for name in gone} == records
    for title in ("## Scores on `test`", "## Selection on `val`", "## Paired differences",
                  "## Composition against recognition", "## Mechanisms on `test`"):
        assert section_of(second, title) == section_of(first, title), title


def test_the_bundle_carries_the_backbone_and_a_later_sitting_continues_from_it(tmp_path):
    """Trained again on another CPU, a backbone has other bits: the bundle keeps the one its runs started from, and
    `study.restore` puts it back, checked by its sha256, so the sweep and the report go on with the same study."""
    from core.run_records import file_sha256
    from study import restore

    sweep = add_validity(tmp_path, make_sweep(tmp_path))
    bundle = tmp_path / "results"
    report_with_bundle(sweep, bundle, tmp_path / "first")
    export = tmp_path / "backbone" / "export"
    weights, sha256 = (export / "open_clip.pt").read_bytes(), file_sha256(export / "open_clip.pt")
    carried = bundle / "study" / "backbones" / sha256[:16]
    assert json.loads((carried / "source.json").read_text()) == {
        "path": str(export), "weights": "open_clip.pt", "sha256": sha256, "folder": True}
    assert (carried / "model.json").read_text() == (export / "model.json").read_text()
    assert not (carried / "open_clip.pt").exists() and (carried / "open_clip.pt.gz").is_file()
    before = {path: path.read_bytes() for path in bundle.rglob("*") if path.is_file()}

    shutil.rmtree(tmp_path / "backbone")  # a new sitting: no backbone here
    assert restore.main(["--bundle", str(bundle)]) == [f"{export}: restored from {carried} (sha256 {sha256[:16]}...)"]
    assert (export / "open_clip.pt").read_bytes() == weights and (export / "model.json").is_file()
    assert "already here" in restore.main(["--bundle", str(bundle)])[0]
    report_with_bundle(sweep, bundle, tmp_path / "second")
    assert {path: path.read_bytes() for path in bundle.rglob("*") if path.is_file()} == before

    (export / "open_clip.pt").write_bytes(b"trained again elsewhere")
    with pytest.raises(SystemExit, match=r"open_clip.pt has sha256 \w+, and the bundle's backbone \w+: it is another"):
        restore.main(["--bundle", str(bundle)])
    shutil.rmtree(tmp_path / "backbone")
    (carried / "open_clip.pt.gz").write_bytes(gzip.compress(b"damaged"))
    with pytest.raises(SystemExit, match="the bundle is damaged"):
        restore.main(["--bundle", str(bundle)])
    assert not (tmp_path / "backbone" / "export").exists() and not (tmp_path / "backbone" / "export.restoring").exists()


def test_a_validity_backbone_trained_again_keeps_the_bundles_scores(tmp_path):
    """Frozen rows and validity backbones are scored once: a later sitting whose backbone of pretraining seed 1 has
    other bits (trained again on another CPU) leaves the bundle's record of the first as it is, and the frozen rows
    the bundle holds are not scored again (a later sitting without their caches writes none)."""
    sweep = add_validity(tmp_path, make_sweep(tmp_path))
    bundle = tmp_path / "results"
    report_with_bundle(sweep, bundle, tmp_path / "first")
    records = {name: (bundle / "study" / "frozen" / f"{name}.json.gz").read_bytes()
               for name in ("validity_1", "frozen_cosine", "sgi")}
    (tmp_path / "pretrain_seed1" / "export" / "open_clip.pt").write_bytes(b"other bits")
    for name in records:  # no cached scores: a row scored again would leave its cache behind (or fail)
        shutil.rmtree(sweep / FROZEN_DIR / name)
    second = report_with_bundle(sweep, bundle, tmp_path / "second").read_text()
    assert {name: (bundle / "study" / "frozen" / f"{name}.json.gz").read_bytes() for name in records} == records
    assert not any((sweep / FROZEN_DIR / name).exists() for name in records)
    assert "with problems)" in second and "0 with problems" in second


def test_two_bundles_are_compared_item_by_item(bundled, tmp_path, capsys):
    """`study.compare` counts the swap items whose outcome differs between two sittings' records of a run."""
    from core.run_records import read_json_gz
    from study.records import write_json_gz
    from study import compare

    _, _, bundle, _ = bundled
    other = tmp_path / "other"
    shutil.copytree(bundle, other)
    name = "method-clip_ft_negatives-with_lr-0.001_seed-0"
    path = other / "study" / "runs" / f"{name}.json.gz"
    record = read_json_gz(path)
    for item in record["splits"]["test"]["swap_outcomes"][:3]:
        item["text_i0"] = 1 - item["text_i0"]
    record["config_digest"] = "another"
    write_json_gz(path, record)
    rows = compare.main([str(bundle), str(other), "--out", str(tmp_path / "compare.md")])
    changed = [row for row in rows if row.differing]
    assert [(row.name, row.split, row.differing, row.items) for row in changed] == [(name, "test", 3, ITEMS)]
    assert changed[0].same_config is False and changed[0].same_backbone is True
    items = sum(len(read_json_gz(p)["splits"][split]["swap_outcomes"]) for p in bundle.rglob("*.json.gz")
                for split in read_json_gz(p)["splits"])
    assert compare.totals(rows) == (items, 3)
    out = capsys.readouterr().out
    assert f"3 of {items} per-item swap outcomes differ" in out and f"another config (not a comparison of numerics): " \
        f"{name}" in out
    assert (tmp_path / "compare.md").read_text() == out
    with pytest.raises(SystemExit, match="is not a results bundle folder"):
        compare.main([str(bundle), str(tmp_path / "nowhere")])


def test_a_run_of_another_config_or_world_is_refused_and_nothing_is_written(bundled, tmp_path):
    root, sweep, bundle, _ = bundled
    copy = tmp_path / "results"
    shutil.copytree(bundle, copy)
    before = {path: path.read_bytes() for path in copy.rglob("*") if path.is_file()}
    name = "method-clip_ft_negatives-without_lr-0.0001_seed-1"
    config_file = sweep / name / "config.yaml"
    original = config_file.read_text()
    try:
        config_file.write_text(yaml.safe_dump({**yaml.safe_load(original), "optim": {"lr": 0.5}}))
        with pytest.raises(SystemExit, match=rf"{name}: config: optim.lr: 0.0001 \(bundle\) -> 0.5 \(now\)"):
            report_with_bundle(sweep, copy, tmp_path / "report")
        config_file.write_text(yaml.safe_dump({**yaml.safe_load(original), "data": {"num_workers": 8,
                                                                                     "batch_size": 32}}))
        report_with_bundle(sweep, copy, tmp_path / "report")  # loader workers cannot change a result
    finally:
        config_file.write_text(original)
    world = Path(json.loads((sweep / "sweep.json").read_text())["study"]["data"])
    swap = world / "annotations" / "swap_test.json"
    original = swap.read_text()
    try:
        swap.write_text("another world")
        with pytest.raises(SystemExit, match=r"is not the one the bundle was made on.*swap_test.json"):
            report_with_bundle(sweep, copy, tmp_path / "report")
    finally:
        swap.write_text(original)
    assert {path: path.read_bytes() for path in copy.rglob("*") if path.is_file()} == before


# The committed bundle's page, README block, docs/study.md blocks and report.json: tests/test_study_readings.py.


def test_labels_of_points_on_one_spot_are_stacked_and_others_stay_put():
    from study.report import label_stack

    # CLIP-FT and CAE gradient land on one spot (equal runs); SmartCLIP's label would run into theirs; a point
    # below them and one far away keep their labels beside them
    points = [(3.0, 35.0), (3.0, 35.0), (3.3, 35.2), (3.0, 30.0), (0.0, 5.0)]
    assert label_stack(points) == [0, 1, 2, 0, 0]
    assert label_stack([(0.0, 0.0), (10.0, 0.0)]) == [0, 0]  # side by side, wider apart than a label
    assert label_stack([]) == [] and label_stack([(1.0, 1.0)]) == [0]

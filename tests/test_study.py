"""The study report: selection on validation only, intervals over seeds, paired differences, files, caching.

Most tests build a sweep directory by hand: sweep.json and, per run, an export folder and a `study_eval.json`
holding per-item outcomes drawn here, so every number the report prints can be recomputed in the test from the
stored outcomes. One test scores real (random-weight, tiny) exports end to end through the command line.
"""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from datamodules.benchmarks.two_by_two import ShapesSwap
from lightning_modules import study as study_module
from lightning_modules.study import (CACHE_FILE, FROZEN_DIR, Evaluations, StudyError, cached_scores,
                                     evaluate_study, export_fingerprint, item_values, load_study, parse_settings,
                                     select_settings, split_fingerprint)
from lightning_modules.study_report import read_curves, write_report
from lightning_modules.study_stats import seed_interval

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
    return {"data": split_fingerprint(data, split), "swap_outcomes": outcomes,
            "swap": ShapesSwap.aggregate(outcomes), "retrieval_outcomes": [],
            "retrieval": {"i2t_r1": float(rng.integers(0, 100)), "t2i_r1": float(rng.integers(0, 100))},
            "mechanisms": None}


def write_export(directory: Path) -> Path:
    (directory / "export").mkdir(parents=True, exist_ok=True)
    (directory / "export" / "model.json").write_text('{"model": "fake"}')
    return directory / "export"


def write_cached(directory: Path, scorer: str, scores: dict, export: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    document = {"version": study_module.CACHE_VERSION, "scorer": scorer, "export": export_fingerprint(export),
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
                    export = write_export(sweep / name)
                    scores = {split: split_scores(draw_outcomes(quality(method, negatives, lr, split), rng), data,
                                                  split, rng) for split in SPLITS}
                    write_cached(sweep / name, "clip", scores, export)
    backbone = write_export(tmp_path / "backbone")
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
    assert any("| macco | with | lr=0.001 | 3 |" in line for line in text.splitlines())
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
    """A generated shapes world whose `test` and `test_unseen` splits are copies of `val` (same layout)."""
    from datamodules.shapes import generate

    generate(root, n_train=4, n_val=6, image_size=64, seed=0, n_swap=6)
    for split in ("test", "test_unseen"):
        for kind in ("captions", "swap"):
            shutil.copy(root / "annotations" / f"{kind}_val.json", root / "annotations" / f"{kind}_{split}.json")
        shutil.copytree(root / "images" / "val", root / "images" / split)
    return root


def test_the_command_scores_real_exports_end_to_end(tmp_path, monkeypatch, capsys):
    from lightning_modules.encoders import build_model
    from lightning_modules.export import export_model

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
    study = {"data": str(data), "frozen": {"backbone": str(tmp_path / "backbone"), "rows": {"cosine": "clip"}}}
    (sweep / "sweep.json").write_text(json.dumps({"name": "e2e", "runs_root": str(sweep), "runs": runs,
                                                  "study": study}))
    monkeypatch.setattr(study_module, "load_mechanisms", lambda: gap_mechanism)
    results = study_module.main(["--sweep", str(sweep), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert results == tmp_path / "out" / "report" / "results.md" and f"report: {results}" in out
    assert "[val 1/3] method-clip_ft_seed-0 (val): scored in" in out
    cache = json.loads((sweep / "method-clip_ft_seed-0" / CACHE_FILE).read_text())
    assert set(cache["splits"]) == set(SPLITS)
    val = cache["splits"]["val"]
    assert len(val["swap_outcomes"]) == 6
    assert set(val["swap_outcomes"][0]) == {"id", "type", *study_module.OUTCOME_FLAGS}
    assert val["swap"]["group"] == pytest.approx(ShapesSwap.aggregate(val["swap_outcomes"])["group"])
    assert len([o for o in val["retrieval_outcomes"] if o[0] == "i2t"]) == 6
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
    study_module.main(["--sweep", str(sweep), "--out", str(tmp_path / "out")])
    assert "scored in" not in capsys.readouterr().out  # the second report reads every cache

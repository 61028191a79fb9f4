"""What the study's numbers may be read as: selections that say whether the grid brackets them, differences with a
seed-level interval beside the bootstrap and claims only where both agree, rows whose own term never acted shown
inactive, a bundle tied to its world, validity checks per backbone, and docs whose every study figure is generated.

The hand-made sweeps, bundles and helpers are those of tests/test_study.py; the committed bundle is read as it is.
"""
from __future__ import annotations

import gzip
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from study.analysis import Comparison, Evaluations, Selection
from study.settings import GridRun, Study, parse_settings
from study.stats import Interval, seed_interval, student_t_quantile
from test_study import (ITEMS, add_checks, add_validity, draw_outcomes, make_sweep, report_with_bundle, section_of,
                        split_scores)

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "results" / "study"


# ----- 1. selections that say whether the grid brackets them ----------------------------------------------------------
def selection(chosen: str, values: dict) -> Selection:
    return Selection(chosen, {s: (float(np.mean(v)), len(v)) for s, v in values.items()},
                     {s: tuple(v) for s, v in values.items()})


def test_a_choice_at_the_grids_edge_is_not_bracketed_and_a_flat_curve_is_flagged():
    from study.analysis import selection_flags, setting_order

    # grid order is not value order: 3e-4 lies between 1e-4 and 1e-3
    grid = {"lr=3e-4": [30.0, 31.0, 32.0], "lr=1e-4": [10.0, 11.0, 12.0], "lr=1e-3": [20.0, 21.0, 22.0]}
    assert setting_order(list(grid)) == ["lr=1e-4", "lr=3e-4", "lr=1e-3"]
    middle = selection_flags(selection("lr=3e-4", grid))
    assert middle.bracketed and not middle.edge and middle.flat is False
    edge = selection_flags(selection("lr=1e-3", {**grid, "lr=1e-3": [40.0, 41.0, 42.0]}))
    assert edge.edge and not edge.bracketed
    # best - worst = 1.0; each setting's standard error 1 / sqrt(3): noise 2 x sqrt(2/3) = 1.63 > 1.0: flat
    flat = selection_flags(selection("lr=1e-4", {"lr=1e-4": [9.0, 11.0, 13.0], "lr=3e-4": [8.0, 10.0, 12.0]}))
    assert flat.flat and flat.spread == pytest.approx(1.0) and flat.noise == pytest.approx(2 * math.sqrt(2 * 4 / 3))
    steep = selection_flags(selection("lr=1e-4", {"lr=1e-4": [19.0, 21.0, 23.0], "lr=3e-4": [8.0, 10.0, 12.0]}))
    assert steep.flat is False
    one_seed = selection_flags(selection("lr=1e-4", {"lr=1e-4": [20.0], "lr=3e-4": [8.0, 10.0]}))
    assert one_seed.flat is None and one_seed.edge
    assert selection_flags(selection("-", {"-": [1.0, 2.0]})) is None  # no setting was chosen among others


def test_the_report_and_the_page_flag_every_selection(bundled_study):
    _, _, bundle, results = bundled_study
    report = json.loads((bundle / "study" / "report.json").read_text())
    chosen = [entry for entry in report["selection"] if entry["chosen"]]
    assert chosen and all(entry["flags"]["edge"] and not entry["flags"]["bracketed"] for entry in chosen)
    assert all(len(setting["values"]) == setting["n_seeds"] for entry in chosen
               for setting in entry["validation"].values())
    assert report["selection_flags"]["flat_multiple"] == 2.0
    selection_section = section_of(results.read_text(), "## Selection on `val`")
    rows = [line for line in selection_section.splitlines() if line.startswith("| ") and "| chosen |" not in line]
    assert rows and all("not bracketed (edge of the grid)" in row for row in rows)
    assert "2 standard errors" in selection_section


# ----- 2. two intervals per difference; claims only where both agree --------------------------------------------------
def test_the_seed_level_t_is_exact():
    from study.stats import paired_seed_t, student_t_two_sided_p

    # Student's t with 2 degrees of freedom in closed form: F(t) = 1/2 + t / (2 sqrt(2 + t^2)),
    # quantile (2p - 1) / sqrt(2 p (1 - p))
    for p in (0.9, 0.975, 0.995):
        assert student_t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), abs=1e-9)
    for t in (0.3, 1.7, 4.3, 12.0):
        assert student_t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
        assert student_t_two_sided_p(-t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-9)
    differences = [-30.2, -28.0, -29.4]
    test = paired_seed_t(differences)
    mean, se = np.mean(differences), np.std(differences, ddof=1) / math.sqrt(3)
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) * se
    assert (test.interval.estimate, test.interval.low, test.interval.high) == pytest.approx(
        (mean, mean - half, mean + half), rel=1e-9)
    assert test.df == 2 and test.p_value == pytest.approx(1 - abs(mean / se) / math.sqrt(2 + (mean / se) ** 2))
    assert paired_seed_t([0.0, 0.0, 0.0]).p_value == 1.0 and paired_seed_t([1.0, 1.0]).p_value == 0.0
    assert math.isnan(paired_seed_t([2.0]).p_value) and paired_seed_t([2.0]).df == 0


def test_each_comparison_carries_the_seed_level_t_of_its_per_seed_differences(bundled_study):
    root, _, bundle, results = bundled_study
    report = json.loads((bundle / "study" / "report.json").read_text())
    c = next(c for c in report["comparisons"] if (c["method"], c["negatives"], c["reference"], c["split"],
                                                  c["metric"]) == ("macco", "with", "clip_ft (with)", "test", "group"))
    chosen = {(s["method"], s["negatives"]): s["chosen"] for s in report["selection"]}
    lr = chosen[("macco", "with")].split("=")[1]
    reference_lr = chosen[("clip_ft", "with")].split("=")[1]

    def group(method: str, lr: str, seed: int) -> float:
        name = f"method-{method}_negatives-with_lr-{lr}_seed-{seed}"
        record = json.loads(gzip.decompress((bundle / "study" / "runs" / f"{name}.json.gz").read_bytes()))
        return 100.0 * np.mean([o["group"] for o in record["splits"]["test"]["swap_outcomes"]])

    per_seed = [group("macco", lr, s) - group("clip_ft", reference_lr, s) for s in range(3)]
    expected = seed_interval(per_seed)
    assert (c["seed_t"]["estimate"], c["seed_t"]["low"], c["seed_t"]["high"]) == pytest.approx(
        (expected.estimate, expected.low, expected.high), rel=1e-9)
    assert c["seed_t"]["df"] == 2 and 0 <= c["seed_t"]["p"] <= 1
    differences = section_of(results.read_text(), "## Paired differences")
    assert "| seed-level t [95%] | p (seed t) |" in differences
    page_claims = section_of(results.read_text(), "## Claims")
    total = len(report["comparisons"])
    assert f"{total} paired differences are each read at 95%" in page_claims
    assert "no correction for multiplicity" in page_claims


def comparison(method: str, bootstrap: tuple, seed: tuple) -> Comparison:
    from study.stats import paired_seed_t

    return Comparison(method, "with", "clip_ft (with)", "test", "group", Interval(*bootstrap), 3, 100,
                      paired_seed_t(seed))


def test_a_claim_needs_both_intervals_on_one_side_and_an_active_row():
    from study.analysis import claims

    both = comparison("a", (-5.0, -8.0, -2.0), [-5.0, -5.5, -4.5])
    bootstrap_only = comparison("b", (-5.0, -8.0, -2.0), [-15.0, 5.0, -5.0])
    seed_only = comparison("c", (1.0, -0.5, 2.5), [1.0, 1.1, 0.9])
    neither = comparison("d", (0.1, -1.0, 1.2), [0.1, -0.4, 0.6])
    inactive = comparison("e", (-5.0, -8.0, -2.0), [-5.0, -5.5, -4.5])
    assert bootstrap_only.seed.interval.high > 0 and seed_only.seed.interval.low > 0
    assert claims([both, bootstrap_only, seed_only, neither, inactive], {("e", "with")}) == [both]


# ----- 3. a row that cannot act is shown inactive ---------------------------------------------------------------------
def activity_study(outcomes: dict) -> Study:
    """A study of clip_ft (the baseline) and two methods, two lrs x two seeds each, whose scores are `outcomes`:
    method -> (lr, seed) -> one split's scores."""
    runs = [GridRun(f"{m}_{lr}_{seed}", m, "with", f"lr={lr}", str(seed), Path("x"))
            for m, found in outcomes.items() for (lr, seed) in found]
    return Study(Path("x"), parse_settings({"data": "x"}), runs)


def test_a_method_whose_runs_change_no_decision_is_inactive():
    from study.analysis import Activity, outcome_keys, row_activity

    rng = np.random.default_rng(0)
    base = {(lr, s): split_scores(draw_outcomes(0.6, rng), Path("x"), "test", rng) for lr in ("1e-4", "3e-4")
            for s in (0, 1)}
    deeper = {key: json.loads(json.dumps(scores)) for key, scores in base.items()}
    for scores in deeper.values():  # a rank deep in a retrieval list moves with the weights' last bits
        scores["retrieval_outcomes"] = [[d, rank + 1 if rank else rank, ties] for d, rank, ties in
                                        scores["retrieval_outcomes"]]
    acting = {key: json.loads(json.dumps(scores)) for key, scores in base.items()}
    acting[("3e-4", 1)]["swap_outcomes"][4]["text_i0"] ^= 1  # one decision of one run
    outcomes = {"clip_ft": base, "copy": deeper, "acting": acting}
    study = activity_study(outcomes)
    evaluations = Evaluations(scores={f"{m}_{lr}_{s}": {"test": scores} for m, found in outcomes.items()
                                      for (lr, s), scores in found.items()})
    found = {a.method: a for a in row_activity(study, evaluations)}
    assert set(found) == {"copy", "acting"}
    decisions = len(outcome_keys(base[("1e-4", 0)]))
    assert decisions == ITEMS + 2 * ITEMS + 2 * ITEMS  # swap items, retrieval queries both ways, zero-shot objects
    assert found["copy"] == Activity("copy", "with", "clip_ft (with)", 4, 4 * decisions, 0)
    assert found["copy"].active is False
    assert found["acting"].differing == 1 and found["acting"].active


def test_an_inactive_row_is_labelled_on_the_page_and_in_the_readme_and_makes_no_claim(bundled_study, tmp_path):
    """A method whose runs are the baseline's, decision for decision (a term that never acts), added to a bundle:
    the page and the README call it inactive, show no numbers for it in the README, and claim nothing of it."""
    from study.headline import BLOCK_END, BLOCK_START
    from study.page import make_page

    _, _, bundle, _ = bundled_study
    copy = tmp_path / "results"
    shutil.copytree(bundle, copy, ignore=shutil.ignore_patterns("backbones"))
    document = json.loads((copy / "study" / "sweep.json").read_text())
    added = []
    for entry in [e for e in document["runs"] if e["choices"]["method"] == "method-clip_ft"]:
        name = entry["name"].replace("method-clip_ft", "method-hinge")
        added.append({**entry, "name": name, "choices": {**entry["choices"], "method": "method-hinge"}})
        source = copy / "study" / "runs" / f"{entry['name']}.json.gz"
        if source.is_file():
            record = json.loads(gzip.decompress(source.read_bytes()))
            (copy / "study" / "runs" / f"{name}.json.gz").write_bytes(gzip.compress(json.dumps(
                {**record, "name": name}).encode()))
    document["runs"] += added
    (copy / "study" / "sweep.json").write_text(json.dumps(document))
    readme = tmp_path / "README.md"
    readme.write_text(f"{BLOCK_START}\n{BLOCK_END}\n")
    page = make_page(copy, tmp_path / "page.md", plots=False, readme=readme)
    activity = section_of(page, "## Did each row's own term act?")
    assert re.search(r"\| hinge \| with \| clip_ft \(with\) \| 6 \| \d+ \| 0 \| inactive: not a result \|", activity)
    assert "| macco | with |" in activity and "| macco | with | clip_ft (with) | 6 | " in activity
    assert "| hinge (inactive) | with |" in section_of(page, "## Scores on `test`")
    assert "| test | hinge | with | clip_ft (with) | swap group |" in page
    assert all(line.endswith("| inactive row: not read |") for line in page.splitlines()
               if line.startswith("| test | hinge |"))
    page_claims = section_of(page, "## Claims")
    assert "Inactive rows enter no claim: `hinge` (with), `hinge` (without)." in page_claims
    assert not any("`hinge`" in line for line in page_claims.splitlines() if line.startswith("- "))
    row = next(line for line in readme.read_text().splitlines() if line.startswith("| hinge (inactive) | with |"))
    assert [cell.strip() for cell in row.strip("|").split("|")][3:7] == ["inactive"] * 4 and "[" not in row


# ----- 4. a bundle of one world ---------------------------------------------------------------------------------------
def test_restore_refuses_a_world_of_other_annotation_files_naming_both_checksums(tmp_path):
    from core.run_records import file_sha256, world_checksum
    from study import restore

    sweep = add_validity(tmp_path, make_sweep(tmp_path))
    bundle = tmp_path / "results"
    report_with_bundle(sweep, bundle, tmp_path / "report")
    world = json.loads((bundle / "study" / "sweep.json").read_text())["world"]
    shutil.rmtree(tmp_path / "backbone")  # a new sitting
    data = Path(world["root"])
    (data / "annotations" / "swap_test.json").write_text("the world of another seed")
    with pytest.raises(SystemExit) as refused:
        restore.main(["--bundle", str(bundle), "--data-root", str(data)])
    here = world_checksum({**world["files"], "annotations/swap_test.json": file_sha256(
        data / "annotations" / "swap_test.json")})
    message = str(refused.value.code)
    assert "\n" not in message and message.startswith("restore error: the world")
    assert f"world checksum {here}" in message and f"checksum {world_checksum(world['files'])}" in message
    assert not (tmp_path / "backbone").exists()  # nothing restored
    with pytest.raises(SystemExit, match="is not there"):
        restore.main(["--bundle", str(bundle), "--data-root", str(tmp_path / "nowhere")])


def test_a_sweep_refuses_a_bundle_of_another_world(tmp_path, monkeypatch, capsys):
    from core.run_records import file_sha256, world_checksum
    from slurm import sweep as sweep_module
    from slurm.sweep import load_sweep
    from test_slurm import bundled_sweep, python_command, refusal, write_record

    path = bundled_sweep(tmp_path)
    sweep = load_sweep(path)
    write_record(sweep, 0)
    data = tmp_path / "data"
    world = {"root": str(data), "files": {"annotations/dataset_coco.json": file_sha256(
        data / "annotations" / "dataset_coco.json")}}
    (tmp_path / "results" / sweep.name / "sweep.json").write_text(json.dumps({"name": sweep.name, "world": world}))
    monkeypatch.setattr(sweep_module, "task_command", python_command("pass"))
    sweep_module.main([str(path), "--dry-run"])  # the same world: run 0 is in the bundle
    assert "(in the bundle: skipped)" in capsys.readouterr().out
    (data / "annotations" / "dataset_coco.json").write_text('{"images": "of another seed"}')
    here = world_checksum({"annotations/dataset_coco.json": file_sha256(data / "annotations" / "dataset_coco.json")})
    for argv in ([str(path), "--dry-run"], [str(path), "--local"]):
        message = refusal(argv)
        assert f"world checksum {here}" in message and f"checksum {world_checksum(world['files'])}" in message
        assert "nothing was submitted or run" in message
    assert not (tmp_path / "runs").exists()


def test_another_seed_gets_configs_and_folders_of_its_own(tmp_path):
    from study.world import COMMITTED_SEED, main, world_configs, world_name

    makefile = (REPO / "Makefile").read_text()
    assert f"STUDY_SEED ?= {COMMITTED_SEED}\n" in makefile and f"$(filter {COMMITTED_SEED},$(STUDY_SEED))" in makefile
    assert world_name(COMMITTED_SEED) == "study" and world_name(11) == "study-world-11"
    out = tmp_path / "w11"
    files = world_configs(11, out)
    assert {path.name for path in files} >= {"finetune.yaml", "backbone.yaml", "study.yaml", "study_checks.yaml"}
    assert all(text.startswith("# Written by `python -m study.world --seed 11") for text in files.values())
    text = "\n".join(text.split("\n", 1)[1] for text in files.values())  # below the header naming the source
    for old in ("data/study\n", "runs/study/", "cache/study\n", "results/study\n", "configs/study/"):
        assert old not in text, old
    finetune = files[out / "study" / "finetune.yaml"]
    assert "pretrained: runs/study-world-11/backbones/seed-0/export" in finetune
    assert "root: data/study-world-11\n" in finetune and "cache_root: cache/study-world-11\n" in finetune
    sweep = files[out / "sweeps" / "study.yaml"]
    assert "runs_root: runs/study-world-11\n" in sweep and "bundle: results/study-world-11\n" in sweep
    assert f"configs: [{out.as_posix()}/study/finetune.yaml]" in sweep and "data: data/study-world-11\n" in sweep
    assert "features_cache: cache/study-world-11_features" in files[out / "study" / "tflocal.yaml"]
    assert len(main(["--seed", "11", "--out", str(out)])) == len(files)
    with pytest.raises(SystemExit, match="committed world's"):
        main(["--seed", str(COMMITTED_SEED), "--out", str(out)])


# ----- 6. validity per backbone ---------------------------------------------------------------------------------------
def test_validity_checks_each_backbones_recognition_chance_and_attribution(tmp_path):
    from study.analysis import select_settings, study_cells
    from study.settings import load_study
    from study.validity import measure_validity

    sweep = add_validity(tmp_path, make_sweep(tmp_path))
    study = load_study(sweep)
    rng = np.random.default_rng(5)

    def backbone(shape: float, colour: float, gaps=None) -> dict:
        scores = split_scores(draw_outcomes(0.5, rng), study.settings.data, "test", rng)
        scores["zeroshot"] = {"shape_top1": shape, "color_top1": colour}
        scores["mechanisms"] = gaps
        return {split: scores for split in ("test", "test_unseen")}

    def checks(*backbones) -> dict:
        evaluations = Evaluations(scores={f"validity_{i}": scores for i, scores in enumerate(backbones)})
        for run in study.runs:  # the control's runs: none needed for (d)-(f)
            evaluations.scores.setdefault(run.name, {})
        found = measure_validity(study, evaluations, study_cells(study, evaluations, select_settings(
            study, evaluations)))
        return {(c.key, c.split): c for c in found.checks}, found

    found, validity = checks(backbone(85.0, 90.0), backbone(81.0, 99.0), backbone(80.0, 80.0))
    assert found[("d", "test")].passed and "validity_2 shape 80.0, colour 80.0 (yes)" in found[("d", "test")].detail
    assert found[("f", "test")].passed is None and found[("f", "test")].status == "NOT MEASURED"
    assert not validity.passed  # not measured is not a pass
    found, _ = checks(backbone(85.0, 90.0), backbone(27.2, 91.3), backbone(85.0, 90.0))
    assert found[("d", "test")].passed is False and "validity_1 shape 27.2, colour 91.3 (no)" in \
        found[("d", "test")].detail
    gaps = {"attr_gap_gradient": -2.0, "attr_gap_captions": 64.0}
    found, _ = checks(*(backbone(85.0, 90.0, gaps) for _ in range(3)))
    assert found[("f", "test")].passed is True and "gradient -2" in found[("f", "test")].detail
    found, _ = checks(backbone(85.0, 90.0, gaps), backbone(85.0, 90.0, gaps),
                      backbone(85.0, 90.0, {"attr_gap_gradient": 5.8}))
    assert found[("f", "test")].passed is False
    relations = {name: values["acc_relation"] for name, values in validity.splits[0].per_backbone.items()}
    assert found[("e", "test")].passed == all(abs(r - 50) <= 5 for r in relations.values())


# ----- the committed bundle: every page, block and document is what it makes ------------------------------------------
@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    """The committed bundle's page, README block, docs/study.md blocks, report.json and bundle README, made in a
    copy of the checkout's study files (the bundle without its carried weights), as `make study`'s last step
    makes them."""
    from study.page import make_page

    if not (COMMITTED / "sweep" / "sweep.json").is_file():
        pytest.skip("no committed bundle yet")
    root = tmp_path_factory.mktemp("committed")
    shutil.copytree(COMMITTED, root / "results" / "study", ignore=shutil.ignore_patterns("backbones"))
    (root / "docs").mkdir()
    shutil.copy(REPO / "docs" / "study.md", root / "docs" / "study.md")
    shutil.copy(REPO / "README.md", root / "README.md")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        page = make_page(Path("results") / "study", Path("docs") / "study_results.md", plots=False,
                         readme=Path("README.md"), doc=Path("docs") / "study.md", refresh_report=True)
    return root, page


def test_the_committed_docs_and_report_are_what_the_committed_bundle_makes(committed):
    root, page = committed
    assert page == (REPO / "docs" / "study_results.md").read_text()
    assert (root / "README.md").read_text() == (REPO / "README.md").read_text()
    assert (root / "docs" / "study.md").read_text() == (REPO / "docs" / "study.md").read_text(), \
        "docs/study.md's generated blocks differ from the bundle's: python -m study.page ... --doc docs/study.md"
    for name in ("sweep/report.json", "README.md"):
        assert (root / "results" / "study" / name).read_text() == (COMMITTED / name).read_text(), name


def test_the_committed_study_reads_as_the_bundle_allows(committed):
    """Every lr at an edge of its 2-point grid; CLIP-CAE's gradient hinge inactive; the testbed not shown valid
    (zero-shot shape recognition near chance, the backbone's text attribution not measured), so every claim is
    provisional; every claim has both intervals on one side."""
    root, page = committed
    report = json.loads((COMMITTED / "sweep" / "report.json").read_text())
    assert all(s["flags"]["edge"] for s in report["selection"] if s["chosen"])
    inactive = {(a["method"], a["negatives"]) for a in report["activity"] if a["active"] is False}
    assert inactive == {("cae_gradient", "with"), ("cae_gradient", "without")}
    validity = report["validity"]
    status = {(c["check"], c["split"]): c["status"] for c in validity["checks"]}
    assert not validity["passed"] and status[("d", "test")] == "FAIL" and status[("f", "test")] == "NOT MEASURED"
    assert report["claims"]["provisional"] and report["claims"]["read"]
    by_key = {(c["method"], c["negatives"], c["reference"], c["split"], c["metric"]): c for c in report["comparisons"]}
    for claim in report["claims"]["read"]:
        c = by_key[tuple(claim[key] for key in ("method", "negatives", "reference", "split", "metric"))]
        assert (c["low"] > 0 and c["seed_t"]["low"] > 0) or (c["high"] < 0 and c["seed_t"]["high"] < 0)
        assert (c["method"], c["negatives"]) not in inactive
    assert "NOT SHOWN VALID" in page and "provisional" in section_of(page, "## Claims")
    readme = (REPO / "README.md").read_text()
    assert "| cae_gradient (inactive) | with |" in readme and "Testbed validity: not shown valid" in readme


# ----- 5. no hand-copied study figure in the docs ---------------------------------------------------------------------
# A decimal number (a score, a difference, an interval, a share), not inside another token. Scientific notation is a
# setting (an lr such as 3.0e-4), not a result, and so is a check's weight label (x0.3): neither matches.
DECIMAL = re.compile(r"(?<![\w.])[-+]?\d+\.\d+(?![\d.]|e[-+]?\d)")
ALLOWED_DECIMALS: set = set()  # no study figure needs to stand outside the generated blocks


def study_figures(text: str) -> list:
    from study.headline import outside_blocks

    return [m.group(0) for m in DECIMAL.finditer(outside_blocks(text)) if m.group(0) not in ALLOWED_DECIMALS]


def test_docs_study_quotes_no_result_outside_its_generated_blocks():
    text = (REPO / "docs" / "study.md").read_text()
    assert "<!-- study:validity:" in text and "<!-- study:claims:" in text
    assert study_figures(text) == [], "figures written by hand in docs/study.md: generate them or remove them"
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Results: the method study", 1)[1].split("\n## ", 1)[0]
    from study.headline import BLOCK_END, BLOCK_START

    outside = section.split(BLOCK_START)[0] + section.split(BLOCK_END)[1]
    assert DECIMAL.findall(outside) == []


def test_the_scan_finds_what_was_written_by_hand():
    from study.headline import DOC_END, DOC_START

    block = f"{DOC_START.format(name='claims')}\n-29.2 [-33.2, -25.1]\n{DOC_END.format(name='claims')}"
    assert study_figures(f"SmartCLIP scores 30.6 at lr 3.0e-4, a gap of -3.4 (x0.3 weight).\n{block}\n") == \
        ["30.6", "-3.4"]
    assert study_figures("1.8% of the outcomes; mask Jaccard 0.72") == ["1.8", "0.72"]


def test_a_doc_block_the_study_does_not_make_or_without_its_end_is_refused():
    from study.headline import DOC_END, DOC_START, replace_doc_blocks
    from study.settings import StudyError

    text = f"a\n{DOC_START.format(name='claims')}\nold\n{DOC_END.format(name='claims')}\nb\n"
    assert replace_doc_blocks(text, {"claims": ["new"]}, "doc") == text.replace("old", "new")
    with pytest.raises(StudyError, match="block `study:wishes` that the study does not make"):
        replace_doc_blocks(text.replace("claims", "wishes"), {"claims": ["new"]}, "doc")
    with pytest.raises(StudyError, match="needs the lines"):
        replace_doc_blocks(f"{DOC_START.format(name='claims')}\nold\n", {"claims": ["new"]}, "doc")


# ----- the page reads the bundle with numpy and the standard library --------------------------------------------------
def test_the_page_is_made_without_torch_or_the_models(bundled_study, tmp_path):
    _, _, bundle, _ = bundled_study
    code = ("import sys\nfrom pathlib import Path\nfrom study.page import make_page\n"
            f"make_page(Path({str(bundle)!r}), Path({str(tmp_path / 'page.md')!r}), plots=False)\n"
            "print(sorted(m for m in ('torch', 'omegaconf', 'matplotlib', 'scipy', 'lightning') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "page.md").is_file()


@pytest.fixture(scope="module")
def bundled_study(tmp_path_factory):
    """The hand-made sweep with validity backbones, a contrast and checks, reported with a bundle."""
    root = tmp_path_factory.mktemp("readings")
    sweep = add_validity(root, make_sweep(root, study={"contrast": {"condition": "with", "reference": "without"}}))
    add_checks(root, sweep)
    bundle = root / "results"
    results = report_with_bundle(sweep, bundle, root / "report")
    return root, sweep, bundle, results


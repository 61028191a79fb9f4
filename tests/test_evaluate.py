"""The evaluation harness and its CLI: per-item outcomes, aggregates recomputed from them, tables, errors."""
from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling.encoders import build_model
from modeling.export import export_model
from evaluation import evaluate, leakage
from evaluation.benchmarks import BENCHMARKS, Benchmark, build_benchmark
from evaluation.benchmarks.base import ImageRef, coco_id_from_name
from testkit.fixtures import fixture
from testkit.standin.sugarcrepe import write_sugarcrepe
from testkit.standin.valse import write_valse
from evaluation.benchmarks.sugarcrepe import SUBSETS
from evaluation.harness import read_outcomes, reaggregate, run_benchmark
from evaluation.scorers import FunctionScorer

REPO = Path(__file__).resolve().parents[1]
TINY = "ViT-Tiny-16-64"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A run directory holding the export of a random tiny model, as fit leaves it."""
    run = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    built = build_model(TINY, None, "configs/models")
    export_model(built.model, built.name, run / "export")
    return run


@pytest.fixture
def data_root(tmp_path) -> Path:
    write_sugarcrepe(tmp_path / "benchmarks" / "sugarcrepe", n_items=28)
    return tmp_path / "benchmarks"


def test_function_scorer_run_matches_a_hand_count(data_root):
    """The positive caption wins iff the image name's id is even: accuracy is the share of even ids."""
    benchmark = build_benchmark("sugarcrepe", data_root / "sugarcrepe")
    even = lambda ref: int(Path(ref.path).stem) % 2 == 0  # noqa: E731
    scorer = FunctionScorer(lambda ref, text: (1.0 if ("sitting" in text) == even(ref) else 0.0))
    result = run_benchmark(benchmark, scorer)
    expected = [even(item.images[0]) for item in benchmark.items()]
    assert len(result.outcomes) == 28
    assert result.aggregates["overall_micro"] == pytest.approx(100.0 * sum(expected) / len(expected))


def test_cli_on_a_tiny_model_writes_outcomes_aggregates_and_tables(tiny_run, data_root, tmp_path):
    out = tmp_path / "eval"
    evaluate.main(["--run", str(tiny_run), "--benchmarks", "sugarcrepe", "--data-root", str(data_root),
                   "--out", str(out), "--num-workers", "0", "--no-progress", "--tensorboard"])
    outcomes = read_outcomes(out / "sugarcrepe" / "outcomes.jsonl")
    assert len(outcomes) == 28 and all({"id", "subset", "correct"} <= set(o) for o in outcomes)
    document = json.loads((out / "aggregates.json").read_text())
    stored = document["benchmarks"]["sugarcrepe"]["aggregates"]
    assert stored == pytest.approx(reaggregate(out)["sugarcrepe"])
    assert document["metadata"]["model"] == TINY and document["metadata"]["precision"] == "32-true"
    with open(out / "results.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {row["metric"] for row in rows} >= set(SUBSETS) | {"overall_micro", "overall_macro"}
    assert "| sugarcrepe | 28 |" in (out / "results.md").read_text()
    assert list((tiny_run / "tb" / "eval").glob("events.out.tfevents.*"))


def test_cli_names_the_expected_files_of_a_missing_benchmark(tiny_run, tmp_path):
    with pytest.raises(SystemExit, match="replace_obj.json"):
        evaluate.main(["--run", str(tiny_run), "--benchmarks", "sugarcrepe", "--data-root", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown benchmark.*registered"):
        evaluate.main(["--run", str(tiny_run), "--benchmarks", "sugarcrap", "--data-root", str(tmp_path)])


def test_all_skips_absent_benchmarks_and_runs_the_present_ones(tiny_run, data_root, tmp_path, capsys):
    results = evaluate.main(["--run", str(tiny_run), "--all", "--data-root", str(data_root), "--out",
                             str(tmp_path / "eval"), "--num-workers", "0", "--no-progress"])
    assert [r.name for r in results] == ["sugarcrepe"]
    assert "skipped:" in capsys.readouterr().err


def test_missing_images_stop_before_encoding_with_the_option_to_fix_it(tiny_run, data_root, tmp_path):
    shutil.rmtree(data_root / "sugarcrepe" / "val2017")
    with pytest.raises(SystemExit, match=r"image files are missing.*options.sugarcrepe.images=DIR"):
        evaluate.main(["--run", str(tiny_run), "--benchmarks", "sugarcrepe", "--data-root", str(data_root),
                       "--out", str(tmp_path / "eval")])


def test_set_passes_benchmark_options(tiny_run, data_root, tmp_path):
    images = tmp_path / "coco_val2017"
    shutil.move(str(data_root / "sugarcrepe" / "val2017"), images)
    results = evaluate.main(["--run", str(tiny_run), "--benchmarks", "sugarcrepe", "--data-root", str(data_root),
                             f"options.sugarcrepe.images={images}", "--out", str(tmp_path / "eval"),
                             "--num-workers", "0", "--no-progress"])
    assert len(results[0].outcomes) == 28


def test_the_real_sugarcrepe_files_through_the_cli_with_stand_in_images(tiny_run, tmp_path):
    root = tmp_path / "sugarcrepe"
    root.mkdir()
    for subset in SUBSETS:
        shutil.copy(fixture(f"sugarcrepe/{subset}.json"), root)
    names = {json.loads((root / f"{s}.json").read_text())[k]["filename"]
             for s in ("swap_obj",) for k in json.loads((root / f"{s}.json").read_text())}
    from testkit.standin.images import write_image
    for i, name in enumerate(sorted(names)):
        write_image(root / "val2017" / name, seed=i, size=(24, 24))
    keep = root / "swap_obj.json"
    for subset in SUBSETS:  # score only swap_obj (245 real items); the other files are emptied
        if root / f"{subset}.json" != keep:
            (root / f"{subset}.json").write_text("{}")
    results = evaluate.main(["--run", str(tiny_run), "--benchmarks", "sugarcrepe", f"roots.sugarcrepe={root}",
                             "--out", str(tmp_path / "eval"), "--num-workers", "0", "--no-progress"])
    assert len(results[0].outcomes) == 245
    aggregates = json.loads((tmp_path / "eval" / "aggregates.json").read_text())["benchmarks"]["sugarcrepe"]
    assert aggregates["aggregates"]["replace_obj"] is None  # an empty subset is undefined, not 0 %


def test_list_runs_as_a_module_and_names_every_benchmark():
    result = subprocess.run([sys.executable, "-m", "evaluation.evaluate", "--list"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in BENCHMARKS:
        assert f"{name}:" in result.stdout
    assert "replace_obj.json" in result.stdout


def coco_captions(path: Path, image_ids) -> Path:
    images = [{"id": i, "file_name": f"{i:012d}.jpg"} for i in image_ids]
    annotations = [{"id": n, "image_id": i, "caption": "a photo"} for n, i in enumerate(image_ids)]
    path.write_text(json.dumps({"images": images, "annotations": annotations}))
    return path


def test_leakage_guard_reports_the_overlap_and_writes_exclusions(data_root, tmp_path, capsys):
    benchmark_ids = sorted(build_benchmark("sugarcrepe", data_root / "sugarcrepe").coco_image_ids())
    train = coco_captions(tmp_path / "train.json", benchmark_ids[:3] + [1, 2])
    exclusions = tmp_path / "leakage" / "exclude_image_ids.json"
    argv = ["--train", str(train), "--benchmarks", "sugarcrepe", "--data-root", str(data_root),
            "--out", str(tmp_path / "leakage")]
    report = leakage.main(argv)
    assert report["sugarcrepe"]["overlap"] == 3 and report["sugarcrepe"]["coco_images"] == len(benchmark_ids)
    assert json.loads(exclusions.read_text()) == benchmark_ids
    with pytest.raises(SystemExit) as exit_info:
        leakage.main(argv + ["--fail-on-overlap"])
    assert exit_info.value.code == 1
    clean = coco_captions(tmp_path / "clean.json", [1, 2])
    assert leakage.main(["--train", str(clean), "--benchmarks", "sugarcrepe", "--data-root", str(data_root),
                         "--fail-on-overlap"])["sugarcrepe"]["overlap"] == 0
    assert "| sugarcrepe |" in capsys.readouterr().out


@pytest.mark.parametrize("name, expected", [
    ("000000391895.jpg", 391895),
    ("val2017/000000391895.jpg", 391895),
    ("/data/coco/train2014/COCO_train2014_000000000009.jpg", 9),
    ("COCO_val2014_000000284024.jpg", 284024),
    ("COCO_test2015_000000000001.jpg", 1),
    ("VisualDialog_val2018_000000284024.jpg", None),  # VALSE coreference-hard: VisDial's own images
    ("visdial_val2018/VisualDialog_val2018_000000284024.jpg", None),
    ("flickr30k-images/1000092795.jpg", None),  # Flickr30k: 10 digits or fewer
    ("000001000092795.jpg", None),  # 15 digits: not a 12-digit COCO name
    ("VG_100K/2354786.jpg", None),  # Visual Genome
    ("VG_100K_2/000000391895_2.jpg", None),
    ("xCOCO_val2014_000000391895.jpg", None),
    ("COCO_val2014_000000391895.png", None),
    ("000000391895.jpg.txt", None),
])
def test_coco_ids_are_read_only_from_coco_file_names(name, expected):
    assert coco_id_from_name(name) == expected


class NamedImages(Benchmark):
    """A benchmark that is only a list of image names (the leakage guard reads nothing else)."""

    name = "named_images"

    def __init__(self, names):
        self.names = names
        super().__init__(".")

    def required_files(self):
        return []

    def image_refs(self):
        return [ImageRef(name) for name in self.names]

    def outcomes(self, scorer, progress=False):
        return []

    @staticmethod
    def aggregate(outcomes):
        return {}


def test_leakage_guard_counts_no_coco_images_for_visdial_flickr_and_vg_names(tmp_path):
    visdial = NamedImages([f"visdial/VisualDialog_val2018_{i:012d}.jpg" for i in (284024, 391895)]
                          + ["flickr30k-images/1000092795.jpg", "VG_100K/2354786.jpg"])
    coco = NamedImages(["val2017/000000391895.jpg"])
    report = leakage.leakage_report({284024, 391895}, {"visdial": visdial, "coco": coco})
    assert {key: report["visdial"][key] for key in ("coco_images", "overlap", "overlap_percent", "examples")} == \
        {"coco_images": 0, "overlap": 0, "overlap_percent": 0.0, "examples": []}
    # ...and says what it could not check: the VG image (no id map given) and the three others
    assert report["visdial"]["visual_genome_images"] == 1 and report["visdial"]["unchecked"] == 4
    assert report["coco"]["overlap"] == 1 and report["coco"]["examples"] == [391895]


def test_valse_coreference_hard_images_are_not_coco(tmp_path):
    options = write_valse(tmp_path / "valse", n_items=4)
    refs = build_benchmark("valse", tmp_path / "valse", **options).image_refs()
    visdial = [ref for ref in refs if Path(ref.path).name.startswith("VisualDialog_")]
    assert visdial and all(coco_id_from_name(ref.path) is None for ref in visdial)
    coco_named = [ref for ref in refs if Path(ref.path).name.startswith("COCO_")]
    assert coco_named and all(coco_id_from_name(ref.path) is not None for ref in coco_named)


def test_evaluations_into_one_folder_accumulate_and_reaggregate_restores_the_tables(tiny_run, data_root, tmp_path):
    from testkit.standin.sts import write_sickr

    assert write_sickr(data_root / "sickr", n_items=12) == {}
    out = tmp_path / "eval"
    common = ["--run", str(tiny_run), "--data-root", str(data_root), "--out", str(out), "--num-workers", "0",
              "--no-progress"]
    evaluate.main([*common, "--benchmarks", "sugarcrepe"])
    first = json.loads((out / "aggregates.json").read_text())["benchmarks"]["sugarcrepe"]
    evaluate.main([*common, "--benchmarks", "sickr"])

    def tables():
        document = json.loads((out / "aggregates.json").read_text())
        with open(out / "results.csv", newline="") as handle:
            # the suites' composites (SugarCrepe is one of their parts) are rows too, naming what they lack
            csv_names = {row["benchmark"] for row in csv.DictReader(handle)} - {"vl_compo_comp_avg", "fsc_clip_comp"}
        return document, csv_names, (out / "results.md").read_text()

    document, csv_names, markdown = tables()
    assert set(document["benchmarks"]) == {"sugarcrepe", "sickr"} == csv_names
    assert document["benchmarks"]["sugarcrepe"]["aggregates"] == pytest.approx(first["aggregates"])
    assert document["benchmarks"]["sugarcrepe"]["items"] == 28
    assert "| sugarcrepe | 28 |" in markdown and "| sickr | 12 |" in markdown
    evaluate.main([*common, "--benchmarks", "sugarcrepe"])  # a rerun replaces its own benchmark only
    assert set(tables()[0]["benchmarks"]) == {"sugarcrepe", "sickr"}
    for name in ("aggregates.json", "results.md", "results.csv"):
        (out / name).unlink() if name != "aggregates.json" else None
    evaluate.main(["--reaggregate", str(out)])
    restored, csv_names, markdown = tables()
    assert set(restored["benchmarks"]) == {"sugarcrepe", "sickr"} == csv_names and "| sickr | 12 |" in markdown


def test_a_combined_aggregate_never_mixes_two_runs(tmp_path):
    from evaluation.harness import BenchmarkResult, markdown_tables, results_combined

    parts = [BenchmarkResult(name, [], {"accuracy": value, "pair_accuracy": value, "set_accuracy": value}, 0.0)
             for name, value in (("whatsup_a", 40.0), ("whatsup_b", 60.0))]
    same = {"whatsup_a": {"model": "x"}, "whatsup_b": {"model": "x"}}
    assert results_combined(parts, same)["whatsup_ab"]["accuracy"] == pytest.approx(50.0)
    mixed = {"whatsup_a": {"model": "x"}, "whatsup_b": {"model": "y"}}
    assert "whatsup_ab" not in results_combined(parts, mixed)
    table = markdown_tables(parts, {"model": "y"}, mixed)
    assert "whatsup_a was scored by an earlier run: model: x" in table and "whatsup_ab" not in table

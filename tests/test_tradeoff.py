"""The world's zero-shot sets (datamodules/shapes/zeroshot.py) and the trade-off command (study/tradeoff.py), end
to end on tiny runs."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from datamodules.shapes import generate, load_heldout
from datamodules.shapes.zeroshot import main as write_zeroshot
from datamodules.shapes.zeroshot import split_classes, write_zeroshot_split, zeroshot_root
from evaluation import evaluate
from evaluation.benchmarks.base import ImageRef
from evaluation.benchmarks.zeroshot import ZeroShotClassification
from evaluation.harness import run_benchmark
from evaluation.scorers import FunctionScorer
from lightning_modules.fit import run
from study import tradeoff
from fitting import tiny_config


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A tiny world with its zero-shot sets (2 images per class)."""
    root = tmp_path_factory.mktemp("tradeoff_world")
    generate(root, n_train=16, n_val=8, image_size=64, seed=0)
    write_zeroshot(["--data-root", str(root), "--per-class", "2"])
    return root


def files(folder: Path) -> dict:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_zero_shot_classes_follow_the_split_rule(world):
    heldout = load_heldout(world)
    seen, unseen = split_classes(0, "test"), split_classes(0, "test_unseen")
    assert len(seen) == 20 and set(unseen) == set(heldout.combos) and not set(seen) & heldout.combos
    names = json.loads((zeroshot_root(world, "test") / "en_classnames.json").read_text())["shapes"]
    prompts = json.loads((zeroshot_root(world, "test") / "en_zeroshot_classification_templates.json").read_text())
    assert names == [f"{colour} {shape}" for colour, shape in seen]
    orange = next(name for name in names if name.startswith("orange"))
    assert prompts["shapes"][orange] == [f"an {orange}", f"there is an {orange}", f"a picture of an {orange}"]


def test_zero_shot_sets_are_byte_identical_when_written_again(world, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(world / "annotations", copy / "annotations")
    write_zeroshot_split(copy, "val", per_class=2)
    assert files(zeroshot_root(copy, "val")) == files(zeroshot_root(world, "val"))


def test_a_perfect_scorer_names_every_object(world):
    """The benchmark reads the set; a scorer that knows each image's class folder is 100% top-1."""
    benchmark = ZeroShotClassification(zeroshot_root(world, "test_unseen"), dataset="shapes")

    def similarity(image: ImageRef, text: str) -> float:
        folder = Path(image.path).parent.name.replace("_", " ")
        return float(text.endswith(folder))

    aggregates = run_benchmark(benchmark, FunctionScorer(similarity)).aggregates
    assert aggregates["top1"] == 100.0 and aggregates["images"] == 4 * 2


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tradeoff_runs")
    run(tiny_config(world, root, "experiment=backbone", "trainer.max_steps=2"))
    common = [f"model.pretrained={root / 'backbone' / 'export'}", "trainer.max_steps=2", "optim.lr=1e-2"]
    run(tiny_config(world, root, "experiment=full", *common))
    run(tiny_config(world, root, "experiment=lora", *common, "model.lora.rank=4", "optim.lr=5e-2"))
    return {name: root / name for name in ("backbone", "full", "lora")}


def test_the_tradeoff_traces_every_run_from_the_pretrained_origin(world, runs, tmp_path):
    out = tmp_path / "tradeoff"
    points = tradeoff.main(["--data-root", str(world), "--alphas", "0,0.5,1", "--out", str(out), "--split", "test",
                            f"runs.full={runs['full']}", f"runs.lora={runs['lora']}"])
    assert [(p.run, p.alpha) for p in points] == [(run, alpha) for run in ("full", "lora") for alpha in (0, 0.5, 1)]
    origins = [p for p in points if p.alpha == 0]
    assert all((p.d_composition, p.d_zeroshot_top1, p.d_retrieval_r1) == (0, 0, 0) for p in origins)
    # both runs start from the same backbone: one origin
    assert origins[0].composition == origins[1].composition and origins[0].zeroshot_top1 == origins[1].zeroshot_top1
    for run_name in ("full", "lora"):
        for alpha in ("alpha-0", "alpha-0.5", "alpha-1"):
            for benchmark in ("shapes_swap", "zeroshot", "coco_retrieval"):
                assert (out / run_name / alpha / benchmark / "outcomes.jsonl").stat().st_size > 0
    # alpha 1 is the run's own export, item by item
    evaluate.main(["--run", str(runs["full"]), "--out", str(tmp_path / "export_eval"), "--benchmarks", "shapes_swap",
                   f"roots.shapes_swap={world}", "options.shapes_swap.split=test", "--no-progress"])
    assert (out / "full" / "alpha-1" / "shapes_swap" / "outcomes.jsonl").read_text() == \
        (tmp_path / "export_eval" / "shapes_swap" / "outcomes.jsonl").read_text()
    rows = list(csv.DictReader((out / "tradeoff.csv").open()))
    assert len(rows) == 6 and float(rows[2]["alpha"]) == 1.0
    assert float(rows[2]["d_composition"]) == pytest.approx(points[2].composition - points[0].composition)
    assert "| lora | 0.5 |" in (out / "tradeoff.md").read_text()
    assert (out / "tradeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "tradeoff.json").read_text())["alphas"] == [0.0, 0.5, 1.0]


def test_the_tradeoff_refuses_bad_inputs_before_scoring(world, runs, tmp_path):
    bare = tmp_path / "bare_world"
    shutil.copytree(world / "annotations", bare / "annotations")
    with pytest.raises(SystemExit, match="no zero-shot set for split test.*python -m datamodules.shapes.zeroshot"):
        tradeoff.main(["--data-root", str(bare), "--out", str(tmp_path / "a"), f"runs.full={runs['full']}"])
    with pytest.raises(SystemExit, match=r"runs.backbone=.*started from random weights[\s\S]*runs.missing=.*no run"):
        tradeoff.main(["--data-root", str(world), "--out", str(tmp_path / "b"), f"runs.backbone={runs['backbone']}",
                       f"runs.missing={tmp_path / 'nowhere'}"])
    with pytest.raises(SystemExit):
        tradeoff.main(["--data-root", str(world), "--alphas", "0.5,1", "--out", str(tmp_path / "c"),
                       f"runs.full={runs['full']}"])
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c"))


def test_a_published_checkpoint_is_a_curve_beside_the_runs(world, runs, tmp_path, monkeypatch):
    """`runs.LABEL=zoo:NAME:FILE`: the checkpoint read by its zoo format, its pretrained end the zoo base (here the
    run's own files stand in for a published one: the two curves must then be one)."""
    from core.zoo import ZOO, ZooEntry

    name = json.loads((runs["full"] / "export" / "model.json").read_text())["model"]
    monkeypatch.setitem(ZOO, "tiny", ZooEntry("tiny", "Tiny", "p", "c", "w", "open_clip", name,
                                              base=str(runs["backbone"] / "export")))
    out = tmp_path / "tradeoff"
    points = tradeoff.main(["--data-root", str(world), "--alphas", "0,1", "--out", str(out), "--split", "test",
                            f"runs.full={runs['full']}",
                            f"runs.zoo=zoo:tiny:{runs['full'] / 'export' / 'open_clip.pt'}"])
    by_run = {(p.run, p.alpha): (p.composition, p.zeroshot_top1, p.retrieval_r1) for p in points}
    assert by_run[("zoo", 0.0)] == by_run[("full", 0.0)] and by_run[("zoo", 1.0)] == by_run[("full", 1.0)]
    metadata = json.loads((out / "zoo" / "alpha-1" / "aggregates.json").read_text())["metadata"]
    assert metadata["zoo"] == "tiny" and metadata["wise_ft"]["pretrained"] == str(runs["backbone"] / "export")
    with pytest.raises(SystemExit, match="runs.zoo=zoo:nothing:x: .*unknown zoo checkpoint 'nothing'"):
        tradeoff.main(["--data-root", str(world), "--out", str(tmp_path / "d"), "runs.zoo=zoo:nothing:x"])

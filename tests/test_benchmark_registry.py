"""Every registered benchmark, on its stand-in data, through the harness with a tiny open_clip model."""
from __future__ import annotations

import json
import math

import pytest
import torch

from evaluation import evaluate
from evaluation.benchmarks import BENCHMARKS, COMBINED, build_benchmark
from evaluation.benchmarks.sources import DataSource
from testkit.standin import STANDINS
from evaluation.harness import reaggregate, run_benchmark
from evaluation.scorers import ClipScorer


@pytest.fixture(scope="module")
def scorer() -> ClipScorer:
    torch.manual_seed(0)
    return ClipScorer.from_pretrained("ViT-Tiny-16-64", None, batch_size=64)


def test_every_benchmark_has_a_stand_in_writer_and_a_headline():
    assert set(STANDINS) == set(BENCHMARKS)
    for name, cls in BENCHMARKS.items():
        assert cls.name == name and cls.headline and cls.description, name


def test_every_benchmark_says_where_its_files_come_from():
    for name, cls in BENCHMARKS.items():
        assert isinstance(cls.data_source, DataSource), name


def same(a, b) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_stand_in_runs_end_to_end_and_re_aggregates_from_json(name, scorer, tmp_path):
    options = STANDINS[name](tmp_path / name, n_items=30, seed=1)
    benchmark = build_benchmark(name, tmp_path / name, **options)
    result = run_benchmark(benchmark, scorer)
    assert result.outcomes and all("id" in outcome for outcome in result.outcomes)
    assert len({outcome["id"] for outcome in result.outcomes}) == len(result.outcomes), "ids must be unique"
    stored = [json.loads(json.dumps(outcome)) for outcome in result.outcomes]
    again = BENCHMARKS[name].aggregate(stored)
    assert again.keys() == result.aggregates.keys()
    assert all(same(again[k], result.aggregates[k]) for k in again), name
    assert set(BENCHMARKS[name].headline) <= set(result.aggregates), name
    assert set(BENCHMARKS[name].published) <= set(result.aggregates), name  # a published number has its key
    assert isinstance(benchmark.coco_image_ids(), set)


def test_all_over_every_stand_in(tmp_path):
    """`--all` finds every benchmark under one data root and writes one results folder."""
    options = []
    for name, write in STANDINS.items():
        for key, value in write(tmp_path / "bench" / name, n_items=12, seed=2).items():
            options += [f"options.{name}.{key}={value}"]
    out = tmp_path / "eval"
    results = evaluate.main(["--model", "ViT-Tiny-16-64", "--all", "--data-root", str(tmp_path / "bench"),
                             "--out", str(out), "--num-workers", "0", "--no-progress", *options])
    assert [r.name for r in results] == list(BENCHMARKS)
    document = json.loads((out / "aggregates.json").read_text())
    recomputed = reaggregate(out)
    for name in BENCHMARKS:
        stored = document["benchmarks"][name]["aggregates"]
        assert all(same(float("nan") if stored[k] is None else stored[k], v) for k, v in recomputed[name].items())
    assert sorted(document["combined"]) == sorted(COMBINED)  # every part of each was run
    assert not any(entry["missing"] for entry in document["combined"].values())

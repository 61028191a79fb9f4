"""`perf.evaluate --clip-benchmark`: the SugarCrepe sample it runs on, its refusal without clip_benchmark, and
(where clip_benchmark is installed) that both harnesses compute the same cosines on the same items."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from PIL import Image

from evaluation.benchmarks import build_benchmark
from testkit.standin.sugarcrepe import write_sugarcrepe, write_sugarcrepe_sample
from evaluation.benchmarks.sugarcrepe import SUBSETS
from perf import evaluate

HAS_CLIP_BENCHMARK = importlib.util.find_spec("clip_benchmark") is not None


@pytest.fixture
def annotations(tmp_path):
    """Official-format files with 84 generated items over 28 images (stand-ins for the real annotations)."""
    write_sugarcrepe(tmp_path / "official", n_items=84, seed=3)
    return tmp_path / "official"


def test_sample_keeps_every_item_of_the_sampled_images_under_its_key(annotations, tmp_path):
    write_sugarcrepe_sample(tmp_path / "sample", annotations, n_images=5, seed=1)
    chosen = {path.name for path in (tmp_path / "sample" / "val2017").iterdir()}
    kept_names = set()
    for subset in SUBSETS:
        official = json.loads((annotations / f"{subset}.json").read_text())
        sample = json.loads((tmp_path / "sample" / f"{subset}.json").read_text())
        kept_names |= {entry["filename"] for entry in sample.values()}
        assert sample == {key: entry for key, entry in official.items() if entry["filename"] in chosen}
    assert kept_names == chosen and len(chosen) == 5
    with Image.open(next((tmp_path / "sample" / "val2017").iterdir())) as image:
        assert image.format == "JPEG" and image.size == (640, 480)
    items = build_benchmark("sugarcrepe", tmp_path / "sample").items()
    assert {item.images[0].file.name for item in items} == chosen
    with pytest.raises(ValueError, match="n_images"):
        write_sugarcrepe_sample(tmp_path / "too_many", annotations, n_images=29)


def test_without_clip_benchmark_it_refuses_before_any_work_and_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "clip_benchmark", None)  # `import clip_benchmark...` now raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["--clip-benchmark", "--data-root", str(tmp_path / "root"), "--out", str(tmp_path / "out.json")])
    assert "pip install --no-deps --target runs/clip_benchmark_site clip_benchmark==1.6.2" in str(exit_info.value)
    assert not (tmp_path / "root").exists() and not (tmp_path / "out.json").exists()


@pytest.mark.skipif(not HAS_CLIP_BENCHMARK, reason="clip_benchmark is not installed (optional: see "
                                                   "perf/versus_clip_benchmark.py)")
def test_both_harnesses_score_the_same_items_alike(annotations, tmp_path):
    report = evaluate.main(["--clip-benchmark", "--model", "ViT-Tiny-16-64", "--cb-images", "6", "--rounds", "1",
                            "--num-workers", "0", "--batch-size", "8", "--annotations", str(annotations),
                            "--data-root", str(tmp_path / "root"), "--out", str(tmp_path / "out.json")])
    agreement = report["agreement"]
    assert agreement["max_abs_cosine_difference"] < 1e-5
    assert agreement["outcome_mismatches"] == 0
    assert agreement["accuracy_ours"] == pytest.approx(agreement["accuracy_clip_benchmark"], rel=1e-6)
    assert report["items"] == report["standin"]["items"] > 6 and report["standin"]["distinct_images"] == 6
    assert json.loads((tmp_path / "out.json").read_text())["speedup"] == pytest.approx(report["speedup"])

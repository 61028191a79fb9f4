"""Long jobs are not silent: per-image / per-caption progress in caching, preprocessing, scoring and the demo."""
from __future__ import annotations

from pathlib import Path
from typing import List

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.callbacks import RichProgressBar
from PIL import Image

import datamodules.preprocess as preprocess
import evaluation.aligner as aligner
from core.config import REPO_ROOT
from modeling.encoders import build_model
from datamodules import features
from evaluation.aligner import AlignerScorer, TokenAligner
from evaluation.benchmarks.base import ImageRef
from study import demo
from lightning_modules.fit import run
from fitting import TINY, tiny_config

# The tiny shapes world: 16 train images with 2 captions each, sorted by image. Shards of 5 captions hold
# images {0,1,2}, {2,3,4}, {5,6,7}, {7,8,9}, {10,11,12}, {12,13,14}, {15}: 19 image encodings in all (an
# image whose captions straddle two shards is encoded in both).
SHARD_SIZE = 5
IMAGES_OVER_SHARDS = 19


class Bars:
    """Stands in for tqdm and keeps every bar made (iterable or manual), with how far it got."""

    def __init__(self):
        self.made: List["Bars.Bar"] = []

    def __call__(self, iterable=None, total=None, desc=None, disable=False, **options):
        bar = Bars.Bar(iterable, total, desc, disable)
        self.made.append(bar)
        return bar

    def named(self, desc: str) -> "Bars.Bar":
        (bar,) = [bar for bar in self.made if bar.desc == desc]
        return bar

    class Bar:
        def __init__(self, iterable, total, desc, disable):
            self.iterable, self.total, self.desc, self.disable, self.n = iterable, total, desc, disable, 0

        def __iter__(self):
            for item in self.iterable:
                self.n += 1
                yield item

        def update(self, count: int) -> None:
            self.n += count

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None


def test_feature_caching_reports_every_image(shapes_root, tmp_path, monkeypatch):
    bars = Bars()
    monkeypatch.setattr(features, "tqdm", bars)
    cfg = tiny_config(shapes_root, tmp_path, "method.name=tflocal", f"data.features_cache={tmp_path / 'f'}",
                      f"preprocess.shard_size={SHARD_SIZE}", "data.val_annotations=null", "data.val_batch_size=2")
    features.run(cfg)
    bar = bars.named("features train")
    assert bar.total == IMAGES_OVER_SHARDS and bar.n == IMAGES_OVER_SHARDS


def test_preprocessing_reports_every_caption_and_image(shapes_root, tmp_path, monkeypatch):
    bars = Bars()
    monkeypatch.setattr(preprocess, "tqdm", bars)
    cfg = tiny_config(shapes_root, tmp_path, f"preprocess.cache_root={tmp_path / 'c'}", "data.val_annotations=null",
                      f"preprocess.shard_size={SHARD_SIZE}", "preprocess.parser_batch_size=2")
    preprocess.run(cfg)
    parsed, grounded = bars.named("parse train"), bars.named("ground train")
    assert parsed.total == parsed.n == 32
    assert grounded.total == grounded.n == IMAGES_OVER_SHARDS


def test_chunked_parsing_and_grounding_give_the_same_cache(shapes_root, tmp_path):
    """The progress bars cut the work into the parser's and grounder's own batches: the records are unchanged."""
    def records(batch_size: int) -> list:
        cfg = tiny_config(shapes_root, tmp_path, f"preprocess.cache_root={tmp_path / str(batch_size)}",
                          "data.val_annotations=null", f"preprocess.parser_batch_size={batch_size}")
        preprocess.run(cfg)
        return preprocess.mask_records(cfg.data, cfg.preprocess, "train")

    assert records(3) == records(256)


@pytest.fixture(scope="module")
def aligner_scorer() -> AlignerScorer:
    built = build_model(TINY, None, str(REPO_ROOT / "configs" / "models"))
    return AlignerScorer(built.model, TokenAligner(64, 32, 1, 2), "local", built.tokenizer, built.preprocess_val,
                         batch_size=2, pair_batch=2)


def image_refs(folder: Path, count: int) -> List[ImageRef]:
    rng = np.random.default_rng(0)
    refs = []
    for index in range(count):
        path = folder / f"{index}.png"
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
        refs.append(ImageRef(str(path)))
    return refs


@pytest.mark.parametrize("progress", [True, False])
def test_aligner_scoring_honours_the_progress_flag(aligner_scorer, tmp_path, monkeypatch, progress):
    bars = Bars()
    monkeypatch.setattr(aligner, "tqdm", bars)
    aligner_scorer.pair_scores.clear()
    images, texts = image_refs(tmp_path, 3), [f"a {colour} square {progress}" for colour in ("red", "blue")]
    aligner_scorer.prepare(images, texts, progress=progress)
    aligner_scorer.score(images, texts)  # 6 pairs: 3 aligner batches of 2
    assert {bar.desc: bar.disable for bar in bars.made} == {
        "images": not progress, "texts": not progress, "aligner pairs": not progress}
    assert bars.named("images").n == 2 and bars.named("aligner pairs").n == 3  # batches of 2 images, pairs


def test_the_demo_table_reports_each_row_and_checks_every_export_first(tmp_path, monkeypatch, capsys):
    runs = [("a", tmp_path / "run_a", "clip"), ("b", tmp_path / "run_b", "sgi")]
    with pytest.raises(SystemExit, match=r"runs.a=.*run_a: no export(.|\n)*runs.b="):
        demo.check_inputs(tmp_path, runs)
    monkeypatch.setattr(demo, "evaluate_export", lambda export, data, split, scorer: {"text": 50.0})
    assert demo.score_rows(runs, tmp_path, "val") == {"a": {"text": 50.0}, "b": {"text": 50.0}}
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["[1/2] a", "[1/2] a", "[2/2] b", "[2/2] b"]
    assert "scoring" in lines[0] and "(clip)" in lines[0] and "done in" in lines[1]


class ProgressShown(L.Callback):
    """Records, after each training batch, the items and the description the run's progress bar shows."""

    def __init__(self):
        self.metrics: List[dict] = []
        self.descriptions: List[str] = []

    def on_train_batch_end(self, trainer, module, *args) -> None:
        bar = trainer.progress_bar_callback
        self.metrics.append(bar.get_metrics(trainer, module))
        if isinstance(bar, RichProgressBar):
            self.descriptions.append(bar.progress.tasks[bar.train_progress_bar_id].description)
        else:
            self.descriptions.append(bar.train_progress_bar.desc)


def test_fit_progress_bar_shows_the_epoch_and_the_losses_without_the_logger_version(shapes_root, tmp_path):
    shown = ProgressShown()
    cfg = tiny_config(shapes_root, tmp_path, "trainer.enable_progress_bar=true", "trainer.max_steps=2",
                      "trainer.max_epochs=-1", "trainer.limit_val_batches=0")
    run(cfg, extra_callbacks=[shown])
    assert len(shown.metrics) == 2
    for metrics, description in zip(shown.metrics, shown.descriptions):
        assert "v_num" not in metrics  # the logger's version is always 0: a resumed run continues its curves
        assert "train/loss" in metrics
        # a run bounded by steps (max_epochs=-1) has no epoch total: Lightning's Rich bar showed "Epoch 0/-2"
        assert description.strip() == "Epoch 0"

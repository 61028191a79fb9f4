"""Structure-guided inference: crop boxes, scene-graph segments, the score against a slow per-crop/per-segment
reference, the global mix, the fallback, encode-once caching and the evaluate CLI with `--scorer sgi`."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from datamodules.benchmarks import build_benchmark
from datamodules.benchmarks.base import ImageRef, unique
from datamodules.benchmarks.images import load_image
from datamodules.benchmarks.standin.images import write_image
from datamodules.benchmarks.standin.sugarcrepe import write_sugarcrepe
from lightning_modules import evaluate, sgi
from lightning_modules.encoders import BuiltModel, build_model
from lightning_modules.evaluation import read_outcomes, run_benchmark
from lightning_modules.export import export_model
from lightning_modules.scorers import ClipScorer
from lightning_modules.sgi import SGIScorer, caption_segments, crop_boxes, crops_per_image, parse_grids
from parsers.scene_graph import SceneGraphParser

TINY = "ViT-Tiny-16-64"
NO_SEGMENT = "very quickly"  # no noun: the parser finds no entity
CAPTIONS = ["a red cube to the left of a blue ball", "The car is red.", NO_SEGMENT, "a dog on a couch"]


@pytest.fixture(scope="module")
def parser() -> SceneGraphParser:
    return SceneGraphParser()


@pytest.fixture(scope="module")
def tiny() -> BuiltModel:
    torch.manual_seed(0)
    return build_model(TINY, None, "configs/models")


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> List[ImageRef]:
    """Images of different sizes (odd sides included) and a boxed ref into one of them."""
    folder = tmp_path_factory.mktemp("images")
    sizes = [(48, 40), (31, 57), (64, 64)]
    files = [str(write_image(folder / f"{i}.png", seed=i, size=size)) for i, size in enumerate(sizes)]
    return [ImageRef(path) for path in files] + [ImageRef(files[0], box=(5, 3, 30, 21))]


def sgi_scorer(tiny: BuiltModel, parser: SceneGraphParser, batch_size: int = 256, **options) -> SGIScorer:
    """A fresh scorer (empty caches) on the shared tiny model."""
    return SGIScorer(ClipScorer(tiny.model, tiny.tokenizer, tiny.preprocess_val, batch_size=batch_size),
                     parser=parser, **options)


# ----- crops --------------------------------------------------------------------------------------------
def test_crop_boxes_by_hand():
    grids = parse_grids("1, 3,halves")
    assert grids == (1, 3, "halves") and crops_per_image(grids) == 1 + 9 + 4
    x, y = [0, 33, 66, 100], [0, 20, 40, 60]  # 100 x 60 in thirds, integer edges k * size // 3
    thirds = [(x[c], y[r], x[c + 1], y[r + 1]) for r in range(3) for c in range(3)]
    halves = [(0, 0, 50, 60), (50, 0, 100, 60), (0, 0, 100, 30), (0, 30, 100, 60)]
    assert crop_boxes(100, 60, grids) == [(0, 0, 100, 60)] + thirds + halves
    assert crop_boxes(5, 3, (2,)) == [(0, 0, 2, 1), (2, 0, 5, 1), (0, 1, 2, 3), (2, 1, 5, 3)]


def test_crop_boxes_of_an_image_smaller_than_the_grid_are_valid_and_counted():
    boxes = crop_boxes(2, 1, parse_grids([3, "halves"]))
    assert len(boxes) == crops_per_image((3, "halves")) == 13
    assert all(0 <= left < right <= 2 and 0 <= top < bottom <= 1 for left, top, right, bottom in boxes)


@pytest.mark.parametrize("spec, expected", [("2", (2,)), (3, (3,)), ([1, "Halves", 1], (1, "halves")),
                                            ("1,2,3,halves", (1, 2, 3, "halves"))])
def test_grid_specs(spec, expected):
    assert parse_grids(spec) == expected


@pytest.mark.parametrize("spec", ["0", "quarters", "", "2,-1"])
def test_bad_grid_specs_are_rejected(spec):
    with pytest.raises(ValueError, match="grid spec"):
        parse_grids(spec)


# ----- segments -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("caption, segments", [
    ("a red cube to the left of a blue ball", ["red cube", "blue ball", "red cube to the left of blue ball"]),
    ("The car is red.", ["red car"]),  # a predicate adjective goes before its noun
    ("a man picking the ball up", ["man", "ball", "man picking up ball"]),  # the object is not repeated
    ("A man riding a brown horse next to two dogs",
     ["man", "brown horse", "two dogs", "man riding brown horse", "man next to two dogs"]),
    ("a dog and a dog", ["dog"]),  # distinct segments
    ("a dog biting itself", ["dog"]),  # no relation of an entity to itself
    (NO_SEGMENT, []),
])
def test_segments_of_hand_written_captions(parser, caption, segments):
    assert caption_segments(parser.parse([caption])[0]) == segments


# ----- scores -------------------------------------------------------------------------------------------
@torch.no_grad()
def slow_reference(tiny: BuiltModel, parser: SceneGraphParser, refs, texts, grids, global_weight) -> np.ndarray:
    """One crop and one segment at a time, straight from the definition."""
    def image_embedding(image):
        return F.normalize(tiny.model.encode_image(tiny.preprocess_val(image)[None]), dim=-1)[0]

    def text_embedding(text):
        return F.normalize(tiny.model.encode_text(tiny.tokenizer([text])), dim=-1)[0]

    images = [load_image(ref) for ref in refs]
    crops = [[image_embedding(image.crop(box)) for box in crop_boxes(*image.size, parse_grids(grids))]
             for image in images]
    wholes = [image_embedding(image) for image in images]
    result = np.zeros((len(refs), len(texts)))
    for t, text in enumerate(texts):
        caption = text_embedding(text)
        segments = [text_embedding(segment) for segment in caption_segments(parser.parse([text])[0])]
        for i in range(len(refs)):
            global_cosine = float(wholes[i] @ caption)
            if not segments:
                result[i, t] = global_cosine
                continue
            best = [max(float(crop @ segment) for crop in crops[i]) for segment in segments]
            result[i, t] = global_weight * global_cosine + (1 - global_weight) * float(np.mean(best))
    return result


@pytest.mark.parametrize("grids, global_weight", [("1,2,3,halves", 0.0), ("2,halves", 0.25)])
def test_score_equals_the_slow_reference(tiny, parser, refs, grids, global_weight):
    scorer = sgi_scorer(tiny, parser, batch_size=16, grids=grids, global_weight=global_weight)
    texts = CAPTIONS + [CAPTIONS[0]]  # a repeated column
    result = scorer.score(refs, texts)
    expected = slow_reference(tiny, parser, refs, texts, grids, global_weight)
    # mixtures of cosines: float32 rounding ~1e-7 of |a| |b| = 1, not of the score's size, hence atol = rtol
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)
    assert result.shape == (4, 5) and not np.allclose(result[0], result[3])  # a boxed ref is its own image


def test_global_weight_mixes_sgi_with_the_global_cosine(tiny, parser, refs):
    scores = {w: sgi_scorer(tiny, parser, global_weight=w).score(refs, CAPTIONS) for w in (0.0, 0.3, 1.0)}
    # the same cosines mixed in float32 or float64: ~1e-7 of the unit scale of cosines
    np.testing.assert_allclose(scores[0.3], 0.3 * scores[1.0] + 0.7 * scores[0.0], rtol=1e-6, atol=1e-6)
    global_cosine = ClipScorer(tiny.model, tiny.tokenizer, tiny.preprocess_val).score(refs, CAPTIONS)
    np.testing.assert_allclose(scores[1.0], global_cosine, rtol=1e-5, atol=1e-5)  # cosines, see above
    assert not np.allclose(scores[0.0][:, :2], global_cosine[:, :2], atol=1e-3)
    with pytest.raises(ValueError, match="global_weight"):
        sgi_scorer(tiny, parser, global_weight=1.5)


def test_a_caption_without_segments_falls_back_to_the_global_cosine_and_is_counted(tiny, parser, refs):
    scorer = sgi_scorer(tiny, parser)
    result = scorer.score(refs, CAPTIONS)
    global_cosine = ClipScorer(tiny.model, tiny.tokenizer, tiny.preprocess_val).score(refs, [NO_SEGMENT])
    # cosines: rounding ~1e-7 of |a| |b| = 1, not of the cosine's size, hence atol = rtol
    np.testing.assert_allclose(result[:, [CAPTIONS.index(NO_SEGMENT)]], global_cosine, rtol=1e-5, atol=1e-5)
    described = scorer.describe()
    assert described["sgi_fallback_captions"] == 1 and described["sgi_captions"] == len(CAPTIONS)
    assert scorer.score(refs[:1], [NO_SEGMENT, NO_SEGMENT]).shape == (1, 2)  # no segment in the whole call


def test_blocked_similarities_equal_the_one_block_result(tiny, parser, refs, monkeypatch):
    scorer = sgi_scorer(tiny, parser, grids="2")
    whole = scorer.score(refs, CAPTIONS)
    monkeypatch.setattr(sgi, "SIMILARITY_BLOCK", 1)  # one image per block
    # not bit-identical: a matmul of other row counts may accumulate in another order (BLAS kernels and thread
    # splits depend on the shape); the cosines of 64 float32 terms round by ~1e-7 of |a| |b| = 1
    np.testing.assert_allclose(scorer.score(refs, CAPTIONS), whole, rtol=1e-6, atol=1e-6)


def test_each_image_is_cropped_and_each_caption_parsed_and_embedded_once(tiny, parser, refs, monkeypatch):
    encoded_crops, encoded_texts, parsed = [], [], []
    encode_image, encode_text, parse = tiny.model.encode_image, tiny.model.encode_text, parser.parse
    monkeypatch.setattr(tiny.model, "encode_image", lambda x: encoded_crops.append(len(x)) or encode_image(x))
    monkeypatch.setattr(tiny.model, "encode_text", lambda x: encoded_texts.append(len(x)) or encode_text(x))
    monkeypatch.setattr(parser, "parse", lambda texts: parsed.extend(texts) or parse(texts))
    scorer = sgi_scorer(tiny, parser, batch_size=20, grids="1,2")  # 5 crops + the full image: 3 images a batch
    a, b = refs[0], refs[1]
    scorer.prepare([a, b, a], CAPTIONS[:2] + CAPTIONS[:1])
    scorer.score([b, a, a], CAPTIONS[:2])
    scorer.score([a], [CAPTIONS[3]])  # a new caption: parsed and embedded on demand, the image is not re-encoded
    assert encoded_crops == [2 * 5]  # one batch; the full image is the 1x1 crop, so 5 distinct crops each
    assert parsed == CAPTIONS[:2] + [CAPTIONS[3]]
    segments = [s for text in CAPTIONS[:2] + [CAPTIONS[3]] for s in scorer.segments[text]]
    assert sum(encoded_texts) == len(unique(CAPTIONS[:2] + [CAPTIONS[3]] + segments))


def test_groups_average_scores_and_sts_is_not_supported(tiny, parser, refs):
    scorer = sgi_scorer(tiny, parser, grids="2")
    groups = [CAPTIONS[:2], CAPTIONS[3:]]
    expected = np.stack([scorer.score(refs, group).mean(axis=1) for group in groups], axis=1)
    np.testing.assert_allclose(scorer.score_groups(refs, groups), expected, rtol=1e-6, atol=1e-6)  # float32 means
    with pytest.raises(NotImplementedError, match="STS"):
        scorer.text_similarity(["a dog"], ["a cat"])


# ----- the evaluate CLI ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny) -> Path:
    run = tmp_path_factory.mktemp("run")
    export_model(tiny.model, tiny.name, run / "export")
    return run


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("benchmarks")
    write_sugarcrepe(root / "sugarcrepe", n_items=14)
    return root


def test_cli_scores_sugarcrepe_with_sgi_from_a_run(tiny_run, data_root, parser):
    evaluate.main(["--run", str(tiny_run), "--scorer", "sgi", "--scorer-option", "grids=[1, 2]",
                   "--scorer-option", "global_weight=0.5", "--benchmarks", "sugarcrepe", "--data-root",
                   str(data_root), "--num-workers", "0", "--no-progress"])
    out = tiny_run / "eval-sgi"  # never the global-cosine folder
    metadata = json.loads((out / "aggregates.json").read_text())["metadata"]
    assert metadata["scorer"] == "SGIScorer" and metadata["sgi_grids"] == "1,2"
    assert metadata["sgi_global_weight"] == 0.5 and metadata["model"] == TINY
    direct = SGIScorer.from_export(tiny_run / "export", grids="1,2", global_weight=0.5)
    expected = run_benchmark(build_benchmark("sugarcrepe", data_root / "sugarcrepe"), direct).outcomes
    assert read_outcomes(out / "sugarcrepe" / "outcomes.jsonl") == expected and len(expected) == 14
    assert not (tiny_run / "eval").exists()


def test_cli_scores_with_sgi_from_a_model_name(data_root, tmp_path):
    results = evaluate.main(["--model", TINY, "--scorer", "sgi", "--scorer-option", "grids=2", "--benchmarks",
                             "sugarcrepe", "--data-root", str(data_root), "--out", str(tmp_path / "eval"),
                             "--num-workers", "0", "--no-progress"])
    assert len(results[0].outcomes) == 14
    assert json.loads((tmp_path / "eval" / "aggregates.json").read_text())["metadata"]["sgi_crops"] == 4


def test_cli_rejects_unknown_scorers_and_options_naming_the_valid_ones(tiny_run, data_root, capsys):
    argv = ["--run", str(tiny_run), "--benchmarks", "sugarcrepe", "--data-root", str(data_root)]
    with pytest.raises(SystemExit):
        evaluate.main(argv + ["--scorer", "sgx"])
    assert re.search(r"invalid choice: 'sgx' \(choose from '?clip'?, '?sgi'?\)", capsys.readouterr().err)
    assert list(evaluate.SCORERS) == ["clip", "sgi"]
    with pytest.raises(SystemExit, match="sgi has no option.*grid.*accepts: grids, global_weight"):
        evaluate.main(argv + ["--scorer", "sgi", "--scorer-option", "grid=2"])
    with pytest.raises(SystemExit, match="clip has no option.*accepts: none"):
        evaluate.main(argv + ["--scorer-option", "grids=2"])


def test_identical_candidates_get_bit_identical_sgi_scores(tiny, parser, refs):
    scorer = sgi_scorer(tiny, parser, batch_size=8, global_weight=0.25)
    texts = [CAPTIONS[0], CAPTIONS[3], CAPTIONS[0], NO_SEGMENT, CAPTIONS[3]]
    images = [refs[1], refs[0], refs[1], refs[2]]
    result = scorer.score(images, texts)
    assert (result[:, 0] == result[:, 2]).all() and (result[:, 1] == result[:, 4]).all()
    assert (result[0] == result[2]).all()
    assert not (result[:, 0] == result[:, 1]).all()

"""Structure-guided inference: the paper's crop sets (exact boxes at 224 and 64 px, mapped to other image sizes),
crops reaching the encoder uncut, scene-graph segments, the score against a slow per-crop/per-segment reference,
the global mix, the fallback, encode-once caching and the evaluate CLI with `--scorer sgi` (cost beside the
global cosine)."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image, ImageDraw

from modeling.encoders import BuiltModel, build_model
from modeling.export import export_model
from evaluation import evaluate, sgi
from evaluation.benchmarks import build_benchmark
from evaluation.benchmarks.base import ImageRef, unique
from evaluation.benchmarks.images import load_image
from testkit.standin.images import write_image
from testkit.standin.sugarcrepe import write_sugarcrepe
from evaluation.harness import read_outcomes, run_benchmark
from evaluation.scorers import ClipScorer
from evaluation.sgi import SGIScorer, Tiling, caption_segments, crop_boxes, crops_per_image, parse_grids
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
# The paper's crops at a 224 px input, (width, height) in px; the overlapping variant moves each by half its
# width and half its height (arXiv 2506.09691). Written from the paper's description, not from `sgi`.
PAPER_SIZES = [(32, 32), (56, 56), (112, 112), (224, 224), (56, 112), (112, 56)]


def paper_boxes(width: int, height: int, overlap: bool) -> List[tuple]:
    """The paper's boxes in 224 px units, each edge mapped to the image as floor(edge * side / 224) (a crop
    at least 1 px wide and high), family by family, row-major."""
    boxes = []
    for w, h in PAPER_SIZES:
        step_x, step_y = (w // 2, h // 2) if overlap else (w, h)
        for y in range(0, 224 - h + 1, step_y):
            for x in range(0, 224 - w + 1, step_x):
                left, top = x * width // 224, y * height // 224
                right, bottom = (x + w) * width // 224, (y + h) * height // 224
                boxes.append((left, top, max(right, left + 1), max(bottom, top + 1)))
    return boxes


def test_the_paper_crop_sets_at_224_px():
    grid, overlap = crop_boxes(224, 224, parse_grids("paper")), crop_boxes(224, 224, parse_grids("paper_overlap"))
    assert len(grid) == crops_per_image(parse_grids("paper")) == 49 + 16 + 4 + 1 + 8 + 8 == 86
    assert len(overlap) == crops_per_image(parse_grids("paper_overlap")) == 169 + 49 + 9 + 1 + 21 + 21 == 270
    assert len(set(grid)) == 86 and len(set(overlap)) == 270 and set(grid) < set(overlap)
    sizes = [(right - left, bottom - top) for left, top, right, bottom in grid]
    assert sizes == [(32, 32)] * 49 + [(56, 56)] * 16 + [(112, 112)] * 4 + [(224, 224)] + [(56, 112)] * 8 + [
        (112, 56)] * 8
    assert grid[:8] == [(32 * c, 0, 32 * c + 32, 32) for c in range(7)] + [(0, 32, 32, 64)]
    assert grid[-16:] == ([(56 * c, 112 * r, 56 * c + 56, 112 * r + 112) for r in range(2) for c in range(4)]
                          + [(112 * c, 56 * r, 112 * c + 112, 56 * r + 56) for r in range(4) for c in range(2)])
    # overlapping: stride half the side along each axis
    assert overlap[:14] == [(16 * c, 0, 16 * c + 32, 32) for c in range(13)] + [(0, 16, 32, 48)]
    assert overlap[-42:-21] == [(28 * c, 56 * r, 28 * c + 56, 56 * r + 112) for r in range(3) for c in range(7)]
    assert overlap[-21:] == [(56 * c, 28 * r, 56 * c + 112, 28 * r + 56) for r in range(7) for c in range(3)]
    assert grid == paper_boxes(224, 224, False) and overlap == paper_boxes(224, 224, True)


def test_the_paper_crop_sets_scaled_to_a_64_px_input():
    """The tiny test model's input: every 224 px length times 64/224, edges floored."""
    sevenths = [0, 9, 18, 27, 36, 45, 54, 64]  # k * 64 // 7
    fourteenths = [0, 4, 9, 13, 18, 22, 27, 32, 36, 41, 45, 50, 54, 59, 64]  # k * 64 // 14
    grid, overlap = crop_boxes(64, 64, parse_grids("paper")), crop_boxes(64, 64, parse_grids("paper_overlap"))
    assert len(grid) == 86 and len(overlap) == 270
    assert grid[:49] == [(sevenths[c], sevenths[r], sevenths[c + 1], sevenths[r + 1])
                         for r in range(7) for c in range(7)]
    assert grid[49:70] == ([(16 * c, 16 * r, 16 * c + 16, 16 * r + 16) for r in range(4) for c in range(4)]
                           + [(32 * c, 32 * r, 32 * c + 32, 32 * r + 32) for r in range(2) for c in range(2)]
                           + [(0, 0, 64, 64)])
    assert grid[70:] == ([(16 * c, 32 * r, 16 * c + 16, 32 * r + 32) for r in range(2) for c in range(4)]
                         + [(32 * c, 16 * r, 32 * c + 32, 16 * r + 16) for r in range(4) for c in range(2)])
    assert overlap[:169] == [(fourteenths[c], fourteenths[r], fourteenths[c + 2], fourteenths[r + 2])
                             for r in range(13) for c in range(13)]
    assert overlap[169:218] == [(8 * c, 8 * r, 8 * c + 16, 8 * r + 16) for r in range(7) for c in range(7)]
    assert overlap[-21:] == [(16 * c, 8 * r, 16 * c + 32, 8 * r + 16) for r in range(7) for c in range(3)]
    assert grid == paper_boxes(64, 64, False) and overlap == paper_boxes(64, 64, True)


@pytest.mark.parametrize("size", [(640, 480), (31, 57), (100, 7), (5, 3), (1, 1)])
def test_paper_crops_are_the_224_px_boxes_mapped_to_the_image(size):
    assert crop_boxes(*size, parse_grids("paper")) == paper_boxes(*size, overlap=False)
    assert crop_boxes(*size, parse_grids("paper_overlap")) == paper_boxes(*size, overlap=True)


def test_a_crop_is_the_same_fraction_of_a_non_square_image():
    boxes = crop_boxes(640, 480, parse_grids("4x2"))  # the 56 x 112 rectangles: a quarter wide, half high
    assert boxes[1] == (160, 0, 320, 240) and boxes[-1] == (480, 240, 640, 480)
    assert crop_boxes(640, 480, parse_grids("1")) == [(0, 0, 640, 480)]  # the whole image, not its centre


@pytest.mark.parametrize("spec", list(sgi.CROP_SETS) + ["2,halves", "3x5:overlap,5x3"])
@pytest.mark.parametrize("size", [(224, 224), (64, 64), (640, 480), (48, 40), (31, 57), (5, 3), (2, 1), (1, 1)])
def test_every_crop_lies_inside_the_image_and_is_counted(spec, size):
    width, height = size
    boxes = crop_boxes(width, height, parse_grids(spec))
    assert len(boxes) == crops_per_image(parse_grids(spec))
    assert all(0 <= left < right <= width and 0 <= top < bottom <= height for left, top, right, bottom in boxes)


def test_crop_boxes_by_hand():
    grids = parse_grids("1, 3,halves")
    assert grids == (Tiling(1, 1), Tiling(3, 3), "halves") and crops_per_image(grids) == 1 + 9 + 4
    x, y = [0, 33, 66, 100], [0, 20, 40, 60]  # 100 x 60 in thirds, integer edges k * size // 3
    thirds = [(x[c], y[r], x[c + 1], y[r + 1]) for r in range(3) for c in range(3)]
    halves = [(0, 0, 50, 60), (50, 0, 100, 60), (0, 0, 100, 30), (0, 30, 100, 60)]
    assert crop_boxes(100, 60, grids) == [(0, 0, 100, 60)] + thirds + halves
    assert crop_boxes(5, 3, (Tiling(2, 2),)) == [(0, 0, 2, 1), (2, 0, 5, 1), (0, 1, 2, 3), (2, 1, 5, 3)]
    # 3 columns x 1 row, overlapping: half-cell edges k * 60 // 6 = 0, 10, ..., 60, windows of two half-cells
    assert crop_boxes(60, 8, parse_grids("3x1:overlap")) == [(0, 0, 20, 8), (10, 0, 30, 8), (20, 0, 40, 8),
                                                               (30, 0, 50, 8), (40, 0, 60, 8)]


def test_crop_boxes_of_an_image_smaller_than_the_grid_are_valid_and_counted():
    boxes = crop_boxes(2, 1, parse_grids([3, "halves"]))
    assert len(boxes) == crops_per_image((Tiling(3, 3), "halves")) == 13
    assert all(0 <= left < right <= 2 and 0 <= top < bottom <= 1 for left, top, right, bottom in boxes)


@pytest.mark.parametrize("spec, expected", [
    ("2", (Tiling(2, 2),)), (3, (Tiling(3, 3),)), ([1, "Halves", 1], (Tiling(1, 1), "halves")),
    ("1,2,3,halves", (Tiling(1, 1), Tiling(2, 2), Tiling(3, 3), "halves")),
    ("ours18", (Tiling(1, 1), Tiling(2, 2), Tiling(3, 3), "halves")),
    ("4x2, 2x4:overlap", (Tiling(4, 2), Tiling(2, 4, overlap=True))),
    ("Paper", (Tiling(7, 7), Tiling(4, 4), Tiling(2, 2), Tiling(1, 1), Tiling(4, 2), Tiling(2, 4))),
    ("paper_overlap", tuple(Tiling(c, r, True) for c, r in [(7, 7), (4, 4), (2, 2), (1, 1), (4, 2), (2, 4)])),
])
def test_grid_specs(spec, expected):
    assert parse_grids(spec) == expected
    assert parse_grids(sgi.grids_spec(expected)) == expected  # the spec written in the metadata parses back


def test_named_crop_sets():
    assert sgi.DEFAULT_GRIDS == "paper"
    assert [sgi.crop_set_name(parse_grids(name)) for name in sgi.CROP_SETS] == list(sgi.CROP_SETS)
    assert sgi.crop_set_name(parse_grids("7,4,2,1,4x2,2x4")) == "paper"
    assert sgi.crop_set_name(parse_grids("2,halves")) == "custom"


@pytest.mark.parametrize("spec", ["0", "quarters", "", "2,-1", "0x2", "4x", "3:overlapping", "paper,1"])
def test_bad_grid_specs_are_rejected(spec):
    with pytest.raises(ValueError, match="grid spec"):
        parse_grids(spec)


# ----- crops reach the encoder uncut --------------------------------------------------------------------
RED, BLUE, GREEN, YELLOW, GREY = (255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 255, 0), (128, 128, 128)


def edge_marked_image(size: int, box) -> Image.Image:
    """A grey image whose `box` carries a red left edge, a blue right edge, a green top and a yellow bottom
    (2 px bands, away from the corners)."""
    image = Image.new("RGB", (size, size), GREY)
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = box
    w, h = right - left, bottom - top
    draw.rectangle((left, top + h // 4, left + 1, bottom - 1 - h // 4), fill=RED)
    draw.rectangle((right - 2, top + h // 4, right - 1, bottom - 1 - h // 4), fill=BLUE)
    draw.rectangle((left + w // 4, top, right - 1 - w // 4, top + 1), fill=GREEN)
    draw.rectangle((left + w // 4, bottom - 2, right - 1 - w // 4, bottom - 1), fill=YELLOW)
    return image


def colour_at(pixels: torch.Tensor, row: int, column: int) -> np.ndarray:
    """The 0-255 RGB colour of an input pixel, normalisation undone (open_clip's OpenAI mean and std)."""
    mean, std = torch.tensor(OPENAI_DATASET_MEAN), torch.tensor(OPENAI_DATASET_STD)
    return ((pixels[:, row, column] * std + mean) * 255).numpy()


def encoder_inputs(scorer: SGIScorer, path: Path, monkeypatch) -> torch.Tensor:
    """Every input the image encoder receives while the scorer prepares `path`."""
    seen = []
    encode = scorer.clip.model.encode_image
    monkeypatch.setattr(scorer.clip.model, "encode_image", lambda x: seen.append(x.clone()) or encode(x))
    scorer.prepare([ImageRef(str(path))], [])
    return torch.cat(seen)


@pytest.mark.parametrize("family, index", [("4x2", 5), ("2x4", 6)])
def test_a_rectangular_crop_reaches_the_encoder_uncut(tiny, parser, tmp_path, monkeypatch, family, index):
    """Stretched to the 64 px input, a 16 x 32 (or 32 x 16) crop keeps all four marked edges; the model's own
    preprocess (shortest side to 64, centre crop) would cut two of them."""
    box = crop_boxes(64, 64, parse_grids(family))[index]
    path = tmp_path / "marked.png"
    edge_marked_image(64, box).save(path)
    scorer = sgi_scorer(tiny, parser, grids=family)
    pixels = encoder_inputs(scorer, path, monkeypatch)[index]  # crops in box order, then the global view
    mid, tol = 32, 40  # bicubic ringing at a colour edge stays well below 40 of 255
    assert np.abs(colour_at(pixels, mid, 0) - RED).max() < tol
    assert np.abs(colour_at(pixels, mid, 63) - BLUE).max() < tol
    assert np.abs(colour_at(pixels, 0, mid) - GREEN).max() < tol
    assert np.abs(colour_at(pixels, 63, mid) - YELLOW).max() < tol
    cut = tiny.preprocess_val(edge_marked_image(64, box).crop(box))  # what the model's own preprocess shows
    assert not all(np.abs(colour_at(cut, r, c) - colour).max() < tol for r, c, colour in
                   [(mid, 0, RED), (mid, 63, BLUE), (0, mid, GREEN), (63, mid, YELLOW)])


def test_pad_letterboxes_a_rectangular_crop_whole(tiny, parser, tmp_path, monkeypatch):
    box = crop_boxes(64, 64, parse_grids("4x2"))[5]  # 16 wide, 32 high: 32 x 64 at the input, bars 16 px
    path = tmp_path / "marked.png"
    edge_marked_image(64, box).save(path)
    pixels = encoder_inputs(sgi_scorer(tiny, parser, grids="4x2", resize="pad"), path, monkeypatch)[5]
    expected = [(32, 2, (0, 0, 0)), (32, 61, (0, 0, 0)),  # black bars left and right
                (32, 16, RED), (32, 47, BLUE), (0, 32, GREEN), (63, 32, YELLOW)]  # the crop's four edges
    for row, column, colour in expected:
        assert np.abs(colour_at(pixels, row, column) - colour).max() < 40, (row, column)


def test_stretch_is_the_model_preprocess_on_a_square_and_bad_inputs_are_rejected(tiny):
    square = Image.effect_noise((40, 40), 60).convert("RGB")
    assert torch.equal(sgi.uncut_transform(tiny.preprocess_val)(square), tiny.preprocess_val(square))
    with pytest.raises(ValueError, match="resize must be one of stretch, pad"):
        sgi.uncut_transform(tiny.preprocess_val, "crop")
    with pytest.raises(ValueError, match="Compose with a Resize and a Normalize"):
        sgi.uncut_transform(lambda image: image)


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
def reference_boxes(image: Image.Image, grids: str) -> List[tuple]:
    """The paper's sets from `paper_boxes` (independent of `sgi`), other specs from `crop_boxes`."""
    if grids in ("paper", "paper_overlap"):
        return paper_boxes(*image.size, overlap=grids == "paper_overlap")
    return crop_boxes(*image.size, parse_grids(grids))


@torch.no_grad()
def slow_reference(tiny: BuiltModel, parser: SceneGraphParser, refs, texts, grids, global_weight) -> np.ndarray:
    """One crop and one segment at a time, straight from the definition: each crop stretched to the 64 px input
    with PIL's bicubic resize and normalised by hand; the global view through the model's own preprocess."""
    mean, std = torch.tensor(OPENAI_DATASET_MEAN)[:, None, None], torch.tensor(OPENAI_DATASET_STD)[:, None, None]

    def embed(pixels):
        return F.normalize(tiny.model.encode_image(pixels[None]), dim=-1)[0]

    def crop_embedding(image, box):
        resized = image.crop(box).resize((64, 64), Image.BICUBIC)
        return embed((torch.from_numpy(np.array(resized)).permute(2, 0, 1) / 255.0 - mean) / std)

    def text_embedding(text):
        return F.normalize(tiny.model.encode_text(tiny.tokenizer([text])), dim=-1)[0]

    images = [load_image(ref) for ref in refs]
    crops = [[crop_embedding(image, box) for box in reference_boxes(image, grids)] for image in images]
    wholes = [embed(tiny.preprocess_val(image)) for image in images]
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


@pytest.mark.parametrize("grids, global_weight, images", [
    ("paper", 0.0, 4), ("paper_overlap", 0.5, 2), ("ours18", 0.0, 4), ("2,halves", 0.25, 4)])
def test_score_equals_the_slow_reference(tiny, parser, refs, grids, global_weight, images):
    scorer = sgi_scorer(tiny, parser, batch_size=16, grids=grids, global_weight=global_weight)
    texts = CAPTIONS + [CAPTIONS[0]]  # a repeated column
    result = scorer.score(refs[:images], texts)
    expected = slow_reference(tiny, parser, refs[:images], texts, grids, global_weight)
    # mixtures of cosines: float32 rounding ~1e-7 of |a| |b| = 1, not of the score's size, hence atol = rtol
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5)
    assert result.shape == (images, 5) and not np.allclose(result[0], result[-1])
    if images == 4:
        assert not np.allclose(result[0], result[3])  # a boxed ref is its own image


def test_the_default_is_the_paper_crop_set(tiny, parser, refs):
    scorer = sgi_scorer(tiny, parser)
    assert scorer.grids == parse_grids("paper") and scorer.resize == "stretch"
    scorer.prepare(refs[:2], CAPTIONS[:1])
    described = scorer.describe()
    assert described["sgi_crop_set"] == "paper" and described["sgi_crops"] == 86
    assert described["sgi_grids"] == "7,4,2,1,4x2,2x4" and described["sgi_resize"] == "stretch"
    # the 48 x 40 and 31 x 57 images: 86 distinct crops each, plus the global view
    assert described["sgi_images_encoded"] == 2 and described["sgi_crops_encoded"] == 2 * 86
    assert described["sgi_image_encodes_per_image"] == 87


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
    encode_image, parse = tiny.model.encode_image, parser.parse
    monkeypatch.setattr(tiny.model, "encode_image", lambda x: encoded_crops.append(len(x)) or encode_image(x))
    # Texts are counted where the text tower starts: the scorer runs it trimmed, not through encode_text.
    hook = tiny.model.token_embedding.register_forward_hook(lambda m, i, o: encoded_texts.append(len(i[0])))
    monkeypatch.setattr(parser, "parse", lambda texts: parsed.extend(texts) or parse(texts))
    scorer = sgi_scorer(tiny, parser, batch_size=20, grids="1,2")  # 5 crops + the global view: 3 images a batch
    a, b = refs[0], refs[1]
    scorer.prepare([a, b, a], CAPTIONS[:2] + CAPTIONS[:1])
    scorer.score([b, a, a], CAPTIONS[:2])
    scorer.score([a], [CAPTIONS[3]])  # a new caption: parsed and embedded on demand, the image is not re-encoded
    assert encoded_crops == [2 * 6]  # one batch: 5 distinct crops (the 1x1 stretched) and the global view each
    assert parsed == CAPTIONS[:2] + [CAPTIONS[3]]
    hook.remove()
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
    evaluate.main(["--run", str(tiny_run), "--scorer", "sgi", "scorer.grids=[1, 2]",
                   "scorer.global_weight=0.5", "--benchmarks", "sugarcrepe", "--data-root",
                   str(data_root), "--num-workers", "0", "--no-progress"])
    out = tiny_run / "eval-sgi"  # never the global-cosine folder
    metadata = json.loads((out / "aggregates.json").read_text())["metadata"]
    assert metadata["scorer"] == "SGIScorer" and metadata["sgi_grids"] == "1,2"
    assert metadata["sgi_global_weight"] == 0.5 and metadata["model"] == TINY
    # the global cosine of the same model timed beside it, per benchmark (no wall-clock thresholds here)
    cost = metadata["cost_vs_global_cosine"]["sugarcrepe"]
    assert cost["items"] == 14 and set(cost) == {"items", "seconds_per_item", "global_cosine_seconds_per_item",
                                                  "ratio"}
    assert cost["seconds_per_item"] > 0 and cost["global_cosine_seconds_per_item"] > 0
    assert cost["ratio"] == pytest.approx(cost["seconds_per_item"] / cost["global_cosine_seconds_per_item"],
                                          rel=0.05, abs=0.01)  # from the unrounded seconds, shown to 2 decimals
    assert metadata["sgi_crops"] == 5 and metadata["sgi_image_encodes_per_image"] > 1
    direct = SGIScorer.from_export(tiny_run / "export", grids="1,2", global_weight=0.5)
    expected = run_benchmark(build_benchmark("sugarcrepe", data_root / "sugarcrepe"), direct).outcomes
    assert read_outcomes(out / "sugarcrepe" / "outcomes.jsonl") == expected and len(expected) == 14
    assert not (tiny_run / "eval").exists()


def test_cli_scores_with_sgi_from_a_model_name(data_root, tmp_path):
    results = evaluate.main(["--model", TINY, "--scorer", "sgi", "scorer.grids=2", "--benchmarks",
                             "sugarcrepe", "--data-root", str(data_root), "--out", str(tmp_path / "eval"),
                             "--num-workers", "0", "--no-progress", "--no-cost-comparison"])
    assert len(results[0].outcomes) == 14
    metadata = json.loads((tmp_path / "eval" / "aggregates.json").read_text())["metadata"]
    assert metadata["sgi_crops"] == 4 and "cost_vs_global_cosine" not in metadata  # --no-cost-comparison


def test_the_global_cosine_twin_shares_the_model_with_empty_caches(tiny, parser, refs):
    scorer = sgi_scorer(tiny, parser, batch_size=8)
    scorer.score(refs[:1], CAPTIONS[:1])
    twin = scorer.global_cosine_twin()
    assert twin.model is tiny.model and twin.preprocess is tiny.preprocess_val and twin.batch_size == 8
    assert not twin.images.row and not twin.texts.row
    global_cosine = ClipScorer(tiny.model, tiny.tokenizer, tiny.preprocess_val).score(refs, CAPTIONS)
    np.testing.assert_allclose(twin.score(refs, CAPTIONS), global_cosine, rtol=1e-6, atol=1e-6)  # cosines


def test_cli_rejects_unknown_scorers_and_options_naming_the_valid_ones(tiny_run, data_root, capsys):
    argv = ["--run", str(tiny_run), "--benchmarks", "sugarcrepe", "--data-root", str(data_root)]
    with pytest.raises(SystemExit):
        evaluate.main(argv + ["--scorer", "sgx"])
    assert re.search(r"invalid choice: 'sgx' \(choose from '?clip'?, '?sgi'?\)", capsys.readouterr().err)
    assert list(evaluate.SCORERS) == ["clip", "sgi"]
    with pytest.raises(SystemExit, match="sgi has no option.*grid.*accepts: grids, global_weight, resize"):
        evaluate.main(argv + ["--scorer", "sgi", "scorer.grid=2"])
    with pytest.raises(SystemExit, match="clip has no option.*accepts: none"):
        evaluate.main(argv + ["scorer.grids=2"])


def test_identical_candidates_get_bit_identical_sgi_scores(tiny, parser, refs):
    scorer = sgi_scorer(tiny, parser, batch_size=8, global_weight=0.25)
    texts = [CAPTIONS[0], CAPTIONS[3], CAPTIONS[0], NO_SEGMENT, CAPTIONS[3]]
    images = [refs[1], refs[0], refs[1], refs[2]]
    result = scorer.score(images, texts)
    assert (result[:, 0] == result[:, 2]).all() and (result[:, 1] == result[:, 4]).all()
    assert (result[0] == result[2]).all()
    assert not (result[:, 0] == result[:, 1]).all()


def test_token_identical_captions_get_bit_identical_sgi_scores(tiny, parser, refs):
    """Captions differing only in spaces around punctuation have the same token ids; parsed into token-identical
    segments, they are one candidate: scored once and tied exactly."""
    scorer = sgi_scorer(tiny, parser, batch_size=8, global_weight=0.25)
    caption, respaced = "a red cube, a blue ball and a dog", "a red cube , a blue ball and a dog "
    assert scorer.text_keys([caption]) == scorer.text_keys([respaced])
    result = scorer.score(refs, [caption, CAPTIONS[3], respaced, CAPTIONS[0]])
    assert (result[:, 0] == result[:, 2]).all() and not (result[:, 0] == result[:, 1]).all()
    # The parser reads the string: a double space costs "ball" its attribute, so SGI sees other segments, and
    # the caption is another candidate although its own token ids are the same.
    parsed_apart = "a red cube, a blue  ball and a dog"
    assert scorer.text_keys([parsed_apart]) != scorer.text_keys([caption])
    assert scorer.text_keys([parsed_apart])[0][0] == scorer.text_keys([caption])[0][0]

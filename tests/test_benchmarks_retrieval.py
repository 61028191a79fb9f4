"""COCO / Flickr30k Karpathy-test retrieval: three annotation formats, strict chunked ranks, R@K aggregates."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evaluation.benchmarks.aro import pre_caption
from evaluation.benchmarks.base import MissingBenchmarkData
from evaluation.benchmarks.images import load_image
from evaluation.benchmarks.retrieval import CocoRetrieval, Flickr30kRetrieval, retrieval_ranks
from testkit.standin.retrieval import write_coco_retrieval, write_flickr30k_retrieval
from evaluation.scorers import ClipScorer, FunctionScorer

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"
WRITERS = {CocoRetrieval: write_coco_retrieval, Flickr30kRetrieval: write_flickr30k_retrieval}
FORMATS = ("karpathy", "blip", "coco")


def build(tmp_path, benchmark=CocoRetrieval, n_items=3, annotation_format="karpathy", **options):
    written = WRITERS[benchmark](tmp_path, n_items=n_items, annotation_format=annotation_format)
    return benchmark(tmp_path, **written, **options)


def naive_ranks(similarity: np.ndarray, caption_image: np.ndarray):
    """Sort every query's candidates by score, wrong before correct on a tie; rank = first correct position."""
    def first_correct(scores, correct):
        order = sorted(range(len(scores)), key=lambda c: (-scores[c], correct[c]))
        return next(position for position, c in enumerate(order) if correct[c])

    i2t = [first_correct(row, caption_image == i) for i, row in enumerate(similarity)]
    images = np.arange(similarity.shape[0])
    t2i = [first_correct(similarity[:, t], images == caption_image[t]) for t in range(similarity.shape[1])]
    return np.array(i2t), np.array(t2i)


def rows_of(matrix):
    return lambda start, stop: matrix[start:stop]


# --- files ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("annotation_format", FORMATS)
@pytest.mark.parametrize("benchmark", [CocoRetrieval, Flickr30kRetrieval])
def test_three_images_with_five_captions_load_in_every_format(tmp_path, benchmark, annotation_format):
    data = build(tmp_path, benchmark, n_items=3, annotation_format=annotation_format).data
    assert len(data.images) == 3 and len(data.captions) == 15  # the two train images are skipped
    assert data.caption_image.tolist() == [0] * 5 + [1] * 5 + [2] * 5
    assert re.fullmatch(r"[A-Z][a-z]+ scene 0 view 0\.", data.captions[0])  # surrounding whitespace stripped
    assert [re.search(r"scene (\d+) view (\d+)", c).groups() for c in data.captions[4:6]] == [("0", "4"), ("1", "0")]
    expected = (tmp_path / "val2014" / "COCO_val2014_000000391897.jpg" if benchmark is CocoRetrieval
                else tmp_path / "flickr30k-images" / "1000092797.jpg")
    assert data.images[2].path == str(expected)
    assert all(ref.file.is_file() for ref in data.images)


def test_karpathy_split_option_and_a_sixth_caption(tmp_path):
    benchmark = build(tmp_path, n_items=7)
    assert len(benchmark.data.images) == 7 and len(benchmark.data.captions) == 36
    assert benchmark.data.caption_image.tolist().count(5) == 6
    train = CocoRetrieval(tmp_path, images=tmp_path, split="train").data
    assert [Path(ref.path).parts[-2] for ref in train.images] == ["train2014", "train2014"]
    assert train.captions == ["a train split caption"] * 10


def test_pre_caption_is_blips_normalisation():
    assert pre_caption('  A "Man" (riding)   a horse!! #1: ~yes~.\n') == "a man riding a horse 1 yes"
    assert pre_caption(" ".join(f"w{i}" for i in range(40))) == " ".join(f"w{i}" for i in range(30))
    assert pre_caption("Don't stop, it's fine") == "don't stop, it's fine"  # only .!"()*#:;~ are removed


def test_pre_caption_option_changes_the_captions(tmp_path):
    raw = build(tmp_path, n_items=3)
    clean = CocoRetrieval(tmp_path, images=tmp_path, pre_caption=True)
    assert raw.data.captions[0].endswith(".") and raw.data.captions[0][0].isupper()
    assert clean.data.captions == [caption.lower().rstrip(".") for caption in raw.data.captions]
    assert clean.data.captions[1] == raw.data.captions[1]  # views 1-4 are already clean


# --- ranks ------------------------------------------------------------------------------------------------

def test_hand_made_matrix_ties_count_against():
    similarity = np.array([[0.5, 0.2, 0.5],
                           [0.1, 0.9, 0.3]])
    caption_image = np.array([0, 0, 1])
    i2t, t2i = retrieval_ranks(rows_of(similarity), caption_image, 2, chunk_size=1)
    assert i2t.rank.tolist() == [1, 1]  # image 0: caption 2 ties its best caption; image 1: caption 1 beats
    assert i2t.ties.tolist() == [1, 0]
    assert t2i.rank.tolist() == [0, 1, 1]
    assert t2i.ties.tolist() == [0, 0, 0]


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 100])
def test_chunked_ranks_equal_a_naive_sort_with_many_ties(chunk_size):
    rng = np.random.default_rng(chunk_size)
    captions_per_image = rng.integers(1, 6, size=9)
    caption_image = np.repeat(np.arange(9), captions_per_image)
    similarity = rng.integers(0, 4, size=(9, len(caption_image))).astype(float)  # ties everywhere
    i2t, t2i = retrieval_ranks(rows_of(similarity), caption_image, 9, chunk_size)
    naive_i2t, naive_t2i = naive_ranks(similarity, caption_image)
    assert i2t.rank.tolist() == naive_i2t.tolist() and t2i.rank.tolist() == naive_t2i.tolist()
    best = [similarity[i, caption_image == i].max() for i in range(9)]
    assert i2t.ties.tolist() == [int(((similarity[i] == best[i]) & (caption_image != i)).sum()) for i in range(9)]


def test_a_scorer_that_changes_its_answers_is_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(RuntimeError, match="deterministic"):
        retrieval_ranks(lambda start, stop: rng.random((stop - start, 6)), np.repeat(np.arange(3), 2), 3, 2)
    with pytest.raises(ValueError, match="non-finite"):
        retrieval_ranks(lambda start, stop: np.full((stop - start, 2), np.nan), np.array([0, 1]), 2, 2)


# --- aggregates -------------------------------------------------------------------------------------------

def test_aggregate_recalls_rsum_and_counts():
    outcomes = ([{"id": f"i2t/{n}", "direction": "i2t", "rank": r, "ties": int(n == 1)}
                 for n, r in enumerate([0, 3, 7, 12])]
                + [{"id": f"t2i/{n}", "direction": "t2i", "rank": r, "ties": 0}
                   for n, r in enumerate([0, 0, 1, 5, 9, 10])])
    result = CocoRetrieval.aggregate(outcomes)
    assert (result["i2t_r1"], result["i2t_r5"], result["i2t_r10"]) == (25.0, 50.0, 75.0)
    assert result["t2i_r1"] == pytest.approx(100 * 2 / 6) and result["t2i_r5"] == pytest.approx(50.0)
    assert result["t2i_r10"] == pytest.approx(100 * 5 / 6)
    assert result["rsum"] == pytest.approx(25 + 50 + 75 + 100 * (2 + 3 + 5) / 6)
    assert (result["images"], result["captions"], result["i2t_tied"], result["t2i_tied"]) == (4, 6, 1, 0)


@pytest.mark.parametrize("chunk_size", [3, 1024])
@pytest.mark.parametrize("annotation_format", FORMATS)
def test_end_to_end_function_scorer_gives_the_designed_recalls(tmp_path, annotation_format, chunk_size):
    """Matching pairs score 1; image 0 also scores 1 with image 1's five captions (tied), nothing else does.

    I2T: image 0 has 5 tied wrong captions (rank 5); T2I: image 1's captions tie with image 0 (rank 1).
    """
    benchmark = build(tmp_path, Flickr30kRetrieval, n_items=4, annotation_format=annotation_format,
                      chunk_size=chunk_size)
    index = {ref: i for i, ref in enumerate(benchmark.data.images)}

    def similarity(ref, text):
        image, caption_of = index[ref], int(re.search(r"scene (\d+) view", text).group(1))
        return float(image == caption_of or (image == 0 and caption_of == 1))

    outcomes = benchmark.outcomes(FunctionScorer(similarity))
    assert [o["id"] for o in outcomes[:5]] == ["i2t/0", "i2t/1", "i2t/2", "i2t/3", "t2i/0"] and len(outcomes) == 24
    result = benchmark.aggregate(outcomes)
    assert (result["i2t_r1"], result["i2t_r5"], result["i2t_r10"]) == (75.0, 75.0, 100.0)
    assert (result["t2i_r1"], result["t2i_r5"], result["t2i_r10"]) == (75.0, 100.0, 100.0)
    assert (result["i2t_tied"], result["t2i_tied"], result["images"], result["captions"]) == (1, 5, 4, 20)
    assert json.loads(json.dumps(outcomes)) == outcomes


# --- missing and malformed files --------------------------------------------------------------------------

def test_missing_files_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match=r"dataset_coco\.json.*coco_karpathy_test\.json"):
        CocoRetrieval(tmp_path)
    with pytest.raises(MissingBenchmarkData, match=r"flickr30k_val\.json"):
        Flickr30kRetrieval(tmp_path, split="val")
    with pytest.raises(MissingBenchmarkData, match=r"captions_karpathy\.json"):
        CocoRetrieval(tmp_path, annotation_file="captions_karpathy.json")


def test_malformed_files_name_file_and_record(tmp_path):
    (tmp_path / "coco_karpathy_test.json").write_text(json.dumps([{"image": "a.jpg", "caption": "one caption"}]))
    with pytest.raises(ValueError, match=r"coco_karpathy_test\.json: \[0\]\.caption is not a list"):
        _ = CocoRetrieval(tmp_path).data
    (tmp_path / "dataset_coco.json").write_text(json.dumps({"images": [{"filename": "a.jpg", "split": "test"}]}))
    with pytest.raises(ValueError, match=r"dataset_coco\.json: images\[0\] lacks"):
        _ = CocoRetrieval(tmp_path).data
    images = [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": "b.jpg"}]
    annotations = [{"image_id": 1, "caption": "x"}]
    (tmp_path / "caps.json").write_text(json.dumps({"images": images, "annotations": annotations}))
    with pytest.raises(ValueError, match="b.jpg has no captions"):
        _ = CocoRetrieval(tmp_path, annotation_file="caps.json").data


# --- a real (tiny, random) open_clip model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_scorer():
    from modeling.encoders import build_model

    torch.manual_seed(0)
    built = build_model("ViT-Tiny-16-64", None, str(CONFIGS))
    return built, ClipScorer(built.model, built.tokenizer, built.preprocess_val)


def test_tiny_clip_aggregates_equal_a_naive_computation(tmp_path, tiny_scorer):
    built, scorer = tiny_scorer
    benchmark = build(tmp_path, CocoRetrieval, n_items=7, chunk_size=3)
    data = benchmark.data
    result = benchmark.aggregate(benchmark.outcomes(scorer))
    with torch.no_grad():
        pixels = torch.stack([built.preprocess_val(load_image(ref)) for ref in data.images])
        images = F.normalize(built.model.encode_image(pixels), dim=-1)
        texts = F.normalize(built.model.encode_text(built.tokenizer(data.captions)), dim=-1)
    similarity = (images @ texts.T).double().numpy()
    # cosines: float32 rounding ~1e-7 of |a| |b| = 1, not of the cosine's size, hence atol = rtol
    assert np.allclose(scorer.score(data.images, data.captions), similarity, rtol=1e-5, atol=1e-5)
    # the ranks below compare scores of another batching: exact while no two candidates of a query lie within
    # rounding of each other (the closest pair of one row is 5e-6 apart, ~100 float32 ulps)
    i2t, t2i = naive_ranks(similarity, data.caption_image)
    for k in (1, 5, 10):
        assert result[f"i2t_r{k}"] == pytest.approx(100 * np.mean(i2t < k))
        assert result[f"t2i_r{k}"] == pytest.approx(100 * np.mean(t2i < k))
    assert (result["images"], result["captions"]) == (7, 36)

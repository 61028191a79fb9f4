"""Zero-shot classification: clip_benchmark's JSON files, class folders, strict ranks, top-k and per-class recall."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evaluation.benchmarks.base import MissingBenchmarkData
from evaluation.benchmarks.images import load_image
from testkit.standin.zeroshot import CLASS_NAMES, write_zeroshot
from evaluation.benchmarks.zeroshot import ZeroShotClassification, class_ranks
from evaluation.harness import run_benchmark
from evaluation.scorers import ClipScorer, FunctionScorer

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"


def build(tmp_path, n_items=14, **options):
    return ZeroShotClassification(tmp_path, **{**write_zeroshot(tmp_path, n_items=n_items), **options})


def rewrite(path: Path, update):
    data = json.loads(path.read_text())
    update(data)
    path.write_text(json.dumps(data))


# --- files ------------------------------------------------------------------------------------------------

def test_standin_tree_loads_with_sorted_folder_labels_and_filled_templates(tmp_path):
    benchmark = build(tmp_path, n_items=14)
    samples = benchmark.samples
    assert len(samples) == 14
    assert [label for _, label, _ in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert samples[1][2] == "n00000000/ILSVRC2012_val_00000007.JPEG"  # id: path relative to the images folder
    assert samples[1][0].path == str(tmp_path / "images" / "n00000000" / "ILSVRC2012_val_00000007.JPEG")
    assert benchmark.class_names == list(CLASS_NAMES)
    assert benchmark.prompts[1] == ["a photo of a green circle.", "a drawing of the green circle.",
                                    "itap of a green circle."]


def test_classes_option_sets_the_label_order(tmp_path):
    folders = [f"n{k:08d}" for k in (5, 4, 3, 2, 1, 0)]
    benchmark = build(tmp_path, classes=folders)
    assert [label for _, label, rel in benchmark.samples if rel.startswith("n00000005/")] == [0, 0]
    with pytest.raises(ValueError, match="does not list the class folders"):
        _ = build(tmp_path, classes=folders[:5] + ["n99999999"]).samples


def test_folder_and_class_name_counts_must_agree(tmp_path):
    write_zeroshot(tmp_path, n_items=14)
    extra = tmp_path / "images" / "n00000009"
    extra.mkdir()
    shutil.copy(next((tmp_path / "images" / "n00000000").iterdir()), extra)
    with pytest.raises(ValueError, match="7 class folders but .*en_classnames.json lists 6 class names"):
        _ = ZeroShotClassification(tmp_path, images=tmp_path / "images", dataset="standin").samples


def test_an_empty_class_folder_is_an_error(tmp_path):
    write_zeroshot(tmp_path, n_items=6)
    for image in (tmp_path / "images" / "n00000003").iterdir():
        image.unlink()
    with pytest.raises(ValueError, match="n00000003 holds no image"):
        _ = ZeroShotClassification(tmp_path, dataset="standin").samples


def test_templates_fall_back_to_imagenet1k_and_may_be_per_class(tmp_path):
    assert build(tmp_path, n_items=6).prompts[0][0] == "a photo of a red square."
    rewrite(tmp_path / "en_zeroshot_classification_templates.json", lambda data: data.pop("standin"))
    fallback = ZeroShotClassification(tmp_path, dataset="standin")
    assert fallback.prompts[0] == ["a bad photo of a red square.", "a photo of many red square."]
    per_class = {name: [f"{name}, drawn", f"{name}, painted"] for name in CLASS_NAMES}
    rewrite(tmp_path / "en_zeroshot_classification_templates.json", lambda data: data.update(standin=per_class))
    assert ZeroShotClassification(tmp_path, dataset="standin").prompts[2] == ["blue triangle, drawn",
                                                                             "blue triangle, painted"]


# --- ranks and aggregates ---------------------------------------------------------------------------------

def test_class_ranks_count_ties_against_the_gold_class():
    scores = np.array([[0.2, 0.5, 0.5],
                       [0.9, 0.1, 0.3],
                       [0.3, 0.3, 0.3]])
    ranks, ties = class_ranks(scores, np.array([1, 0, 2]))
    assert ranks.tolist() == [1, 0, 2] and ties.tolist() == [1, 0, 2]


def test_aggregate_top_k_and_mean_per_class_recall_by_hand():
    ranks = {0: [0, 0, 0, 3], 1: [1, 6], 2: [0, 0]}  # class -> ranks of its images
    outcomes = [{"id": f"{c}/{i}", "label": c, "rank": r, "ties": int(r == 6), "classes": 10}
                for c, rs in ranks.items() for i, r in enumerate(rs)]
    result = ZeroShotClassification.aggregate(outcomes)
    assert result["top1"] == pytest.approx(100 * 5 / 8)  # micro over images
    assert result["top5"] == pytest.approx(100 * 7 / 8)
    assert result["mean_per_class_recall"] == pytest.approx(100 * (3 / 4 + 0 + 1) / 3)  # macro over classes
    assert (result["images"], result["tied"]) == (8, 1)
    few = ZeroShotClassification.aggregate([{**o, "classes": 4} for o in outcomes])
    assert math.isnan(few["top5"]) and few["top1"] == result["top1"]  # clip_benchmark: no acc5 below 5 classes


def test_end_to_end_function_scorer_gives_the_designed_numbers(tmp_path):
    """A prompt scores 1 with images of its class; class 0 images also score 1 with class 1 (a tie) and class 2
    images score 2 with class 3, so classes 0 (3 images) and 2 (2 images) miss top-1 and nothing misses top-5."""
    benchmark = build(tmp_path, n_items=14, chunk_size=4)
    label_of = {ref: label for ref, label, _ in benchmark.samples}

    def similarity(ref, prompt):
        image, prompt_class = label_of[ref], next(k for k, name in enumerate(CLASS_NAMES) if name in prompt)
        if (image, prompt_class) == (2, 3):
            return 2.0
        return float(prompt_class == image or (image, prompt_class) == (0, 1))

    outcomes = benchmark.outcomes(FunctionScorer(similarity))
    assert [o["id"] for o in outcomes] == [rel for _, _, rel in benchmark.samples]
    result = benchmark.aggregate(outcomes)
    assert result["top1"] == pytest.approx(100 * 9 / 14)
    assert result["top5"] == 100.0
    assert result["mean_per_class_recall"] == pytest.approx(100 * 4 / 6)
    assert (result["images"], result["tied"]) == (14, 3)
    assert json.loads(json.dumps(outcomes)) == outcomes


def test_repeated_class_names_tie_and_are_never_top1(tmp_path, caplog):
    """As "missile" and "sunglasses" in clip_benchmark's ImageNet names: identical prompts, identical scores."""
    write_zeroshot(tmp_path, n_items=12)
    rewrite(tmp_path / "en_classnames.json", lambda data: data["standin"].__setitem__(4, CLASS_NAMES[3]))
    benchmark = ZeroShotClassification(tmp_path, dataset="standin")

    label_of = {ref: label for ref, label, _ in benchmark.samples}

    def similarity(ref, prompt):  # an image matches the prompts naming its class
        return float(benchmark.class_names[label_of[ref]] in prompt)

    with caplog.at_level("WARNING"):
        outcomes = benchmark.outcomes(FunctionScorer(similarity))
    assert "yellow star" in caplog.text
    assert {o["rank"] for o in outcomes if o["label"] in (3, 4)} == {1}
    assert {o["rank"] for o in outcomes if o["label"] not in (3, 4)} == {0}
    assert benchmark.aggregate(outcomes)["tied"] == 4  # the two images each of classes 3 and 4


# --- missing and malformed files --------------------------------------------------------------------------

def test_missing_files_and_folder_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match=r"en_classnames\.json.*en_zeroshot_classification_templates"):
        ZeroShotClassification(tmp_path)
    write_zeroshot(tmp_path, n_items=6)
    with pytest.raises(MissingBenchmarkData, match="elsewhere"):
        _ = ZeroShotClassification(tmp_path, images=tmp_path / "elsewhere", dataset="standin").samples


def test_malformed_json_gives_clear_errors(tmp_path):
    write_zeroshot(tmp_path, n_items=6)
    with pytest.raises(ValueError, match="no dataset 'cifar10'; it has imagenet1k, standin"):
        _ = ZeroShotClassification(tmp_path, dataset="cifar10").class_names
    rewrite(tmp_path / "en_zeroshot_classification_templates.json",
            lambda data: data.update(standin=["a photo of a {}."]))
    with pytest.raises(ValueError, match=r"must each contain '\{c\}'"):
        _ = ZeroShotClassification(tmp_path, dataset="standin").prompts


# --- a real (tiny, random) open_clip model ----------------------------------------------------------------

def test_tiny_clip_aggregates_equal_a_naive_computation(tmp_path):
    from modeling.encoders import build_model

    torch.manual_seed(0)
    built = build_model("ViT-Tiny-16-64", None, str(CONFIGS))
    scorer = ClipScorer(built.model, built.tokenizer, built.preprocess_val)
    benchmark = build(tmp_path, n_items=12, chunk_size=5)
    result = benchmark.aggregate(benchmark.outcomes(scorer))
    with torch.no_grad():
        pixels = torch.stack([built.preprocess_val(load_image(ref)) for ref, _, _ in benchmark.samples])
        images = F.normalize(built.model.encode_image(pixels), dim=-1)
        weights = torch.stack([F.normalize(F.normalize(built.model.encode_text(built.tokenizer(group)), dim=-1)
                                           .mean(dim=0), dim=0) for group in benchmark.prompts])
    logits = (images @ weights.T).double().numpy()
    labels = np.array([label for _, label, _ in benchmark.samples])
    gold = logits[np.arange(len(labels)), labels]
    ranks = np.array([(np.delete(row, y) >= g).sum() for row, y, g in zip(logits, labels, gold)])
    assert result["top1"] == pytest.approx(100 * np.mean(ranks == 0))
    assert result["top5"] == pytest.approx(100 * np.mean(ranks < 5))
    recalls = [np.mean(ranks[labels == c] == 0) for c in range(6)]
    assert result["mean_per_class_recall"] == pytest.approx(100 * np.mean(recalls))


# --- the shapes world's recognition (shapes_zeroshot) ----------------------------------------------------------

def test_shapes_zeroshot_crops_every_object_and_a_scorer_that_knows_them_is_always_right(tmp_path):
    from datamodules.shapes import COLORS, SHAPES, load_scene_graphs, write_caption_split
    from evaluation.benchmarks.zeroshot import ShapesZeroShot, crop_box

    (tmp_path / "annotations").mkdir()
    write_caption_split(tmp_path, "val", 8, image_size=32, seed=3, captions_per_image=1)
    benchmark = ShapesZeroShot(tmp_path, split="val")
    truth = {}
    for record in load_scene_graphs(tmp_path, "val"):
        for obj in record["objects"]:
            box = crop_box(obj["bbox"], 32, ShapesZeroShot.CROP_SCALE)
            x0, y0, x1, y1 = obj["bbox"]
            assert box[2] == box[3] == min(32, 2 * max(x1 - x0, y1 - y0))  # a square twice the object's side
            assert 0 <= box[0] <= x0 and 0 <= box[1] <= y0 and box[0] + box[2] >= x1 and box[1] + box[3] >= y1
            assert box[0] + box[2] <= 32 and box[1] + box[3] <= 32  # moved inside the image
            truth[(str(tmp_path / "images" / "val" / record["file_name"]), box)] = (obj["shape"], obj["color"])
    assert len(benchmark.samples) == len(truth) >= 16
    for (path, box), (shape, color) in list(truth.items())[:5]:  # the crop shows the object (its box is inside)
        crop = load_image(next(ref for _, ref, _ in benchmark.samples if (ref.path, ref.box) == (path, box)))
        assert crop.size == (round(box[2]), round(box[3])) and COLORS[color] in set(crop.getdata())
    # every class is the ensemble of the world's plainest captions naming it: "square" over every colour
    assert benchmark.prompts["shape"][SHAPES.index("square")] == [f"{'an' if color == 'orange' else 'a'} {color} square"
                                                                  for color in COLORS]
    assert benchmark.prompts["color"][list(COLORS).index("orange")] == [f"an orange {shape}" for shape in SHAPES]

    def knows(ref, text):
        shape, color = truth[(ref.path, ref.box)]
        return float(shape in text.split()) + float(color in text.split())

    result = run_benchmark(benchmark, FunctionScorer(knows))
    assert result.aggregates["shape_top1"] == result.aggregates["color_top1"] == 100.0
    assert result.aggregates["objects"] == len(truth) and len(result.outcomes) == 2 * len(truth)
    assert {o["id"].split(":")[0] for o in result.outcomes} == {"shape", "color"}
    constant = run_benchmark(benchmark, FunctionScorer(lambda ref, text: 0.0))  # every class ties: all wrong
    assert constant.aggregates["top1"] == 0.0 and constant.aggregates["tied"] == 2 * len(truth)
    stored = [json.loads(json.dumps(o)) for o in result.outcomes]
    assert ShapesZeroShot.aggregate(stored) == result.aggregates

"""ELEVATER: the toolkit's names, templates and metrics; the registry's file layout; strict top-1; the 21-task mean."""
from __future__ import annotations

import functools
import io
import json
import math
import re
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from evaluation.benchmarks.base import OTHER, ImageRef, MissingBenchmarkData
from evaluation.benchmarks.elevater import (TASKS, VL_COMPO, Elevater, average_ranks, class_probabilities,
                                            eleven_point_average_precision, eleven_point_map, load_tasks, roc_auc)
from evaluation.benchmarks.images import load_image
from evaluation.harness import run_benchmark
from evaluation.scorers import ClipScorer, FunctionScorer
from testkit.standin.elevater import images_per_task, write_elevater

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"
# TEST.METRIC of each task's config (vision_benchmark/resources/datasets/<task>.yaml).
METRIC_OF = {**dict.fromkeys(TASKS, "accuracy"),
             **dict.fromkeys(("caltech101", "fgvc-aircraft-2013b", "flower102", "oxford-iiit-pets"), "mean-per-class"),
             "voc2007classification": "11point_mAP", "hateful-memes": "roc_auc"}


def build(root: Path, n_items: int = 84, **options) -> Elevater:
    return Elevater(root, **{**write_elevater(root, n_items=n_items), **options})


def same(first: dict, second: dict) -> bool:
    """Equal dicts of floats, NaN equal to NaN."""
    return first.keys() == second.keys() and all(
        (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b
        for a, b in ((first[key], second[key]) for key in first))


# --- the toolkit's tasks --------------------------------------------------------------------------------------

def test_tasks_file_holds_the_toolkits_names_templates_and_metrics():
    tasks = load_tasks()
    assert tuple(tasks) == TASKS and len(TASKS) == 21
    assert {name: task.metric for name, task in tasks.items()} == METRIC_OF
    assert sum(task.num_images for task in tasks.values()) == 242677
    assert tasks["cifar10"].templates == tasks["cifar100"].templates and len(tasks["cifar10"].templates) == 18
    assert tasks["fer2013"].classes == ("angry", "disgusted", "fearful", "happy", "neutral", "sad", "surprised")
    imagenet = tasks["imagenet-1k"]
    assert (len(imagenet.classes), len(imagenet.templates), imagenet.format) == (1000, 80, "coco")
    assert sorted(name for name in set(imagenet.classes) if imagenet.classes.count(name) > 1) == ["missile",
                                                                                                   "sunglasses"]
    assert [name for name, task in tasks.items() if not task.center_crop] == ["kitti-distance"]
    assert tasks["kitti-distance"].templates == ("{}",)
    assert tasks["mnist"].prompts()[7] == ['a photo of the number: "7".']
    assert tasks["hateful-memes"].prompts() == [["a meme."], ["a hatespeech meme."]]
    assert [name for name, task in tasks.items() if task.multilabel] == ["voc2007classification"]
    assert tasks["caltech101"].index_path == "classification/caltech_101_20211007/test.txt"
    assert all(task.classes and all(t.count("{}") == 1 for t in task.templates) for task in tasks.values())


def test_published_numbers_are_vl_compos_and_their_mean():
    assert set(Elevater.published) == set(TASKS) | {"average"}
    assert {name: Elevater.published[name].value for name in TASKS} == VL_COMPO
    assert round(Elevater.published["average"].value, 2) == 57.10  # vl_compo's 21_tasks_avg
    by_hand = Elevater.data_source.by_hand
    assert all(f"{task.root_folder}/{{{task.index}, {task.archives[0]}}}" in by_hand for task in load_tasks().values())
    # accuracy numbers are counts over the whole registry test split: the split sizes are the ones scored
    for name, task in load_tasks().items():
        if task.metric == "accuracy":
            correct = VL_COMPO[name] / 100 * task.num_images
            assert abs(correct - round(correct)) < 1e-6, name


# --- files --------------------------------------------------------------------------------------------------

def test_standin_reads_back_in_the_registry_layout(tmp_path):
    benchmark = build(tmp_path, n_items=84)
    per_task = images_per_task(84)
    assert list(benchmark.samples) == list(TASKS) and all(len(s) == per_task for s in benchmark.samples.values())
    cars = benchmark.samples["stanfordcar"][1]
    archive = tmp_path / "classification" / "stanford_cars_20211007" / "val.zip"
    assert cars.id == "stanfordcar/val.zip@Audi TT Coupe 2011/00001.png"  # a path with spaces, then the label
    assert cars.image == ImageRef(str(archive), member="Audi TT Coupe 2011/00001.png")
    with zipfile.ZipFile(archive) as handle:
        assert Image.open(io.BytesIO(handle.read(cars.image.member))).size == (48, 40)
    lines = (archive.parent / "test.txt").read_text().splitlines()
    assert [int(line.rsplit(" ", 1)[1]) for line in lines] == [s.labels[0] for s in benchmark.samples["stanfordcar"]]
    # COCO: images by id, though listed backwards; labels by category id; the first annotation first
    coco = json.loads((tmp_path / "classification" / "hateful_memes_20211014" / "test_meta.json").read_text())
    memes = benchmark.samples["hateful-memes"]
    assert [s.image.member for s in memes] == [f"images/{k:05d}.png" for k in range(per_task)]
    first_category = next(a["category_id"] for a in coco["annotations"] if a["image_id"] == 1)
    assert memes[0].labels == (first_category - 1, 1) and [s.labels[0] for s in memes] == [0, 1, 0, 1]
    voc = benchmark.samples["voc2007classification"]
    assert all(1 <= len(s.labels) <= 3 for s in voc) and any(len(s.labels) > 1 for s in voc)
    assert benchmark.image_origin(cars.image).source == OTHER and benchmark.coco_image_ids() == set()


def test_an_unpacked_archive_is_read_from_its_folder(tmp_path):
    write_elevater(tmp_path, n_items=21)
    base = tmp_path / "classification" / "cifar_10_20211007"
    with zipfile.ZipFile(base / "val.zip") as handle:
        handle.extractall(base / "val")
    benchmark = Elevater(tmp_path, tasks=["cifar10"], check_counts=False)
    refs = [s.image for s in benchmark.samples["cifar10"]]
    assert refs[0] == ImageRef(str(base / "val" / "images" / "00000.png"))
    assert load_image(refs[0]).size == (48, 40)


def test_tasks_option_and_absent_tasks(tmp_path, caplog):
    write_elevater(tmp_path, n_items=21)
    chosen = Elevater(tmp_path, tasks=["voc2007classification", "cifar10"], check_counts=False)
    assert [task.name for task in chosen.tasks] == ["voc2007classification", "cifar10"]
    with pytest.raises(TypeError, match="list of task names"):
        Elevater(tmp_path, tasks="cifar10")
    with pytest.raises(ValueError, match="distinct names among"):
        Elevater(tmp_path, tasks=["cifar-10"])
    (tmp_path / "classification" / "dtd_20211007" / "test.txt").unlink()
    (tmp_path / "classification" / "imagenet_1k_20220105" / "val.json").unlink()
    with pytest.raises(MissingBenchmarkData, match="dtd_20211007/test.txt"):
        Elevater(tmp_path, tasks=["dtd"])
    with caplog.at_level("WARNING"):
        partial = Elevater(tmp_path, check_counts=False)
    assert "dtd, imagenet-1k" in caplog.text and len(partial.tasks) == 19
    result = partial.aggregate(partial.outcomes(FunctionScorer(lambda ref, text: 0.0)))
    assert math.isnan(result["average"]) and result["missing_tasks"] == 2 and result["tasks"] == 19
    assert result["missing/dtd"] == result["missing/imagenet-1k"] == 1.0 and "missing/mnist" not in result
    with pytest.raises(MissingBenchmarkData, match="caltech_101_20211007/test.txt"):
        Elevater(tmp_path / "empty")


def _rewrite(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_malformed_files_are_errors_naming_the_file(tmp_path):
    write_elevater(tmp_path, n_items=21)
    mnist = tmp_path / "classification" / "mnist_20211008"

    def read(task="mnist", **options):
        return Elevater(tmp_path, tasks=[task], **{"check_counts": False, **options}).samples

    with pytest.raises(ValueError, match=r"test\.txt: lists 4 images, ELEVATER's registry has 10000"):
        read(check_counts=True)
    original = (mnist / "test.txt").read_text()
    _rewrite(mnist / "test.txt", "00001.png ", "00001.png x")
    with pytest.raises(ValueError, match=r"mnist_20211008/test\.txt, line 2: expected"):
        read()
    (mnist / "test.txt").write_text(original.replace("00002.png ", "00002.png 1", 1))  # 10..19 of 10 classes
    with pytest.raises(ValueError, match=r"test\.txt: image 'val\.zip@images/00002\.png' has label\(s\) \[1\d\]"):
        read()
    (mnist / "test.txt").write_text(original.replace("\n", "\nval.zip@images/00003.png\n", 1))
    with pytest.raises(ValueError, match="has no label"):  # a bare path is a multilabel negative, not multiclass
        read()
    (mnist / "test.txt").write_text(original + "val.zip@images/09999.png 3\n")
    with pytest.raises(ValueError, match=r"1 images are not in .*val\.zip"):
        read()
    (mnist / "test.txt").write_bytes(original.encode() + b"val.zip@caf\xe9.png 3\n")
    with pytest.raises(ValueError, match=r"mnist_20211008/test\.txt: not a UTF-8 text file"):
        read()
    kitti = tmp_path / "classification" / "kitti_distance_20210923" / "test_meta.json"
    text = kitti.read_text()
    kitti.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"test_meta\.json: not a whole JSON file"):
        read("kitti-distance")
    coco = json.loads(text)
    coco["annotations"][0]["category_id"] = 9  # kitti-distance has categories 1..4
    kitti.write_text(json.dumps(coco))
    with pytest.raises(ValueError, match=r"test_meta\.json: annotation .* unknown image or category"):
        read("kitti-distance")


# --- metrics against naive float64 references ---------------------------------------------------------------

def naive_auc(positives, scores) -> float:
    """Every (positive, negative) pair: 1 when the positive scores higher, 1/2 on a tie."""
    pos = [s for s, y in zip(scores, positives) if y]
    neg = [s for s, y in zip(scores, positives) if not y]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg) / (len(pos) * len(neg))


def naive_ap11(positives, scores) -> float:
    """For each level t of vision-evaluation's 11 (np.linspace(1, 0, 11)), the best precision over thresholds whose
    recall reaches t, counted by brute force; scikit-learn's final point (recall 0, precision 1) counts at t = 0."""
    positives, scores = np.asarray(positives, dtype=bool), np.asarray(scores, dtype=np.float64)
    total = 0.0
    for level in np.linspace(1, 0, 11).tolist():
        best = 1.0 if level <= 0.0 else 0.0
        for threshold in set(scores.tolist()):
            predicted = scores >= threshold
            hits = int((predicted & positives).sum())
            if hits / positives.sum() >= level:
                best = max(best, hits / predicted.sum())
        total += best
    return total / 11


def test_metrics_on_hand_examples_with_ties():
    positives, scores = np.array([1, 0, 1, 0]), np.array([0.9, 0.9, 0.5, 0.1])
    assert roc_auc(positives, scores) == pytest.approx(2.5 / 4)  # the tied pair counts 1/2
    # points: (recall 1/2, precision 1/2) at 0.9, (1, 2/3) at 0.5, (1, 1/2) at 0.1; levels 1.0 ... 0.1 reach 2/3,
    # level 0 the curve's final (0, 1)
    assert eleven_point_average_precision(positives, scores) == pytest.approx((10 * 2 / 3 + 1) / 11)
    assert math.isnan(roc_auc(np.array([1, 1]), np.array([0.2, 0.4])))
    labels = np.array([[1, 0, 0], [0, 0, 0], [1, 0, 1]], dtype=bool)  # class 1 has no positive: not averaged
    scores = np.array([[0.5, 0.1, 0.2], [0.5, 0.3, 0.2], [0.1, 0.3, 0.2]])
    assert eleven_point_map(labels, scores) == pytest.approx(np.mean([naive_ap11(labels[:, c], scores[:, c])
                                                                      for c in (0, 2)]))


@pytest.mark.parametrize("seed", range(6))
def test_metrics_equal_naive_references_on_random_tied_scores(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 40))
    positives = rng.random(n) < rng.uniform(0.1, 0.9)
    positives[:2] = [True, False]
    scores = rng.integers(0, 5, n) / 4.0  # five values: ties everywhere
    assert roc_auc(positives, scores) == pytest.approx(naive_auc(positives, scores), abs=1e-12)
    assert eleven_point_average_precision(positives, scores) == pytest.approx(naive_ap11(positives, scores), abs=1e-12)
    values = rng.integers(0, 6, n).astype(float)
    naive_ranks = [1 + sum(v < x for v in values) + (sum(v == x for v in values) - 1) / 2 for x in values]
    assert average_ranks(values).tolist() == naive_ranks


def test_class_probabilities_are_the_softmax_and_equal_for_permuted_rows():
    scores = np.array([[0.21, 0.30, 0.25, 0.2], [0.25, 0.2, 0.30, 0.21]])
    naive = np.exp(100 * scores) / np.exp(100 * scores).sum(axis=1, keepdims=True)
    probabilities = class_probabilities(scores)
    assert probabilities == pytest.approx(naive, rel=1e-12)
    assert probabilities[0, 1] == probabilities[1, 2]  # bit-identical: the same row in another order


def test_mean_per_class_and_top1_aggregates_by_hand():
    ranks = {0: [0, 0, 1], 5: [0], 9: [2, 0]}  # class -> ranks of its images
    outcomes = [{"id": f"caltech101/{c}/{k}", "task": "caltech101", "label": c, "rank": r, "ties": int(r == 1),
                 "classes": 3} for c, rs in ranks.items() for k, r in enumerate(rs)]
    assert Elevater.aggregate(outcomes)["caltech101"] == pytest.approx(100 * (2 / 3 + 1 + 1 / 2) / 3)
    as_cifar = [{**o, "task": "cifar10", "id": o["id"].replace("caltech101", "cifar10")} for o in outcomes]
    result = Elevater.aggregate(as_cifar)
    assert result["cifar10"] == pytest.approx(100 * 4 / 6) and result["ties/cifar10"] == 1
    assert result["n"] == 6 and result["missing_tasks"] == 20 and math.isnan(result["average"])


# --- the toolkit's rule, step by step, on every item ----------------------------------------------------------

def toolkit_curve(positives, scores):
    """scikit-learn's `_binary_clf_curve` as `precision_recall_curve` and `roc_curve` use it: per distinct score,
    highest first, the true and false positives at or above it."""
    order = np.argsort(scores, kind="mergesort")[::-1]
    scores, positives = scores[order], positives[order].astype(float)
    last = np.r_[np.where(np.diff(scores))[0], len(scores) - 1]
    true_positives = np.cumsum(positives)[last]
    return 1 + last - true_positives, true_positives


def toolkit_ap11(positives, scores) -> float:
    """`MeanAveragePrecisionNPointsEvaluator._per_class_calc` on scikit-learn's precision-recall curve: walk the
    points (highest recall first) while a level is at most their recall, keeping the best precision seen."""
    false_positives, true_positives = toolkit_curve(positives, scores)
    precision = np.r_[(true_positives / (true_positives + false_positives))[::-1], 1]
    recall = np.r_[(true_positives / true_positives[-1])[::-1], 0]
    total, point, best = 0.0, 0, 0.0
    for level in np.linspace(1, 0, 11, endpoint=True).tolist():
        while point < len(recall) and level <= recall[point]:
            best, point = max(best, precision[point]), point + 1
        total += best
    return total / 11


def toolkit_auc(positives, scores) -> float:
    """`roc_auc_score`: the trapezoidal area under (false positive rate, true positive rate)."""
    false_positives, true_positives = toolkit_curve(positives, scores)
    fpr, tpr = np.r_[0, false_positives] / false_positives[-1], np.r_[0, true_positives] / true_positives[-1]
    return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))


def toolkit_task(task, labels, scores) -> dict:
    """`clip_zeroshot_evaluator` then `metric.py` for one task: softmax(100 * scores), then the task's metric. Per
    image: the argmax decision (ties to the lowest index) and whether the gold class beats every other strictly."""
    logits = 100 * scores
    exps = np.exp(logits - logits.max(axis=1, keepdims=True))  # torch's softmax subtracts the row maximum
    probabilities = exps / exps.sum(axis=1, keepdims=True)
    if task.metric == "11point_mAP":
        truth = np.zeros(scores.shape, dtype=bool)
        for row, tags in enumerate(labels):
            truth[row, list(tags)] = True
        present = [c for c in range(truth.shape[1]) if truth[:, c].any()]
        return {"value": np.mean([toolkit_ap11(truth[:, c], probabilities[:, c]) for c in present])}
    gold = np.array([tags[0] for tags in labels])
    if task.metric == "roc_auc":
        return {"value": toolkit_auc(gold == 1, probabilities[:, 1]), "probability": probabilities[:, 1]}
    columns = sorted(set(gold.tolist())) if task.metric == "mean-per-class" else list(range(scores.shape[1]))
    restricted = probabilities[:, columns]  # BalancedAccuracyScoreEvaluator keeps the classes with a target
    position = np.array([columns.index(g) for g in gold])
    argmax_right = restricted.argmax(axis=1) == position
    gold_scores = restricted[np.arange(len(gold)), position]
    ties = np.array([int((np.delete(row, g) == s).sum()) for row, g, s in zip(restricted, position, gold_scores)])
    strict = argmax_right & (ties == 0)
    if task.metric == "accuracy":
        value, argmax_value = strict.mean(), argmax_right.mean()
    else:  # balanced accuracy: the mean recall of the classes present
        value = np.mean([strict[gold == c].mean() for c in columns])
        argmax_value = np.mean([argmax_right[gold == c].mean() for c in columns])
    return {"value": value, "argmax_value": argmax_value, "strict": strict, "argmax_right": argmax_right,
            "ties": ties}


def tied_scorer(benchmark: Elevater) -> FunctionScorer:
    """Scores in steps of 1/800 from a hash of (image group, class name): every prompt of a class scores alike,
    images in one group (member number mod 5) score alike, and classes tie often."""
    name_of = {prompt: task.classes[c] for task in benchmark.tasks for c, group in enumerate(task.prompts())
               for prompt in group}
    group_of = {sample.image.member: int(re.search(r"(\d+)\.png$", sample.image.member).group(1)) % 5
                for samples in benchmark.samples.values() for sample in samples}

    @functools.lru_cache(maxsize=None)
    def level(group: int, name: str) -> float:
        return (zlib.crc32(f"{group}|{name}".encode()) % 9) / 800

    return FunctionScorer(lambda ref, prompt: level(group_of[ref.member], name_of[prompt]))


def test_every_item_and_metric_follows_the_toolkit_with_ties_strict(tmp_path):
    benchmark = build(tmp_path, n_items=21 * 12)
    scorer = tied_scorer(benchmark)
    outcomes = run_benchmark(benchmark, scorer).outcomes
    result = benchmark.aggregate(outcomes)
    by_task = {name: [o for o in outcomes if o["task"] == name] for name in TASKS}
    credited_ties = 0
    for task in benchmark.tasks:
        samples = benchmark.samples[task.name]
        scores = np.asarray(scorer.score_groups([s.image for s in samples], task.prompts()), dtype=np.float64)
        reference = toolkit_task(task, [s.labels for s in samples], scores)
        ours = by_task[task.name]
        assert [o["id"] for o in ours] == [s.id for s in samples]
        assert result[task.name] == pytest.approx(100 * reference["value"], abs=1e-9), task.name
        if "strict" in reference:
            assert [o["rank"] == 0 for o in ours] == reference["strict"].tolist(), task.name
            assert [o["ties"] for o in ours] == reference["ties"].tolist(), task.name
            assert result[task.name] <= 100 * reference["argmax_value"] + 1e-9
            credited_ties += int((reference["argmax_right"] & ~reference["strict"]).sum())
        if "probability" in reference:
            assert [o["probability"] for o in ours] == pytest.approx(reference["probability"].tolist(), rel=1e-12)
    assert credited_ties > 0  # the toolkit's argmax would have credited some tied images; the strict rule does not
    assert result["average"] == pytest.approx(np.mean([result[name] for name in TASKS]))
    assert result["missing_tasks"] == 0 and result["n"] == 21 * 12 and result["ties"] > 0
    stored = [json.loads(json.dumps(o)) for o in outcomes]
    assert same(Elevater.aggregate(stored), result)


def test_repeated_imagenet_names_tie_and_are_never_top1(tmp_path, caplog):
    """ELEVATER's ImageNet names hold "missile" twice: the two classes get the same prompts and scores."""
    write_elevater(tmp_path, n_items=21)
    missiles = [k for k, name in enumerate(load_tasks()["imagenet-1k"].classes) if name == "missile"]
    path = tmp_path / "classification" / "imagenet_1k_20220105" / "val.json"
    coco = json.loads(path.read_text())
    for annotation in coco["annotations"]:
        if annotation["image_id"] == 2:
            annotation["category_id"] = missiles[1] + 1
    path.write_text(json.dumps(coco))
    benchmark = Elevater(tmp_path, tasks=["imagenet-1k"], check_counts=False)
    with caplog.at_level("WARNING"):
        outcomes = benchmark.outcomes(FunctionScorer(lambda ref, prompt: float("missile" in prompt)))
    assert "'missile', 'sunglasses'" in caplog.text
    missile_image = next(o for o in outcomes if o["id"].endswith("00001.png"))
    assert (missile_image["label"], missile_image["rank"], missile_image["ties"]) == (missiles[1], 1, 1)


# --- a real (tiny, random) open_clip model --------------------------------------------------------------------

def test_tiny_clip_outcomes_equal_a_naive_computation(tmp_path):
    from modeling.encoders import build_model

    write_elevater(tmp_path, n_items=21 * 6)
    tasks = ["cifar10", "hateful-memes", "voc2007classification"]
    for task in (load_tasks()[name] for name in tasks):  # unpacked: the images are read as files
        base = tmp_path / task.root_folder
        with zipfile.ZipFile(base / task.archives[0]) as handle:
            handle.extractall(base / task.archives[0][: -len(".zip")])
    torch.manual_seed(0)
    built = build_model("ViT-Tiny-16-64", None, str(CONFIGS))
    benchmark = Elevater(tmp_path, tasks=tasks, check_counts=False, chunk_size=4)
    outcomes = benchmark.outcomes(ClipScorer(built.model, built.tokenizer, built.preprocess_val))
    for name in tasks:
        task, samples = load_tasks()[name], benchmark.samples[name]
        with torch.no_grad():
            pixels = torch.stack([built.preprocess_val(load_image(s.image)) for s in samples])
            images = F.normalize(built.model.encode_image(pixels), dim=-1)
            weights = torch.stack([F.normalize(F.normalize(built.model.encode_text(built.tokenizer(group)), dim=-1)
                                               .mean(dim=0), dim=0) for group in task.prompts()])
        scores = (images @ weights.T).double().numpy()
        ours = [o for o in outcomes if o["task"] == name]
        if task.multilabel:
            assert np.array([o["probabilities"] for o in ours]) == pytest.approx(class_probabilities(scores), abs=1e-4)
        else:
            gold = np.array([s.labels[0] for s in samples])
            ranks = [int((np.delete(row, y) >= row[y]).sum()) for row, y in zip(scores, gold)]
            assert [o["rank"] for o in ours] == ranks


def test_standin_scales_to_thousands_of_images(tmp_path):
    benchmark = build(tmp_path, n_items=3000)
    assert sum(len(s) for s in benchmark.samples.values()) == 21 * images_per_task(3000) >= 3000
    assert len(benchmark.image_refs()) == 21 * images_per_task(3000)

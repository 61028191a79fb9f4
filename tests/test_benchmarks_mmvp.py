"""MMVP-VLM: Questions.csv pairs, the official softmax rule (float32 logit ties included) and vl_compo's scores."""
from __future__ import annotations

import csv
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from evaluation.benchmarks.base import ImageRef, MissingBenchmarkData
from evaluation.benchmarks.images import load_image
from evaluation.benchmarks.mmvp import PATTERNS, MMVPVLM, first_image_probability, official_pair
from evaluation.scorers import FunctionScorer
from testkit.standin.mmvp import write_mmvp_vlm

RIGHT = np.array([[0.9, 0.2], [0.1, 0.8]])  # s[image i, statement j]


def _float32_pair_tied_by_the_logit_scale() -> tuple[float, float]:
    """Two float32 similarities a < b whose float32 logits 100 * a and 100 * b are equal."""
    a = np.float32(0.33)
    while True:
        b = np.nextafter(a, np.float32(1))
        if np.float32(100) * a == np.float32(100) * b:
            return float(a), float(b)
        a = b


LOW, HIGH = _float32_pair_tied_by_the_logit_scale()
SCORE_VALUES = (0.1, 0.2, LOW, HIGH, 0.45)


def tied_similarity(ref: ImageRef, text: str) -> float:
    """Scores from SCORE_VALUES by a hash of (image, text): exact ties are common, and so are LOW-HIGH pairs,
    which differ as similarities but tie as logits."""
    digest = hashlib.sha256(f"{Path(ref.path).parent.name}/{Path(ref.path).name}|{text}".encode()).hexdigest()
    return SCORE_VALUES[int(digest[:8], 16) % len(SCORE_VALUES)]


# ---------------------------------------------------------------- loading


def test_standin_reads_back_pairs_prompts_images_and_patterns(tmp_path):
    benchmark = MMVPVLM(tmp_path, **write_mmvp_vlm(tmp_path, n_items=20, seed=1))
    with open(tmp_path / "Questions.csv", newline="") as handle:
        rows = list(csv.reader(handle))[1:]
    items = benchmark.items()
    assert len(items) == 20 and [item.id for item in items[:2]] == ["1-2", "3-4"]
    assert items[1].texts == ["a photo of " + rows[2][2], "a photo of " + rows[3][2]] and "," in rows[2][2]
    folder = tmp_path / "MLLM_VLM Images"
    assert items[16].images == [ImageRef(str(folder / "Presence" / f"{qid}.jpg")) for qid in (33, 34)]
    assert items[14].meta == {"pattern": "Orientation and Direction", "type": "Orientation", "qids": [29, 30]}
    assert items[15].meta["pattern"] == "Presence of Specific Features"
    assert np.asarray(load_image(items[16].images[0])).shape[2] == 3
    assert MMVPVLM(tmp_path, images=tmp_path / "elsewhere").items()[0].images[0].path == \
        str(tmp_path / "elsewhere" / "Orientation" / "1.jpg")


def test_both_images_come_from_the_first_rows_folder_and_patterns_from_the_position(tmp_path):
    (tmp_path / "Questions.csv").write_text("Question ID,Type,Statement\n1,Color,a red cup\n2,Text,a blue cup\n")
    [item] = MMVPVLM(tmp_path).items()
    assert [Path(ref.path).parent.name for ref in item.images] == ["Color", "Color"]
    assert item.meta["pattern"] == "Orientation and Direction"  # pair 0, whatever its Type says


# ---------------------------------------------------------------- the rule by hand


def _torch_probability(scores, logit_scale: float = 100.0) -> float:
    """CLIP's `logits_per_text.softmax(dim=-1)[0][0]` for one statement over two images."""
    logits = torch.tensor(np.float32(logit_scale)) * torch.tensor([list(scores)], dtype=torch.float32)
    return logits.softmax(dim=-1)[0][0].item()


def test_the_softmax_matches_torch_and_a_logit_tie_predicts_image_2():
    low, high = _float32_pair_tied_by_the_logit_scale()
    for scores in ([0.31, 0.27], [0.27, 0.31], [0.3, 0.3], [high, low], [low, high]):
        assert first_image_probability(scores, 100.0) == _torch_probability(scores)
    assert first_image_probability([high, low], 100.0) == 0.5  # high > low, yet the logits tie
    assert first_image_probability([high, low], 10.0) > 0.5  # another scale separates them
    assert first_image_probability([high, low], 1.0) == 0.5  # and at scale 1 the softmax saturates
    result = official_pair(np.array([[high, 0.1], [low, 0.9]]), [1, 2], 100.0)
    assert (result["pred_1"], result["pred_2"], result["correct"], result["logit_tie"]) == (2, 2, False, True)


def test_outcomes_on_hand_made_matrices(tmp_path):
    write_mmvp_vlm(tmp_path, n_items=1)
    benchmark = MMVPVLM(tmp_path)
    [item] = benchmark.items()
    right = benchmark.outcome(item, RIGHT)
    assert (right["correct"], right["text"], right["image"], right["group"], right["tie"]) == (True,) * 4 + (False,)
    tie = benchmark.outcome(item, np.array([[0.5, 0.2], [0.5, 0.8]]))  # statement 1 ties: image 2 is predicted
    assert (tie["pred_1"], tie["correct"], tie["image"], tie["tie"], tie["logit_tie"]) == (2, False, False, True, True)
    low, high = _float32_pair_tied_by_the_logit_scale()
    near = benchmark.outcome(item, np.array([[high, 0.2], [low, 0.8]]))
    # the similarities rank image 1 first (vl_compo's image score); the official logits tie (wrong)
    assert (near["correct"], near["image"], near["tie"], near["logit_tie"]) == (False, True, False, True)
    loose = MMVPVLM(tmp_path, logit_scale=10.0).outcome(item, np.array([[high, 0.2], [low, 0.8]]))
    assert loose["correct"] and not loose["logit_tie"]


def test_gold_images_follow_the_parity_of_the_question_ids(tmp_path):
    (tmp_path / "Questions.csv").write_text("Question ID,Type,Statement\n4,Color,a red cup\n3,Color,a blue cup\n")
    benchmark = MMVPVLM(tmp_path)
    [item] = benchmark.items()
    # qid 4 (even) describes image 2, qid 3 (odd) image 1: the crossed matrix is the right one
    crossed = benchmark.outcome(item, RIGHT[:, ::-1])
    assert (crossed["gt_1"], crossed["gt_2"], crossed["correct"], crossed["group"]) == (2, 1, True, True)
    assert not benchmark.outcome(item, RIGHT)["correct"]


def test_aggregate_by_hand_official_accuracy_and_vl_compo_means():
    def outcome(pattern, correct, text, image, tie=False):
        return {"pattern": pattern, "correct": correct, "text": text, "image": image, "group": text and image,
                "tie": tie, "logit_tie": tie}
    outcomes = [outcome(PATTERNS[0], True, True, True), outcome(PATTERNS[0], False, True, False, tie=True),
                outcome(PATTERNS[0], False, False, False), outcome(PATTERNS[8], True, False, True)]
    result = MMVPVLM.aggregate(outcomes)
    assert result[f"accuracy/{PATTERNS[0]}"] == pytest.approx(100 / 3) and result[f"accuracy/{PATTERNS[8]}"] == 100
    assert result[f"text/{PATTERNS[0]}"] == pytest.approx(200 / 3) and result[f"group/{PATTERNS[8]}"] == 0.0
    assert (result["ties"], result["logit_ties"], result["n"], result["patterns"]) == (1, 1, 4, 2)
    # two of nine patterns: every mean is undefined, never a mean over the two at hand
    assert all(np.isnan(result[key]) for key in ("accuracy", "text", "image", "group"))
    assert np.isnan(result[f"accuracy/{PATTERNS[4]}"])
    complete = outcomes + [outcome(pattern, True, True, False) for pattern in PATTERNS[1:8]]
    result = MMVPVLM.aggregate(complete)
    assert result["accuracy"] == pytest.approx((100 / 3 + 100 + 7 * 100) / 9) and result["patterns"] == 9
    assert result["group"] == pytest.approx((100 / 3 + 0 + 7 * 0) / 9)
    assert result["image"] == pytest.approx((100 / 3 + 100 + 0) / 9)
    assert np.isnan(MMVPVLM.aggregate([])["accuracy"])


# ---------------------------------------------------------------- the authors' rule, item by item


def authors_benchmark_model(benchmark_dir: str, similarity) -> tuple[list[tuple], dict]:
    """`benchmark_model` of tsb0601/MMVP 7635005 (scripts/evaluate_vlm.py) step by step, CLIP replaced by
    `similarity(image path, text)` as the cosine inside `logits_per_text` (logit scale 100, float32).
    Returns its output.csv rows (qid1, qid2, pred1, pred2, gt1, gt2) and `pair_accuracies`."""
    image_dir = os.path.join(benchmark_dir, 'MLLM_VLM Images')
    categories = ['Orientation and Direction', 'Presence of Specific Features', 'State and Condition',
                  'Quantity and Count', 'Positional and Relational Context', 'Color and Appearance',
                  'Structural Characteristics', 'Texts', 'Viewpoint and Perspective']
    pair_accuracies = {category: 0 for category in categories}
    num_pairs, written = 0, []
    with open(os.path.join(benchmark_dir, 'Questions.csv'), 'r') as f:
        reader = csv.reader(f)
        next(reader)
        for row in reader:
            qid1, qtype1, statement1 = row
            row = next(reader, None)
            if not row:
                break
            qid2, qtype2, statement2 = row
            qid1, qid2 = int(qid1), int(qid2)
            img1 = os.path.join(image_dir, qtype1, f'{qid1}.jpg')
            img2 = os.path.join(image_dir, qtype1, f'{qid2}.jpg')
            text1, text2 = 'a photo of ' + statement1, 'a photo of ' + statement2
            probs1 = _torch_probability([similarity(img1, text1), similarity(img2, text1)])
            probs2 = _torch_probability([similarity(img1, text2), similarity(img2, text2)])
            pred1 = "img1" if probs1 > 0.5 else "img2"
            pred2 = "img1" if probs2 > 0.5 else "img2"
            gt1 = "img1" if qid1 % 2 == 1 else "img2"
            gt2 = "img1" if qid2 % 2 == 1 else "img2"
            written.append((qid1, qid2, pred1, pred2, gt1, gt2))
            current_category = categories[num_pairs // 15]
            if pred1 == gt1 and pred2 == gt2:
                pair_accuracies[current_category] += 1
            num_pairs += 1
    for category in pair_accuracies:
        pair_accuracies[category] = (pair_accuracies[category] / (num_pairs // len(categories))) * 100
    return written, pair_accuracies


def test_the_authors_script_and_ours_agree_on_every_pair_and_pattern(tmp_path):
    benchmark = MMVPVLM(tmp_path, **write_mmvp_vlm(tmp_path, n_items=135, seed=4))
    outcomes = benchmark.outcomes(FunctionScorer(tied_similarity))
    written, pair_accuracies = authors_benchmark_model(str(tmp_path), lambda path, text: tied_similarity(
        ImageRef(path), text))
    image = {1: "img1", 2: "img2"}
    assert [(o["qid_1"], o["qid_2"], image[o["pred_1"]], image[o["pred_2"]], image[o["gt_1"]], image[o["gt_2"]])
            for o in outcomes] == written
    result = MMVPVLM.aggregate(outcomes)
    assert {pattern: result[f"accuracy/{pattern}"] for pattern in PATTERNS} == pytest.approx(pair_accuracies)
    assert result["accuracy"] == pytest.approx(np.mean(list(pair_accuracies.values())))
    assert 10 < result["logit_ties"] < 135 and result["ties"] > 10 and result["patterns"] == 9
    assert any(o["logit_tie"] and not o["tie"] for o in outcomes)  # ties the logit scale alone made


def test_vl_compo_scores_are_the_winoground_definitions_per_pair(tmp_path):
    benchmark = MMVPVLM(tmp_path, **write_mmvp_vlm(tmp_path, n_items=30, seed=4))
    for item, outcome in zip(benchmark.items(), benchmark.outcomes(FunctionScorer(tied_similarity))):
        s = [[tied_similarity(ref, text) for text in item.texts] for ref in item.images]
        text = s[0][0] > s[0][1] and s[1][1] > s[1][0]
        image = s[0][0] > s[1][0] and s[1][1] > s[0][1]
        assert (outcome["text"], outcome["image"], outcome["group"]) == (text, image, text and image), item.id


def test_aggregates_recompute_from_json_round_tripped_outcomes(tmp_path):
    benchmark = MMVPVLM(tmp_path, **write_mmvp_vlm(tmp_path, n_items=135, seed=2))
    outcomes = benchmark.outcomes(FunctionScorer(tied_similarity))
    assert MMVPVLM.aggregate(json.loads(json.dumps(outcomes))) == MMVPVLM.aggregate(outcomes)
    assert set(MMVPVLM.published) <= set(MMVPVLM.aggregate(outcomes)) and "group" in MMVPVLM.headline
    assert MMVPVLM.published["group"].value == pytest.approx(np.mean(
        [MMVPVLM.published[f"group/{pattern}"].value for pattern in PATTERNS]), abs=0.01)


# ---------------------------------------------------------------- malformed files


def _questions(tmp_path: Path, body: str | bytes) -> Path:
    path = tmp_path / "Questions.csv"
    data = body if isinstance(body, bytes) else body.encode()
    path.write_bytes(b"Question ID,Type,Statement\n" + data)
    return path


@pytest.mark.parametrize("body, message", [
    ("1,Color,a red cup\n2,Color,a blue cup\n3,Color,a green\n", r"Questions.csv: 3 questions; they come in pairs"),
    ("1,Color,a red cup\n2,Color\n", r"Questions.csv: line 3 has 2 fields"),
    ("1,Color,a red cup\nx2,Color,a blue cup\n", r"Questions.csv: line 3: question id 'x2' is not a whole number"),
    ("1,Color,a red cup\n3,Color,a blue cup\n", r"Questions.csv: lines 2-3: question ids 1 and 3 are not one odd"),
    (b"1,Color,a red cup\n2,Color,a bl\xe9 cup\n", r"Questions.csv: not a UTF-8 text file"),
])
def test_malformed_questions_name_the_file_and_line(tmp_path, body, message):
    _questions(tmp_path, body)
    with pytest.raises(ValueError, match=message):
        MMVPVLM(tmp_path).items()


def test_more_pairs_than_the_patterns_hold_and_a_missing_file_are_refused(tmp_path):
    _questions(tmp_path, "".join(f"{q},Color,cup {q}\n" for q in range(1, 273)))
    with pytest.raises(ValueError, match="136 pairs; the official patterns cover 135"):
        MMVPVLM(tmp_path).items()
    with pytest.raises(MissingBenchmarkData, match=re.escape("expected files: Questions.csv")):
        MMVPVLM(tmp_path / "empty")

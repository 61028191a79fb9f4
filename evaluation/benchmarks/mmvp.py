"""MMVP-VLM (Tong et al., Eyes Wide Shut?, CVPR 2024): 135 pairs of images and statements, 9 visual patterns.

Official files (Hugging Face dataset `MMVP/MMVP_VLM`, MIT): `Questions.csv` (`Question ID,Type,Statement`, 270
rows) and `MLLM_VLM Images/<Type>/<Question ID>.jpg`. The folder name is the one the authors' script reads
(tsb0601/MMVP `7635005`, `scripts/evaluate_vlm.py`); their README draws it as `MMVP_VLM_Images`, which the
published dataset does not use.

Official rule (`scripts/evaluate_vlm.py`, function `benchmark_model`, read step by step):
- rows are taken two at a time in file order (a trailing odd row would be dropped; we refuse it instead), and
  both images are read from the FIRST row's Type folder;
- each statement becomes "a photo of " + statement;
- for each statement, CLIP's `logits_per_text` (logit scale x cosine, float32) over the pair's two images is
  softmaxed; the prediction is image 1 iff its probability is > 0.5, so a tie predicts image 2. The logit
  scale cannot flip a decision, but it can create a tie: two cosines a float32 ulp or two apart can give equal
  logits, and logits a few ulps apart saturate the float32 softmax at exactly 0.5. We apply torch's float32
  softmax to `logit_scale x similarity` (`logit_ties` counts pairs where it met exactly 0.5). This reproduces
  every exact tie; for similarities an ulp or two apart it can differ from a CLIP forward pass, which applies
  the scale to the image embedding before the product and so rounds differently;
- the gold image of a statement is image 1 iff its Question ID is odd; a pair is right iff both statements pick
  their gold image;
- a pair's pattern is `categories[pair_index // 15]` (its position, not its Type), and each pattern's accuracy is
  right pairs / 15 in percent; the paper's "MMVP Average" is their mean.

vl_compo (Oh et al., CVPRW 2024; ytaek-oh/vl_compo `43e2eae`, `individual_results.csv`) reports the pairs as
Winoground items instead: per pattern, text (each image prefers its own statement), image (each statement
prefers its own image) and group, all strict `>` on the similarities, and headlines the mean group over the 9
patterns. Its "image" is the official pair accuracy up to the tie rule (a tie predicting image 2 is right for the
second statement officially, wrong under `>`). Its statements' prompt is not published; we use the official one.

Published (OpenAI CLIP ViT-B/32): vl_compo's per-pattern text / image / group and mean group 6.67. The MMVP paper
does not report ViT-B/32 (its figure lists ViT-L/14 and larger models).
"""
from __future__ import annotations

from collections import defaultdict
from functools import cached_property
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from evaluation.benchmarks.annotations import read_csv_rows, require, required_text
from evaluation.benchmarks.base import ImageRef, Item, ItemBenchmark, Outcome, percent
from evaluation.benchmarks.sources import DataSource, published
from evaluation.benchmarks.two_by_two import SCORES, two_by_two_scores

QUESTIONS = "Questions.csv"
IMAGE_FOLDER = "MLLM_VLM Images"
PROMPT = "a photo of "
# `categories` of evaluate_vlm.py: the pattern of pair k is PATTERNS[k // PAIRS_PER_PATTERN].
PATTERNS = ("Orientation and Direction", "Presence of Specific Features", "State and Condition",
            "Quantity and Count", "Positional and Relational Context", "Color and Appearance",
            "Structural Characteristics", "Texts", "Viewpoint and Perspective")
PAIRS_PER_PATTERN = 15
OPENAI_LOGIT_SCALE = 100.0  # exp of OpenAI CLIP's learned logit scale (4.6052)

_VL_COMPO = {  # individual_results.csv, ViT-B-32 / openai: text, image, group per pattern (percent)
    "Orientation and Direction": (6.67, 0.0, 0.0), "Presence of Specific Features": (6.67, 20.0, 0.0),
    "State and Condition": (33.33, 13.33, 13.33), "Quantity and Count": (6.67, 6.67, 0.0),
    "Positional and Relational Context": (6.67, 0.0, 0.0), "Color and Appearance": (53.33, 26.67, 13.33),
    "Structural Characteristics": (26.67, 33.33, 13.33), "Texts": (13.33, 13.33, 6.67),
    "Viewpoint and Perspective": (20.0, 26.67, 13.33)}


def first_image_probability(scores: Sequence[float], logit_scale: float) -> float:
    """Probability of the first of two images for one statement: torch's float32 softmax of the `[1, 2]` logits
    `logit_scale x (s(image 1), s(image 2))`, the operation the official script applies to `logits_per_text`.
    Torch's own kernel, not a re-derivation: where the two logits differ by a few ulps the softmax saturates at
    exactly 0.5, and implementations disagree on where."""
    similarities = torch.tensor([list(scores)], dtype=torch.float32)
    return (torch.tensor(logit_scale, dtype=torch.float32) * similarities).softmax(dim=-1)[0, 0].item()


def official_pair(similarity: np.ndarray, qids: Sequence[int], logit_scale: float) -> dict:
    """The official per-pair result from s[image i, statement j]: predicted and gold image (1 or 2) per
    statement, the softmax probabilities, and whether the pair is right."""
    probabilities = [first_image_probability(similarity[:, j], logit_scale) for j in (0, 1)]
    predicted = [1 if probability > 0.5 else 2 for probability in probabilities]
    gold = [1 if qid % 2 == 1 else 2 for qid in qids]
    return {"prob_1": probabilities[0], "prob_2": probabilities[1], "pred_1": predicted[0], "pred_2": predicted[1],
            "gt_1": gold[0], "gt_2": gold[1], "correct": predicted == gold,
            "logit_tie": any(probability == 0.5 for probability in probabilities)}


class MMVPVLM(ItemBenchmark):
    """MMVP-VLM: one item per pair of `Questions.csv` rows, images `[image of qid 1, image of qid 2]`, texts
    `["a photo of " + statement 1, "a photo of " + statement 2]`.

    Args:
        root: the dataset folder (holding `Questions.csv` and `MLLM_VLM Images/`).
        images: the image folder; default `<root>/MLLM_VLM Images`.
        logit_scale: the scale of the official softmax (OpenAI CLIP's 100 by default); it decides only which
            near-equal similarities tie.

    Aggregates: `accuracy/<pattern>` (official) and `accuracy`, their mean (the paper's MMVP Average);
    `<score>/<pattern>` for text, image, group and `text`, `image`, `group`, their means (vl_compo's headline is
    `group`); `patterns` (how many the means cover: 9 on the release), `ties` (pairs with a tied similarity),
    `logit_ties` (pairs whose official probability was exactly 0.5), `n`.
    """

    name = "mmvp_vlm"
    headline = ("accuracy", "text", "image", "group")
    description = "MMVP-VLM: official pair accuracy and Winoground text / image / group per visual pattern (%)"
    data_source = DataSource(
        home="https://huggingface.co/datasets/MMVP/MMVP_VLM",
        licence="MIT (dataset card; tsb0601/MMVP)",
        size="270 statements and 270 JPEG images (135 pairs), under 30 MB",
        by_hand="`huggingface-cli download --repo-type dataset MMVP/MMVP_VLM --local-dir <root>` (gives "
                "<root>/Questions.csv and '<root>/MLLM_VLM Images/<Type>/<id>.jpg'). No full revision hash is "
                "recorded here (main was at commit 211372d, 'Upload Questions.csv'): note the commit you download.")
    published = published({**{f"{score}/{pattern}": values[k] for pattern, values in _VL_COMPO.items()
                               for k, score in enumerate(SCORES)}, "group": 6.67}, "vl_compo")

    def __init__(self, root: str | Path, images: str | Path | None = None, logit_scale: float = OPENAI_LOGIT_SCALE):
        super().__init__(root)
        self.images = Path(images) if images else self.root / IMAGE_FOLDER
        self.logit_scale = float(logit_scale)

    def required_files(self) -> list[str]:
        return [QUESTIONS]

    def items(self) -> list[Item]:
        return self._items

    @cached_property
    def _items(self) -> list[Item]:
        path = self.root / QUESTIONS
        rows = read_questions(path)
        require(len(rows) % 2 == 0, f"{path}: {len(rows)} questions; they come in pairs (an odd count means a "
                                    "truncated or edited file)")
        require(len(rows) <= 2 * PAIRS_PER_PATTERN * len(PATTERNS),
                f"{path}: {len(rows) // 2} pairs; the official patterns cover {PAIRS_PER_PATTERN * len(PATTERNS)}")
        return [self._item(path, pair, rows[2 * pair], rows[2 * pair + 1]) for pair in range(len(rows) // 2)]

    def _item(self, path: Path, pair: int, first: tuple, second: tuple) -> Item:
        (line_1, qid_1, folder, statement_1), (line_2, qid_2, _, statement_2) = first, second
        require(qid_1 % 2 != qid_2 % 2, f"{path}: lines {line_1}-{line_2}: question ids {qid_1} and {qid_2} are "
                                        "not one odd and one even (the odd one is image 1's statement)")
        images = [ImageRef(str(self.images / folder / f"{qid}.jpg")) for qid in (qid_1, qid_2)]
        return Item(id=f"{qid_1}-{qid_2}", images=images, texts=[PROMPT + statement_1, PROMPT + statement_2],
                    meta={"pattern": PATTERNS[pair // PAIRS_PER_PATTERN], "type": folder, "qids": [qid_1, qid_2]})

    def outcome(self, item: Item, similarity: np.ndarray) -> Outcome:
        qids = item.meta["qids"]
        official = official_pair(similarity, qids, self.logit_scale)
        # Winoground's caption i is image i's statement: the statement whose gold image is i.
        order = [[official["gt_1"], official["gt_2"]].index(image) for image in (1, 2)]
        return {"id": item.id, "pattern": item.meta["pattern"], "type": item.meta["type"], "qid_1": qids[0],
                "qid_2": qids[1], **official, **two_by_two_scores(np.asarray(similarity)[:, order])}

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        by_pattern: dict[str, list[Outcome]] = defaultdict(list)
        for outcome in outcomes:
            by_pattern[str(outcome["pattern"])].append(outcome)
        # Every official pattern is reported, NaN where it has no pair, so that a mean is over all nine or NaN:
        # never over whichever patterns a partial file happens to hold.
        patterns = list(PATTERNS) + sorted(set(by_pattern) - set(PATTERNS))
        result: dict[str, float] = {}
        for key in ("accuracy", *SCORES):
            value = "correct" if key == "accuracy" else key
            per_pattern = {p: percent([bool(o[value]) for o in by_pattern.get(p, [])]) for p in patterns}
            result.update({f"{key}/{p}": v for p, v in per_pattern.items()})
            result[key] = float(np.mean(list(per_pattern.values())))
        present = sum(pattern in by_pattern for pattern in patterns)
        return {**result, "patterns": float(present), "ties": float(sum(bool(o["tie"]) for o in outcomes)),
                "logit_ties": float(sum(bool(o["logit_tie"]) for o in outcomes)), "n": float(len(outcomes))}


def read_questions(path: Path) -> list[tuple[int, int, str, str]]:
    """The rows of Questions.csv after its header, as (line, question id, type, statement); a
    `DamagedBenchmarkData` names the file and line."""
    rows = read_csv_rows(path, encoding="utf-8-sig")  # a byte-order mark would otherwise stick to the header
    require(bool(rows), f"{path}: empty file")
    questions = []
    for line, fields in rows[1:]:
        require(len(fields) == 3, f"{path}: line {line} has {len(fields)} fields, not Question ID,Type,Statement")
        qid, folder, statement = fields
        require(qid.strip().isdigit(), f"{path}: line {line}: question id {qid!r} is not a whole number")
        # the prompt prefix would hide an empty statement from the item-level check
        questions.append((line, int(qid), folder, required_text(statement, f"{path}: line {line}", "statement")))
    return questions

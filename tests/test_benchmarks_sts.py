"""SICK-R and STS-B: file shapes and splits, Spearman with average ranks for ties, end-to-end text cosine."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evaluation.benchmarks.base import MissingBenchmarkData
from testkit.standin.sts import write_sickr, write_stsb
from evaluation.benchmarks.sts import STSB, SickR, spearman
from evaluation.scorers import ClipScorer, Scorer

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"
SEMEVAL_HEADER = "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"


class PairScorer(Scorer):
    """Text similarity from a function of the two sentences (the STS tests need no images)."""

    def __init__(self, similarity):
        self.similarity, self.prepared = similarity, None

    def prepare(self, images, texts, progress=False):
        self.prepared = (list(images), list(texts))

    def score_unique(self, images, texts):
        raise AssertionError("STS scores text pairs only")

    def text_similarity(self, first, second):
        return np.array([self.similarity(a, b) for a, b in zip(first, second)])


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, each tie group given the mean of the positions it spans (float64, written out)."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    start = 0
    while start < len(values):
        stop = start
        while stop + 1 < len(values) and values[order[stop + 1]] == values[order[start]]:
            stop += 1
        ranks[order[start:stop + 1]] = (start + stop) / 2 + 1
        start = stop + 1
    return ranks


def naive_spearman(x, y) -> float:
    return float(np.corrcoef(average_ranks(np.asarray(x)), average_ranks(np.asarray(y)))[0, 1])


def write_semeval(root: Path, rows_by_file: dict) -> None:
    for name, rows in rows_by_file.items():
        lines = [SEMEVAL_HEADER] + [f"{pid}\t{a}\t{b}\t{score}\tNEUTRAL" for pid, a, b, score in rows]
        (root / name).write_text("\n".join(lines) + "\n")


# --- files ------------------------------------------------------------------------------------------------

def test_sick_txt_splits_by_semeval_set(tmp_path):
    write_sickr(tmp_path, n_items=9)
    every = SickR(tmp_path).pairs
    assert [p.id for p in every] == [str(k) for k in range(1, 10)]
    assert [p.id for p in SickR(tmp_path, split="test").pairs] == ["3", "6", "9"]
    assert [p.id for p in SickR(tmp_path, split="train").pairs] == ["1", "4", "7"]
    line = (tmp_path / "SICK.txt").read_text().splitlines()[2].split("\t")
    assert (every[1].first, every[1].second, every[1].gold) == (line[1], line[2], float(line[4]))


def test_sick_semeval_files_all_concatenates_train_trial_test(tmp_path):
    write_semeval(tmp_path, {"SICK_train.txt": [("1", "a b", "c d", "4.5")],
                             "SICK_trial.txt": [("2", "e", "f", "3.2")],
                             "SICK_test_annotated.txt": [("6", "g", "h", "1.0"), ("7", "i", "j", "2")]})
    assert [(p.id, p.gold) for p in SickR(tmp_path).pairs] == [("1", 4.5), ("2", 3.2), ("6", 1.0), ("7", 2.0)]
    assert [p.id for p in SickR(tmp_path, split="test").pairs] == ["6", "7"]
    (tmp_path / "SICK_train.txt").unlink()
    with pytest.raises(MissingBenchmarkData, match="SICK_train.txt"):
        _ = SickR(tmp_path).pairs
    with pytest.raises(ValueError, match="split"):
        SickR(tmp_path, split="dev")


def test_stsb_original_file_keeps_quotes_and_ignores_extra_columns(tmp_path):
    write_stsb(tmp_path, n_items=6)
    pairs = STSB(tmp_path).pairs
    rows = [line.split("\t") for line in (tmp_path / "sts-test.csv").read_text().splitlines()]
    assert len(pairs) == 6 and len(rows[2]) == 9  # the third line carries two source columns
    assert [(p.first, p.second, p.gold) for p in pairs] == [(r[5], r[6], float(r[4])) for r in rows]
    assert any('"big"' in p.first + p.second for p in pairs)  # unquoted file: quotes are text


@pytest.mark.parametrize("name, delimiter", [("stsb_test.tsv", "\t"), ("stsb_test.csv", ",")])
def test_stsb_headered_shapes(tmp_path, name, delimiter):
    lines = [delimiter.join(("sentence1", "sentence2", "score")),
             delimiter.join(("A man is playing a large flute.", "A man is playing a flute.", "0.76")),
             delimiter.join(('"He said ""hi"", then left."', "Nobody spoke.", "0.1"))]
    (tmp_path / name).write_text("\n".join(lines) + "\n")
    pairs = STSB(tmp_path).pairs
    assert [(p.id, p.gold) for p in pairs] == [("0", 0.76), ("1", 0.1)]
    assert pairs[0].first == "A man is playing a large flute." and pairs[1].first == 'He said "hi", then left.'


# --- Spearman ---------------------------------------------------------------------------------------------

def test_spearman_identical_reversed_and_ties_by_hand():
    x = np.array([0.1, 0.4, 0.35, 0.8, 0.2])
    # torchmetrics' 1e-6 in the denominator biases rho by ~1e-6 relative (4.8e-7 for these 5 pairs)
    assert 100 * spearman(x, 3 * x + 1) == pytest.approx(100.0, rel=1e-5)
    assert 100 * spearman(x, -x) == pytest.approx(-100.0, rel=1e-5)
    # ranks x = 1, 2.5, 2.5, 4 and y = 1, 3, 2, 4: rho = 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10)
    assert spearman(np.array([1.0, 2, 2, 3]), np.array([1.0, 3, 2, 4])) == pytest.approx(3 / math.sqrt(10), rel=1e-5)
    assert math.isnan(spearman(np.array([1.0]), np.array([2.0])))


def test_spearman_matches_average_rank_reference_on_a_large_tied_sample():
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 26, size=5000) / 5  # 0-5 in steps of 0.2: heavy ties, like SICK's scores
    cosine = np.round(gold + rng.normal(0, 1.5, size=5000), 2)
    assert spearman(cosine, gold) == pytest.approx(naive_spearman(cosine, gold), rel=1e-5)  # rho ~0.7


def test_aggregate_reports_spearman_pearson_and_pairs():
    pairs = [(0.1, 1), (0.5, 2), (0.4, 3), (0.9, 5)]
    outcomes = [{"id": str(k), "cosine": c, "gold": g} for k, (c, g) in enumerate(pairs)]
    result = SickR.aggregate(outcomes)
    assert result["spearman"] == pytest.approx(100 * 0.8, rel=1e-5)  # one swapped neighbour pair of 4
    assert result["pearson"] == pytest.approx(100 * np.corrcoef([0.1, 0.5, 0.4, 0.9], [1, 2, 3, 5])[0, 1])
    assert result["pairs"] == 4


def test_end_to_end_scorer_with_known_correlation(tmp_path):
    write_sickr(tmp_path, n_items=12)
    benchmark = SickR(tmp_path)
    gold = {(p.first, p.second): p.gold for p in benchmark.pairs}
    scorer = PairScorer(lambda a, b: -gold[(a, b)])  # perfectly reversed ranking
    outcomes = benchmark.outcomes(scorer)
    assert scorer.prepared[0] == [] and set(scorer.prepared[1]) == {s for pair in gold for s in pair}
    assert [o["id"] for o in outcomes] == [str(k) for k in range(1, 13)]
    result = benchmark.aggregate(outcomes)
    assert result["spearman"] == pytest.approx(-100.0, rel=1e-5) and result["pearson"] == pytest.approx(-100.0)
    assert result["pairs"] == 12
    assert json.loads(json.dumps(outcomes)) == outcomes


# --- missing and malformed files --------------------------------------------------------------------------

def test_missing_files_are_named(tmp_path):
    with pytest.raises(MissingBenchmarkData, match=r"SICK\.txt.*SICK_test_annotated\.txt"):
        SickR(tmp_path)
    with pytest.raises(MissingBenchmarkData, match=r"sts-test\.csv.*stsb_test\.tsv.*stsb_test\.csv"):
        STSB(tmp_path)


def test_malformed_rows_name_the_file_and_row(tmp_path):
    write_semeval(tmp_path, {"SICK_test_annotated.txt": [("17", "a", "b", "high")]})
    with pytest.raises(ValueError, match=r"SICK_test_annotated\.txt: pair_ID 17 .* not a number: 'high'"):
        _ = SickR(tmp_path, split="test").pairs
    (tmp_path / "sts-test.csv").write_text("main-news\tx\t2012\t1\t2.5\tone\ttwo\nmain-news\tx\t2012\t2\t3.0\tonly\n")
    with pytest.raises(ValueError, match=r"sts-test\.csv: line 2 has 6 tab-separated columns"):
        _ = STSB(tmp_path).pairs
    (tmp_path / "SICK.txt").write_text("pair_ID\tsentence_A\tsentence_B\n1\ta\tb\n")
    with pytest.raises(ValueError, match=r"SICK\.txt: missing column\(s\) relatedness_score"):
        _ = SickR(tmp_path).pairs


# --- a real (tiny, random) open_clip model ----------------------------------------------------------------

def test_tiny_clip_spearman_equals_a_naive_computation(tmp_path):
    from modeling.encoders import build_model

    torch.manual_seed(0)
    built = build_model("ViT-Tiny-16-64", None, str(CONFIGS))
    write_stsb(tmp_path, n_items=30)
    benchmark = STSB(tmp_path)
    result = benchmark.aggregate(benchmark.outcomes(ClipScorer(built.model, built.tokenizer, built.preprocess_val)))
    pairs = benchmark.pairs
    with torch.no_grad():
        first = F.normalize(built.model.encode_text(built.tokenizer([p.first for p in pairs])), dim=-1)
        second = F.normalize(built.model.encode_text(built.tokenizer([p.second for p in pairs])), dim=-1)
    cosine = (first * second).sum(dim=-1).double().numpy()
    gold = np.array([p.gold for p in pairs])
    # the ranks are the same (the closest two cosines are 1.5e-4 apart, rounding is ~1e-7): rho differs by the
    # float64 rounding and torchmetrics' 1e-6 only; pearson by the cosines' float32 rounding (~1e-7 of 1)
    assert result["spearman"] == pytest.approx(100 * naive_spearman(cosine, gold), rel=1e-5)
    assert result["pearson"] == pytest.approx(100 * np.corrcoef(cosine, gold)[0, 1], rel=1e-5, abs=1e-5)

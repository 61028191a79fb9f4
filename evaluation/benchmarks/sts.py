"""SICK-R and STS-B: Spearman correlation of the text tower's cosine with human similarity (text-only probes).

The unsupervised protocol (MTEB's main score "cos_sim spearman"; not SentEval's trained SICK-R regressor):
embed both sentences of a pair, take their cosine (`scorer.text_similarity`), and report 100 x Spearman's rho
(average ranks for ties) against the gold scores over all pairs, with Pearson's r and the pair count.

SICK-R (`sickr`), the first found under `root`:
- `SICK.txt`, the full release (Zenodo 2787612): tab-separated with a header including `pair_ID`,
  `sentence_A`, `sentence_B`, `relatedness_score` (1-5) and `SemEval_set` (TRAIN / TRIAL / TEST); 9,840
  pairs (4,439 / 495 / 4,906).
- The SemEval-2014 files SentEval reads: `SICK_train.txt`, `SICK_trial.txt`, `SICK_test_annotated.txt`, with
  header `pair_ID, sentence_A, sentence_B, relatedness_score, entailment_judgment`; 4,500 / 500 / 4,927 pairs,
  9,927 in all: MTEB's `mteb/sickr-sts` test set.
Option `split`: "all" (default; every pair, the unsupervised convention) or "train" / "trial" / "test".

STS-B (`stsb`), the original test split (1,379 pairs; the GLUE test split hides its labels), the first found:
- `sts-<split>.csv` from `Stsbenchmark.tar.gz`: tab-separated, no header, columns genre, filename, year, id,
  score (0-5), sentence1, sentence2 (some lines carry extra source columns); read without quote handling,
  as the file is not quoted but its sentences contain `"`.
- `stsb_<split>.tsv` / `stsb_<split>.csv`: a header naming `sentence1`, `sentence2`, `score` (the
  sentence-transformers (0-1) and MTEB (0-5) shapes; the scale does not change the correlations), tab- or
  comma-separated (read from the header line), with standard CSV quoting.
Option `split` (default "test") names the file.

Both sentences of every pair read must be non-empty: an empty one is a damaged file, refused.

CLIP's tokenizer truncates at 77 tokens (the scorer's tokenizer does); a handful of long STS-B sentences
are cut. How many is not counted here, as the benchmark has no tokenizer.
"""
from __future__ import annotations

from abc import abstractmethod

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from evaluation.benchmarks.annotations import (DamagedBenchmarkData, read_csv_records, read_csv_rows, read_text,
                                               require, required_text)
from evaluation.benchmarks.base import Benchmark, MissingBenchmarkData, Outcome, Scorer, unique
from evaluation.benchmarks.sources import DataSource

SICK_FULL = "SICK.txt"
SICK_SEMEVAL = {"train": "SICK_train.txt", "trial": "SICK_trial.txt", "test": "SICK_test_annotated.txt"}


@dataclass(frozen=True)
class SentencePair:
    id: str
    first: str
    second: str
    gold: float


class _SentencePairs(Benchmark):
    """A sentence-pair similarity benchmark scored by Spearman's rho of cosine vs gold."""

    headline = ("spearman",)

    @cached_property
    def pairs(self) -> list[SentencePair]:
        """Every pair of the chosen split, read from the official file(s)."""
        return self.read_pairs()

    @abstractmethod
    def read_pairs(self) -> list[SentencePair]:
        """The pairs of the chosen split, from the benchmark's own file format."""

    def read_annotations(self) -> None:
        self.pairs  # no images: the pairs are the files to check

    def outcomes(self, scorer: Scorer, progress: bool = False) -> list[Outcome]:
        pairs = self.pairs
        scorer.prepare([], unique(s for pair in pairs for s in (pair.first, pair.second)), progress=progress)
        cosines = np.asarray(scorer.text_similarity([p.first for p in pairs], [p.second for p in pairs]))
        return [{"id": pair.id, "cosine": float(cosine), "gold": pair.gold} for pair, cosine in zip(pairs, cosines)]

    @staticmethod
    def aggregate(outcomes: Sequence[Outcome]) -> dict[str, float]:
        """100 x Spearman's rho and Pearson's r of cosine vs gold, and the number of pairs."""
        cosine = np.array([o["cosine"] for o in outcomes], dtype=np.float64)
        gold = np.array([o["gold"] for o in outcomes], dtype=np.float64)
        return {"spearman": 100.0 * spearman(cosine, gold), "pearson": 100.0 * pearson(cosine, gold),
                "pairs": len(outcomes)}


class SickR(_SentencePairs):
    """Args: root (`SICK.txt`, or the three SemEval-2014 files), split ("all", "train", "trial", "test")."""

    name = "sickr"
    description = "SICK-R: Spearman x 100 of text cosine vs relatedness (unsupervised)"
    data_source = DataSource(home="https://zenodo.org/records/2787612", licence="CC BY-NC-SA 3.0",
                        size="SICK.txt, 2 MB (9,927 pairs)",
                        by_hand="SICK.zip from the Zenodo record above, unzipped into <root> (SICK.txt)")

    def __init__(self, root: str | Path, split: str = "all"):
        if split not in ("all", *SICK_SEMEVAL):
            raise ValueError(f"split must be 'all' or one of {sorted(SICK_SEMEVAL)}, got {split!r}")
        self.split = split
        super().__init__(root)

    def required_files(self) -> list[str]:
        return [f"{SICK_FULL} | {SICK_SEMEVAL['test']}"]

    def read_pairs(self) -> list[SentencePair]:
        if (self.root / SICK_FULL).exists():
            rows = _read_sick(self.root / SICK_FULL)
            return [pair for pair, semeval_set in rows if self.split in ("all", semeval_set.lower())]
        splits = list(SICK_SEMEVAL) if self.split == "all" else [self.split]
        missing = [SICK_SEMEVAL[s] for s in splits if not (self.root / SICK_SEMEVAL[s]).exists()]
        if missing:
            raise MissingBenchmarkData(f"{self.name}: {self.root} lacks {', '.join(missing)} (split {self.split!r})")
        return [pair for s in splits for pair, _ in _read_sick(self.root / SICK_SEMEVAL[s])]


class STSB(_SentencePairs):
    """Args: root (`sts-test.csv`, or a headered `stsb_test.tsv` / `stsb_test.csv`), split (default "test")."""

    name = "stsb"
    description = "STS-B (original test split): Spearman x 100 of text cosine vs gold similarity"
    data_source = DataSource(home="https://ixa2.si.ehu.eus/stswiki/index.php/STSbenchmark",
                        licence="per source (news, captions, forums); see the page above",
                        size="Stsbenchmark.tar.gz, 0.4 MB (test: 1,379 pairs)",
                        by_hand="Stsbenchmark.tar.gz from the page above; put stsbenchmark/sts-test.csv in <root>")

    def __init__(self, root: str | Path, split: str = "test"):
        self.split = split
        super().__init__(root)

    def candidates(self) -> list[str]:
        return [f"sts-{self.split}.csv", f"stsb_{self.split}.tsv", f"stsb_{self.split}.csv"]

    def required_files(self) -> list[str]:
        return [" | ".join(self.candidates())]

    def read_pairs(self) -> list[SentencePair]:
        original, *headered = [self.root / name for name in self.candidates()]
        if original.exists():
            return _read_sts_original(original)
        return _read_sts_headered(next(path for path in headered if path.exists()))


def _read_sick(path: Path) -> list[tuple[SentencePair, str]]:
    """(pair, SemEval_set or "") per row of a SICK file with a header, columns found by name."""
    records = read_csv_records(path, ("pair_ID", "sentence_A", "sentence_B", "relatedness_score"), delimiter="\t",
                               quoting=csv.QUOTE_NONE)
    return [(_pair(row["pair_ID"], row["sentence_A"], row["sentence_B"], row["relatedness_score"],
                   f"{path}: pair_ID {row['pair_ID']} (line {line})"), row.get("SemEval_set") or "")
            for line, row in records]


def _read_sts_original(path: Path) -> list[SentencePair]:
    """The original STS-B `sts-*.csv`: no header; score, sentence1, sentence2 are columns 5-7 (1-based)."""
    pairs = []
    for number, (line, row) in enumerate(read_csv_rows(path, delimiter="\t", quoting=csv.QUOTE_NONE)):
        require(len(row) >= 7, f"{path}: line {line} has {len(row)} tab-separated columns, expected at least 7")
        pairs.append(_pair(str(number), row[5], row[6], row[4], f"{path}: line {line}"))
    return pairs


def _read_sts_headered(path: Path) -> list[SentencePair]:
    """A headered STS-B file (sentence-transformers / MTEB export), tab- or comma-separated."""
    delimiter = "\t" if "\t" in read_text(path).partition("\n")[0] else ","
    records = read_csv_records(path, ("sentence1", "sentence2", "score"), delimiter=delimiter)
    return [_pair(str(n), row["sentence1"], row["sentence2"], row["score"], f"{path}: line {line}")
            for n, (line, row) in enumerate(records)]


def _pair(pair_id: str, first: str, second: str, score: str, where: str) -> SentencePair:
    """A pair whose sentences are non-empty and whose gold score is a number."""
    return SentencePair(pair_id, required_text(first, where, "first sentence"),
                        required_text(second, where, "second sentence"), _score(score, where))


def _score(text: str | None, where: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        raise DamagedBenchmarkData(f"{where} has a gold score that is not a number: {text!r}") from None


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho, ties given their average rank (torchmetrics' `spearman_corrcoef`); NaN for < 2 pairs.

    torchmetrics adds 1e-6 to the denominator, so a perfect ranking of n pairs gives 1 - O(1e-6 / n^2).
    """
    if len(x) < 2:
        return float("nan")
    import torch  # only the STS benchmarks need it here
    from torchmetrics.functional import spearman_corrcoef

    return float(spearman_corrcoef(torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)))


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's r; NaN for < 2 pairs."""
    return float(np.corrcoef(x, y)[0, 1]) if len(x) >= 2 else float("nan")

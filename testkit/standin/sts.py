"""Stand-in SICK (`SICK.txt`, the full release's 12 columns) and STS-B (`sts-test.csv`, the original
header-less tab-separated file, some lines with the extra source columns and sentences holding `"`)."""
from __future__ import annotations

import random
from pathlib import Path

SUBJECTS = ("A man", "A woman", "The dog", "Two children", "A cat", "A chef")
VERBS = ("is playing", "is cutting", "is riding", "is eating", "is watching", "is cleaning")
OBJECTS = ("a guitar", "an onion", "a horse", "a sandwich", "the \"big\" screen", "a red car")
SICK_HEADER = ("pair_ID", "sentence_A", "sentence_B", "entailment_label", "relatedness_score", "entailment_AB",
               "entailment_BA", "sentence_A_original", "sentence_B_original", "sentence_A_dataset",
               "sentence_B_dataset", "SemEval_set")
SEMEVAL_SETS = ("TRAIN", "TRIAL", "TEST")
GENRES = ("main-captions", "main-news", "main-forums")


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"


def write_sickr(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`SICK.txt` with `n_items` pairs; pair `k` is in SemEval set `SEMEVAL_SETS[k % 3]`, ids start at 1."""
    rng = random.Random(seed)
    lines = ["\t".join(SICK_HEADER)]
    for k in range(n_items):
        first, second = sentence(rng), sentence(rng)
        score = round(rng.uniform(1, 5), 1)
        lines.append("\t".join((str(k + 1), first, second, "NEUTRAL", str(score), "A_neutral_B", "B_neutral_A",
                                first, second, "FLICKR", "SEMEVAL", SEMEVAL_SETS[k % 3])))
    _write(Path(root) / "SICK.txt", lines)
    return {}


def write_stsb(root: Path, n_items: int = 20, seed: int = 0) -> dict:
    """`sts-test.csv` with `n_items` pairs; every third line carries two extra source columns."""
    rng = random.Random(seed)
    lines = []
    for k in range(n_items):
        columns = [GENRES[k % 3], "images", "2015", f"{k:04d}", f"{rng.uniform(0, 5):.3f}", sentence(rng),
                   sentence(rng)]
        if k % 3 == 2:
            columns += ["source-a", "source-b"]
        lines.append("\t".join(columns))
    _write(Path(root) / "sts-test.csv", lines)
    return {}


def _write(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")

"""Damaged benchmark files are refused, never scored.

Every registered benchmark, on its stand-in data, is damaged three ways: one text it scores made empty (whitespace
only), the file holding it cut short in the middle of a row, a byte that is not UTF-8 put into it. Each time the
check `python -m evaluation.evaluate` runs before it builds a model (`harness.check_images`) must stop with one
`DamagedBenchmarkData` line naming the damaged file.
"""
from __future__ import annotations

import csv
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import pytest

from core.config import REPO_ROOT
from evaluation.benchmarks import BENCHMARKS, DamagedBenchmarkData, build_benchmark
from evaluation.benchmarks.base import ImageRef, Scorer
from evaluation.harness import check_images, run_benchmark
from testkit.standin import STANDINS
from testkit.standin.sugarcrepe import write_sugarcrepe

TEXT_FILES = (".json", ".jsonl", ".csv", ".tsv", ".txt")
# Benchmarks whose scored texts are not read from their files (ELEVATER's class names and templates ship with the
# repository, the shapes world's prompts are built from its vocabulary): no text of theirs to empty; a look for
# one would find strings they never read (a COCO index's category names, the shapes world's training captions).
TEXTS_FROM_CODE = ("elevater", "shapes_zeroshot")


class RecordingScorer(Scorer):
    """Similarities from a hash of (image, text), the same on every call; remembers every text it was given."""

    def __init__(self, empty_wins: bool = False):
        self.texts: set[str] = set()
        self.calls = 0
        self.empty_wins = empty_wins

    def prepare(self, images: Sequence[ImageRef], texts: Sequence[str], progress: bool = False) -> None:
        self.calls += 1
        self.texts.update(texts)

    def score_unique(self, images: Sequence[ImageRef], texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        self.texts.update(texts)
        return np.array([[self._similarity(repr(image), text) for text in texts] for image in images])

    def text_similarity(self, first: Sequence[str], second: Sequence[str]) -> np.ndarray:
        self.calls += 1
        self.texts.update([*first, *second])
        return np.array([self._similarity(a, b) for a, b in zip(first, second)])

    def _similarity(self, image: str, text: str) -> float:
        if self.empty_wins:  # as an embedding model may: the empty string closest, negatives above captions
            return 1.0 if not text.strip() else 0.5 if "standing" in text else 0.0
        digest = hashlib.sha256(f"{image}\0{text}".encode()).digest()
        return int.from_bytes(digest[:4], "big") / 2 ** 32


def normalised(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


# --- where a scored text lies in the files -----------------------------------------------------------------

Site = Tuple[Path, object, str]  # (file, where in it, the text as written)


def annotation_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file() and path.suffix in (*TEXT_FILES, ".parquet"))


def leaves(value, where=()) -> Iterator[Tuple[tuple, str]]:
    """(path in the document, string) for every string of a JSON value, in document order."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*where, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from leaves(item, (*where, index))


def delimiter_of(text: str) -> str:
    return "\t" if "\t" in text.partition("\n")[0] else ","


def file_strings(path: Path) -> Iterator[Tuple[object, str]]:
    """(locator, string) for every string value of an annotation file, in file order."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        for column in table.column_names:
            values = table.column(column).to_pylist()
            if all(isinstance(value, str) for value in values):
                yield from (((column, row), value) for row, value in enumerate(values))
        return
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        yield from ((where, value) for where, value in leaves(json.loads(text)))
    elif path.suffix == ".jsonl":
        for line, record in enumerate(text.splitlines()):
            if record.strip():
                yield from (((line, where), value) for where, value in leaves(json.loads(record)))
    else:
        for line, row in enumerate(text.splitlines()):
            cells = next(csv.reader([row], delimiter=delimiter_of(text)), [])
            yield from (((line, column), cell) for column, cell in enumerate(cells))


def caption_site(root: Path, scored: set[str]) -> Optional[Site]:
    """The first string of the files that is a scored text; else the first (longest-worded) that a scored text
    contains as whole words (a class name in its prompts, a statement behind a prompt prefix)."""
    exact = {normalised(text) for text in scored}
    padded = [f" {text} " for text in exact]
    strings = [(path, where, value) for path in annotation_files(root) for where, value in file_strings(path)
               if normalised(value) and re.search("[a-z]", normalised(value))]
    for path, where, value in strings:
        if normalised(value) in exact:
            return path, where, value
    inside = [(path, where, value) for path, where, value in strings
              if any(f" {normalised(value)} " in text for text in padded)]
    return max(inside, key=lambda site: len(site[2].split()), default=None)


# --- damage ------------------------------------------------------------------------------------------------

def replace_at(document, where: tuple, value):
    target = document
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value


def set_string(site: Site, value: str | bytes) -> None:
    """Put `value` where the site's string was (bytes: an invalid UTF-8 string, in a parquet file only)."""
    path, where, old = site
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        column, row = where
        table = pq.read_table(path)
        cells = [text.encode() for text in table.column(column).to_pylist()]
        cells[row] = value if isinstance(value, bytes) else value.encode()
        strings = pa.array(cells, pa.binary()).cast(pa.string(), safe=False)  # no check: bad UTF-8 stays bad
        pq.write_table(table.set_column(table.column_names.index(column), column, strings), path)
    elif path.suffix == ".json":
        document = json.loads(path.read_text(encoding="utf-8"))
        replace_at(document, where, value)
        path.write_text(json.dumps(document), encoding="utf-8")
    elif path.suffix == ".jsonl":
        lines = path.read_text(encoding="utf-8").splitlines()
        line, inner = where
        record = json.loads(lines[line])
        replace_at(record, inner, value)
        lines[line] = json.dumps(record)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    else:  # the cell, found between its delimiters (or quotes) on its own line
        line, _ = where
        lines = path.read_text(encoding="utf-8").split("\n")
        lines[line] = re.sub(rf'(?:(?<=^)|(?<=[,\t"])){re.escape(old)}(?=$|[,\t"])', lambda _: value, lines[line],
                             count=1)
        path.write_text("\n".join(lines), encoding="utf-8")


def cut_short(path: Path) -> None:
    """The file cut in the middle: a parquet file at half its bytes, a text file just after the first separator
    of the row holding its middle byte (so that a CSV row loses cells rather than the end of its last one)."""
    data = path.read_bytes()
    if path.suffix == ".parquet":
        path.write_bytes(data[:len(data) // 2])
        return
    start = data.rfind(b"\n", 0, len(data) // 2) + 1
    separator = re.compile(rb"[,\t :]").search(data, start)
    path.write_bytes(data[:separator.end() if separator else (start + len(data)) // 2])


def not_utf8(path: Path, site: Optional[Site]) -> None:
    """A byte that starts no UTF-8 character, in the middle of the file (in a parquet file: in a caption)."""
    if path.suffix == ".parquet":
        set_string(site, site[2].encode() + b"\xff")
        return
    data = path.read_bytes()
    middle = data.find(b" ", len(data) // 2)
    path.write_bytes(data[:middle] + b"\xff" + data[middle:])


# --- the test ------------------------------------------------------------------------------------------------

def written(name: str, root: Path) -> Tuple[dict, set[str]]:
    """The stand-in's build options and every text a scorer is asked to score on it."""
    options = STANDINS[name](root, n_items=12, seed=3)
    scorer = RecordingScorer()
    run_benchmark(build_benchmark(name, root, **options), scorer)
    return options, scorer.texts


def scored_site(name: str, root: Path, scored: set[str]) -> Optional[Site]:
    return None if name in TEXTS_FROM_CODE else caption_site(root, scored)


def target_file(name: str, root: Path, options: dict, site: Optional[Site]) -> Path:
    """The file holding the first scored text; for a benchmark without texts in its files, its first required
    file (of alternatives, the first present)."""
    if site is not None:
        return site[0]
    first = build_benchmark(name, root, **options).required_files()[0]
    return next(root / option.strip() for option in first.split("|") if (root / option.strip()).is_file())


def assert_refused(name: str, root: Path, options: dict, damaged: Path) -> None:
    scorer = RecordingScorer()
    with pytest.raises(DamagedBenchmarkData) as raised:
        benchmark = build_benchmark(name, root, **options)
        check_images(benchmark)  # what evaluate checks before it builds a model
        run_benchmark(benchmark, scorer)
    message = str(raised.value)
    assert str(damaged) in message and "\n" not in message, message
    assert scorer.calls == 0


@pytest.mark.parametrize("name", [name for name in BENCHMARKS if name not in TEXTS_FROM_CODE])
def test_an_empty_text_in_a_file_is_refused(name, tmp_path):
    root = tmp_path / name
    options, scored = written(name, root)
    site = scored_site(name, root, scored)
    assert site is not None, f"{name}: no scored text found in its files"
    set_string(site, "  ")
    assert_refused(name, root, options, site[0])


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_a_file_cut_short_is_refused(name, tmp_path):
    root = tmp_path / name
    options, scored = written(name, root)
    damaged = target_file(name, root, options, scored_site(name, root, scored))
    cut_short(damaged)
    assert_refused(name, root, options, damaged)


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_a_file_that_is_not_utf8_is_refused(name, tmp_path):
    root = tmp_path / name
    options, scored = written(name, root)
    site = scored_site(name, root, scored)
    damaged = target_file(name, root, options, site)
    not_utf8(damaged, site)
    assert_refused(name, root, options, damaged)


def test_an_empty_sugarcrepe_caption_does_not_move_swap_att(tmp_path):
    """With a model that ranks every negative above its caption but the empty string above both, swap_att is 0 %;
    one caption emptied must not make it 25 % (1 of its 4 items): the file is refused, naming it and the item."""
    write_sugarcrepe(tmp_path, n_items=28)  # 4 items per subset
    result = run_benchmark(build_benchmark("sugarcrepe", tmp_path), RecordingScorer(empty_wins=True))
    assert result.aggregates["swap_att"] == 0.0
    path = tmp_path / "swap_att.json"
    entries = json.loads(path.read_text())
    key = next(iter(entries))
    entries[key]["caption"] = " "
    path.write_text(json.dumps(entries))
    with pytest.raises(DamagedBenchmarkData, match=rf"swap_att\.json: item '{key}': the caption is empty"):
        run_benchmark(build_benchmark("sugarcrepe", tmp_path), RecordingScorer(empty_wins=True))


@pytest.mark.parametrize("empty_label, refused", [(3, False), (2, True)])
def test_only_the_empty_class_name_clip_benchmark_ships_is_scored(tmp_path, caplog, empty_label, refused):
    """clip_benchmark's own list names class 3 of clevr_closest_object_distance "": scored as clip_benchmark scores
    it (its template filled with nothing), with a warning; an empty name anywhere else is a damaged file."""
    options = STANDINS["zeroshot"](tmp_path, n_items=6)
    names = ["very nearby", "nearby", "near", "distant", "very distant"]
    names.insert(empty_label, "")
    dataset = "clevr_closest_object_distance"
    (tmp_path / "en_classnames.json").write_text(json.dumps({dataset: names}))
    (tmp_path / "en_zeroshot_classification_templates.json").write_text(json.dumps({dataset: ["{c} shapes."]}))
    benchmark = build_benchmark("zeroshot", tmp_path, **{**options, "dataset": dataset})
    scorer = RecordingScorer()
    if refused:
        with pytest.raises(DamagedBenchmarkData, match=rf"en_classnames.json: '{dataset}' class 2: the class name"):
            check_images(benchmark)
        return
    run_benchmark(benchmark, scorer)
    assert " shapes." in scorer.texts
    assert "class 3 of 'clevr_closest_object_distance' has an empty name" in caplog.text


def test_the_cli_prints_a_damaged_file_in_one_line(tmp_path):
    """`python -m evaluation.evaluate` stops before building a model: exit status 1, the file named in one line
    of stderr, no traceback."""
    write_sugarcrepe(tmp_path / "data" / "sugarcrepe", n_items=14)
    path = tmp_path / "data" / "sugarcrepe" / "add_obj.json"
    path.write_bytes(path.read_bytes()[:-30])
    done = subprocess.run([sys.executable, "-m", "evaluation.evaluate", "--model", "ViT-Tiny-16-64", "--benchmarks",
                           "sugarcrepe", "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "eval"),
                           "--no-progress"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if str(path) in line]
    assert len(lines) == 1 and "not a whole JSON file" in lines[0], done.stderr
    assert not (tmp_path / "eval").exists()

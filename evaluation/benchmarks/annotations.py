"""Reading a benchmark's annotation files: one error for damaged input, one rule for an empty text.

Every benchmark reads its files through these readers, so damaged input stops in one way, before anything is
scored: a `DamagedBenchmarkData` (a `MissingBenchmarkData`, so that the CLIs print it as one line) whose message
names the file and where in it the problem is (the line, byte offset or record). Damaged means:
- a file cut short or not in its format (JSON that stops mid-value, a JSON-lines line that does not parse, a CSV
  row with fewer or more cells than its header, a parquet file pyarrow cannot read), or not UTF-8 text;
- a text the benchmark scores (a caption, a negative, a foil, a sentence, a class name) that is empty or only
  whitespace (`required_text`). Scoring one would compare images with the empty string's embedding and move the
  result (one empty caption took a 4-item SugarCrepe swap_att from 0 % to 25 %), so such a file is refused,
  never scored and never silently thinned. The official releases that could be checked hold no empty text
  (SugarCrepe, SugarCrepe++, VALSE, VL-CheckList, Cola multi-object, ImageCoDe); the one that does is
  clip_benchmark's class-name list, whose single empty name `zeroshot.py` lets through by name.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Iterable, List, Sequence, Tuple

RECOPY = "copy it again from the benchmark's release"


class MissingBenchmarkData(FileNotFoundError):
    """A benchmark root without the files the benchmark reads; the message lists them."""


class DamagedBenchmarkData(MissingBenchmarkData, ValueError):
    """A benchmark file that is there but unusable: cut short, not UTF-8, a malformed record, an empty text.

    The message is one line naming the file and where in it. A `MissingBenchmarkData` (the CLIs report either in
    one line, before any model is built) and a `ValueError` (a malformed file always was one here).
    """


def require(condition: bool, message: str) -> None:
    """A malformed annotation is a `DamagedBenchmarkData` whose message names the file and the record."""
    if not condition:
        raise DamagedBenchmarkData(message)


def required_text(value: object, where: str, field: str = "caption") -> str:
    """`value` unchanged when it is a text to score: a string with something besides whitespace.

    Args:
        value: the field's value as read.
        where: the file and the record (`"<path>: record 12"`), for the message.
        field: what the text is (caption, foil, negative_caption, sentence, class name, ...).
    """
    require(isinstance(value, str), f"{where}: {field} is not a string ({value!r:.80})")
    require(value.strip() != "", f"{where}: the {field} is empty ({value!r}); a benchmark file with an empty text "
                                 f"is damaged: {RECOPY}")
    return value


def required_texts(values: object, where: str, field: str = "caption") -> List[str]:
    """Every element of a list of texts (`required_text`); the list itself must be one."""
    require(isinstance(values, list), f"{where} has a {field!r} that is not a list of strings ({values!r:.80})")
    return [required_text(value, where, f"{field}[{k}]") for k, value in enumerate(values)]


def read_text(path: Path, encoding: str = "utf-8") -> str:
    """A file's text; bytes that are not `encoding` (another encoding, a file cut inside a character) name the
    file, the byte offset and the line."""
    data = Path(path).read_bytes()
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        name = "UTF-8" if encoding.lower().replace("_", "-") in ("utf-8", "utf8", "utf-8-sig") else encoding
        raise DamagedBenchmarkData(f"{path}: not a {name} text file (byte {error.start}, line {line}: "
                                   f"{error.reason}); {RECOPY}") from None


def read_json(path: Path):
    """A JSON file's content; a file cut short or not JSON names the file, the line and the column."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise DamagedBenchmarkData(f"{path}: not a whole JSON file ({error.msg}: line {error.lineno} column "
                                   f"{error.colno}, char {error.pos}); {RECOPY}") from None


def load_json_list(path: Path) -> list:
    """A JSON file that must hold a list of records."""
    records = read_json(path)
    require(isinstance(records, list), f"{path}: expected a JSON list of records, found {type(records).__name__}")
    return records


def read_jsonl(path: Path) -> List[Tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSON-lines file; a line that is not a JSON object
    (the last one, in a file cut short) names the file and the line."""
    records = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DamagedBenchmarkData(f"{path}: line {number} is not JSON ({error.msg}: column {error.colno}); "
                                       f"{RECOPY}") from None
        require(isinstance(record, dict), f"{path}: line {number} is not a JSON object")
        records.append((number, record))
    return records


def read_csv_rows(path: Path, delimiter: str = ",", quoting: int = csv.QUOTE_MINIMAL,
                  encoding: str = "utf-8") -> List[Tuple[int, List[str]]]:
    """(line number, cells) for each non-blank row of a CSV / TSV file, header included; the line is where the
    row ends (a quoted cell may span lines). A quote left open (a file cut inside a cell) names the line."""
    reader = csv.reader(io.StringIO(read_text(path, encoding), newline=""), delimiter=delimiter, quoting=quoting,
                        strict=True)
    rows = []
    try:
        for cells in reader:
            if cells:
                rows.append((reader.line_num, cells))
    except csv.Error as error:
        raise DamagedBenchmarkData(f"{path}: line {reader.line_num}: not a valid CSV file ({error}); {RECOPY}") \
            from None
    return rows


def read_csv_records(path: Path, columns: Sequence[str], delimiter: str = ",", quoting: int = csv.QUOTE_MINIMAL,
                     encoding: str = "utf-8") -> List[Tuple[int, dict]]:
    """(line number, {column: cell}) for each row after the header, which must name every one of `columns` (it
    may name more). A row with another number of cells than the header (a file cut mid-row) names the line."""
    rows = read_csv_rows(path, delimiter, quoting, encoding)
    require(bool(rows), f"{path}: empty file, expected a header naming {', '.join(columns)}")
    (_, header), body = rows[0], rows[1:]
    missing = [column for column in columns if column not in header]
    require(not missing, f"{path}: missing column(s) {', '.join(missing)} (the header has {header})")
    for line, cells in body:
        require(len(cells) == len(header), f"{path}: line {line} has the wrong number of cells ({len(cells)}, the "
                                           f"header has {len(header)}; a file cut short?); {RECOPY}")
    return [(line, dict(zip(header, cells))) for line, cells in body]


def read_parquet_rows(path: Path, columns: Iterable[str], also_required: Iterable[str] = ()) -> List[dict]:
    """The given (non-image) columns of a parquet file as row dicts; the file must also hold the columns
    `also_required` (embedded images). A file pyarrow cannot read (cut short), a missing column or a string
    that is not UTF-8 names the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(columns)
    try:
        names = set(pq.read_schema(path).names)
        missing = sorted({*columns, *also_required} - names)
        rows = [] if missing else pq.read_table(path, columns=columns).to_pylist()
    except (OSError, pa.ArrowException, UnicodeDecodeError) as error:  # pyarrow's messages do not name the file
        raise DamagedBenchmarkData(f"{path}: cannot read the parquet shard ({error}); {RECOPY}") from None
    require(not missing, f"{path}: missing column(s) {', '.join(missing)}")
    return rows

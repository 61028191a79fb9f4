"""Replacement words of CLIP-CAE's perturbation attribution: the training captions' parsed words, per kind.

The CAE paper defines the perturbation attribution of a word as the *expected* drop of S(I, T) when the word is
replaced by other concepts [paper]. Here "other concepts" are words of the same kind (objects by objects,
attributes by attributes, relations by relations) drawn from the words the scene-graph parser found in the
training split's own captions (the preprocessing cache), in proportion to how often they occur there, never
the word itself (compared by BPE ids) [ours where the paper is silent: the source, the weighting, K].

A word's kind comes from the cache's spans: objects are `obj_spans`; relation words are the words of the
graph's relations; attribute words are the entities' attributes. A word that is both takes the first of
object > relation > attribute (the order `token_kinds` uses at token level). Plain numpy and Python: the
DataModule builds the vocabulary once from the kept training records, the module draws from it, and the
checkpoint stores it (`to_dict` / `from_dict`), so a resumed run draws from the same table.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

import numpy as np

# Kind codes of words and tokens (0 = no kind: articles, punctuation, ...).
OBJECT, ATTRIBUTE, RELATION = 1, 2, 3
KINDS = {"object": OBJECT, "attribute": ATTRIBUTE, "relation": RELATION}
KIND_NAMES = {code: name for name, code in KINDS.items()}
# When a word or token carries several kinds, the first of this order wins.
KIND_PRIORITY = (OBJECT, RELATION, ATTRIBUTE)

TokenIds = Tuple[int, ...]


def _nonempty_spans(caption: str, spans: Iterable[Sequence[int]]) -> List[Tuple[int, int]]:
    return [(int(start), int(end)) for start, end in spans if caption[int(start):int(end)].strip()]


def record_word_kinds(record: dict) -> Dict[Tuple[int, int], int]:
    """Character span -> kind code of every parsed word of one cache record (object > relation > attribute)."""
    caption, graph = record["caption"], record["graph"]
    spans = {
        OBJECT: _nonempty_spans(caption, record["obj_spans"]),
        RELATION: _nonempty_spans(caption, (w for relation in graph["relations"] for w in relation["words"])),
        ATTRIBUTE: _nonempty_spans(caption, (a for entity in graph["entities"] for a in entity["attributes"])),
    }
    kinds: Dict[Tuple[int, int], int] = {}
    for kind in KIND_PRIORITY:
        for span in spans[kind]:
            kinds.setdefault(span, kind)
    return kinds


def count_words(records: Iterable[dict]) -> Dict[int, Counter]:
    """Occurrences of each parsed word (lower-cased text) per kind code, over the records."""
    counts: Dict[int, Counter] = {kind: Counter() for kind in KIND_PRIORITY}
    for record in records:
        caption = record["caption"]
        for (start, end), kind in record_word_kinds(record).items():
            counts[kind][caption[start:end].strip().lower()] += 1
    return counts


@dataclass
class KindTable:
    """The words of one kind: BPE ids, a readable text and the count of each, in a fixed order."""

    ids: List[TokenIds]
    texts: List[str]
    counts: np.ndarray  # int64 [V]

    def __post_init__(self):
        self.counts = np.asarray(self.counts, dtype=np.int64)
        self.cumulative = np.cumsum(self.counts)  # inclusive: word i covers [cumulative[i] - counts[i], cumulative[i])
        self.index = {ids: i for i, ids in enumerate(self.ids)}

    def __len__(self) -> int:
        return len(self.ids)


class WordVocabulary:
    """Per kind (object / attribute / relation), the replacement words and their frequencies.

    Args:
        tables: kind code -> `KindTable`; every kind needs at least two distinct words (a word is never
            replaced by itself).
    """

    def __init__(self, tables: Dict[int, KindTable]):
        for kind in KIND_PRIORITY:
            if len(tables.get(kind, ())) < 2:
                raise ValueError(f"the replacement vocabulary has {len(tables.get(kind, ()))} distinct "
                                 f"{KIND_NAMES[kind]} word(s); CAE's kind-preserving perturbation needs at least 2 "
                                 f"per kind (more training captions, or method.attribution.replacement=token)")
        self.tables = tables

    @classmethod
    def from_counts(cls, counts: Dict[int, Counter], tokenizer) -> "WordVocabulary":
        """Tokenise every counted word alone; words with the same BPE ids are one entry (counts added).

        Entries are ordered by text, so the table (and every draw from it) depends only on the counts.
        """
        tables = {}
        for kind in KIND_PRIORITY:
            merged: Dict[TokenIds, List] = {}
            for text in sorted(counts.get(kind, {})):
                ids = tuple(int(i) for i in tokenizer.encode(text))
                if not ids:
                    continue
                entry = merged.setdefault(ids, [text, 0])
                entry[1] += counts[kind][text]
            ordered = sorted(merged.items(), key=lambda item: (item[1][0], item[0]))
            tables[kind] = KindTable([ids for ids, _ in ordered], [e[0] for _, e in ordered],
                                     [e[1] for _, e in ordered])
        return cls(tables)

    @classmethod
    def from_records(cls, records: Iterable[dict], tokenizer) -> "WordVocabulary":
        return cls.from_counts(count_words(records), tokenizer)

    def draw(self, kind: int, word: TokenIds, rng: np.random.Generator, count: int) -> List[TokenIds]:
        """`count` words of `kind` drawn with replacement in proportion to their counts, never `word` itself.

        Exact conditional sampling in one pass: a uniform integer over the total count without `word`'s own
        share, shifted past that share, picks the entry whose cumulative interval contains it.
        """
        table = self.tables[kind]
        own = table.index.get(tuple(word))
        own_count = int(table.counts[own]) if own is not None else 0
        total = int(table.cumulative[-1]) - own_count
        if total <= 0:
            raise ValueError(f"no {KIND_NAMES[kind]} word other than {table.texts[own]!r} to replace it with")
        draws = rng.integers(0, total, size=count)
        if own is not None:
            own_start = int(table.cumulative[own]) - own_count
            draws = np.where(draws >= own_start, draws + own_count, draws)
        return [table.ids[i] for i in np.searchsorted(table.cumulative, draws, side="right")]

    def sizes(self) -> Dict[str, int]:
        return {KIND_NAMES[kind]: len(table) for kind, table in self.tables.items()}

    def to_dict(self) -> dict:
        """JSON-serialisable form (stored in the checkpoint)."""
        return {KIND_NAMES[kind]: {"ids": [list(ids) for ids in table.ids], "texts": list(table.texts),
                                   "counts": table.counts.tolist()} for kind, table in self.tables.items()}

    @classmethod
    def from_dict(cls, state: dict) -> "WordVocabulary":
        return cls({KINDS[name]: KindTable([tuple(ids) for ids in table["ids"]], list(table["texts"]),
                                           table["counts"]) for name, table in state.items()})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WordVocabulary) and self.to_dict() == other.to_dict()


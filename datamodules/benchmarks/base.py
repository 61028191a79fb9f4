"""What every benchmark provides: items from its official files, a per-item rule, and aggregates.

Every aggregate is computed from stored per-item outcomes, and every comparison is a strict `>`: a tie is
wrong (np.argmax would silently break ties toward the first option, which flips the answer between
datasets whose gold index is 0 and those whose gold index is 1).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np


@dataclass
class Item:
    """One benchmark item: its images and texts, scored as a similarity matrix [len(images), len(texts)]."""

    id: str
    images: List[str]
    texts: List[str]
    meta: Dict[str, str] = field(default_factory=dict)


class MissingBenchmarkData(FileNotFoundError):
    """A benchmark root without the files the benchmark reads; the message lists them."""


class Benchmark(ABC):
    """A benchmark over the files under `root` (its official layout)."""

    name: str = ""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.check_files()

    @abstractmethod
    def required_files(self) -> List[str]:
        """Paths relative to `root` that must exist."""

    @abstractmethod
    def items(self) -> List[Item]:
        """Every item, read from the official files."""

    @abstractmethod
    def outcome(self, item: Item, similarity: np.ndarray) -> Dict[str, object]:
        """The per-item result (stored, JSON-serialisable) from the item's similarity matrix."""

    @abstractmethod
    def aggregate(self, outcomes: Sequence[Dict[str, object]]) -> Dict[str, float]:
        """The published aggregates (percent), computed from per-item outcomes only."""

    def check_files(self) -> None:
        missing = [name for name in self.required_files() if not (self.root / name).exists()]
        if missing:
            raise MissingBenchmarkData(f"{self.name}: {self.root} lacks {', '.join(missing)}; expected files: "
                                       f"{', '.join(self.required_files())}")


def percent(hits: Sequence[bool]) -> float:
    return 100.0 * float(np.mean(hits)) if len(hits) else float("nan")

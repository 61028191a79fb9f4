"""Aggregates over several registry benchmarks: the number a paper reports for sets the registry keeps apart.

What'sUp's Table 1, for one, reports macro averages of subsets (subset A with B, COCO-spatial one- with
two-object, GQA-spatial likewise), while each subset is its own registry benchmark. A `CombinedAggregate` names
its parts and the aggregate keys it averages; the results writer computes it from the parts' aggregates, and
only when every part was run: a mean over some of the parts would be another number under the same name.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CombinedAggregate:
    """The unweighted mean of `keys` over the benchmarks `parts` (each part weighs the same, whatever its size).

    Attributes:
        name: the results-table name; it must differ from every registry benchmark name.
        description: what the number is and where it is published.
        parts: the registry benchmarks it averages.
        keys: the aggregate keys it averages; every part must report each of them.
    """

    name: str
    description: str
    parts: tuple[str, ...]
    keys: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len(set(self.parts)) != len(self.parts) or not self.keys:
            raise ValueError(f"combined aggregate {self.name!r}: needs two or more distinct parts and one key or "
                             f"more, got parts {self.parts} and keys {self.keys}")

    @property
    def headline(self) -> tuple[str, ...]:
        return self.keys

    def applies_to(self, benchmarks: Mapping[str, object]) -> bool:
        """Whether every part is among `benchmarks` (the names of a run's results)."""
        return all(part in benchmarks for part in self.parts)

    def compute(self, aggregates: Mapping[str, Mapping[str, object]]) -> dict[str, float]:
        """Each key's mean over the parts, then each part's own value as `<part>/<key>`.

        A part whose value is undefined (NaN, or None as `aggregates.json` stores it) makes the mean NaN.
        """
        absent = [part for part in self.parts if part not in aggregates]
        if absent:
            raise KeyError(f"combined aggregate {self.name!r} needs the aggregates of {', '.join(absent)}")
        values = {key: [self._value(aggregates[part], part, key) for part in self.parts] for key in self.keys}
        means = {key: float(np.mean(parts)) for key, parts in values.items()}
        return {**means, **{f"{part}/{key}": value for key, parts in values.items()
                            for part, value in zip(self.parts, parts)}}

    def _value(self, aggregates: Mapping[str, object], part: str, key: str) -> float:
        if key not in aggregates:
            raise ValueError(f"combined aggregate {self.name!r}: {part} reports no {key!r} "
                             f"(its keys: {', '.join(map(str, aggregates))})")
        value = aggregates[key]
        return math.nan if value is None else float(value)

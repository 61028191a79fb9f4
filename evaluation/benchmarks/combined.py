"""Numbers a paper reports over several registry benchmarks: combined aggregates and composites.

Two kinds, one interface (`name`, `description`, `parts`, `headline`, `published`, `applies_to`, `missing`,
`compute`), registered together in `evaluation.benchmarks.COMBINED` in the order they are computed:

- `CombinedAggregate`: the same keys averaged over subsets the registry keeps apart (What'sUp's Table 1 averages
  subset A with B, COCO-spatial one- with two-object). Computed only when every part was run.
- `Composite`: one headline number from each of several benchmarks, or of other combined numbers, averaged with
  equal weight: ARO's mean of its four sets, vl_compo's `comp_avg` over its 12 benchmarks, fsc-clip's over its 11.
  Shown as soon as one part was run, but its mean is a number only when every part was: otherwise it is NaN and
  `missing` names the parts it lacks. A mean over the parts at hand would be another number under the same name,
  and would look comparable to the published one.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from evaluation.benchmarks.sources import Published


@dataclass(frozen=True)
class CombinedAggregate:
    """The unweighted mean of `keys` over the benchmarks `parts` (each part weighs the same, whatever its size).

    Attributes:
        name: the results-table name; it must differ from every registry benchmark name.
        description: what the number is and where it is published.
        parts: the registry benchmarks it averages.
        keys: the aggregate keys it averages; every part must report each of them.
        published: numbers published for the reference model, by key (`sources.Published`).
    """

    name: str
    description: str
    parts: tuple[str, ...]
    keys: tuple[str, ...]
    published: Mapping[str, Published] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len(set(self.parts)) != len(self.parts) or not self.keys:
            raise ValueError(f"combined aggregate {self.name!r}: needs two or more distinct parts and one key or "
                             f"more, got parts {self.parts} and keys {self.keys}")

    @property
    def headline(self) -> tuple[str, ...]:
        return self.keys

    def applies_to(self, available: Collection[str]) -> bool:
        """Whether every part is among `available` (the names of a run's results)."""
        return all(part in available for part in self.parts)

    def missing(self, available: Collection[str]) -> list[str]:
        """Parts absent from `available` (empty whenever the aggregate applies)."""
        return [part for part in self.parts if part not in available]

    def compute(self, aggregates: Mapping[str, Mapping[str, object]]) -> dict[str, float]:
        """Each key's mean over the parts, then each part's own value as `<part>/<key>`.

        A part whose value is undefined (NaN, or None as `aggregates.json` stores it) makes the mean NaN.
        """
        absent = self.missing(aggregates)
        if absent:
            raise KeyError(f"combined aggregate {self.name!r} needs the aggregates of {', '.join(absent)}")
        values = {key: [part_value(aggregates[part], self.name, part, key) for part in self.parts]
                  for key in self.keys}
        means = {key: float(np.mean(parts)) for key, parts in values.items()}
        return {**means, **{f"{part}/{key}": value for key, parts in values.items()
                            for part, value in zip(self.parts, parts)}}


@dataclass(frozen=True)
class Composite:
    """The unweighted mean of one number from each part: `terms` pairs a part (a registry benchmark or an earlier
    combined number) with the aggregate key it contributes.

    Attributes:
        name: the results-table name (distinct from every benchmark and combined name).
        description: what the number is and who publishes it.
        terms: `(part, key)` pairs, one per part.
        published: numbers published for the reference model under `key` (`sources.Published`).
        key: the name of the mean among the composite's aggregates (default "mean").
    """

    name: str
    description: str
    terms: tuple[tuple[str, str], ...]
    published: Mapping[str, Published] = field(default_factory=dict)
    key: str = "mean"

    def __post_init__(self) -> None:
        if len(self.terms) < 2 or len(set(self.parts)) != len(self.parts):
            raise ValueError(f"composite {self.name!r}: needs two or more distinct parts, got {self.terms}")

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(part for part, _ in self.terms)

    @property
    def headline(self) -> tuple[str, ...]:
        return (self.key, "parts_scored")

    def applies_to(self, available: Collection[str]) -> bool:
        """Shown once any part is among `available`: the table then says what the mean lacks."""
        return any(part in available for part in self.parts)

    def missing(self, available: Collection[str]) -> list[str]:
        return [part for part in self.parts if part not in available]

    def compute(self, aggregates: Mapping[str, Mapping[str, object]]) -> dict[str, float]:
        """The mean (NaN unless every part is there and defined), each part's value as `<part>/<key>` (NaN for an
        absent part), and `parts_scored`, the number of parts with a defined value."""
        values = {f"{part}/{key}": (part_value(aggregates[part], self.name, part, key) if part in aggregates
                                    else math.nan) for part, key in self.terms}
        scored = sum(not math.isnan(value) for value in values.values())
        mean = float(np.mean(list(values.values()))) if scored == len(values) else math.nan
        return {self.key: mean, **values, "parts_scored": float(scored)}


def part_value(aggregates: Mapping[str, object], name: str, part: str, key: str) -> float:
    """`aggregates[key]` of `part` as a float (None, as `aggregates.json` stores NaN, is NaN); a part that does
    not report the key is an error naming what it reports."""
    if key not in aggregates:
        raise ValueError(f"combined aggregate {name!r}: {part} reports no {key!r} "
                         f"(its keys: {', '.join(map(str, aggregates))})")
    value = aggregates[key]
    return math.nan if value is None else float(value)

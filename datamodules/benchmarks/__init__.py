"""Evaluation benchmarks by name (`BENCHMARKS`); each reads its official file format from a local root."""
from __future__ import annotations

from typing import Dict, Type

from datamodules.benchmarks.base import Benchmark, Item, MissingBenchmarkData
from datamodules.benchmarks.sugarcrepe import SugarCrepe

BENCHMARKS: Dict[str, Type[Benchmark]] = {
    "sugarcrepe": SugarCrepe,
}


def build_benchmark(name: str, root, **options) -> Benchmark:
    """The benchmark registered as `name`; an unknown name lists the valid ones."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; registered: {', '.join(sorted(BENCHMARKS))}")
    return BENCHMARKS[name](root, **options)


__all__ = ["BENCHMARKS", "Benchmark", "Item", "MissingBenchmarkData", "build_benchmark"]

"""Evaluation benchmarks by name (`BENCHMARKS`); each reads its official file format from a local root.

The order here is the order of `--all` and of the results tables: compositional benchmarks first, then
retrieval, zero-shot classification and the text-only STS probes.
"""
from __future__ import annotations

from typing import Dict, Type

from datamodules.benchmarks.aro import COCOOrder, Flickr30kOrder, VGAttribution, VGRelation
from datamodules.benchmarks.base import Benchmark, ImageRef, Item, ItemBenchmark, MissingBenchmarkData
from datamodules.benchmarks.retrieval import CocoRetrieval, Flickr30kRetrieval
from datamodules.benchmarks.sts import STSB, SickR
from datamodules.benchmarks.sugarcrepe import SugarCrepe
from datamodules.benchmarks.two_by_two import BiSCoRCtrl, BiVLC, ShapesSwap, Winoground
from datamodules.benchmarks.valse import Valse
from datamodules.benchmarks.vlchecklist import VLCheckList
from datamodules.benchmarks.whatsup import (WhatsUpA, WhatsUpB, WhatsUpCocoOne, WhatsUpCocoTwo, WhatsUpGqaOne,
                                            WhatsUpGqaTwo)
from datamodules.benchmarks.zeroshot import ZeroShotClassification

BENCHMARKS: Dict[str, Type[Benchmark]] = {cls.name: cls for cls in (
    SugarCrepe, VGRelation, VGAttribution, COCOOrder, Flickr30kOrder, Valse, VLCheckList,
    WhatsUpA, WhatsUpB, WhatsUpCocoOne, WhatsUpCocoTwo, WhatsUpGqaOne, WhatsUpGqaTwo,
    Winoground, BiVLC, BiSCoRCtrl, ShapesSwap,
    CocoRetrieval, Flickr30kRetrieval, ZeroShotClassification, SickR, STSB)}


def build_benchmark(name: str, root, **options) -> Benchmark:
    """The benchmark registered as `name`; an unknown name lists the valid ones."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; registered: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name](root, **options)


__all__ = ["BENCHMARKS", "Benchmark", "ImageRef", "Item", "ItemBenchmark", "MissingBenchmarkData",
           "build_benchmark"]

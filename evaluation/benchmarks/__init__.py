"""Evaluation benchmarks by name (`BENCHMARKS`); each reads its official file format from a local root.

The order here is the order of `--all` and of the results tables: compositional benchmarks first, then
retrieval, zero-shot classification and the text-only STS probes. `COMBINED` holds the numbers a paper reports
over several of them, in the order they are computed: What'sUp's Table 1 averages, ARO's mean of four, and the
suites' one-number summaries (vl_compo's `comp_avg`, fsc-clip's `Comp`), each NaN until all its parts were run.
"""
from __future__ import annotations

from typing import Dict, Type

from evaluation.benchmarks.annotations import DamagedBenchmarkData
from evaluation.benchmarks.aro import ARO_MEAN, COCOOrder, Flickr30kOrder, VGAttribution, VGRelation
from evaluation.benchmarks.base import Benchmark, ImageRef, Item, ItemBenchmark, MissingBenchmarkData
from evaluation.benchmarks.coco_counterfactuals import CocoCounterfactuals, CocoCounterfactualsTest
from evaluation.benchmarks.cola import ColaMultiObject, ColaSingleObject
from evaluation.benchmarks.colorswap import ColorSwap
from evaluation.benchmarks.combined import CombinedAggregate, Composite
from evaluation.benchmarks.composites import SUITES
from evaluation.benchmarks.crepe import CrepeProductivity
from evaluation.benchmarks.elevater import Elevater
from evaluation.benchmarks.eqben import EqBen
from evaluation.benchmarks.imagecode import ImageCoDe
from evaluation.benchmarks.mmvp import MMVPVLM
from evaluation.benchmarks.retrieval import CocoRetrieval, Flickr30kRetrieval
from evaluation.benchmarks.spec import Spec
from evaluation.benchmarks.sts import STSB, SickR
from evaluation.benchmarks.sugarcrepe import SugarCrepe
from evaluation.benchmarks.sugarcrepe_pp import SugarCrepePP
from evaluation.benchmarks.svo_probes import SVOProbes
from evaluation.benchmarks.two_by_two import BiSCoRCtrl, BiVLC, ShapesSwap, Winoground
from evaluation.benchmarks.valse import Valse
from evaluation.benchmarks.vismin import VisMin
from evaluation.benchmarks.vlchecklist import VLCheckList
from evaluation.benchmarks.whatsup import (WHATSUP_COMBINED, WhatsUpA, WhatsUpB, WhatsUpCocoOne, WhatsUpCocoTwo,
                                            WhatsUpGqaOne, WhatsUpGqaTwo)
from evaluation.benchmarks.zeroshot import ShapesZeroShot, ZeroShotClassification

BENCHMARKS: Dict[str, Type[Benchmark]] = {cls.name: cls for cls in (
    SugarCrepe, SugarCrepePP, VGRelation, VGAttribution, COCOOrder, Flickr30kOrder, Valse, VLCheckList,
    WhatsUpA, WhatsUpB, WhatsUpCocoOne, WhatsUpCocoTwo, WhatsUpGqaOne, WhatsUpGqaTwo,
    Winoground, BiVLC, BiSCoRCtrl, VisMin, MMVPVLM, ColorSwap, EqBen, CrepeProductivity, Spec, SVOProbes,
    ColaMultiObject, ColaSingleObject, ImageCoDe, ShapesSwap,
    CocoRetrieval, Flickr30kRetrieval, CocoCounterfactuals, CocoCounterfactualsTest,
    ZeroShotClassification, Elevater, ShapesZeroShot, SickR, STSB)}

# Numbers a paper reports over several of the benchmarks above, in results-table order (`combined.py`).
COMBINED: Dict[str, CombinedAggregate | Composite] = {combined.name: combined
                                                     for combined in (*WHATSUP_COMBINED, ARO_MEAN, *SUITES)}


def build_benchmark(name: str, root, **options) -> Benchmark:
    """The benchmark registered as `name`; an unknown name lists the valid ones."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; registered: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name](root, **options)


__all__ = ["BENCHMARKS", "COMBINED", "Benchmark", "CombinedAggregate", "Composite", "DamagedBenchmarkData", "ImageRef",
           "Item", "ItemBenchmark", "MissingBenchmarkData", "build_benchmark"]

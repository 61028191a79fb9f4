"""Table helpers the report and the validity section share: metric titles, chance levels, interval text and
Markdown tables."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

from study.stats import Interval

TITLES = {"text": "swap text", "image": "swap image", "group": "swap group", "acc_attribute": "2-way attribute",
          "acc_relation": "2-way relation", "acc_object": "2-way object", "i2t_r1": "I2T R@1", "t2i_r1": "T2I R@1",
          "shape_top1": "zero-shot shape", "color_top1": "zero-shot colour", "zeroshot_top1": "zero-shot top-1",
          "retrieval_r1": "R@1 (both directions)"}
# What a random scorer gets: a 2x2 group score of 1/6 (Winoground's chance), a 2-way choice of 1/2, one of the
# world's 4 shapes or 6 colours.
CHANCE = {"group": 100.0 / 6, "text": 25.0, "image": 25.0, "acc_attribute": 50.0, "acc_relation": 50.0,
          "acc_object": 50.0, "shape_top1": 25.0, "color_top1": 100.0 / 6}


def interval_text(interval: Interval, digits: int = 1) -> str:
    """`mean [low, high]`; a single seed (or a frozen row, scored once) has no interval: `mean (one run)`."""
    mean = f"{interval.estimate:.{digits}f}"
    if not (math.isfinite(interval.low) and math.isfinite(interval.high)):
        return f"{mean} (one run)"
    return f"{mean} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"


def mechanism_text(interval: Interval) -> str:
    """Mechanism metrics come in any scale: three significant digits."""
    if not (math.isfinite(interval.low) and math.isfinite(interval.high)):
        return f"{interval.estimate:.3g} (one run)"
    return f"{interval.estimate:.3g} [{interval.low:.3g}, {interval.high:.3g}]"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int,
          numeric_to: Optional[int] = None) -> List[str]:
    """A Markdown table whose columns numeric_from .. numeric_to - 1 are right-aligned (numbers)."""
    numeric_to = len(header) if numeric_to is None else numeric_to
    rule = ["---:" if numeric_from <= index < numeric_to else "---" for index in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"] + \
           ["| " + " | ".join(row) + " |" for row in rows]

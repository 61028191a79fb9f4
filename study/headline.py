"""The study's headline table, for the repository's README, made from the same numbers as the page.

`python -m study.page --bundle results/study --out docs/study_results.md --readme README.md` rewrites the block
between `BLOCK_START` and `BLOCK_END` in the README: on the first reporting split, every row's swap group and
2-way relation, its group difference against its reference (the baseline in its condition; the frozen cosine for
the frozen-backbone rows) and, for a trained row in the contrast's condition, against itself in the other
condition (what the hard negatives add). A copy by hand would drift from the bundle; tests/test_study.py checks
that the committed README holds what the committed bundle makes.
"""
from __future__ import annotations

import textwrap
from typing import Dict, List, Optional, Tuple

from study.analysis import Comparison, Evaluations, Findings, contrast_of, reference_of
from study.report import by_key, report_rows
from study.settings import Study, StudyError
from study.tables import interval_text, table

BLOCK_START = "<!-- study-headline: made by `python -m study.page --readme`; edit the code or the bundle -->"
BLOCK_END = "<!-- /study-headline -->"
HEADLINE_METRIC = "group"
LINE_WIDTH = 120  # the README's prose is wrapped at the code's line length


def headline(study: Study, evaluations: Evaluations, findings: Findings, bundle: str) -> List[str]:
    """The block's lines (between its markers): a sentence saying what the numbers are, then the table."""
    split, settings = study.settings.splits[0], study.settings
    scored = sum(1 for run in study.runs if run.name in evaluations.scores)
    contrast = (f"; `{settings.contrast[0]} - {settings.contrast[1]}`: the same method across the two conditions,"
                " seeds paired" if settings.contrast else "")
    sentence = (f"From the committed bundle `{bundle}` ({scored} of {len(study.runs)} grid runs scored), on "
                f"`{split}`: mean over seeds with its 95% interval, learning rate chosen on "
                f"`{settings.selection_split}`; differences of the swap group score paired by item and seed "
                f"(bootstrap), against the row's reference{contrast}.")
    return textwrap.wrap(sentence, LINE_WIDTH, break_on_hyphens=False) + [""] + headline_table(study, findings,
                                                                                                 split)


def headline_table(study: Study, findings: Findings, split: str) -> List[str]:
    settings = study.settings
    summaries = by_key(findings.summaries)
    cells = {(cell.method, cell.condition, cell.split): cell for cell in findings.cells}
    differences: Dict[Tuple[str, str, str], Comparison] = {
        (d.method, d.condition, d.reference): d for d in findings.differences
        if d.split == split and d.metric == HEADLINE_METRIC}
    rows = []
    for method, condition in report_rows(study, findings.summaries, split):
        cell = cells[(method, condition, split)]
        reference = reference_of(cell, settings, cells)
        other = contrast_of(cell, settings, cells)
        rows.append([method, condition,
                     score(summaries.get((method, condition, split, "group"))),
                     score(summaries.get((method, condition, split, "acc_relation"))),
                     difference(differences, method, condition, reference),
                     difference(differences, method, condition, other),
                     reference[0] if reference else "-"])
    if not rows:
        return ["(no scored runs)"]
    contrast = f"group: {settings.contrast[0]} - {settings.contrast[1]}" if settings.contrast else "contrast"
    return table(["method", "negatives", "swap group", "2-way relation", "group - reference", contrast,
                  "reference"], rows, 2, 6)


def score(summary) -> str:
    return interval_text(summary.interval) if summary else "-"


def difference(differences: Dict[Tuple[str, str, str], Comparison], method: str, condition: str,
               reference: Optional[Tuple[str, object]]) -> str:
    found = differences.get((method, condition, reference[0])) if reference else None
    return interval_text(found.interval) if found else "-"


def replace_block(text: str, block: List[str], where: str) -> str:
    """`text` with the lines between its markers replaced by `block`; a clear error without both markers."""
    start, end = text.find(BLOCK_START), text.find(BLOCK_END)
    if start < 0 or end < start:
        raise StudyError(f"{where} has no headline block: put the lines\n{BLOCK_START}\n{BLOCK_END}\n"
                         "where the study's table belongs")
    return text[:start] + BLOCK_START + "\n" + "\n".join(block) + "\n" + text[end:]

"""The study's generated text outside its page: the README's headline block and the blocks of docs/study.md, made
from the same numbers as the page.

`python -m study.page --bundle results/study --out docs/study_results.md --readme README.md --doc docs/study.md`
rewrites the block between `BLOCK_START` and `BLOCK_END` in the README (`headline`): on the first reporting split,
whether the testbed is shown valid, every row's chosen setting with its selection flags, swap group and 2-way
relation, its group difference against its reference (the baseline in its condition; the frozen cosine for the
frozen-backbone rows) and, for a trained row in the contrast's condition, against itself in the other condition
(what the hard negatives add); an inactive row's cells say so instead of numbers; then the claims on that split
and metric. In docs/study.md, each block between `<!-- study:NAME ... -->` and `<!-- /study:NAME -->` is rewritten
(`doc_blocks`): every figure the study page quotes is generated, so none can drift from the bundle (a copy by
hand would); tests/test_study.py checks that the committed README and docs/study.md hold what the committed
bundle makes, and that docs/study.md holds no result figure outside its blocks.
"""
from __future__ import annotations

import re
import textwrap
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from study import validity as study_validity
from study.analysis import Comparison, Evaluations, Findings, Selection, claims, contrast_of, reference_of
from study.report import (activity_section, by_key, checks_section, claim_lines, claims_statement, p_text,
                          report_rows, selection_rule, selection_table, seed_t_text, setting_label, verdict)
from study.settings import Study, StudyError
from study.tables import TITLES, interval_text, table

BLOCK_START = "<!-- study-headline: made by `python -m study.page --readme`; edit the code or the bundle -->"
BLOCK_END = "<!-- /study-headline -->"
HEADLINE_METRIC = "group"
LINE_WIDTH = 120  # the README's prose is wrapped at the code's line length
INACTIVE = "inactive"


# A wrapped line must not open a Markdown list, heading or quote.
BLOCK_OPENER = re.compile(r"^([-+*] |\d+[.)] |#|>)")


def wrap(text: str) -> List[str]:
    """`text` wrapped at LINE_WIDTH, a word moved down wherever a line would start a Markdown block."""
    lines = textwrap.wrap(text, LINE_WIDTH, break_on_hyphens=False)
    for index in range(1, len(lines)):
        while BLOCK_OPENER.match(lines[index]) and " " in lines[index - 1]:
            head, last = lines[index - 1].rsplit(" ", 1)
            lines[index - 1], lines[index] = head, f"{last} {lines[index]}"
    return lines


def validity_sentence(validity: Optional[study_validity.Validity], short: bool = False) -> str:
    """Whether the testbed is shown valid; `short`: the checks not passed by key only (the README's)."""
    if validity is None:
        return "Testbed validity: not measured (the study has no validity block); every comparison is provisional."
    if validity.passed:
        return "Testbed validity: every check passes."
    failed = (", ".join(dict.fromkeys(f"({c.key}) {c.status}" for c in validity.not_passed())) if short
              else study_validity.not_passed_text(validity))
    return (f"Testbed validity: not shown valid ({failed}); every comparison is provisional, a measurement of this "
            "testbed and no conclusion about the methods.")


def headline(study: Study, evaluations: Evaluations, findings: Findings, bundle: str,
             validity: Optional[study_validity.Validity] = None) -> List[str]:
    """The block's lines (between its markers): what the numbers are, the validity verdict, the table, the claims."""
    split, settings = study.settings.splits[0], study.settings
    scored = sum(1 for run in study.runs if run.name in evaluations.scores)
    contrast = (f"; `{settings.contrast[0]} - {settings.contrast[1]}`: the same method across the two conditions,"
                " seeds paired" if settings.contrast else "")
    sentence = (f"From `{bundle}` ({scored} of {len(study.runs)} grid runs scored), on `{split}`: mean over seeds "
                f"[95% interval], lr chosen on `{settings.selection_split}`; swap group differences paired by item "
                f"and seed (bootstrap) against the row's reference{contrast}.")
    return wrap(sentence) + [""] + headline_table(study, findings, split) + [""] + wrap(
        validity_sentence(validity, short=True) + " " + inactive_sentence(findings) + headline_claims(findings, split))


def inactive_sentence(findings: Findings) -> str:
    if not findings.inactive:
        return ""
    return ("`inactive`: no decision of the row's runs differs from its baseline's paired runs; its own term never "
            "acted. ")


def headline_claims(findings: Findings, split: str) -> str:
    """The claims on the headline split and metric (the page lists every claim)."""
    found = [c for c in claims(findings.differences, findings.inactive)
             if (c.split, c.metric) == (split, HEADLINE_METRIC)]
    body = "; ".join(f"`{c.method}` ({c.condition}) {c.interval.estimate:+.1f}, t [{c.seed.interval.low:.1f}, "
                     f"{c.seed.interval.high:.1f}]" for c in found) or "none"
    return (f"Claims, `{split}` {TITLES[HEADLINE_METRIC]} against the reference (bootstrap and seed-level paired t "
            f"both exclude 0; 95% each, no multiplicity correction): {body}.")


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
        setting = setting_label(cell.setting, findings.flags.get((method, condition)))
        if (method, condition) in findings.inactive:
            rows.append([f"{method} ({INACTIVE})", condition, setting, INACTIVE, INACTIVE, INACTIVE, INACTIVE,
                         reference[0] if reference else "-"])
            continue
        rows.append([method, condition, setting,
                     score(summaries.get((method, condition, split, "group"))),
                     score(summaries.get((method, condition, split, "acc_relation"))),
                     difference(differences, method, condition, reference),
                     difference(differences, method, condition, other),
                     reference[0] if reference else "-"])
    if not rows:
        return ["(no scored runs)"]
    contrast = f"group: {settings.contrast[0]} - {settings.contrast[1]}" if settings.contrast else "contrast"
    return table(["method", "negatives", "setting", "swap group", "2-way relation", "group - reference", contrast,
                  "reference"], rows, 3, 7)


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


# ----- docs/study.md ------------------------------------------------------------------------------------------
DOC_START = "<!-- study:{name}: made by `python -m study.page --doc`; edit the code or the bundle -->"
DOC_END = "<!-- /study:{name} -->"
DOC_MARKER = re.compile(r"<!-- study:([a-z-]+):")


def doc_blocks(study: Study, selections: Mapping[Tuple[str, str], Selection], findings: Findings,
               validity: Optional[study_validity.Validity]) -> Dict[str, List[str]]:
    """Every block docs/study.md may hold, by name: `validity` (the verdict and each check), `selection` (every
    setting's validation mean and the choice's flags), `activity` (which rows' own terms acted), `contrast` (what
    the hard negatives add, both intervals), `claims` (every claim and how they were read), `checks` (the
    one-seed checks beside the rows)."""
    blocks = {"validity": validity_block(validity, study.settings.selection_split),
              "selection": selection_table(study, selections, findings.flags) + [""] + wrap(selection_rule()[0]),
              "activity": strip_heading(activity_section(study, findings)) or ["(no row is compared with the "
                                                                                 "baseline)"],
              "contrast": contrast_block(study, findings),
              "claims": wrap(claims_statement(findings, validity)) + [""] + claim_lines(findings, validity),
              "checks": strip_heading(checks_section(study, findings.checks)) or ["(the study has no checks)"]}
    return {name: wrapped(trimmed(lines)) for name, lines in blocks.items()}


def strip_heading(lines: Sequence[str]) -> List[str]:
    """A page section without its `## ` heading (the document has its own)."""
    lines = list(lines)
    return lines[2:] if lines and lines[0].startswith("## ") else lines


def wrapped(lines: Sequence[str]) -> List[str]:
    """Markdown lines with prose and list items wrapped at LINE_WIDTH (a list item's lines indented under it);
    tables, blank lines and short lines as they are."""
    found: List[str] = []
    for line in lines:
        if len(line) <= LINE_WIDTH or line.startswith("|"):
            found.append(line)
        elif line.startswith("- "):
            found += textwrap.wrap(line, LINE_WIDTH, subsequent_indent="  ", break_on_hyphens=False)
        else:
            found += wrap(line)
    return found


def trimmed(lines: Sequence[str]) -> List[str]:
    lines = list(lines)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def validity_block(validity: Optional[study_validity.Validity], selection_split: str) -> List[str]:
    if validity is None:
        return ["(the study has no validity block: nothing is shown valid)"]
    section = study_validity.markdown_section(validity, selection_split)
    checks = [line for line in section if line.startswith("- **")]
    return wrap(validity_sentence(validity)) + [""] + [f"- World checksum: `{validity.world or 'not recorded'}`."] + \
        checks


def contrast_block(study: Study, findings: Findings) -> List[str]:
    """The contrast rows (each method in one condition against itself in the other), every split and metric, with
    both intervals and their reading."""
    contrast = study.settings.contrast
    if contrast is None:
        return ["(the study has no contrast)"]
    found = [d for d in findings.differences if d.condition == contrast[0]
             and d.reference == f"{d.method} ({contrast[1]})"]
    if not found:
        return ["(no contrast row scored)"]
    rows = [[d.split, d.method, TITLES[d.metric], interval_text(d.interval), seed_t_text(d),
             p_text(d.seed.p_value) if d.seed else "-", verdict(d, findings.inactive)] for d in found]
    return table(["split", "method", "metric", f"{contrast[0]} - {contrast[1]} [95% bootstrap]",
                  "seed-level t [95%]", "p (seed t)", "reading"], rows, 3, 6)


def replace_doc_blocks(text: str, blocks: Mapping[str, List[str]], where: str) -> str:
    """`text` with each `study:NAME` block's lines replaced by `blocks[NAME]`; a block the text names that is not
    made, or one without its end marker, is a StudyError (nothing is written)."""
    for name in dict.fromkeys(DOC_MARKER.findall(text)):
        if name not in blocks:
            raise StudyError(f"{where} has a block `study:{name}` that the study does not make; blocks: "
                             f"{sorted(blocks)}")
        start_marker, end_marker = DOC_START.format(name=name), DOC_END.format(name=name)
        start, end = text.find(start_marker), text.find(end_marker)
        if start < 0 or end < start:
            raise StudyError(f"{where}: the block `study:{name}` needs the lines\n{start_marker}\n{end_marker}")
        text = text[:start] + start_marker + "\n" + "\n".join(blocks[name]) + "\n" + text[end:]
    return text


def outside_blocks(text: str) -> str:
    """The text of a document without its generated blocks (markers and contents)."""
    return re.sub(r"<!-- study:([a-z-]+):.*?<!-- /study:\1 -->", "", text, flags=re.S)

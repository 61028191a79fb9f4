"""`python -m study.page --bundle results/study --out docs/study_results.md`: the study's page from its bundle.

The page is the study report's Markdown (`study.report`: testbed validity, scores per split, selection with its
flags, which rows acted, paired differences with both intervals, the claims, the composition / recognition
trade-off, the checks beside each row, mechanisms, validation curves, missing runs), made from the results bundle
alone (`study/bundle.py`) with numpy and the standard library: no run folder, no world and no model is read, so a
clean clone makes the committed page again, byte for byte (tests/test_study.py checks it). Its figures go to
`images/` beside the page, as `study_<name>.png` (`--no-plots`: the page alone; the figures need matplotlib).
With `--readme README.md`, the README's headline block is rewritten from the same numbers; with `--doc
docs/study.md`, that page's generated blocks (`study/headline.py`). With `--refresh-report`, the bundle's own
`report.json` and README.md are written again from the bundle alone (after a change of the report's code; the
runs' records are not touched).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from core.cli import add_output
from core.files import atomic_write_text
from study.analysis import select_settings
from study.bundle import BUNDLE_README, bundled_study, load_bundle, report_document
from study.headline import doc_blocks, headline, replace_block, replace_doc_blocks
from study.records import README, REPORT_DOCUMENT, sweep_folder, write_json
from study.report import report_numbers, write_page
from study.settings import StudyError


def page_header(bundle: Path, out: Path) -> list:
    return [f"<!-- Made by `python -m study.page --bundle {bundle} --out {out}` from the results bundle; edit the "
            "code or the bundle, not this page. -->", "",
            f"The method study's results, made from the committed bundle `{bundle}` (its README.md gives the format "
            "and how to recompute any interval from the stored per-item outcomes). The design and the reading of "
            "these numbers: README, \"Method study\"."]


def make_page(bundle: Path, out: Path, plots: bool = True, readme: Optional[Path] = None,
              doc: Optional[Path] = None, refresh_report: bool = False) -> str:
    """The page's text (and, with `plots`, its figures), written to `out`; with `readme`, that file's headline
    block, and with `doc`, that file's generated blocks, rewritten from the same numbers; with `refresh_report`,
    the bundle's report.json and README.md written again from the bundle."""
    study, evaluations = load_bundle(bundle)
    selections = select_settings(study, evaluations)
    numbers = report_numbers(study, evaluations, selections)
    findings, validity = numbers
    # Every file is made before any is written: a README or a doc without its blocks is refused with nothing written.
    texts = {}
    if readme is not None:
        texts[Path(readme)] = replace_block(Path(readme).read_text(), headline(study, evaluations, findings,
                                                                                str(bundle), validity), str(readme))
    if doc is not None:
        texts[Path(doc)] = replace_doc_blocks(Path(doc).read_text(), doc_blocks(study, selections, findings,
                                                                                 validity), str(doc))
    name = bundled_study(bundle)
    source = f"the bundle `{bundle}` (`{name}/runs/*.json.gz`, `{name}/frozen/*.json.gz`)"
    page = write_page(study, evaluations, selections, out, page_header(bundle, out), source, plots, numbers)
    for path, text in texts.items():
        atomic_write_text(path, text)
    if refresh_report:
        write_json(sweep_folder(bundle, name) / REPORT_DOCUMENT,
                   report_document(study, evaluations, selections, findings, validity))
        atomic_write_text(Path(bundle) / README, BUNDLE_README)
    return page


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--bundle", type=Path, required=True, help="the results bundle (e.g. results/study)")
    add_output(parser, "file", required=True, help="the page (its figures go to images/ beside it)")
    parser.add_argument("--no-plots", action="store_true", help="write the page only, not its figures")
    parser.add_argument("--readme", type=Path, metavar="FILE",
                        help="also rewrite this file's study headline block (e.g. README.md)")
    parser.add_argument("--doc", type=Path, metavar="FILE",
                        help="also rewrite this file's generated `study:NAME` blocks (e.g. docs/study.md)")
    parser.add_argument("--refresh-report", action="store_true",
                        help="also write the bundle's report.json and README.md again from the bundle alone")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Path:
    args = parse_args(argv)
    try:
        make_page(args.bundle, args.out, plots=not args.no_plots, readme=args.readme, doc=args.doc,
                  refresh_report=args.refresh_report)
    except StudyError as err:
        raise SystemExit(f"study error: {err}") from None
    print(f"page: {args.out}")
    return args.out


if __name__ == "__main__":
    main()

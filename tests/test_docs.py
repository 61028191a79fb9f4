"""The documentation's links hold: README.md and docs/*.md link to files that exist and to headings that exist,
every `docs/<page>.md#anchor` cited in code, configs and the Makefile names a real heading, and no file cites the
team's private notes instead of the repository's own pages."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
THIS_FILE = Path(__file__).resolve()

# Notes kept outside the repository; a clone has none of them, so nothing may point at them. (Spelled in pieces
# so that only the list below, not this comment, would be found by a search for them.)
PRIVATE_NOTES = tuple(name + ".md" for name in ("METHODS", "BENCHMARKS", "DESIGN", "STYLE"))

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`+[^`]*`+")
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_CITATION = re.compile(r"docs/([\w.-]+\.md)(#[\w-]+)?")
CITING_FILES = re.compile(r"(\.py|\.ya?ml|(^|/)Makefile)$")
# Pages made by a command from committed data (`python -m study.page` from the results bundle): they exist once
# their data does (tests/test_study.py checks that the committed page is what the data makes).
MADE_PAGES = {"study_results.md": REPO / "results" / "study"}
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "runs", "data", "cache", ".gpu"}


# ----- GitHub's heading anchors ---------------------------------------------------------------------------------
def heading_text(markdown: str) -> str:
    """A heading's rendered text, as far as anchors go: a link keeps its text only (code and emphasis marks are
    punctuation, which `slug` drops)."""
    return re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (except '-' and '_'), spaces to '-'."""
    text = heading_text(heading).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def outside_code(lines: List[str]) -> Iterator[Tuple[int, str]]:
    """(line number, line) of the lines that are not inside a fenced code block."""
    fenced = False
    for number, line in enumerate(lines, start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def anchors(page: Path) -> Set[str]:
    """Every heading anchor of a Markdown page, repeated headings numbered as GitHub numbers them (-1, -2, ...)."""
    seen: Dict[str, int] = {}
    result = set()
    for _, line in outside_code(page.read_text(encoding="utf-8").splitlines()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


# ----- which files ----------------------------------------------------------------------------------------------
def repository_files() -> List[Path]:
    """Tracked and untracked-but-not-ignored files (git), else every file outside build and data folders."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                                capture_output=True, check=True).stdout.decode("utf-8").split("\0")
        return [REPO / name for name in listed if name and (REPO / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, dirs, names in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
            files += [Path(folder) / name for name in names]
        return files


def markdown_pages() -> List[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def links(page: Path) -> Iterator[Tuple[int, str]]:
    """(line number, target) of every Markdown link and image outside code blocks and inline code."""
    for number, line in outside_code(page.read_text(encoding="utf-8").splitlines()):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None


# ----- the slug rule itself ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("heading, expected", [
    ("CLIP-CAE", "clip-cae"),
    ("MACCO-CLIP", "macco-clip"),
    ("What'sUp", "whatsup"),
    ("TFLocal and TFGlobal", "tflocal-and-tfglobal"),
    ("SICK-R and STS-B", "sick-r-and-sts-b"),
    ("Options: original versus ours", "options-original-versus-ours"),
    ("The `data.masks` option", "the-datamasks-option"),
    ("snake_case stays", "snake_case-stays"),
])
def test_slug_follows_githubs_rule(heading, expected):
    assert slug(heading) == expected


def test_repeated_headings_get_numbered_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n## Setup\n```\n## not a heading\n```\n## Setup\n", encoding="utf-8")
    assert anchors(page) == {"title", "setup", "setup-1"}


# ----- the checks ---------------------------------------------------------------------------------------------------
def test_docs_pages_exist():
    assert (DOCS / "methods.md").is_file() and (DOCS / "evaluation.md").is_file()


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_of_a_page_resolves(page):
    """Each relative link names an existing file; a `#anchor` into a Markdown page names one of its headings."""
    broken = []
    for number, target in links(page):
        if is_external(target):
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"line {number}: {target} (no heading with anchor #{anchor} in {destination.name})")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


def test_docs_anchors_cited_in_code_configs_and_makefile_resolve():
    """`docs/<page>.md#anchor` in .py / .yaml files and the Makefile: the page exists and has the heading."""
    broken, cited = [], 0
    for path in repository_files():
        relative = path.relative_to(REPO).as_posix()
        if not CITING_FILES.search(relative):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            for match in CODE_CITATION.finditer(line):
                cited += 1
                page, anchor = DOCS / match.group(1), (match.group(2) or "")[1:]
                made_from = MADE_PAGES.get(match.group(1))
                if not page.is_file() and made_from is not None and not made_from.exists():
                    continue  # its data is not committed yet, so neither is the page
                if not page.is_file():
                    broken.append(f"{relative}:{number}: {match.group(0)} (no page docs/{match.group(1)})")
                elif anchor and anchor not in anchors(page):
                    broken.append(f"{relative}:{number}: {match.group(0)} (no heading #{anchor})")
    assert cited > 0, "no docs/<page>.md citation found in the code: is the search looking at the right files?"
    assert not broken, "citations of the docs that do not resolve:\n" + "\n".join(broken)


def test_no_file_cites_the_private_notes():
    offending = []
    for path in repository_files():
        if path.resolve() == THIS_FILE:
            continue
        content = path.read_bytes()
        offending += [f"{path.relative_to(REPO)}: {name}" for name in PRIVATE_NOTES if name.encode() in content]
    assert not offending, "files citing notes that are not in the repository (cite docs/ instead):\n" + \
        "\n".join(offending)

"""The documentation cannot rot: README.md, CONTRIBUTING.md and docs/*.md link to files and headings that exist; every
`python -m` module they name exists and answers `--help`, with every option they give it; every `make` target,
repository path and config key they name exists; docs/configuration.md is what the schema generates; every
`docs/<page>.md#anchor` cited in code, configs and the Makefile names a real heading; and no file cites notes
kept outside the repository instead of its own pages."""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Set, Tuple

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
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]


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
    pages = ("methods", "evaluation", "data-pipeline", "training", "slurm", "configuration", "study", "performance",
             "gpu")
    assert [page for page in pages if not (DOCS / f"{page}.md").is_file()] == []
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert [page for page in pages if f"(docs/{page}.md" not in readme] == [], "the README links every page"


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


# ----- what the pages tell a reader to type ------------------------------------------------------------------------
# Top-level folders whose files a page may name by path, and the repository's packages (`python -m` targets).
PATH_ROOTS = ("core", "parsers", "modeling", "datamodules", "evaluation", "lightning_modules", "testkit", "slurm",
              "perf", "gpucheck", "study", "configs", "tests", "docs")
TOP_LEVEL_FILES = ("Makefile", "requirements.txt", "setup.cfg", "pyproject.toml", "README.md")
# `python -m` modules of other projects that the pages may name.
EXTERNAL_MODULES = {"pip", "venv", "pytest", "spacy"}
CONFIG_SECTIONS = ("model", "method", "data", "optim", "trainer", "checkpoint", "preprocess", "evaluation", "monitor")
# The pages' example of the error a typo gives.
DELIBERATE_TYPOS = {"trainer.max_stepz"}
FILE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".jsonl", ".md", ".txt", ".ckpt", ".pt", ".png", ".csv", ".tsv")

PYTHON_M = re.compile(r"python3?\s+-m\s+([A-Za-z_][\w.]*)(.*)")
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")
MAKE_TARGET = re.compile(r"(?<![\w-])make\s+([a-z][\w-]*)")
REPO_PATH = re.compile(r"(?<![\w./<$-])((?:%s)/[\w./<>*{},-]*[\w>*}]|(?:%s)(?![\w.-]))"
                       % ("|".join(PATH_ROOTS), "|".join(re.escape(name) for name in TOP_LEVEL_FILES)))
CONFIG_KEY = re.compile(r"(?<![\w./<$-])((?:%s)(?:\.[\w{},<>*-]+)+)(?![\w(])" % "|".join(CONFIG_SECTIONS))
PLACEHOLDER = re.compile(r"<[^>]*>|\b[A-Z][A-Z_]+\b")
BRACES = re.compile(r"\{([^{}]*,[^{}]*)\}")


def code_texts(page: Path) -> List[str]:
    """The page's code: each fenced block's lines with backslash continuations joined, and each inline code span
    (which may wrap across lines)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    texts, prose, block, fenced = [], [], [], False
    for line in lines:
        if FENCE.match(line):
            if fenced:
                texts += "\n".join(block).replace("\\\n", " ").splitlines()
                block = []
            fenced = not fenced
        elif fenced:
            block.append(line)
        else:
            prose.append(line)
    texts += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", "\n".join(prose))]
    return texts


def documented_commands() -> Dict[str, Dict[str, Set[str]]]:
    """{module: {option: pages naming it}} for every `python -m module ...` on the pages (the options are those
    written after the module, up to the end of its command)."""
    commands: Dict[str, Dict[str, Set[str]]] = {}
    for page in markdown_pages():
        for text in code_texts(page):
            for match in PYTHON_M.finditer(text):
                rest = re.split(r"&&|\|\||;|\s#|\|", match.group(2))[0]
                options = commands.setdefault(match.group(1).rstrip("."), {})
                options.setdefault("", set()).add(page.name)
                for option in OPTION.findall(rest):
                    options.setdefault(option, set()).add(page.name)
    return commands


HELP_RUNNER = """
import contextlib, io, json, runpy, sys
results = {}
for name in sys.argv[1:]:
    printed = io.StringIO()
    sys.argv = [name, "--help"]
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException as err:
        code, printed = "error", io.StringIO(f"{type(err).__name__}: {err}")
    results[name] = [code, printed.getvalue()]
sys.__stdout__.write(json.dumps(results))
"""


@functools.lru_cache(maxsize=1)
def help_texts() -> Dict[str, Tuple[object, str]]:
    """{module: (exit status, what `python -m module --help` printed)} for every repository module the pages name.
    One child process runs them all, each as `python -m` runs a module (runpy as __main__), so the libraries are
    imported once and not once per module."""
    names = sorted(name for name in documented_commands() if name.split(".")[0] not in EXTERNAL_MODULES)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", HELP_RUNNER, *names], cwd=REPO, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, f"the --help runner failed:\n{done.stderr[-3000:]}"
    return {name: (code, text) for name, (code, text) in json.loads(done.stdout).items()}


def test_the_pages_name_the_main_commands():
    named = set(documented_commands())
    assert {"lightning_modules.fit", "datamodules.preprocess", "evaluation.evaluate", "slurm.sweep", "study",
            "lightning_modules.config_docs"} <= named


def test_every_python_m_module_named_exists_and_answers_help():
    problems = [f"python -m {name} --help: exit status {code}\n{text[-800:]}"
                for name, (code, text) in help_texts().items() if code != 0 or "usage:" not in text]
    unknown = sorted(name for name in documented_commands()
                     if name.split(".")[0] not in EXTERNAL_MODULES and name not in help_texts())
    assert not unknown and not problems, "\n".join(unknown + problems)


def test_every_option_given_to_a_documented_command_is_one_it_has():
    """An option a page passes to `python -m X` appears in X's --help (a renamed spelling is hidden there)."""
    wrong = []
    for name, options in sorted(documented_commands().items()):
        if name not in help_texts():
            continue
        shown = set(OPTION.findall(help_texts()[name][1]))
        wrong += [f"{sorted(pages)}: python -m {name} {option}" for option, pages in options.items()
                  if option and option not in shown]
    assert not wrong, "options the commands do not have (renamed or gone):\n" + "\n".join(wrong)


def make_targets() -> Set[str]:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", text, flags=re.MULTILINE))


def test_every_make_target_named_exists():
    targets, missing = make_targets(), []
    for page in markdown_pages():
        for text in code_texts(page):
            missing += [f"{page.name}: make {target}" for target in MAKE_TARGET.findall(text)
                        if target not in targets]
    assert not missing, "make targets the Makefile lacks:\n" + "\n".join(missing)


def expand_braces(text: str) -> List[str]:
    """`a/{b,c}.py` -> [`a/b.py`, `a/c.py`] (shell brace expansion, nested ones included)."""
    match = BRACES.search(text)
    if not match:
        return [text]
    return [expanded for choice in match.group(1).split(",")
            for expanded in expand_braces(text[:match.start()] + choice + text[match.end():])]


def path_exists(named: str) -> bool:
    """Whether a path a page names exists: placeholders (`<name>`, `*`) match any name; `file.py::test` needs the
    test function too; a trailing `#anchor` is the link checks' business."""
    path, _, function = named.partition("::")
    path = path.split("#")[0].rstrip("/.,")
    made_from = MADE_PAGES.get(path.removeprefix("docs/")) if path.startswith("docs/") else None
    if made_from is not None and not made_from.exists():
        return True  # a page its command writes once its data exists
    pattern = re.sub(r"<[^>]*>", "*", path)
    matches = list(REPO.glob(pattern)) if "*" in pattern else [REPO / pattern] if (REPO / pattern).exists() else []
    if not function:
        return bool(matches)
    return any(re.search(rf"^\s*def {re.escape(function)}\(", m.read_text(encoding="utf-8"), re.MULTILINE)
               for m in matches if m.is_file())


def test_every_repository_path_named_exists():
    missing = []
    for page in markdown_pages():
        for text in code_texts(page) + [line for _, line in outside_code(page.read_text().splitlines())]:
            for match in REPO_PATH.finditer(text):
                missing += [f"{page.name}: {path}" for path in expand_braces(match.group(1)) if not path_exists(path)]
    assert not missing, "paths that do not exist:\n" + "\n".join(sorted(set(missing)))


def layout_block() -> List[str]:
    """The lines of the package diagram: the first code block after the README's "## Layout" heading."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("## Layout")
    opening = next(i for i in range(start, len(lines)) if FENCE.match(lines[i]))
    closing = next(i for i in range(opening + 1, len(lines)) if FENCE.match(lines[i]))
    return lines[opening + 1:closing]


def layout_problems(block: Sequence[str]) -> List[str]:
    """Names in the diagram that do not exist: each line starts with its folders (`core/`, or `parsers/ core/`)
    or continues the line above; every file (`fit.py`) or folder (`methods/`) it names must be in one of them."""
    problems, folders = [], []
    for line in block:
        head, _, description = line.partition("  ")
        if head.strip():
            folders = [REPO / name for name in head.split() if name.endswith("/")]
            if not all(folder.is_dir() for folder in folders):
                problems.append(f"no folder {head.strip()}")
        for name in re.findall(r"(?<![\w./-])([\w-]+(?:\.(?:py|yaml|sbatch)|/))(?![\w/])", description):
            if not any(next(folder.rglob(name.rstrip("/")), None) for folder in folders):
                problems.append(f"{name} (in {' '.join(f.name + '/' for f in folders)})")
    return problems


def test_the_readme_layout_names_files_that_exist():
    block = layout_block()
    assert len(block) >= 8
    assert not layout_problems(block), "the README's layout names what is not there:\n" + \
        "\n".join(layout_problems(block))
    assert layout_problems(["core/    config.py, no_such_module.py"]) == ["no_such_module.py (in core/)"]


@functools.lru_cache(maxsize=1)
def config_keys() -> Set[str]:
    """Every dotted key of a run's config, each method's options included, and every section prefix."""
    from core.config import OPEN_MAPPINGS, load_config, valid_keys
    from lightning_modules.methods import METHOD_OPTIONS

    keys = set()
    for method in METHOD_OPTIONS:
        keys |= set(valid_keys(load_config(overrides=[f"method.name={method}"], methods=METHOD_OPTIONS)))
    prefixes = {key.rsplit(".", depth)[0] for key in keys for depth in range(1, key.count(".") + 1)}
    return keys | prefixes | set(OPEN_MAPPINGS)


def config_key_exists(named: str) -> bool:
    """A key as a page writes it: placeholders (`<name>`, `NAME`, `*`) stand for any segment; below an open mapping
    (`evaluation.roots`, `evaluation.options`) any key is valid."""
    from core.config import OPEN_MAPPINGS

    key = named.rstrip(".,")
    if key in DELIBERATE_TYPOS or any(key.startswith(mapping + ".") for mapping in OPEN_MAPPINGS):
        return True
    pattern = re.escape(PLACEHOLDER.sub("\0", key)).replace("\0", r"[\w*]+").replace(r"\*", r"[\w]*")
    return any(re.fullmatch(pattern, candidate) for candidate in config_keys())


def is_module_or_file(named: str) -> bool:
    """`evaluation.leakage` is a module and `monitor.py` a file, not config keys."""
    named = named.rstrip(".,")
    if named.endswith(FILE_SUFFIXES):
        return True
    path = REPO.joinpath(*named.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_every_config_key_named_exists():
    unknown = []
    for page in markdown_pages():
        for text in code_texts(page):
            for match in CONFIG_KEY.finditer(text):
                unknown += [f"{page.name}: {key}" for key in expand_braces(match.group(1))
                            if not is_module_or_file(key) and not config_key_exists(key)]
    assert not unknown, "config keys the schema does not have:\n" + "\n".join(sorted(set(unknown)))


def test_the_configuration_page_is_what_the_schema_generates():
    from lightning_modules import config_docs

    page = DOCS / "configuration.md"
    assert page.is_file() and page.read_text(encoding="utf-8") == config_docs.render(), \
        f"docs/configuration.md is out of date; regenerate it: {config_docs.COMMAND}"


def test_every_config_key_is_on_the_configuration_page_with_a_meaning():
    """Each key of every method's config has a row, and no row's meaning is empty: a new field needs its comment."""
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `([\w.]+)` \| .*\| (.*?) ?\|$", page, flags=re.MULTILINE))
    leaves = {key for key in config_keys() if not any(other.startswith(key + ".") for other in config_keys())}
    assert sorted(leaves - set(rows)) == []
    assert [key for key, meaning in rows.items() if not meaning.strip()] == []


def test_the_doc_checks_catch_what_they_are_for(tmp_path):
    """The extractors find a command, its options, a path and a key in a made-up page, and the checks reject a
    missing path, a wrong key and an unknown option (so an empty extraction cannot pass the checks above)."""
    page = tmp_path / "page.md"
    page.write_text("Run `python -m lightning_modules.fit --config configs/clip_ft.yaml\n  trainer.max_stepz=3`.\n"
                    "```bash\npython -m slurm.sweep configs/sweeps/study.yaml \\\n"
                    "    --dry-run  # a comment --x\n```\n",
                    encoding="utf-8")
    texts = code_texts(page)
    assert "python -m slurm.sweep configs/sweeps/study.yaml      --dry-run  # a comment --x" in texts
    assert any("--config configs/clip_ft.yaml   trainer.max_stepz=3" in text for text in texts)
    assert path_exists("configs/sweeps/study.yaml") and path_exists("lightning_modules/methods/<name>.py")
    assert path_exists("tests/test_docs.py::test_the_doc_checks_catch_what_they_are_for")
    assert not path_exists("configs/sweeps/stuyd.yaml") and not path_exists("tests/test_docs.py::no_such_test")
    assert config_key_exists("trainer.max_steps") and config_key_exists("method.attribution.layers")
    assert config_key_exists("evaluation.options.sugarcrepe.images") and config_key_exists("method.<option>")
    assert not config_key_exists("trainer.max_stepss") and not config_key_exists("method.mlm_wieght")
    assert is_module_or_file("evaluation.leakage") and not is_module_or_file("evaluation.batch_size")
    assert expand_braces("method.{mca,mir}_weight") == ["method.mca_weight", "method.mir_weight"]

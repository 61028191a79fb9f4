"""docs/adding-a-method.md is true and complete: every file, test, symbol, config key and command its list names
exists, and every place the tests hold a method to (a test that reads the method registry, a table of methods a
test spells out, a table keyed by every method in the code) is on the page.

Completeness is found, not listed: the tests and the code are searched for such places, so a new one that the
page does not name fails here, naming it.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest
import yaml
from test_docs import CONFIG_KEY, config_key_exists, path_exists

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "adding-a-method.md"
TESTS = REPO / "tests"
# The method registries: a test that reads one holds every method to its checks.
REGISTRIES = {"METHODS", "REGISTRY", "METHOD_OPTIONS"}
# Project packages whose tables keyed by method name a new method must join (the study, the step benchmark, ...).
CODE_PACKAGES = ("core", "parsers", "modeling", "datamodules", "evaluation", "lightning_modules", "slurm", "perf",
                 "study")
ITEM = re.compile(r"^(\d+)\. ")
SPAN = re.compile(r"`([^`]+)`")
# "`SYMBOL` of `path`": the symbol is a name of that module (a table or a class there).
SYMBOL_OF_FILE = re.compile(r"`(\w+)` (?:of|in) `([\w/.]+\.py)`")
PATH_LIKE = re.compile(r"^[\w.<>*-]+(/[\w.<>*-]+)*(\.py|\.ya?ml|\.md)(::\w+)?$|^[\w.<>-]+/[\w.<>/*-]+$|^Makefile$")


# ----- reading the page ----------------------------------------------------------------------------------------
def page_items() -> List[str]:
    """The numbered list's items, each joined onto one line, in page order."""
    items: List[str] = []
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if ITEM.match(line):
            items.append(line)
        elif items and line.startswith("   ") and line.strip():
            items[-1] += " " + line.strip()
        elif items and line.strip():
            break  # the list ended
    return items


def spans(text: str) -> List[str]:
    return SPAN.findall(text)


def named_on_page() -> Set[str]:
    """Every code span of the list (a file, a `file::test`, a symbol, a key, a command)."""
    return {span for item in page_items() for span in spans(item)}


def named_suite_files() -> Set[str]:
    """The test files the page names, alone or through one of their tests (`tests/x.py::test_y`)."""
    return {span.partition("::")[0] for span in named_on_page() if span.startswith("tests/")}


# ----- what the named things are --------------------------------------------------------------------------------
def files_named(text: str) -> List[Path]:
    """The repository files a text names, placeholders (`<name>`) matching any name."""
    found: List[Path] = []
    for span in spans(text):
        if PATH_LIKE.match(span):
            pattern = re.sub(r"<[^>]*>", "*", span.partition("::")[0])
            found += [path for path in REPO.glob(pattern) if path.is_file()]
    return found


@lru_cache(maxsize=None)
def identifiers(path: Path) -> Set[str]:
    """The names a file uses or defines: identifiers of a Python file's code (not its strings), keys of a YAML
    file."""
    if path.suffix == ".py":
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = set()
        for node in ast.walk(tree):
            for field in ("id", "attr", "name", "arg"):
                value = getattr(node, field, None)
                if isinstance(value, str):
                    names.add(value.split(".")[-1])
        return names
    if path.suffix in (".yaml", ".yml"):
        return set(yaml_keys(yaml.safe_load(path.read_text(encoding="utf-8"))))
    return set()


def yaml_keys(value) -> Iterator[str]:
    if isinstance(value, dict):
        for key, inner in value.items():
            yield str(key)
            yield from yaml_keys(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from yaml_keys(inner)


def module_of(path: str):
    """The module of a repository file (`tests/fitting.py` is the tests' `fitting`)."""
    relative = Path(path).with_suffix("")
    parts = list(relative.parts[1:] if relative.parts[0] == "tests" else relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return importlib.import_module(".".join(parts))


def make_targets() -> Set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.MULTILINE))


def span_problem(span: str, page_files: List[Path]) -> str | None:
    """Why a code span of the list is not true, or None."""
    if span.startswith("python -m "):
        module = span.split()[2]
        return None if importlib.util.find_spec(module) is not None else f"no module {module}"
    if span.startswith("make "):
        return None if span.split()[1] in make_targets() else f"no make target {span.split()[1]}"
    if PATH_LIKE.match(span):
        return None if path_exists(span) else "no such file (or test)"
    if CONFIG_KEY.fullmatch(span):
        return None if config_key_exists(span) else "no such config key"
    if re.fullmatch(r"\w+", span):
        return None if any(span in identifiers(path) for path in page_files) else "in none of the files named"
    return "neither a file, a symbol, a config key nor a command: write it as prose or make it checkable"


# ----- where the tests and the code hold a method -------------------------------------------------------------
@lru_cache(maxsize=None)
def method_names() -> Tuple[str, ...]:
    from lightning_modules.methods import REGISTRY

    return tuple(sorted(REGISTRY))


def reads_a_registry(node: ast.AST) -> bool:
    """Whether code goes over every registered method: iterates a registry, sorts, sets, lists or measures it,
    asks its items / keys / values, or tests membership in it (`name in METHODS`)."""
    def is_registry(expr) -> bool:
        return isinstance(expr, ast.Name) and expr.id in REGISTRIES

    for inner in ast.walk(node):
        if isinstance(inner, (ast.For, ast.comprehension)) and is_registry(inner.iter):
            return True
        if (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and any(map(is_registry, inner.args))
                and inner.func.id in ("sorted", "set", "list", "len", "dict", "tuple")):
            return True
        if (isinstance(inner, ast.Attribute) and inner.attr in ("items", "keys", "values")
                and is_registry(inner.value)):
            return True
        if isinstance(inner, ast.Compare) and any(isinstance(op, ast.In) for op in inner.ops) \
                and any(map(is_registry, inner.comparators)):
            return True
    return False


def suite_files() -> List[Path]:
    """The test suite's files but this one, whose own searches name the registries and the methods."""
    return sorted(path for path in TESTS.glob("*.py") if path != Path(__file__).resolve())


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef]:
    return (node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def registry_readers() -> Dict[str, List[str]]:
    """Test file -> its functions that read a registry."""
    found: Dict[str, List[str]] = {}
    for path in suite_files():
        for function in functions(ast.parse(path.read_text(encoding="utf-8"))):
            if reads_a_registry(function):
                found.setdefault(f"tests/{path.name}", []).append(function.name)
    return found


def is_table_of_methods(value) -> bool:
    """A dict keyed by, or a list / tuple / set of, names among which is a registered method."""
    if not isinstance(value, (dict, list, tuple, set, frozenset)):
        return False
    return any(isinstance(entry, str) and entry in method_names() for entry in value)


def tables_read_beside_the_registry() -> Dict[str, str]:
    """Tables of methods that a test reading a registry imports from another module -> where it reads them."""
    tables: Dict[str, str] = {}
    for path in suite_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {alias.asname or alias.name: node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        for function in functions(tree):
            if not reads_a_registry(function):
                continue
            for inner in ast.walk(function):
                name = inner.id if isinstance(inner, ast.Name) else None
                if name and name.isupper() and name not in REGISTRIES and name in imported:
                    if is_table_of_methods(getattr(importlib.import_module(imported[name]), name, None)):
                        tables[name] = f"tests/{path.name}::{function.name}"
    return tables


def string_values(node: ast.AST) -> List[str]:
    """The string elements of a list / tuple / set literal, or the string keys of a dict literal."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if isinstance(node, ast.Dict):
        return [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    return []


def spells_out_the_methods(node: ast.AST) -> bool:
    """Whether code writes the methods out by hand: a literal naming most registered methods, or a string that
    lists all of them (an error message's "methods: a, b, ...")."""
    names = set(method_names())
    listing = ", ".join(method_names())
    for inner in ast.walk(node):
        if len(names & set(string_values(inner))) > len(names) / 2:
            return True
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str) and listing in inner.value:
            return True
    return False


def hand_written_method_lists() -> List[str]:
    """`tests/file.py::function` of every test function (its parametrize decorators included) that spells out the
    methods: a new method must be added to it by hand."""
    found = []
    for path in suite_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"tests/{path.name}::{f.name}" for f in functions(tree) if spells_out_the_methods(f)]
    return found


def code_tables_keyed_by_every_method() -> Dict[str, str]:
    """Module-level dicts in the project's code whose keys are every registered method -> their file."""
    tables: Dict[str, str] = {}
    for package in CODE_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
                value = getattr(node, "value", None)
                if isinstance(target, ast.Name) and isinstance(value, ast.Dict) \
                        and set(method_names()) <= set(string_values(value)):
                    tables[target.id] = str(path.relative_to(REPO))
    return tables


# ----- the checks ------------------------------------------------------------------------------------------------
def test_the_page_is_one_numbered_list_in_order():
    numbers = [int(ITEM.match(item).group(1)) for item in page_items()]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 8


@pytest.mark.parametrize("number", range(1, len(page_items()) + 1))
def test_every_place_an_item_names_exists(number):
    """Files and tests exist, symbols are in the files the page names, keys are config keys, commands run."""
    page_files = [path for item in page_items() for path in files_named(item)]
    item = page_items()[number - 1]
    problems = [f"`{span}`: {problem}" for span in spans(item) if (problem := span_problem(span, page_files))]
    assert not problems, f"item {number}:\n" + "\n".join(problems)


def test_every_symbol_of_a_named_file_is_in_that_module():
    """"`VARIANTS` of `perf/step.py`": the module has that name (a table, a class, a registry)."""
    pairs = [match.groups() for item in page_items() for match in SYMBOL_OF_FILE.finditer(item)]
    assert len(pairs) >= 6
    missing = [f"{symbol} of {path}" for symbol, path in pairs if not hasattr(module_of(path), symbol)]
    assert not missing, missing


def test_the_configuration_page_command_is_the_generators():
    from lightning_modules.config_docs import COMMAND

    assert COMMAND in named_on_page()


def test_every_test_that_reads_the_method_registry_is_named():
    readers = registry_readers()
    assert {"tests/test_registry.py", "tests/test_fit.py", "tests/test_mechanisms.py"} <= set(readers)
    missing = {path: names for path, names in readers.items() if path not in named_suite_files()}
    assert not missing, f"tests that hold every method to a check, not on {PAGE.name}: {missing}"


def test_every_table_those_tests_read_beside_the_registry_is_named():
    tables = tables_read_beside_the_registry()
    assert {"NEEDS_MASKS", "MECHANISMS", "VARIANTS"} <= set(tables)
    missing = {name: where for name, where in tables.items() if name not in named_on_page()}
    assert not missing, f"tables of methods the tests read, not on {PAGE.name}: {missing}"


def test_every_test_that_spells_out_the_methods_is_named():
    spelled = hand_written_method_lists()
    assert "tests/test_fit_checks.py::test_methods_declare_the_masks_they_read" in spelled
    missing = [test for test in spelled if test not in named_on_page()]
    assert not missing, f"tests that list the methods by hand, not on {PAGE.name}: {missing}"


def test_every_table_of_the_code_keyed_by_every_method_is_named():
    tables = code_tables_keyed_by_every_method()
    assert {"REGISTRY", "MECHANISMS"} <= set(tables)
    missing = {name: path for name, path in tables.items() if name not in named_on_page()}
    assert not missing, f"tables keyed by every method, not on {PAGE.name}: {missing}"


def test_the_searches_find_what_they_look_for():
    """The detectors on made-up code: a registry read, a hand-written list of methods, and neither."""
    names = method_names()
    assert reads_a_registry(ast.parse("for name in sorted(METHODS):\n    pass\n"))
    assert reads_a_registry(ast.parse("assert cfg.method.name in METHODS\n"))
    assert reads_a_registry(ast.parse("x = {n: e for n, e in REGISTRY.items()}\n"))
    assert not reads_a_registry(ast.parse("monkeypatch.setitem(METHODS, 'x', X)\ncls = METHODS['clip_ft']\n"))
    assert spells_out_the_methods(ast.parse(repr(list(names))))
    assert spells_out_the_methods(ast.parse(repr(f"(methods: {', '.join(names)})")))
    assert not spells_out_the_methods(ast.parse(repr(list(names[:len(names) // 2]))))
    assert span_problem("no_such_symbol_anywhere", [REPO / "perf" / "step.py"]) is not None
    assert span_problem("VARIANTS", [REPO / "perf" / "step.py"]) is None
    assert span_problem("tests/test_fit.py::no_such_test", []) is not None
    assert span_problem("a -> b", []) is not None

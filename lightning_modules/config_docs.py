"""`python -m lightning_modules.config_docs --out docs/configuration.md`: the configuration reference, generated.

Every key of a run's config is declared once, as a dataclass field with a comment above it: the shared sections
in `core/config.py`, each method's own options in `lightning_modules/methods/options.py` (paired with their
method by `lightning_modules.methods.REGISTRY`). This command turns those declarations into one Markdown page:
per section a table of key, type, default (what a run gets from `configs/base.yaml` and the schema when no
config file sets it) and meaning (the field's comment), with the allowed values of every string option.

It lives here, not in `core`, because it reads the method registry, which sits above `core`. `--check` compares
the page with what the schema gives and exits with status 1 when they differ; the test suite does the same, so
the committed page cannot drift from the code.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from core import config as schema
from core.cli import add_output
from core.files import atomic_write_text

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path("docs/configuration.md")
COMMAND = "python -m lightning_modules.config_docs --out docs/configuration.md"

# The sections of ExperimentConfig in page order, each with one line on what it holds.
SECTIONS = {
    "model": "Which open_clip model is built and from which weights.",
    "method": "The training method and its options.",
    "data": "Caption data, batches and the masks read from the preprocessing cache.",
    "optim": "AdamW parameter groups and the learning-rate schedule.",
    "trainer": "Lightning's `Trainer` arguments, passed on as they are unless a line says otherwise.",
    "checkpoint": "Which checkpoints are kept.",
    "evaluation": "Benchmarks scored during training.",
    "monitor": "The attribution-gap monitor, on for every method (docs/monitoring.md).",
    "preprocess": "The offline preprocessing job (`python -m datamodules.preprocess`) and its cache.",
}

INTRODUCTION = """\
A run's config is built in this order, later sources winning:

1. the schema's defaults (`core/config.py`; each method's options in `lightning_modules/methods/options.py`);
2. `configs/base.yaml`;
3. each `--config FILE`, in the order given;
4. the `key=value` arguments of the command line (`trainer.max_steps=100 optim.lr=1e-5`).

The schema is closed. A key it does not declare is an error that names the closest valid key
(`trainer.max_stepz=3`: "did you mean 'trainer.max_steps'?"). A key of another method is an error that names
the method owning it. A string option outside its allowed values is an error that names the closest one.
`data.batch_size` is the global batch: `fit` divides it by devices x nodes x `trainer.accumulate_grad_batches`
and records the result in the run's `config.yaml`. The resolved config of every run is saved there.

The "default" column is what a run gets when no config file and no override sets the key."""


# ----- what the source says about each field -------------------------------------------------------------------
def field_comments(cls: type) -> Dict[str, Tuple[str, Optional[str]]]:
    """(comment, group leader) of each field declared in `cls` itself. The comment is the comment lines right
    above the field plus a comment at the end of its line. A field without comment lines above, declared on the
    line after another field, belongs to that field's group (one comment describing several fields): its leader
    is the group's first field, else None."""
    lines, _ = inspect.getsourcelines(cls)
    body = ast.parse(textwrap.dedent("".join(lines))).body[0].body  # type: ignore[attr-defined]
    comments: Dict[str, Tuple[str, Optional[str]]] = {}
    previous: Optional[Tuple[int, str, str]] = None  # (last line, group text, group leader) of the field before
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name, start = node.target.id, node.lineno - 1
        above = _comment_lines_above(lines, start)
        own = lines[start].split("#", 1)[1].strip() if _ends_in_comment(lines[start]) else ""
        leader = None
        if above:
            text = " ".join(above)
        elif previous is not None and previous[0] == start - 1:
            text, leader = previous[1], previous[2]
        else:
            text = ""
        comments[name] = (" ".join(part for part in (text, own) if part), leader)
        previous = (node.end_lineno - 1, text, leader or name)  # type: ignore[operator]
    return comments


def _comment_lines_above(lines: Sequence[str], start: int) -> List[str]:
    above: List[str] = []
    index = start - 1
    while index >= 0 and lines[index].strip().startswith("#"):
        above.insert(0, lines[index].strip()[1:].strip())
        index -= 1
    return above


def _ends_in_comment(line: str) -> bool:
    """Whether `line` ends in a comment (a '#' outside string quotes)."""
    quote = None
    for char in line:
        if quote:
            quote = None if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == "#":
            return True
    return False


def declared_here(cls: type) -> List[dataclasses.Field]:
    """The fields `cls` declares itself (not those it inherits)."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return [f for f in dataclasses.fields(cls) if f.name not in inherited]


# ----- rendering ---------------------------------------------------------------------------------------------------
def yaml_value(value: Any) -> str:
    """How a default reads in a YAML file."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {yaml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, str) and value == "":
        return '""'
    return str(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return text.replace("typing.", "")


def rows(cls: type, prefix: str, defaults: Any, choices: Mapping[str, Sequence[str]]) -> List[str]:
    """One table row per leaf key of `cls` (nested dataclasses expanded), keys spelled `prefix<name>`."""
    comments = field_comments(cls)
    out = []
    for f in declared_here(cls):
        key = prefix + f.name
        value = OmegaConf.select(defaults, key)
        nested = f.type if isinstance(f.type, type) else _dataclass_named(cls, f.type)
        if nested is not None and dataclasses.is_dataclass(nested):
            out += rows(nested, key + ".", defaults, choices)
            continue
        text, leader = comments.get(f.name, ("", None))
        meaning = f"As `{prefix}{leader}`." if leader else text
        if key in choices:
            meaning += f" One of: {', '.join(f'`{c}`' for c in choices[key])}."
        out.append(f"| `{key}` | `{cell(type_name(f.type))}` | `{cell(yaml_value(value))}` | {cell(meaning.strip())} |")
    return out


def _dataclass_named(owner: type, annotation: Any) -> Optional[type]:
    """The dataclass a string annotation names, looked up in the module that declares `owner`."""
    if not isinstance(annotation, str):
        return None
    found = getattr(sys.modules[owner.__module__], annotation, None)
    return found if isinstance(found, type) and dataclasses.is_dataclass(found) else None


TABLE_HEAD = ["| key | type | default | meaning |", "|---|---|---|---|"]


def top_level_section(defaults: Any) -> List[str]:
    scalar_fields = [f for f in dataclasses.fields(schema.ExperimentConfig) if f.name not in SECTIONS]
    comments = field_comments(schema.ExperimentConfig)
    table = [f"| `{f.name}` | `{type_name(f.type)}` | `{yaml_value(defaults[f.name])}` | "
             f"{cell(comments[f.name][0])} |" for f in scalar_fields]
    return ["## Top level", "", "Run identity and resumption.", "", *TABLE_HEAD, *table, ""]


def method_section(registry: Mapping[str, Any], choices: Mapping[str, Sequence[str]]) -> List[str]:
    """The shared `method` keys, then each option class with the methods that use it."""
    from core.config import load_config
    from lightning_modules.methods import METHOD_OPTIONS

    shared = load_config(methods=METHOD_OPTIONS)
    lines = ["## method", "", SECTIONS["method"], "", "Every method has these keys:", "", *TABLE_HEAD,
             *rows(schema.MethodConfig, "method.", shared, choices), ""]
    by_options: Dict[type, List[str]] = {}
    for name, entry in registry.items():
        by_options.setdefault(entry.options, []).append(name)
    for options, names in by_options.items():
        defaults = load_config(overrides=[f"method.name={names[0]}"], methods=METHOD_OPTIONS)
        own = {f"method.{key}": allowed for key, allowed in getattr(options, "CHOICES", {}).items()}
        recipes = ", ".join(f"`{registry[name].recipe}`" for name in names)
        lines += [f"### {' and '.join(f'`{name}`' for name in names)}", ""]
        doc = inspect.getdoc(options) or ""
        lines += [" ".join(doc.split()), "", f"Paper recipe: {recipes}. Class: `{options.__name__}` in "
                  f"`{options.__module__.replace('.', '/')}.py`.", ""]
        table = rows(options, "method.", defaults, own)
        lines += [*TABLE_HEAD, *table, ""] if table else ["No options of its own.", ""]
    return lines


def section(name: str, cls: type, defaults: Any, choices: Mapping[str, Sequence[str]]) -> List[str]:
    return [f"## {name}", "", SECTIONS[name], "", *TABLE_HEAD, *rows(cls, f"{name}.", defaults, choices), ""]


def render() -> str:
    """The whole page."""
    from core.config import load_config
    from lightning_modules.methods import REGISTRY

    defaults = load_config()
    choices = schema.string_choices()
    classes = {f.name: f.type for f in dataclasses.fields(schema.ExperimentConfig)}
    lines = ["# Configuration reference", "",
             f"<!-- Generated from the schema by `{COMMAND}`; edit the schema's comments, not this page. -->", "",
             INTRODUCTION, "", "Sections: [top level](#top-level), "
             + ", ".join(f"[`{name}`](#{name})" for name in SECTIONS) + ".", ""]
    lines += top_level_section(defaults)
    for name in SECTIONS:
        if name == "method":
            lines += method_section(REGISTRY, choices)
            continue
        cls = classes[name]
        cls = cls if isinstance(cls, type) else _dataclass_named(schema.ExperimentConfig, cls)
        lines += section(name, cls, defaults, choices)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output(parser, "file", f"the page to write (default {DEFAULT_OUT})", default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit with status 1 when the page differs from what the schema gives")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
        if current != page:
            print(f"{args.out} is not what the schema gives; regenerate it: {COMMAND}", file=sys.stderr)
            return 1
        print(f"{args.out} is current")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out, page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

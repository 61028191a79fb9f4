"""The one command-line dialect of every `python -m` entry point; each adds the shared arguments through these helpers.

| what               | form                                  | e.g.                                                    |
|--------------------|---------------------------------------|---------------------------------------------------------|
| output             | `--out PATH`                          | `--out runs/perf_step.json`, `--out eval/negclip`       |
| precision          | `--precision NAME`, Lightning's names | `--precision bf16-mixed`                                |
| key=value settings | positional `KEY=VALUE`, dotted keys   | `trainer.max_steps=100`, `roots.sugarcrepe=/data/sc`    |
| data root          | `--data-root DIR`                     | `--data-root data/shapes`                               |
| experiment configs | `--config FILE` (repeatable)          | `--config configs/negclip.yaml`                         |

Output. `--out` names everything a command writes (besides the run directories and caches its experiment config
names), by what it writes:
- one file: that file (`perf.step --out runs/perf_step.json`);
- one result in several formats: the path of any of them; each is written with its own suffix in place of the
  given one (`explain --out cat.png` writes cat.png and cat.json, `perf.gpu --out runs/perf_gpu` writes
  runs/perf_gpu.json and runs/perf_gpu.md);
- several documents: a folder holding them under fixed names (evaluate's results, a shapes world, the study's
  report, the leakage guard's report and exclusion list).
TensorBoard events are not an output of this kind: evaluate's `--tensorboard` adds them to the run's own
TensorBoard folder, beside its training curves.

Precision. Lightning's names everywhere (`PRECISIONS`): the trainer takes them as they are (plus `auto`), and
a command that runs a model outside Lightning supports the ones it implements: `32-true` (float32), `bf16-mixed`
and `16-mixed` (autocast over float32 weights; `autocast_dtype`). Lightning's own legacy spellings and ours
(`32`, `bf16`, `fp32`, ...) are refused, naming the new one.

Key=value settings. One form: positional `KEY=VALUE` arguments, interleaved with the options in any order, later
ones winning. Where a command reads an experiment config they are its dotlist overrides, merged over the
`--config` files (fit, preprocess, features, perf.step, perf.loader, study.term_gradients; the sweep's, beside its
`only.AXIS=LABEL`, override every run's). Elsewhere they are the command's own named settings under a few
sections (`key_value_sections`): evaluate's `roots.NAME=DIR` and `options.NAME.OPTION=VALUE` (the keys of the
config's `evaluation:` section) and `scorer.OPTION=VALUE`, the demo's `runs.LABEL=RUN_DIR`. Positional dotted
keys rather than repeatable `--option NAME=VALUE` flags, because fit's overrides, the most used of them, already
had that form, the keys spell the same path as the YAML that would hold them, and one form means one way to type
a setting whatever the command; a key outside the command's sections is refused naming those it has.

Data root. `--data-root DIR` is the folder a command reads its data from (a shapes world, the folder holding
one sub-folder per benchmark, the stand-ins' folder); a root of one item below it is a key=value setting
(`roots.NAME=DIR`), as the config spells it. Files that are not a data root keep flags naming what they are.

Renamed spellings stay known to each parser, hidden from `--help`, and are refused in one line naming the new
spelling (`refuse_renamed`).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence

# Lightning's precision names (lightning.fabric.plugins.precision), checked against Lightning by the tests.
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "transformer-engine",
              "transformer-engine-float16")
# The trainer's own extra: bf16-mixed on a GPU, 32-true on the CPU (lightning_modules.fit.resolve_precision).
AUTO = "auto"
# Spellings refused with a pointer: Lightning's legacy aliases and the ones our commands used to take.
RENAMED_PRECISIONS = {"32": "32-true", "fp32": "32-true", "float32": "32-true", "64": "64-true",
                      "fp64": "64-true", "16": "16-mixed", "fp16": "16-mixed", "float16": "16-mixed",
                      "bf16": "bf16-mixed", "bfloat16": "bf16-mixed"}
# What runs under torch.autocast over float32 weights: the dtype of the autocast (None: no autocast).
AUTOCAST = {"32-true": None, "bf16-mixed": "bfloat16", "16-mixed": "float16"}

OUTPUT_KINDS = {"file": "FILE", "formats": "PATH", "folder": "DIR"}


# ----- output -------------------------------------------------------------------------------------------------
def add_output(parser: argparse.ArgumentParser, kind: str, help: str, default: Optional[Path] = None,
               required: bool = False) -> None:
    """`--out`: a file, a path whose suffix each format replaces (`output_paths`), or a folder (`kind`)."""
    parser.add_argument("--out", type=Path, default=default, required=required, metavar=OUTPUT_KINDS[kind],
                        help=help)


def output_paths(out: Path, suffixes: Sequence[str]) -> Dict[str, Path]:
    """The file of each format of one result: `out` with each suffix in place of its own
    (`cat.png`, [".png", ".json"] -> cat.png, cat.json; `runs/perf_gpu` -> runs/perf_gpu.png, ...)."""
    out = Path(out)
    return {suffix: out.with_suffix(suffix) for suffix in suffixes}


# ----- precision ----------------------------------------------------------------------------------------------
def renamed_precision_message(value: str) -> str:
    return f"precision {value!r} was renamed: use {RENAMED_PRECISIONS[value]} (Lightning's names)"


def precision_problem(value: object, supported: Sequence[str]) -> Optional[str]:
    """Why `value` is not one of the `supported` precision names (None when it is); a renamed one names the new."""
    if value in supported:
        return None
    if str(value) in RENAMED_PRECISIONS:
        return renamed_precision_message(str(value))
    return f"precision {value!r} is not one of {', '.join(supported)}"


def check_precision(value: str, supported: Sequence[str]) -> str:
    """`value` when it is one of `supported`, else ValueError (for code that takes a precision outside argparse)."""
    problem = precision_problem(value, supported)
    if problem:
        raise ValueError(problem)
    return value


def _precision_name(value: str) -> str:
    if value in RENAMED_PRECISIONS:
        raise argparse.ArgumentTypeError(renamed_precision_message(value))
    return value


def add_precision(parser, supported: Sequence[str], default: str, help: str = "") -> None:
    """`--precision NAME` with the subset of Lightning's names (and `auto`) the command implements."""
    unknown = [name for name in supported if name not in PRECISIONS + (AUTO,)]
    if unknown or default not in supported:
        raise ValueError(f"not Lightning precision names: {unknown or default!r}")
    parser.add_argument("--precision", type=_precision_name, choices=list(supported), default=default,
                        help=f"{help + '; ' if help else ''}Lightning's names (default {default})")


def autocast_dtype(precision: str):
    """The torch dtype `precision` autocasts to over float32 weights (None: float32, no autocast)."""
    import torch  # here: the parsers of commands that never run a model do not import torch

    name = AUTOCAST[check_precision(precision, tuple(AUTOCAST))]
    return None if name is None else getattr(torch, name)


# ----- key=value settings -------------------------------------------------------------------------------------
def add_key_values(parser: argparse.ArgumentParser, help: str, dest: str = "overrides") -> None:
    """The positional `KEY=VALUE` arguments (parse with `parser.parse_intermixed_args`, so that they may come
    between options)."""
    parser.add_argument(dest, nargs="*", metavar="KEY=VALUE", help=help)


def key_value_sections(parser: argparse.ArgumentParser, items: Sequence[str],
                       forms: Mapping[str, str]) -> Dict[str, Dict[str, str]]:
    """`SECTION.KEY=VALUE` items as {section: {KEY: VALUE}} with every section of `forms` present (values as
    typed: each command parses its own; a later item wins). `forms` maps each section to its usage, e.g.
    {"roots": "roots.NAME=DIR"}; an item of another form ends the program naming them."""
    sections: Dict[str, Dict[str, str]] = {section: {} for section in forms}
    for item in items:
        key, sep, value = item.partition("=")
        section, dot, rest = key.partition(".")
        if not sep or not dot or not rest or section not in forms:
            parser.error(f"{item!r}: the key=value arguments of this command are {', '.join(forms.values())}")
        sections[section][rest] = value
    return sections


# ----- data roots ---------------------------------------------------------------------------------------------
def add_data_root(parser: argparse.ArgumentParser, help: str, default: Optional[Path] = None,
                  required: bool = False) -> None:
    parser.add_argument("--data-root", type=Path, default=default, required=required, metavar="DIR", help=help)


# ----- renamed spellings --------------------------------------------------------------------------------------
class _Renamed(argparse.Action):
    """A spelling the command no longer takes: using it ends the program with the one that replaced it."""

    def __init__(self, option_strings, dest, replacement: str, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.replacement = replacement

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed: use {self.replacement}")


def refuse_renamed(parser: argparse.ArgumentParser, renamed: Mapping[str, str]) -> None:
    """Each old option of `renamed` (old -> how to say it now) is refused, hidden from --help."""
    for old, replacement in renamed.items():
        parser.add_argument(old, action=_Renamed, replacement=replacement)

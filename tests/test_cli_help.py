"""Every `python -m` entry point speaks the one dialect of core/cli.py: its `--help` runs, its options use the shared
names (`--out`, `--precision` in Lightning's names, `--data-root`, positional KEY=VALUE settings), and each renamed
spelling is refused naming the new one.

The entry points are found, not listed: every module of the packages with a `__name__ == "__main__"` guard (a
package's `__main__.py` runs as the package). `--help` runs in this process (`main(["--help"])`), the parser
caught as it prints; two commands also run as real `python -m` processes.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import io
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple, get_args

import pytest

from core import cli

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "parsers", "modeling", "datamodules", "evaluation", "lightning_modules", "testkit", "slurm", "perf",
            "gpucheck", "study")
MAIN_GUARD = re.compile(r"""^if __name__ == ["']__main__["']:""", re.MULTILINE)
# Options no command may show: each was one of the dialects.
FORBIDDEN = {"--json", "--md", "--report", "--write-exclusions", "--set", "--root", "--scorer-option", "--only",
             "--data", "--output", "-o"}
# Option names that would be a second output flag when they take a value.
OUTPUT_NAME = re.compile(r"^--(json|md|report|output|out-.+|.+-out|write-.+|save.*)$")


def entry_points() -> List[str]:
    """`python -m` names: each module with the main guard (`pkg/__main__.py` runs as `pkg`)."""
    names = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if MAIN_GUARD.search(path.read_text()):
                parts = path.relative_to(REPO_ROOT).with_suffix("").parts
                names.append(".".join(parts[:-1] if parts[-1] == "__main__" else parts))
    return names


ENTRY_POINTS = entry_points()


def module_of(name: str):
    """The module whose `main` `python -m name` runs."""
    path = REPO_ROOT.joinpath(*name.split("."))
    return importlib.import_module(f"{name}.__main__" if path.is_dir() else name)


@functools.lru_cache(maxsize=None)
def help_of(name: str) -> Tuple[argparse.ArgumentParser, str]:
    """The parser of `name` and what `main(["--help"])` printed (it must exit with status 0)."""
    parsers: List[argparse.ArgumentParser] = []
    print_help = argparse.ArgumentParser.print_help

    def caught(parser, file=None):
        parsers.append(parser)
        print_help(parser, file)

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(argparse.ArgumentParser, "print_help", caught)
        with pytest.raises(SystemExit) as done:
            module_of(name).main(["--help"])
    assert done.value.code == 0 and len(parsers) == 1, f"{name} --help"
    return parsers[0], printed.getvalue()


def visible_options(parser: argparse.ArgumentParser) -> Dict[str, argparse.Action]:
    return {option: action for action in parser._actions if action.help != argparse.SUPPRESS
            for option in action.option_strings}


def refusal(name: str, argv: List[str], capsys) -> str:
    """The one error line `main(argv)` ends with (argparse's status 2)."""
    with pytest.raises(SystemExit) as done:
        module_of(name).main(argv)
    assert done.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1]


def test_the_entry_points_are_found():
    assert len(ENTRY_POINTS) >= 19
    assert {"lightning_modules.fit", "study", "evaluation.explain",
            "study.demo", "evaluation", "evaluation.evaluate", "evaluation.leakage", "datamodules.shapes",
            "datamodules.preprocess", "datamodules.features", "slurm.sweep", "perf.gpu", "perf.step",
            "study.term_gradients", "gpucheck", "gpucheck.bundle", "gpucheck.stages"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_runs_and_the_options_speak_the_dialect(name, capsys):
    assert list(inspect.signature(module_of(name).main).parameters) == ["argv"]  # in-process callable
    parser, printed = help_of(name)
    assert printed.startswith("usage:")
    options = visible_options(parser)
    assert not FORBIDDEN & set(options), f"{name}: {sorted(FORBIDDEN & set(options))}"
    for option, action in options.items():
        takes_value = action.nargs != 0
        assert not (takes_value and OUTPUT_NAME.match(option)), f"{name} {option}: the output flag is --out"
        assert "=" not in str(action.metavar or ""), f"{name} {option}: key=value settings are positional"
        assert option == "--data-root" or not re.match(r"^--(data|.*root.*)$", option), f"{name} {option}"
    if "--out" in options:
        assert options["--out"].metavar in cli.OUTPUT_KINDS.values()
    if "--precision" in options:
        action = options["--precision"]
        assert set(action.choices) <= set(cli.PRECISIONS) | {cli.AUTO} and action.default in action.choices
        with pytest.raises(SystemExit):
            parser.parse_known_args(["--precision", "fp32"])
        assert "precision 'fp32' was renamed: use 32-true (Lightning's names)" in capsys.readouterr().err
    for action in parser._actions:
        if not action.option_strings and action.nargs == "*":  # the positional settings
            assert action.metavar == "KEY=VALUE", f"{name} {action.dest}"


RENAMED = [
    ("perf.gpu", ["--json", "x.json"], "--json was renamed: use --out PATH (writes PATH.json and PATH.md)"),
    ("perf.gpu", ["--md", "x.md"], "--md was renamed: use --out PATH"),
    ("study.term_gradients", ["--json", "x.json"], "--json was renamed: use --out FILE"),
    ("evaluation.leakage", ["--train", "t.json", "--write-exclusions", "x.json"],
     "--write-exclusions was renamed: use --out DIR (writes DIR/exclude_image_ids.json)"),
    ("evaluation.leakage", ["--train", "t.json", "--report", "x.json"],
     "--report was renamed: use --out DIR (writes DIR/overlap_report.json)"),
    ("evaluation.leakage", ["--train", "t.json", "--set", "sugarcrepe.images=x"],
     "--set was renamed: use options.NAME.OPTION=VALUE"),
    ("evaluation.evaluate", ["--set", "sugarcrepe.images=x"], "--set was renamed: use options.NAME.OPTION=VALUE"),
    ("evaluation.evaluate", ["--root", "sugarcrepe=x"], "--root was renamed: use roots.NAME=DIR"),
    ("evaluation.evaluate", ["--scorer-option", "grids=2"], "--scorer-option was renamed: use scorer.OPTION=VALUE"),
    ("evaluation.evaluate", ["--precision", "bf16"], "'bf16' was renamed: use bf16-mixed"),
    ("evaluation.evaluate", ["--precision", "fp16"], "'fp16' was renamed: use 16-mixed"),
    ("perf.step", ["--precision", "32"], "'32' was renamed: use 32-true"),
    ("perf.step", ["--precision", "bf16"], "'bf16' was renamed: use bf16-mixed"),
    ("perf.evaluate", ["--root", "x"], "--root was renamed: use --data-root DIR"),
    ("study.demo", ["--data", "w", "runs.a=r"], "--data was renamed: use --data-root DIR"),
    ("study.demo", ["--data-root", "w", "--run", "a=r"], "--run was renamed: use runs.LABEL=RUN_DIR"),
    ("study", ["--sweep", "s", "--data", "w"], "--data was renamed: use --data-root DIR"),
    ("study.relation_text_probe", ["--data", "w"], "--data was renamed: use --data-root DIR"),
    ("slurm.sweep", ["s.yaml", "--only", "method=x"], "--only was renamed: use only.AXIS=LABEL"),
]


@pytest.mark.parametrize("name, argv, pointer", RENAMED, ids=[f"{n} {a[-2]}" for n, a, _ in RENAMED])
def test_each_old_spelling_is_refused_naming_the_new_one(name, argv, pointer, capsys):
    assert pointer in refusal(name, argv, capsys)


@pytest.mark.parametrize("name, argv, message", [
    ("evaluation.evaluate", ["sugarcrepe.images=x"], "the key=value arguments of this command are roots.NAME=DIR, "
                                                     "options.NAME.OPTION=VALUE, scorer.OPTION=VALUE"),
    ("study.demo", ["--data-root", "w", "a=r"], "are runs.LABEL=RUN_DIR[@SCORER]"),
])
def test_a_key_outside_the_commands_sections_names_them(name, argv, message, capsys):
    assert message in refusal(name, argv, capsys)


def test_key_value_settings_come_between_options_in_any_order():
    from evaluation import evaluate

    args = evaluate.parse_args(["roots.sugarcrepe=/sc", "--benchmarks", "sugarcrepe", "options.sugarcrepe.images=/i",
                                "--precision", "bf16-mixed", "scorer.global_weight=0.5", "--tensorboard"])
    assert args.roots == {"sugarcrepe": Path("/sc")} and args.options == {"sugarcrepe": {"images": "/i"}}
    assert args.scorer_options == {"global_weight": 0.5} and args.precision == "bf16-mixed"
    assert args.tensorboard is True


def test_outputs_of_several_formats_share_the_path_less_its_suffix():
    assert cli.output_paths(Path("runs/cat.png"), [".png", ".json"]) == {".png": Path("runs/cat.png"),
                                                                         ".json": Path("runs/cat.json")}
    assert cli.output_paths(Path("runs/perf_gpu"), [".json", ".md"])[".md"] == Path("runs/perf_gpu.md")


def test_the_precision_names_are_lightnings():
    from lightning.fabric.plugins.precision.precision import (_PRECISION_INPUT_STR,
                                                              _PRECISION_INPUT_STR_ALIAS_CONVERSION)

    assert set(cli.PRECISIONS) == set(get_args(_PRECISION_INPUT_STR))
    for alias, name in _PRECISION_INPUT_STR_ALIAS_CONVERSION.items():  # Lightning's legacy spellings, refused
        assert cli.RENAMED_PRECISIONS[alias] == name
    assert set(cli.RENAMED_PRECISIONS.values()) <= set(cli.PRECISIONS)
    import torch

    assert [cli.autocast_dtype(name) for name in ("32-true", "bf16-mixed", "16-mixed")] == [None, torch.bfloat16,
                                                                                          torch.float16]


def test_fit_refuses_a_legacy_precision_in_the_config_naming_lightnings():
    from core.config import load_config
    from lightning_modules import METHODS, fit

    for value, new in (("bf16", "bf16-mixed"), ("32", "32-true")):
        cfg = load_config([], [f"trainer.precision={value}"])
        assert f"trainer.precision: precision '{value}' was renamed: use {new}" in \
            " ".join(fit.config_problems(cfg, METHODS["clip_ft"]))
    for value in ("auto", "bf16-mixed", "32-true"):
        assert not fit.precision_problems(load_config([], [f"trainer.precision={value}"]))


def run_module(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", *argv], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_as_real_processes_help_runs_and_an_old_spelling_is_one_error_line():
    done = run_module("datamodules.shapes", "--help")
    assert done.returncode == 0 and "--out DIR" in done.stdout
    done = run_module("evaluation", "--set", "sugarcrepe.images=/x")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(
        "error: --set was renamed: use options.NAME.OPTION=VALUE (a key=value argument)")

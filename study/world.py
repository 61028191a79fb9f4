"""`python -m study.world --seed N --out DIR`: the method study's configs for the world of seed N, in folders of its
own.

The committed study is the world of seed `COMMITTED_SEED`: `configs/study/` and `configs/sweeps/study*.yaml` put
it in `data/study`, its runs in `runs/study`, its caches in `cache/study` and `cache/study_features`, its results
bundle in `results/study`. Another seed is another world, and nothing of it may mix with the committed one: a run's
config digest names the world's folder, not its contents, so a world of another seed generated into `data/study`
would find every run of the committed bundle "already done" (the sweep and `study.restore` now refuse it, naming
both world checksums; this module gives such a world its own place instead).

This command copies the study's config files into `DIR/study/` and `DIR/sweeps/`, with every folder of the study
renamed for the world (`world_name`): `data/study` -> `data/study-world-N`, `runs/study` -> `runs/study-world-N`,
`cache/study` and `cache/study_features` -> `cache/study-world-N` and `cache/study-world-N_features`,
`results/study` -> `results/study-world-N`, and the config files' own paths `configs/study/` and `configs/sweeps/`
-> `DIR/study/` and `DIR/sweeps/`. `make study STUDY_SEED=N` writes them (under `runs/study-world-N/configs`) and
runs every step of the study with them; the seed of the committed world uses `configs/` as it is.

One setting is the committed backbone's own number and is copied as it is: SmartCLIP's fixed temperature
(`method.modular_temperature`, the exp(logit_scale) of the committed world's seed-0 backbone). Another world's
backbone learns its own; set it with the value of that backbone's export when its SmartCLIP rows are to follow the
paper's rule exactly.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from core.cli import add_output
from core.files import atomic_write_text

COMMITTED_SEED = 1  # the Makefile's STUDY_SEED default: the world of the committed bundle results/study
REPO = Path(__file__).resolve().parents[1]
CONFIG_FOLDERS = {"study": "configs/study/*.yaml", "sweeps": "configs/sweeps/study*.yaml"}
# A study folder (data/study, runs/study/..., cache/study_features, results/study) not inside another path.
STUDY_FOLDER = re.compile(r"(?<![\w./-])(data|runs|cache|results)/study(?=/|_|\b)(?!-)")
CONFIG_PATH = re.compile(r"(?<![\w./-])configs/(study|sweeps)/")


def world_name(seed: int) -> str:
    """The folder name of the world of `seed` under data/, runs/, cache/ and results/."""
    return "study" if seed == COMMITTED_SEED else f"study-world-{seed}"


def rewrite(text: str, name: str, out: str) -> str:
    """A config file's text with the study's folders renamed to `name` and its config paths moved to `out`."""
    text = STUDY_FOLDER.sub(lambda match: f"{match.group(1)}/{name}", text)
    return CONFIG_PATH.sub(lambda match: f"{out}/{match.group(1)}/", text)


def world_configs(seed: int, out: Path, repo: Path = REPO) -> Dict[Path, str]:
    """{path under `out`: text} of every study config file, rewritten for the world of `seed`."""
    name = world_name(seed)
    header = (f"# Written by `python -m study.world --seed {seed} --out {out}` from {{source}}: the world of seed "
              f"{seed}. Edit the original and write this again.\n")
    files = {}
    for folder, pattern in CONFIG_FOLDERS.items():
        for source in sorted(repo.glob(pattern)):
            relative = source.relative_to(repo).as_posix()
            files[Path(out) / folder / source.name] = header.format(source=relative) + rewrite(
                source.read_text(), name, Path(out).as_posix())
    return files


def write_world_configs(seed: int, out: Path, repo: Path = REPO) -> List[Path]:
    if seed == COMMITTED_SEED:
        raise SystemExit(f"seed {seed} is the committed world's: its configs are configs/study and configs/sweeps")
    written = []
    for path, text in world_configs(seed, out, repo).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
        written.append(path)
    return written


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--seed", type=int, required=True, help="the world's seed (python -m datamodules.shapes)")
    add_output(parser, "folder", required=True, help="where the configs go (DIR/study/, DIR/sweeps/)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> List[Path]:
    args = parse_args(argv)
    written = write_world_configs(args.seed, args.out)
    print(f"world {world_name(args.seed)}: {len(written)} config files in {args.out}")
    return written


if __name__ == "__main__":
    main()

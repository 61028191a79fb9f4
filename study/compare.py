"""`python -m study.compare OLD NEW [--out FILE]`: how two results bundles of one design differ, item by item.

Two sittings of the same study (same configs and world) give runs whose last bits depend on the machine that
trained them: the CPU generation, the threads per run, the torch version (study/records.py). This command says how
much that moves the results. For every run and frozen row both bundles hold under the same name, and every split
both scored, it matches the swap items by id and counts those whose outcome differs (any of the four comparisons
of the Winoground rule: `text_i0`, `text_i1`, `image_c0`, `image_c1`), and gives the group score of each side. It
also says whether each run had the same config digest and started from the same backbone (sha256); a differing
config makes the pair no comparison of numerics at all, and is named.

Reads the bundles only (standard library): e.g. the committed bundle against one from an older commit,
`git worktree add /tmp/old <commit>` then `python -m study.compare /tmp/old/results/study results/study`.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from core.cli import add_output
from core.files import atomic_write_text
from core.run_records import RUNS_DIR
from study.records import FROZEN_DIR, read_records

COMPARED_FLAGS = ("text_i0", "text_i1", "image_c0", "image_c1")


@dataclass
class SplitComparison:
    sweep: str
    name: str
    split: str
    items: int
    differing: int
    group_old: float
    group_new: float
    same_config: Optional[bool]  # None for a frozen row (no config)
    same_backbone: Optional[bool]


def swap_outcomes(record: dict, split: str) -> Dict[str, dict]:
    return {item["id"]: item for item in (record["splits"].get(split) or {}).get("swap_outcomes") or []}


def group_score(outcomes: Sequence[dict]) -> float:
    return 100.0 * sum(item["group"] for item in outcomes) / len(outcomes) if outcomes else float("nan")


def compare_records(sweep: str, name: str, old: dict, new: dict) -> List[SplitComparison]:
    """One row per split both records scored, over the swap items both hold."""
    rows = []
    is_run = "config_digest" in old
    same_config = old.get("config_digest") == new.get("config_digest") if is_run else None
    same_backbone = ((old.get("backbone") or {}).get("sha256") == (new.get("backbone") or {}).get("sha256")
                     if is_run else old["export"]["sha256"] == new["export"]["sha256"])
    for split in sorted(set(old["splits"]) & set(new["splits"])):
        first, second = swap_outcomes(old, split), swap_outcomes(new, split)
        shared = sorted(set(first) & set(second))
        if not shared:
            continue
        differing = sum(any(first[i][flag] != second[i][flag] for flag in COMPARED_FLAGS) for i in shared)
        rows.append(SplitComparison(sweep, name, split, len(shared), differing,
                                    group_score([first[i] for i in shared]), group_score([second[i] for i in shared]),
                                    same_config, same_backbone))
    return rows


def compare_bundles(old: Path, new: Path) -> List[SplitComparison]:
    """Every run and frozen row both bundles hold (same sweep folder, same name), split by split."""
    rows: List[SplitComparison] = []
    sweeps = sorted({path.name for path in Path(old).iterdir() if path.is_dir()}
                    & {path.name for path in Path(new).iterdir() if path.is_dir()})
    for sweep in sweeps:
        for kind in (RUNS_DIR, FROZEN_DIR):
            first, second = read_records(Path(old) / sweep / kind), read_records(Path(new) / sweep / kind)
            for name in sorted(set(first) & set(second)):
                rows += compare_records(sweep, name, first[name], second[name])
    return rows


def totals(rows: Sequence[SplitComparison]) -> Tuple[int, int]:
    return sum(row.items for row in rows), sum(row.differing for row in rows)


def flag(value: Optional[bool]) -> str:
    return "-" if value is None else ("same" if value else "**differs**")


def markdown(old: Path, new: Path, rows: Sequence[SplitComparison]) -> str:
    items, differing = totals(rows)
    runs = {(row.sweep, row.name) for row in rows}
    lines = [f"# `{old}` against `{new}`", "",
             f"{len(runs)} runs and frozen rows in both; {differing} of {items} per-item swap outcomes differ "
             f"({100.0 * differing / items if items else 0.0:.1f}%).", ""]
    other_config = sorted({row.name for row in rows if row.same_config is False})
    if other_config:
        lines += [f"Ran with another config (not a comparison of numerics): {', '.join(other_config)}.", ""]
    lines += ["| sweep | run | split | items | differing | group (old) | group (new) | config | backbone |",
              "|---|---|---|---:|---:|---:|---:|---|---|"]
    lines += [f"| {row.sweep} | {row.name} | {row.split} | {row.items} | {row.differing} | {row.group_old:.1f} | "
              f"{row.group_new:.1f} | {flag(row.same_config)} | {flag(row.same_backbone)} |" for row in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("old", type=Path, help="a results bundle (e.g. an older commit's results/study)")
    parser.add_argument("new", type=Path, help="another results bundle of the same design")
    add_output(parser, "file", help="write the Markdown table here too")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> List[SplitComparison]:
    args = parse_args(argv)
    for bundle in (args.old, args.new):
        if not Path(bundle).is_dir():
            raise SystemExit(f"compare error: {bundle} is not a results bundle folder")
    rows = compare_bundles(args.old, args.new)
    if not rows:
        raise SystemExit(f"compare error: {args.old} and {args.new} hold no run under the same name with a split "
                         "both scored")
    text = markdown(args.old, args.new, rows)
    if args.out:
        atomic_write_text(args.out, text)
    print(text, end="")
    return rows


if __name__ == "__main__":
    main()

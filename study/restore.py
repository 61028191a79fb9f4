"""`python -m study.restore --bundle results/study [--data-root DIR]`: put the bundle's backbone back where its runs
expect it, once the world is checked to be the bundle's.

A later sitting continues a bundled study only from the backbone its runs started from (the sweep checks each
run's backbone sha256 against the bundle's record). Trained again, a backbone has other bits on another CPU
generation, so the bundle carries the one it was made with (`<sweep>/backbones/<sha>/`, its weights gzipped) and
this command writes it back to the path the records name (e.g. `runs/study/backbones/seed-0/export`), checked by
its sha256. A backbone already there is left alone when it is the same and refused when it differs; the
backbones sweep then skips the restored run, whose export exists. `make study` runs it first.

The backbone belongs to the bundle's world: first the world at `--data-root` (default: the folder the bundle's
`world` names) is checksummed as the bundle's was, and a world of other annotation files (another seed generated
into the same folder, or none there) is refused with both world checksums, before anything is written. A bundle
written before worlds were recorded is restored unchecked.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional, Sequence

from core.cli import add_data_root
from core.run_records import bundle_world, world_problem
from study.records import BundleError, carried_backbones, restore_backbone


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--bundle", type=Path, required=True, help="the results bundle (e.g. results/study)")
    add_data_root(parser, help="the world the backbone is restored for (default: the one the bundle's world names)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> List[str]:
    args = parse_args(argv)
    world = bundle_world(args.bundle)
    if world is not None:
        problem = world_problem(args.bundle, args.data_root or Path(world["root"]))
        if problem:
            raise SystemExit(f"restore error: {problem}")
    folders = carried_backbones(args.bundle)
    if not folders:
        print(f"{args.bundle}: no backbone carried (a new study, or a bundle without one): nothing to restore")
    lines = []
    try:
        for folder in folders:
            lines.append(restore_backbone(folder))
            print(lines[-1], flush=True)
    except BundleError as err:
        raise SystemExit(f"restore error: {err}") from None
    return lines


if __name__ == "__main__":
    main()

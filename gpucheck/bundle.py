"""`python -m gpucheck.bundle --out .gpu`: what the GPU node check needs on a node without a package index or spaCy.

`make gpu-prepare` downloads the wheels of the packages such a node lacks into OUT/whl and then runs this, where an
index and spaCy are, which writes beside them:

    shapes/        a small shapes world (`datamodules.shapes`): what the check's fits train on and evaluate
    cache/         its preprocessing cache for the demo configs (`datamodules.preprocess`: parsed here, where
                   spaCy is; fit finds it there from its stored settings, without spaCy)
    records.json   the caption records of perf.gpu's training batch (`python -m perf.gpu --write-records`)
    manifest.json  the commit, the date, every part's size, and the total with the repository's tracked files,
                   which travel with it

With `--max-mib N` it refuses (exit status 1, after writing the manifest) a total over N MiB, for a copy to the node
that may hold no more; by default it only reports the size. On the node, `python -m gpucheck` installs the wheels
into OUT/site (`install_wheels`) and puts that folder on every stage's PYTHONPATH.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from core.cli import add_output
from core.files import atomic_write_text

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUNDLE = Path(".gpu")
WORLD, CACHE, RECORDS, MANIFEST, WHEELS, SITE = "shapes", "cache", "records.json", "manifest.json", "whl", "site"
# The demo's preprocessing settings (grounder "annotations", the world's scene graphs): every demo config that
# reads masks shares them, so one cache serves the check's fits.
CACHE_CONFIG = REPO_ROOT / "configs" / "demo" / "pretrain.yaml"
MIB = 2 ** 20
# The check's world: 512 training images (1,024 captions, 16 steps of 64 per epoch), 64 per evaluation split.
GPU_WORLD = {"n_train": 512, "n_val": 64, "image_size": 64, "seed": 0}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output(parser, "folder", default=DEFAULT_BUNDLE, help=f"the bundle's folder (default {DEFAULT_BUNDLE})")
    parser.add_argument("--max-mib", type=float, default=None,
                        help="refuse a bundle that holds more than this together with the tracked files (MiB; "
                             "default: no limit, the size is reported)")
    parser.add_argument("--record-count", type=int, default=256, help="caption records for perf.gpu")
    return parser.parse_args(argv)


def world_config(bundle: Path, *overrides: str):
    """The demo config pointed at the bundle's world and cache (what the check's fits and this job read)."""
    from lightning_modules import load_run_config

    return load_run_config([CACHE_CONFIG], [f"data.root={bundle / WORLD}", f"preprocess.cache_root={bundle / CACHE}",
                                            "data.masks=true", *overrides])


def write_world(bundle: Path, world: Dict[str, int]) -> None:
    """The shapes world, unless one is there (the generator writes annotations/heldout.json last)."""
    from datamodules.shapes import generate

    if not (bundle / WORLD / "annotations" / "heldout.json").is_file():
        generate(bundle / WORLD, **world)


def write_cache(bundle: Path) -> None:
    """The world's preprocessing cache (resumes: finished shards are kept)."""
    from datamodules.preprocess import run

    run(world_config(bundle))


def write_records(bundle: Path, count: int) -> None:
    """The throughput batch's caption records, by the timing benchmark's own command (the check runs perf.gpu as a
    command and never imports it)."""
    subprocess.run([sys.executable, "-m", "perf.gpu", "--write-records", "--record-count", str(count), "--out",
                    str((bundle / RECORDS).resolve())], cwd=REPO_ROOT, check=True)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def tracked_bytes() -> Optional[int]:
    """The size of the repository's tracked files (None outside a git checkout)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True)
    if listed.returncode != 0:
        return None
    names = [name for name in listed.stdout.decode().split("\0") if name]
    return sum((REPO_ROOT / name).stat().st_size for name in names if (REPO_ROOT / name).is_file())


def commit() -> Dict[str, object]:
    """The checkout's commit and whether it has uncommitted changes (None outside git)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        return {"commit": None, "uncommitted_changes": None}
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    return {"commit": head.stdout.strip(), "uncommitted_changes": bool(status.stdout.strip())}


def manifest(bundle: Path, max_mib: Optional[float]) -> dict:
    parts = {name: folder_bytes(bundle / name) if (bundle / name).is_dir() else
             ((bundle / name).stat().st_size if (bundle / name).is_file() else 0)
             for name in (WORLD, CACHE, RECORDS, WHEELS)}
    wheels = sorted(p.name for p in (bundle / WHEELS).glob("*.whl")) if (bundle / WHEELS).is_dir() else []
    tracked = tracked_bytes()
    total = sum(parts.values()) + (tracked or 0)
    return {**commit(), "written": datetime.datetime.now().isoformat(timespec="seconds"),
            "parts_bytes": parts, "wheels": wheels, "tracked_files_bytes": tracked, "total_bytes": total,
            "total_mib": total / MIB, "max_mib": max_mib, "within_limit": max_mib is None or total <= max_mib * MIB}


def prepare(bundle: Path, world: Dict[str, int] = GPU_WORLD, record_count: int = 256,
            max_mib: Optional[float] = None) -> dict:
    """Write the world, its cache, perf.gpu's records and the manifest into `bundle`; return the manifest."""
    bundle.mkdir(parents=True, exist_ok=True)
    write_world(bundle, world)
    write_cache(bundle)
    write_records(bundle, record_count)
    written = manifest(bundle, max_mib)
    atomic_write_text(bundle / MANIFEST, json.dumps(written, indent=1))
    return written


# ----- on the node ---------------------------------------------------------------------------------------------
def wheel_files(bundle: Path) -> List[Path]:
    return sorted((bundle / WHEELS).glob("*.whl")) if (bundle / WHEELS).is_dir() else []


def install_wheels(bundle: Path, python: str = sys.executable) -> Optional[Path]:
    """The bundle's wheels installed into OUT/site (once: a stamp names the wheels installed); the folder, or None
    when the bundle carries no wheels."""
    wheels = wheel_files(bundle)
    if not wheels:
        return None
    site, names = bundle / SITE, "\n".join(p.name for p in wheels)
    stamp = site / ".installed"
    if stamp.is_file() and stamp.read_text() == names:
        return site
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
    stamp.write_text(names)
    return site


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    written = prepare(args.out, record_count=args.record_count, max_mib=args.max_mib)
    print(json.dumps(written["parts_bytes"]), flush=True)
    limit = "no limit" if args.max_mib is None else f"limit {args.max_mib:g} MiB"
    print(f"{args.out}: {written['total_mib']:.1f} MiB with the tracked files ({limit})", flush=True)
    if not written["within_limit"]:
        raise SystemExit(f"{args.out} and the tracked files hold {written['total_mib']:.1f} MiB, over --max-mib "
                         f"{args.max_mib:g}: carry fewer wheels, or a smaller world")


if __name__ == "__main__":
    main()

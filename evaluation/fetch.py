"""`python -m evaluation.fetch`: download a benchmark's public files into the layout its loader reads.

Examples:
    python -m evaluation.fetch --benchmarks sugarcrepe,valse --data-root data/benchmarks
    python -m evaluation.fetch --all --data-root data/benchmarks
    python -m evaluation.fetch --benchmarks crepe --data-root data/benchmarks --mirror https://mirror.example.org

Each benchmark's `data_source.downloads` (`evaluation/benchmarks/sources.py`) are files pinned at a fixed revision,
each with its sha256 and size. A file is downloaded next to its target as `<target>.part`, checked (size, then
sha256) and only then renamed into place, so an interrupted or altered download never leaves a file the loader
would read; an archive (`unpack`) is extracted into its target's folder after the check (members that would land
outside it are refused) and then deleted, and a stamp (`.fetched.json` in the benchmark's folder) records what was
fetched, so a second run skips it. A target that is already there with the pinned sha256 is kept; one with other
bytes is an error naming both digests (delete it to fetch it again). What cannot be fetched (gated data, sign-up
forms, images of other datasets) is printed from `data_source.by_hand`. `--mirror URL` downloads
`<URL>/<host>/<path>` instead of each file's own address (an institutional mirror, or a local server in tests).
The exit status is 1 when any download failed; the others are kept.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tarfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Dict, List, Optional, Sequence
from urllib.parse import urlsplit
from urllib.request import Request, urlopen

from core.cli import add_data_root
from core.files import atomic_write_text
from evaluation.benchmarks import BENCHMARKS
from evaluation.benchmarks.sources import DataSource, Download

STAMP_FILE = ".fetched.json"
CHUNK = 1 << 20
TIMEOUT_SECONDS = 60


class FetchError(RuntimeError):
    """A download that could not be completed or checked; the message names the file and why."""


def source_url(download: Download, mirror: Optional[str]) -> str:
    """Where to download `download` from: its own URL, or `<mirror>/<host>/<path>`."""
    if not mirror:
        return download.url
    parts = urlsplit(download.url)
    return f"{mirror.rstrip('/')}/{parts.netloc}{parts.path}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_stamp(root: Path) -> Dict[str, str]:
    """Targets fetched (and unpacked) into `root` earlier, with the sha256 they were fetched at."""
    path = root / STAMP_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def record_fetched(root: Path, download: Download) -> None:
    stamp = {**read_stamp(root), download.target: download.sha256}
    atomic_write_text(root / STAMP_FILE, json.dumps(stamp, indent=2, sort_keys=True))


def is_present(root: Path, download: Download) -> bool:
    """Whether the target is there as pinned: the file with its sha256, or (an archive) stamped as unpacked.

    A file with other bytes is an error: it may be a user's own edit, or another revision, and it is not ours to
    delete."""
    if download.unpack:
        return read_stamp(root).get(download.target) == download.sha256
    target = root / download.target
    if not target.exists():
        return False
    found = sha256_of(target)
    if found != download.sha256:
        raise FetchError(f"{target} is there with sha256 {found}, not the pinned {download.sha256}; delete it to "
                         "fetch the pinned file")
    return True


def download_to(url: str, part: Path, download: Download) -> None:
    """Stream `url` into `part`, then check its size and sha256 (the part file is removed on any failure)."""
    digest, size = hashlib.sha256(), 0
    try:
        request = Request(url, headers={"User-Agent": "compositional-clip-lab fetch"})
        with urlopen(request, timeout=TIMEOUT_SECONDS) as response, open(part, "wb") as handle:
            for chunk in iter(lambda: response.read(CHUNK), b""):
                handle.write(chunk)
                digest.update(chunk)
                size += len(chunk)
        if size != download.size:
            raise FetchError(f"{url}: got {size} bytes, expected {download.size}")
        if digest.hexdigest() != download.sha256:
            raise FetchError(f"{url}: sha256 {digest.hexdigest()} is not the pinned {download.sha256}")
    except OSError as err:  # URLError, HTTPError and socket timeouts are OSErrors
        part.unlink(missing_ok=True)
        raise FetchError(f"{url}: {err}") from err
    except FetchError:
        part.unlink(missing_ok=True)
        raise


def fetch_one(root: Path, download: Download, mirror: Optional[str] = None) -> str:
    """Fetch one file into `root` unless it is there as pinned; returns "present" or "fetched"."""
    if is_present(root, download):
        return "present"
    target = root / download.target
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    download_to(source_url(download, mirror), part, download)
    if download.unpack:
        unpack(part, download.unpack, target.parent)
        part.unlink()
        record_fetched(root, download)
    else:
        os.replace(part, target)
    return "fetched"


def unpack(archive: Path, kind: str, into: Path) -> None:
    """Extract a checked zip or tar archive into `into`, refusing members that would land outside it."""
    if kind == "zip":
        with zipfile.ZipFile(archive) as members:
            _check_members(archive, members.namelist())
            members.extractall(into)
        return
    with tarfile.open(archive) as members:
        _check_members(archive, [member.name for member in members.getmembers()])
        unsafe = [m.name for m in members.getmembers() if m.issym() or m.islnk() or m.isdev()]
        if unsafe:
            raise FetchError(f"{archive}: links or devices in the archive ({', '.join(unsafe[:3])}); not extracted")
        members.extractall(into, filter="data")


def _check_members(archive: Path, names: Sequence[str]) -> None:
    outside = [name for name in names if PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts]
    if outside:
        raise FetchError(f"{archive}: members outside the target folder ({', '.join(outside[:3])}); not extracted")


def fetch_benchmark(name: str, root: Path, mirror: Optional[str] = None) -> List[str]:
    """Fetch every pinned download of benchmark `name` into `root`; returns the failures (one line each) after
    printing what happened to each file and what must be fetched by hand."""
    source: DataSource = BENCHMARKS[name].data_source
    failures = []
    for download in source.downloads:
        try:
            state = fetch_one(root, download, mirror)
        except FetchError as err:
            failures.append(f"{name}: {err}")
            print(f"{name}: FAILED {download.target}: {err}", file=sys.stderr)
            continue
        print(f"{name}: {state} {root / download.target} ({download.size:,} bytes, sha256 {download.sha256[:12]})")
    if source.by_hand:
        print(f"{name}: by hand: {source.by_hand.replace('<root>', str(root))}")
    return failures


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    chosen = parser.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--benchmarks", help="comma-separated registry names (see python -m evaluation --list)")
    chosen.add_argument("--all", action="store_true", help="every benchmark with public files")
    add_data_root(parser, help="folder holding one sub-folder per benchmark (default data/benchmarks)")
    parser.add_argument("--mirror", metavar="URL", help="download <URL>/<host>/<path> instead of each file's URL")
    args = parser.parse_args(argv)
    args.names = [name.strip() for name in (args.benchmarks or "").split(",") if name.strip()]
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; registered: {', '.join(BENCHMARKS)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    base = Path(args.data_root) if args.data_root else Path("data/benchmarks")
    names = [name for name in BENCHMARKS if BENCHMARKS[name].data_source.downloads] if args.all else args.names
    failures = [failure for name in names for failure in fetch_benchmark(name, base / name, args.mirror)]
    if failures:
        raise SystemExit(f"{len(failures)} download(s) failed:\n" + "\n".join(failures))


if __name__ == "__main__":
    main()

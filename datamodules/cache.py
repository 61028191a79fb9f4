"""Sharded, atomically written, checksummed caches, and the shard bookkeeping of the offline jobs that fill them.

One helper serves both offline caches: `ShardedCache` holds the preprocessing cache (JSON-lines records of
`python -m datamodules.preprocess`), and its subclass `datamodules.features.FeatureShards` the frozen-feature
cache (tensors of `python -m datamodules.features`); the two differ only in how a shard's payload is encoded.
`ShardedCache.unfinished`, `fill_shards`, `shard_count` and `add_shard_argument` are the loop and the
`--shard i/n` option that both jobs share, and `open_cache` opens either kind once it is finished.

Layout of one preprocessing cache (one annotation file under one set of parser + grounder settings):

    <cache_root>/<key>/
        settings.json                      what the key hashes (annotation file hash, parser, grounder)
        shard-00003-of-00012.jsonl.gz      records of captions [3 * shard_size, 4 * shard_size)
        shard-00003-of-00012.json          its sha256, record count and counts
        manifest.json                      counts summed over finished shards, and whether all are done

A shard's data file is written to a temporary name and renamed, then its metadata (with the data's sha256)
is written the same way: a shard counts as done only when both exist and the checksum matches, so a crash
at any point leaves either a finished shard or one that is redone. On load every shard is verified, and a
truncated or corrupt one is named in the error; a job that finds one (a finished shard whose data is now
missing, truncated or altered) rebuilds it, warns naming it, and counts it in what it returns.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Type, TypeVar

from core.files import atomic_write_bytes

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
COUNT_KEYS = ("captions", "parsed", "no_object", "no_composition", "phrases", "grounded",
              "phrases_without_boxes", "unreadable_images")


class CacheError(RuntimeError):
    """A cache that is missing, incomplete or corrupt; the message names the file and the fix."""


# The arguments of the job that (re)builds a cache, as its errors write them: the reader's own config files and
# overrides. A command that has them (fit) writes them in their place (`with_arguments`).
SAME_ARGUMENTS = "--config <the same config files and overrides>"


def with_arguments(message: str, arguments: str) -> str:
    """A cache error's `message` with `arguments` (e.g. `--config a.yaml k=v`) in place of `SAME_ARGUMENTS`."""
    return message.replace(SAME_ARGUMENTS, arguments)


def file_sha256(path: os.PathLike | str, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_key(settings: Dict[str, Any]) -> str:
    """A short stable hash of everything that changes the cached records."""
    payload = json.dumps({"format": CACHE_FORMAT_VERSION, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def write_json(path: Path, document: Any) -> None:
    atomic_write_bytes(path, json.dumps(document, indent=1, sort_keys=True).encode())


class ShardedCache:
    """One cache directory of `num_shards` shards of JSON-lines records.

    Subclasses change the payload format through `data_suffix`, `encode` and `decode`, the counts summed in
    the manifest through `count_keys`, and the wording of errors through `label` and `job`.
    """

    data_suffix = "jsonl.gz"
    count_keys: Tuple[str, ...] = COUNT_KEYS
    label = "preprocessing cache"
    job = "python -m datamodules.preprocess"

    def __init__(self, directory: os.PathLike | str, num_shards: int):
        self.directory = Path(directory)
        self.num_shards = num_shards

    def data_path(self, index: int) -> Path:
        return self.directory / f"shard-{index:05d}-of-{self.num_shards:05d}.{self.data_suffix}"

    def meta_path(self, index: int) -> Path:
        return self.directory / f"shard-{index:05d}-of-{self.num_shards:05d}.json"

    def encode(self, records: List[dict]) -> Tuple[bytes, int]:
        """The shard's bytes and its number of records."""
        lines = "".join(json.dumps(record, sort_keys=True) + "\n" for record in records)
        return gzip.compress(lines.encode(), mtime=0), len(records)

    def decode(self, path: Path, expected: int) -> List[dict]:
        """The payload of the verified data file `path`, which must hold `expected` records."""
        return _decode_records(path, expected)

    def create(self, settings: Dict[str, Any]) -> None:
        """The directory and its settings.json. Jobs call this with their first finished shard (or to write the
        manifest), not before the work: a job that fails first (a detector that cannot load) leaves no folder."""
        if not (self.directory / "settings.json").is_file():
            self.directory.mkdir(parents=True, exist_ok=True)
            write_json(self.directory / "settings.json", settings)

    def write_shard(self, index: int, payload: Any, counts: Dict[str, int]) -> None:
        """Data first, then metadata carrying the data's checksum: the shard is done once both are in place."""
        self.directory.mkdir(parents=True, exist_ok=True)
        data, records = self.encode(payload)
        atomic_write_bytes(self.data_path(index), data)
        meta = {"index": index, "num_shards": self.num_shards, "records": records,
                "sha256": hashlib.sha256(data).hexdigest(), "counts": counts}
        write_json(self.meta_path(index), meta)

    def unfinished(self, shard: Tuple[int, int]) -> List[int]:
        """The shards worker `shard = (i, n)` still has to do: its own (`my_shards`) that are not done."""
        return [index for index in my_shards(self.num_shards, shard) if not self.is_done(index)]

    def read_meta(self, index: int) -> Optional[dict]:
        path = self.meta_path(index)
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError as err:
            raise CacheError(f"corrupt shard metadata {path} ({err}): {self.job} {SAME_ARGUMENTS} rebuilds the "
                             f"shard") from err

    def is_done(self, index: int) -> bool:
        """True when the shard's data exists and matches its recorded checksum (then a rerun skips it)."""
        return self.damage(index) is None and self.meta_path(index).is_file()

    def damage(self, index: int) -> Optional[str]:
        """What is wrong with a shard that was finished once (its metadata exists), or None: a shard that is
        intact or was never finished."""
        if not self.meta_path(index).is_file():
            return None
        try:
            meta = self.read_meta(index)
        except CacheError as err:
            return str(err)
        data = self.data_path(index)
        if not data.is_file():
            return f"its data file {data.name} is missing"
        if file_sha256(data) != meta["sha256"]:
            return f"its data file {data.name} does not match its checksum (truncated or altered)"
        return None

    def read_shard(self, index: int) -> Any:
        """The shard's payload, verified against its checksum."""
        meta, data = self.read_meta(index), self.data_path(index)
        if meta is None or not data.is_file():
            raise CacheError(f"shard {index} of {self.num_shards} of the {self.label} is missing in "
                             f"{self.directory}: {self.job} {SAME_ARGUMENTS} rebuilds it")
        if file_sha256(data) != meta["sha256"]:
            raise CacheError(f"corrupt or truncated {self.label} shard {data} (checksum mismatch): {self.job} "
                             f"{SAME_ARGUMENTS} rebuilds it")
        return self.decode(data, meta["records"])

    def summarise(self, settings: Dict[str, Any]) -> dict:
        """Write manifest.json: counts over finished shards and whether every shard is finished."""
        metas = [self.read_meta(i) for i in range(self.num_shards)]
        done = [m for m in metas if m is not None]
        counts = {key: sum(m["counts"].get(key, 0) for m in done) for key in self.count_keys}
        manifest = {"num_shards": self.num_shards, "finished_shards": len(done),
                    "complete": len(done) == self.num_shards, "counts": counts, "settings": settings}
        write_json(self.directory / "manifest.json", manifest)
        return manifest

    def read_all(self) -> Iterable[dict]:
        for index in range(self.num_shards):
            yield from self.read_shard(index)


def _decode_records(path: Path, expected: int) -> List[dict]:
    try:
        records = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
    except (OSError, EOFError, ValueError) as err:
        raise CacheError(f"corrupt cache shard {path}: {err}") from err
    if len(records) != expected:
        raise CacheError(f"corrupt cache shard {path}: {len(records)} records, expected {expected}")
    return records


CacheKind = TypeVar("CacheKind", bound=ShardedCache)


def open_cache(directory: os.PathLike | str, kind: Type[CacheKind] = ShardedCache) -> CacheKind:
    """A finished cache of `kind`, from its manifest; a missing or incomplete one is a clear error."""
    manifest_path = Path(directory) / "manifest.json"
    if not manifest_path.is_file():
        raise CacheError(f"no {kind.label} at {directory}: run {kind.job} {SAME_ARGUMENTS}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as err:
        raise CacheError(f"corrupt {kind.label} manifest {manifest_path} ({err}): {kind.job} {SAME_ARGUMENTS} "
                         f"writes it again") from err
    cache = kind(directory, manifest["num_shards"])
    if not manifest["complete"]:  # shards finished concurrently may each have seen the others unfinished
        manifest = cache.summarise(manifest["settings"])
    if not manifest["complete"]:
        raise CacheError(f"the {kind.label} at {directory} is incomplete ({manifest['finished_shards']} of "
                         f"{manifest['num_shards']} shards): finish it with {kind.job} {SAME_ARGUMENTS}")
    return cache


def keyed_caches(cache_root: os.PathLike | str) -> Iterator[Tuple[Path, dict]]:
    """(directory, stored settings) of every cache under `cache_root` whose name is the key of its settings.json:
    how a reader finds a cache by settings it knows only in part (a folder renamed or a settings.json edited by
    hand is not a cache of those settings, so it is passed over)."""
    root = Path(cache_root)
    if not root.is_dir():
        return
    for directory in sorted(root.iterdir()):
        try:
            settings = json.loads((directory / "settings.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(settings, dict) and directory.name == cache_key(settings):
            yield directory, settings


# ----- the offline jobs' shard bookkeeping ------------------------------------------------------------------
def shard_count(num_records: int, shard_size: int) -> int:
    """Shards of `shard_size` records that hold `num_records` (at least one, so an empty split has a manifest)."""
    return max(1, -(-num_records // shard_size))


def my_shards(num_shards: int, shard: Tuple[int, int]) -> List[int]:
    """The shard indices worker `shard = (i, n)` does: those with index % n == i."""
    index, count = shard
    return [i for i in range(num_shards) if i % count == index]


def fill_shards(cache: ShardedCache, settings: Dict[str, Any], todo: Sequence[int],
                produce: Callable[[int], Tuple[Any, Dict[str, int]]]) -> dict:
    """Produce and write each shard of `todo` (`produce(index)` gives its payload and counts); return the manifest,
    with `rebuilt_shards`: how many of `todo` were damaged shards (finished once, see `damage`) that this call
    rebuilt, each also logged as a warning. (That count is this job's, so it is not written to manifest.json,
    which every worker of a job rewrites.)

    The folder appears with the first finished shard, so a job that fails before any shard leaves nothing.
    """
    damaged = warn_damaged_shards(cache, todo)
    for index in todo:
        payload, counts = produce(index)
        cache.create(settings)
        cache.write_shard(index, payload, counts)
    cache.create(settings)
    return {**cache.summarise(settings), "rebuilt_shards": len(damaged)}


def warn_damaged_shards(cache: ShardedCache, todo: Sequence[int]) -> List[int]:
    """The damaged shards among `todo`, each named in a warning."""
    damaged = []
    for index in todo:
        damage = cache.damage(index)
        if damage is not None:
            log.warning("%s shard %d of %d in %s is damaged (%s): rebuilding it", cache.label, index,
                        cache.num_shards, cache.directory, damage)
            damaged.append(index)
    return damaged


def parse_shard(text: str) -> Tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise argparse.ArgumentTypeError(f"--shard expects i/n with 0 <= i < n, got {text!r}")
    return int(index), int(count)


def add_shard_argument(parser: argparse.ArgumentParser) -> None:
    """The offline jobs' `--shard i/n` option: one of n workers of a SLURM array, each doing its own shards."""
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), help="i/n: do shards with index %% n == i")


def resolve_device(device: str) -> str:
    """`device`, with "auto" meaning CUDA when there is one (torch is imported only then)."""
    if device != "auto":
        return device
    import torch  # the parser-only preprocessing path needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"

"""The preprocessing cache: sharded, atomically written, checksummed JSON-lines records.

Layout of one cache (one annotation file under one set of parser + grounder settings):

    <cache_root>/<key>/
        settings.json                      what the key hashes (annotation file hash, parser, grounder)
        shard-00003-of-00012.jsonl.gz      records of captions [3 * shard_size, 4 * shard_size)
        shard-00003-of-00012.json          its sha256, record count and counts
        manifest.json                      counts summed over finished shards, and whether all are done

A shard's data file is written to a temporary name and renamed, then its metadata (with the data's sha256)
is written the same way: a shard counts as done only when both exist and the checksum matches, so a crash
at any point leaves either a finished shard or one that is redone. On load every shard is verified, and a
truncated or corrupt one is named in the error.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from core.files import atomic_write_bytes

CACHE_FORMAT_VERSION = 1
COUNT_KEYS = ("captions", "parsed", "no_object", "no_composition", "phrases", "grounded",
              "phrases_without_boxes", "unreadable_images")


class CacheError(RuntimeError):
    """A cache that is missing, incomplete or corrupt; the message names the file and the fix."""


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
    """One cache directory of `num_shards` shards."""

    def __init__(self, directory: os.PathLike | str, num_shards: int):
        self.directory = Path(directory)
        self.num_shards = num_shards

    def data_path(self, index: int) -> Path:
        return self.directory / f"shard-{index:05d}-of-{self.num_shards:05d}.jsonl.gz"

    def meta_path(self, index: int) -> Path:
        return self.directory / f"shard-{index:05d}-of-{self.num_shards:05d}.json"

    def create(self, settings: Dict[str, Any]) -> None:
        """The directory and its settings.json. Jobs call this with their first finished shard (or to write the
        manifest), not before the work: a job that fails first (a detector that cannot load) leaves no folder."""
        if not (self.directory / "settings.json").is_file():
            self.directory.mkdir(parents=True, exist_ok=True)
            write_json(self.directory / "settings.json", settings)

    def write_shard(self, index: int, records: List[dict], counts: Dict[str, int]) -> None:
        """Data first, then metadata carrying the data's checksum: the shard is done once both are in place."""
        self.directory.mkdir(parents=True, exist_ok=True)
        lines = "".join(json.dumps(record, sort_keys=True) + "\n" for record in records)
        data = gzip.compress(lines.encode(), mtime=0)
        atomic_write_bytes(self.data_path(index), data)
        meta = {"index": index, "num_shards": self.num_shards, "records": len(records),
                "sha256": hashlib.sha256(data).hexdigest(), "counts": counts}
        write_json(self.meta_path(index), meta)

    def read_meta(self, index: int) -> Optional[dict]:
        path = self.meta_path(index)
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError as err:
            raise CacheError(f"corrupt shard metadata {path}: {err}") from err

    def is_done(self, index: int) -> bool:
        """True when the shard's data exists and matches its recorded checksum (then a rerun skips it)."""
        meta = self.read_meta(index)
        data = self.data_path(index)
        return meta is not None and data.is_file() and file_sha256(data) == meta["sha256"]

    def read_shard(self, index: int) -> List[dict]:
        """The shard's records, verified against its checksum."""
        meta, data = self.read_meta(index), self.data_path(index)
        if meta is None or not data.is_file():
            raise CacheError(f"shard {index} of {self.num_shards} is missing in {self.directory} "
                             f"(run python -m datamodules.preprocess with the same config)")
        if file_sha256(data) != meta["sha256"]:
            raise CacheError(f"corrupt or truncated cache shard {data}: checksum mismatch; delete it and "
                             f"rerun python -m datamodules.preprocess to rebuild it")
        return _decode_records(data, meta["records"])

    def summarise(self, settings: Dict[str, Any]) -> dict:
        """Write manifest.json: counts over finished shards and whether every shard is finished."""
        metas = [self.read_meta(i) for i in range(self.num_shards)]
        done = [m for m in metas if m is not None]
        counts = {key: sum(m["counts"].get(key, 0) for m in done) for key in COUNT_KEYS}
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


def open_cache(directory: os.PathLike | str) -> ShardedCache:
    """A finished cache, from its manifest; a missing or incomplete one is a clear error."""
    manifest_path = Path(directory) / "manifest.json"
    if not manifest_path.is_file():
        raise CacheError(f"no preprocessing cache at {directory}: run python -m datamodules.preprocess "
                         f"--config <the same config files and overrides>")
    manifest = json.loads(manifest_path.read_text())
    cache = ShardedCache(directory, manifest["num_shards"])
    if not manifest["complete"]:  # shards finished concurrently may each have seen the others unfinished
        manifest = cache.summarise(manifest["settings"])
    if not manifest["complete"]:
        raise CacheError(f"the preprocessing cache at {directory} is incomplete ({manifest['finished_shards']} "
                         f"of {manifest['num_shards']} shards): finish python -m datamodules.preprocess")
    return cache

"""Atomic file writes: a crash leaves either the old file or the new one, never half of one."""
from __future__ import annotations

import os
from pathlib import Path


def atomic_write_bytes(path: os.PathLike | str, data: bytes) -> None:
    """Write to a process-unique temporary name beside `path`, flush to disk, then rename over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: os.PathLike | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))

"""Where a benchmark image is (`ImageRef`) and how it is read: a file (a `.npy` file is a BGR video frame), a crop of
a file, a member of a zip archive or a cell of a parquet file.

The pixels are decoded by `parsers.images`, the project's one decoder (16-bit grayscale is scaled, not clipped), and
the crop is taken after decoding. This module imports no other module of the benchmarks package, so every one of
them (`base` included) can import it (setup.cfg's `evaluation.benchmarks` contract).
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, List, Optional, Tuple

from PIL import Image

from parsers.images import IMAGE_ERRORS, read_npy_frame, read_rgb_bytes, read_rgb_file


@dataclass(frozen=True)
class ImageRef:
    """Where an image is: a file, optionally cropped, or a cell of a container file.

    Attributes:
        path: the image file (a `.npy` file is a BGR video frame), or the container (a parquet file or a zip
            archive) when `member` is set.
        box: optional crop `(x, y, w, h)` in pixels, applied after decoding (ARO's `bbox_*` fields).
        member: for a parquet container, `"<column>:<row>"` whose cell holds `{"bytes", "path"}` (the
            Hugging Face image feature); for a zip archive, the member's name.
    """

    path: str
    box: Optional[Tuple[float, float, float, float]] = None
    member: Optional[str] = None

    @property
    def file(self) -> Path:
        return Path(self.path)


class UnreadableImageError(OSError):
    """A benchmark image that is there but does not decode; the message names the file."""


def load_image(ref: ImageRef) -> Image.Image:
    """The 8-bit RGB image `ref` points at, cropped to `ref.box` when it has one."""
    try:
        return _decode(ref)
    except IMAGE_ERRORS as err:  # PIL's "cannot identify image file", truncated data, a float image
        where = ref.path if ref.member is None else f"{ref.path} ({ref.member})"
        raise UnreadableImageError(f"cannot read benchmark image {where}: {err}; copy it again from the "
                                   f"benchmark's release") from err


def _decode(ref: ImageRef) -> Image.Image:
    if ref.member is not None:
        rgb = read_rgb_bytes(member_bytes(ref.path, ref.member))
    elif ref.path.endswith(".npy"):
        rgb = read_npy_frame(ref.path)
    else:
        rgb = read_rgb_file(ref.path)
    if ref.box is not None:
        x, y, w, h = ref.box
        rgb = rgb.crop((x, y, x + w, y + h))  # PIL rounds float boxes, as the ARO reference does
    return rgb


def image_file_name(ref: ImageRef) -> str:
    """The name image `ref` was published under: its path, or for an image embedded in a parquet file the file
    name recorded with it (the Hugging Face image feature's `path`; the container's path when none is)."""
    if ref.member is None:
        return ref.path
    if ref.path.lower().endswith(".zip"):
        return ref.member
    column, _, row = ref.member.rpartition(":")
    return parquet_image_names(ref.path, column)[int(row)] or ref.path


def member_bytes(path: str, member: str) -> bytes:
    """The encoded bytes of an image inside a container file: a member of a zip archive (`path` ends in .zip,
    `member` is its name there, as ELEVATER's `<archive>.zip@<member>` names images) or the Hugging Face image
    cell `"<column>:<row>"` of a parquet file."""
    if path.lower().endswith(".zip"):
        try:
            return _zip_archive(path, os.getpid()).read(member)
        except KeyError as err:  # an OSError, so that load_image names the archive and the member
            raise FileNotFoundError(f"{path} holds no member {member!r}") from err
        except zipfile.BadZipFile as err:
            raise OSError(f"{path}: not a readable zip archive ({err})") from err
    return parquet_image_bytes(path, member)


@lru_cache(maxsize=16)
def _zip_archive(path: str, pid: int) -> zipfile.ZipFile:
    """One open archive per process (`pid` is part of the key): a handle inherited by a forked DataLoader worker
    would share its file offset with the parent's."""
    return zipfile.ZipFile(path)


def parquet_image_bytes(path: str, member: str) -> bytes:
    """The encoded bytes of the Hugging Face image cell `"<column>:<row>"` of a parquet file."""
    column, _, row = member.rpartition(":")
    cell = _parquet_table(path).column(column)[int(row)].as_py()
    if not cell or not cell.get("bytes"):
        raise ValueError(f"{path}: row {row} of column {column!r} holds no embedded image bytes")
    return cell["bytes"]


@lru_cache(maxsize=4)
def _parquet_table(path: str):
    """Memory-mapped so that each loader worker shares the OS page cache instead of a copy."""
    import pyarrow.parquet as pq  # only the parquet-backed benchmarks need it

    return pq.read_table(path, memory_map=True)


@lru_cache(maxsize=16)
def parquet_image_names(path: str, column: str) -> List[Optional[str]]:
    """The file name recorded with each image of an image column (its `path` field; None where it has none),
    read without the image bytes."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=[f"{column}.path"]).column(0).to_pylist()


def missing_files(refs: Iterable[ImageRef]) -> List[str]:
    """Distinct files among `refs` (images or containers) that do not exist."""
    return sorted({ref.path for ref in refs if not Path(ref.path).is_file()})

"""Decoding a benchmark image from an `ImageRef`: a file (a `.npy` file is a BGR video frame), a crop of a file, or a
cell of a parquet file."""
from __future__ import annotations

import io
import os
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Iterable, List, Optional

import numpy as np
from PIL import Image

from evaluation.benchmarks.base import ImageRef


class UnreadableImageError(OSError):
    """A benchmark image that is there but does not decode; the message names the file."""


def load_image(ref: ImageRef) -> Image.Image:
    """The RGB image `ref` points at, cropped to `ref.box` when it has one."""
    try:
        return _decode(ref)
    except OSError as err:  # PIL's "cannot identify image file", truncated data
        where = ref.path if ref.member is None else f"{ref.path} ({ref.member})"
        raise UnreadableImageError(f"cannot read benchmark image {where}: {err}; copy it again from the "
                                   f"benchmark's release") from err


def _decode(ref: ImageRef) -> Image.Image:
    if ref.member is not None:
        image = Image.open(io.BytesIO(member_bytes(ref.path, ref.member)))
    elif ref.path.endswith(".npy"):
        image = read_npy_frame(ref.path)
    else:
        image = Image.open(ref.path)
    with image:  # closed at once: an evaluation opens thousands of files
        rgb = image.convert("RGB")
    if ref.box is not None:
        x, y, w, h = ref.box
        rgb = rgb.crop((x, y, x + w, y + h))  # PIL rounds float boxes, as the ARO reference does
    return rgb


def read_npy_frame(path: str | Path) -> Image.Image:
    """A video frame stored as a numpy array [H, W, 3] of uint8 in BGR order (EqBen's YouCook2 frames, read as its
    `process_img_npy` reads them), as an RGB image."""
    try:
        array = np.load(path)
    except (ValueError, EOFError) as error:  # not an .npy file, a pickled object array, a truncated file
        raise OSError(f"{path}: not a numpy array file ({error})") from error
    if array.ndim != 3 or array.shape[2] != 3 or array.dtype != np.uint8:
        raise OSError(f"{path}: expected a [H, W, 3] uint8 array, found {array.dtype} {array.shape}")
    return Image.fromarray(np.ascontiguousarray(array[:, :, [2, 1, 0]]), "RGB")


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


def read_parquet_rows(path: Path, columns: Iterable[str]) -> List[dict]:
    """The given (non-image) columns of a parquet file as a list of row dicts."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=list(columns)).to_pylist()


def missing_files(refs: Iterable[ImageRef]) -> List[str]:
    """Distinct files among `refs` (images or containers) that do not exist."""
    return sorted({ref.path for ref in refs if not Path(ref.path).is_file()})

"""The study's results bundle as files: the finished runs of a study kept as data (gzip JSON, standard library only).

`python -m study --sweep DIR --bundle DIR` writes it (`study/bundle.py` builds its records); `python -m study.page`
reads it back; `slurm.sweep` reads its run records to skip every run whose results it already holds. Its layout,
which `<bundle>/README.md` describes for readers without this code:

    <bundle>/README.md
    <bundle>/<sweep name>/sweep.json            the grid, the study settings, the world's checksums
    <bundle>/<sweep name>/runs/<run>.json.gz    one record per finished run
    <bundle>/<sweep name>/frozen/<row>.json.gz  rows scored from a backbone without training
    <bundle>/<sweep name>/report.json           selection, validity table, paired comparisons
    <bundle>/<sweep name>/backbones/<sha>/      the backbone the runs started from, its weights gzipped

A run record holds `config_digest` (`lightning_modules.resume.config_digest` of the run's resolved config) and
`config` (the keys that digest covers), `backbone` ({"path", "sha256"} of the export the run started from:
`model.pretrained`'s weights file, and the `numerics` it was trained with when its export records them), the
run's own `export_sha256`, its validation `curves` and its per-split scores with their per-item outcomes. The run
records' place and the fields a sweep checks (config digest, backbone sha256 and numerics) are the file contract
of `core/run_records.py`, which the sweep reads without importing the study: a sweep skips a run whose record
matches its config digest and backbone checksum, and refuses to go on when either differs (the bundle then belongs
to another study).

A backbone's exact bits depend on the machine that trained it (CPU generation, threads, torch), so one trained again
in a later sitting on another machine is another backbone. The bundle therefore carries the backbone its runs started
from (`carry_backbone`) and `restore_backbone` puts it back where the runs expect it: a later sitting continues the same
study on any machine (its own runs then differ from the earlier ones only in their last bits, recorded per run).

Every file is written deterministically (sorted keys, gzip without a time stamp), so an unchanged record is an
unchanged file and a commit of the bundle shows only what changed.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from core.files import atomic_write_bytes
from core.run_records import RECORD_SUFFIX, backbone_weights, export_weights, file_sha256, read_json_gz

FORMAT = 1
README = "README.md"
SWEEP_DOCUMENT = "sweep.json"
REPORT_DOCUMENT = "report.json"
FROZEN_DIR = "frozen"
BACKBONES_DIR = "backbones"
CARRIED_SOURCE = "source.json"  # where a carried backbone came from: {"path", "weights", "sha256", "folder"}
CARRIED_SUFFIX = ".gz"
EXPORT_HF_FOLDER = "hf"  # the export's Hugging Face copy of the weights (modeling.export.HF_DIR)


# ----- files ----------------------------------------------------------------------------------------------------
def canonical_json(document: object) -> bytes:
    """Sorted keys, no spaces, UTF-8: one byte string per document."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def write_json_gz(path: Path, document: object) -> None:
    """`document` as gzip-compressed canonical JSON, with no time stamp or file name in the gzip header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, gzip.compress(canonical_json(document), compresslevel=9, mtime=0))


def write_json(path: Path, document: object) -> None:
    """Plain JSON for the small documents (sorted keys, indented: readable in a diff)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(document, sort_keys=True, indent=1, ensure_ascii=False) + "\n")
                       .encode("utf-8"))


def weights_sha256(export_dir: Path) -> Optional[str]:
    """sha256 of an export's weights file (None when there is none): `sha256sum <export>/open_clip.pt`."""
    weights = export_weights(export_dir)
    return file_sha256(weights) if weights.is_file() else None


# ----- where things are -----------------------------------------------------------------------------------------
def sweep_folder(bundle: Path, sweep_name: str) -> Path:
    return Path(bundle) / sweep_name


def frozen_record_path(bundle: Path, sweep_name: str, label: str) -> Path:
    return sweep_folder(bundle, sweep_name) / FROZEN_DIR / f"{label}{RECORD_SUFFIX}"


def read_records(folder: Path) -> Dict[str, dict]:
    """Every record of a `runs/` or `frozen/` folder by name ({} when the folder does not exist)."""
    if not folder.is_dir():
        return {}
    return {path.name[:-len(RECORD_SUFFIX)]: read_json_gz(path) for path in sorted(folder.glob(f"*{RECORD_SUFFIX}"))}


# ----- the backbone the runs started from -------------------------------------------------------------------------
class BundleError(Exception):
    """A bundle's carried backbone cannot be put back: the path holds other weights, or the copy is damaged."""


def carried_folder(bundle: Path, sweep_name: str, sha256: str) -> Path:
    return sweep_folder(bundle, sweep_name) / BACKBONES_DIR / sha256[:16]


def carry_backbone(bundle: Path, sweep_name: str, backbone: Optional[Mapping[str, Any]]) -> Optional[Path]:
    """Keep the backbone a run record names (`{"path", "sha256"}`) in the bundle, once: its export folder's small
    files as they are and its weights gzipped. Returns the folder, or None when there is nothing to carry (no
    local weights, or weights here with another checksum than the record's, which the record checks refuse)."""
    if not backbone or not backbone.get("sha256"):
        return None
    folder = carried_folder(bundle, sweep_name, backbone["sha256"])
    if (folder / CARRIED_SOURCE).is_file():
        return folder
    weights = backbone_weights(backbone["path"])
    if weights is None or not weights.is_file() or file_sha256(weights) != backbone["sha256"]:
        return None
    is_folder = Path(backbone["path"]).is_dir()
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if is_folder:  # the small files; not the weights (gzipped below) nor the export's Hugging Face copy of them
        shutil.copytree(weights.parent, partial, ignore=lambda folder, names: [
            n for n in names if n == weights.name or (Path(folder) == weights.parent and n == EXPORT_HF_FOLDER)])
    else:
        partial.mkdir(parents=True)
    with open(weights, "rb") as source, open(partial / (weights.name + CARRIED_SUFFIX), "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=6, mtime=0) as packed:
            shutil.copyfileobj(source, packed, 1 << 20)
    write_json(partial / CARRIED_SOURCE, {"path": str(backbone["path"]), "weights": weights.name,
                                          "sha256": backbone["sha256"], "folder": is_folder})
    os.replace(partial, folder)
    return folder


def carried_backbones(bundle: Path) -> List[Path]:
    return sorted(path.parent for path in Path(bundle).glob(f"*/{BACKBONES_DIR}/*/{CARRIED_SOURCE}"))


def restore_backbone(folder: Path) -> str:
    """Put a carried backbone back at the path its runs name, checked by its sha256; a line saying what was done.
    Weights already there are left alone when they are the same and refused (BundleError) when they differ."""
    source = json.loads((Path(folder) / CARRIED_SOURCE).read_text())
    target = Path(source["path"])
    weights = target / source["weights"] if source["folder"] else target
    if weights.is_file():
        found = file_sha256(weights)
        if found != source["sha256"]:
            raise BundleError(f"{weights} has sha256 {found}, and the bundle's backbone {source['sha256']}: it is "
                              "another backbone (trained again here?). Move it aside to continue the bundled study "
                              "from the backbone its runs started from, or start a new bundle.")
        return f"{target}: already here (sha256 {found[:16]}...)"
    if target.exists() and source["folder"] and any(target.iterdir()):
        raise BundleError(f"{target} exists without its weights {weights.name}: move it aside first")
    partial = target.with_name(target.name + ".restoring")
    shutil.rmtree(partial, ignore_errors=True) if partial.is_dir() else partial.unlink(missing_ok=True)
    if source["folder"]:
        shutil.copytree(folder, partial, ignore=lambda _, names: [
            n for n in names if n in (CARRIED_SOURCE, source["weights"] + CARRIED_SUFFIX)])
        unpacked = partial / source["weights"]
    else:
        partial.parent.mkdir(parents=True, exist_ok=True)
        unpacked = partial
    with gzip.open(Path(folder) / (source["weights"] + CARRIED_SUFFIX), "rb") as packed, open(unpacked, "wb") as out:
        shutil.copyfileobj(packed, out, 1 << 20)
    if file_sha256(unpacked) != source["sha256"]:
        shutil.rmtree(partial) if partial.is_dir() else partial.unlink()
        raise BundleError(f"{folder}: the carried weights do not have the sha256 they were carried with: the bundle "
                          "is damaged")
    if target.is_dir():
        target.rmdir()  # empty: checked above
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, target)
    return f"{target}: restored from {folder} (sha256 {source['sha256'][:16]}...)"

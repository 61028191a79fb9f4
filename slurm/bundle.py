"""A results bundle: the finished runs of a sweep kept as data (gzip JSON, standard library only).

`python -m study --sweep DIR --bundle DIR` writes it (`study/bundle.py` builds its records); `slurm.sweep` reads
it to skip every run whose results it already holds. Its layout, which `<bundle>/README.md` describes for readers
without this code:

    <bundle>/README.md
    <bundle>/<sweep name>/sweep.json            the grid, the study settings, the world's checksums
    <bundle>/<sweep name>/runs/<run>.json.gz    one record per finished run
    <bundle>/<sweep name>/frozen/<row>.json.gz  rows scored from a backbone without training
    <bundle>/<sweep name>/report.json           selection, validity table, paired comparisons
    <bundle>/<sweep name>/backbones/<sha>/      the backbone the runs started from, its weights gzipped

A run record holds `config_digest` (`lightning_modules.resume.config_digest` of the run's resolved config) and
`config` (the keys that digest covers), `backbone` ({"path", "sha256"} of the export the run started from:
`model.pretrained`'s weights file, and the `numerics` it was trained with when its export records them), the
run's own `export_sha256`, its validation `curves` and its per-split scores with their per-item outcomes. A sweep
skips a run whose record matches its config digest and backbone checksum, and refuses to go on when either differs
(`record_problems`): the bundle then belongs to another study.

A backbone's exact bits depend on the machine that trained it (CPU generation, threads, torch), so one trained again
in a later sitting on another machine is another backbone. The bundle therefore carries the backbone its runs started
from (`carry_backbone`) and `restore_backbone` puts it back where the runs expect it: a later sitting continues the same
study on any machine (its own runs then differ from the earlier ones only in their last bits, recorded per run).

Every file is written deterministically (sorted keys, gzip without a time stamp), so an unchanged record is an
unchanged file and a commit of the bundle shows only what changed.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from core.files import atomic_write_bytes

FORMAT = 1
README = "README.md"
SWEEP_DOCUMENT = "sweep.json"
REPORT_DOCUMENT = "report.json"
RUNS_DIR = "runs"
FROZEN_DIR = "frozen"
RECORD_SUFFIX = ".json.gz"
BACKBONES_DIR = "backbones"
CARRIED_SOURCE = "source.json"  # where a carried backbone came from: {"path", "weights", "sha256", "folder"}
CARRIED_SUFFIX = ".gz"
EXPORT_METADATA = "model.json"  # modeling.export's names, read here without importing torch
EXPORT_HF_FOLDER = "hf"  # the export's Hugging Face copy of the weights (modeling.export.HF_DIR)
DEFAULT_WEIGHTS = "open_clip.pt"


# ----- files ----------------------------------------------------------------------------------------------------
def canonical_json(document: object) -> bytes:
    """Sorted keys, no spaces, UTF-8: one byte string per document."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def write_json_gz(path: Path, document: object) -> None:
    """`document` as gzip-compressed canonical JSON, with no time stamp or file name in the gzip header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, gzip.compress(canonical_json(document), compresslevel=9, mtime=0))


def read_json_gz(path: Path) -> Any:
    return json.loads(gzip.decompress(Path(path).read_bytes()).decode("utf-8"))


def write_json(path: Path, document: object) -> None:
    """Plain JSON for the small documents (sorted keys, indented: readable in a diff)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, (json.dumps(document, sort_keys=True, indent=1, ensure_ascii=False) + "\n")
                       .encode("utf-8"))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def export_weights(export_dir: Path) -> Path:
    """The weights file of a model export (`model.json`'s "weights", else open_clip.pt)."""
    metadata = Path(export_dir) / EXPORT_METADATA
    name = json.loads(metadata.read_text()).get("weights", DEFAULT_WEIGHTS) if metadata.is_file() else DEFAULT_WEIGHTS
    return Path(export_dir) / name


def weights_sha256(export_dir: Path) -> Optional[str]:
    """sha256 of an export's weights file (None when there is none): `sha256sum <export>/open_clip.pt`."""
    weights = export_weights(export_dir)
    return file_sha256(weights) if weights.is_file() else None


def export_numerics(weights: Optional[Path]) -> Optional[dict]:
    """The `numerics` an export's model.json records beside `weights` (device, threads, processes, precision,
    torch: lightning_modules/callbacks.py), or None (no export folder, or one written before they were kept)."""
    metadata = Path(weights).parent / EXPORT_METADATA if weights is not None else None
    if metadata is None or not metadata.is_file():
        return None
    return json.loads(metadata.read_text()).get("numerics")


def pretrained_weights(pretrained: Optional[str]) -> Optional[Path]:
    """The local weights file a run starts from (`model.pretrained`): an export folder's weights, or the file
    named; None for no weights or a hub tag such as `openai` (a name without a folder)."""
    if not pretrained:
        return None
    path = Path(pretrained)
    if path.is_dir():
        return export_weights(path)
    return path if path.suffix or len(path.parts) > 1 else None


# ----- where things are -----------------------------------------------------------------------------------------
def sweep_folder(bundle: Path, sweep_name: str) -> Path:
    return Path(bundle) / sweep_name


def run_record_path(bundle: Path, sweep_name: str, run_name: str) -> Path:
    return sweep_folder(bundle, sweep_name) / RUNS_DIR / f"{run_name}{RECORD_SUFFIX}"


def frozen_record_path(bundle: Path, sweep_name: str, label: str) -> Path:
    return sweep_folder(bundle, sweep_name) / FROZEN_DIR / f"{label}{RECORD_SUFFIX}"


def read_records(folder: Path) -> Dict[str, dict]:
    """Every record of a `runs/` or `frozen/` folder by name ({} when the folder does not exist)."""
    if not folder.is_dir():
        return {}
    return {path.name[:-len(RECORD_SUFFIX)]: read_json_gz(path) for path in sorted(folder.glob(f"*{RECORD_SUFFIX}"))}


def read_run_record(bundle: Path, sweep_name: str, run_name: str) -> Optional[dict]:
    path = run_record_path(bundle, sweep_name, run_name)
    return read_json_gz(path) if path.is_file() else None


# ----- is it the same run? --------------------------------------------------------------------------------------
def config_differences(stored: Mapping[str, Any], now: Mapping[str, Any], limit: int = 8) -> List[str]:
    """`key: stored -> now` for each key whose value differs (a key on one side only reads `<absent>`)."""
    absent = "<absent>"
    keys = [key for key in sorted(set(stored) | set(now)) if stored.get(key, absent) != now.get(key, absent)]
    lines = [f"{key}: {stored.get(key, absent)!r} (bundle) -> {now.get(key, absent)!r} (now)" for key in keys[:limit]]
    return lines + ([f"... and {len(keys) - limit} more keys"] if len(keys) > limit else [])


def record_problems(record: Mapping[str, Any], digest: str, config: Mapping[str, Any],
                    backbone_sha256: Optional[str], backbone_numerics: Optional[Mapping[str, Any]] = None) -> List[str]:
    """Why a run's stored record does not belong to the run as configured now ([] when it does): another config
    (the differing keys named) or another backbone (its checksum differs: the study was not continued from the
    same backbone). A backbone retrained from the same config differs when it was trained on another device, CPU
    (instruction set or generation), thread count or torch version; where both sides recorded these, the
    difference is named."""
    problems = []
    if record.get("config_digest") != digest:
        differences = config_differences(record.get("config") or {}, config)
        problems.append("its config differs from the bundle's record: "
                        + ("; ".join(differences) if differences else "same keys, another digest"))
    stored = record.get("backbone") or {}
    if stored.get("sha256") != backbone_sha256:
        problems.append(f"its backbone {stored.get('path')} has sha256 {backbone_sha256} here, and "
                        f"{stored.get('sha256')} in the bundle: not the backbone the bundled runs started from"
                        + numerics_difference(stored.get("numerics"), backbone_numerics))
    return problems


def numerics_difference(stored: Optional[Mapping[str, Any]], now: Optional[Mapping[str, Any]]) -> str:
    """How the two backbones' training differed numerically, as a clause for `record_problems`."""
    if not stored or not now:
        return (" (a backbone trained again gives the same bits only on the same device, CPU generation, "
                "thread count and torch version; the bundle's backbones carry no record of those)")
    differences = config_differences(stored, now)
    if not differences:
        return " (trained with the same recorded numerics: its config, data or other libraries differ)"
    return " (trained differently: " + "; ".join(differences) + ")"


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
    weights = pretrained_weights(backbone["path"])
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

"""What was scored: the training step and a content hash of the weights, recorded with every result.

A run keeps training and exporting into the same `export/` folder, and its evaluations go to the same `eval/`
folder, so a model name and an export path do not say which weights produced a number. `weights_provenance`
reads, before any model is built:

- an export (`--run RUN`, or `--pretrained` naming an export folder or a file in one): the `global_step` its
  metadata records and the sha256 of the weights file it names (`open_clip.pt`; `aligner.pt` for a TFLocal /
  TFGlobal export, whose frozen backbone the aligner's metadata already pins by a hash of its parameters);
- a local checkpoint file: its sha256;
- an open_clip pretrained tag (or none: random init): the tag alone.

`Provenance.check_unchanged()` after the model is built refuses a weights file that was replaced meanwhile (a
new export renames a new file into place), so the hash recorded is the hash of the weights that were loaded.
`python -m evaluation.evaluate --run RUN` on a run that has no export yet stops here with one line.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from core.config import resume_command
from modeling.export import METADATA_FILE, WEIGHTS_FILE
from evaluation.aligner import ALIGNER_METADATA

HASH_CHUNK = 1 << 20
SHORT_HASH = 12  # characters of the sha256 shown in tables (the full hash is in aggregates.json and the CSV)


class ProvenanceError(ValueError):
    """The weights to score cannot be identified (no export yet, a weights file missing); one-line message."""


@dataclass
class Provenance:
    """`record` goes into every result's metadata; `stamps` are the files read, as found before the build."""

    record: Dict[str, object]
    stamps: Dict[Path, Tuple[int, int, int]] = field(default_factory=dict)

    def check_unchanged(self) -> None:
        for path, stamp in self.stamps.items():
            if _stamp(path) != stamp:
                raise ProvenanceError(f"{path} was replaced while the model was being loaded (a new export?); "
                                      f"evaluate again once it is written")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(path: Path) -> Tuple[int, int, int]:
    """Identity and content stamp: an atomic replacement changes the inode, an edit in place the mtime."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return (-1, -1, -1)
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


def run_export_dir(run: Path) -> Path:
    """`<run>/export`, or a one-line error when the run folder or its export is not there."""
    run = Path(run)
    if not run.is_dir():
        raise ProvenanceError(f"no run folder {run}: --run takes the folder fit created (runs/<experiment>)")
    export_dir = run / "export"
    if not (export_dir / METADATA_FILE).is_file() and not (export_dir / ALIGNER_METADATA).is_file():
        command = resume_command(run)
        resume = (f"`{command}` resumes and finishes it" if command is not None
                  else "run its fit command again, from the folder it ran in, to resume and finish it")
        raise ProvenanceError(f"run {run} has no export yet (no {export_dir / METADATA_FILE}): fit writes the "
                              f"export when training ends; {resume}, or evaluate another run")
    return export_dir


def export_provenance(export_dir: Path) -> Provenance:
    """The export's training step and the sha256 of its weights (the aligner's for an aligner export)."""
    export_dir = Path(export_dir)
    metadata_path = export_dir / ALIGNER_METADATA
    if not metadata_path.is_file():
        metadata_path = export_dir / METADATA_FILE
    metadata_stamp = _stamp(metadata_path)
    metadata = json.loads(metadata_path.read_text())
    weights = export_dir / metadata.get("weights", WEIGHTS_FILE)
    if not weights.is_file():
        raise ProvenanceError(f"{metadata_path} names the weights file {weights.name}, which is not in "
                              f"{export_dir}: the export is incomplete; export the run again")
    stamps = {weights: _stamp(weights), metadata_path: metadata_stamp}  # the weights named first when both changed
    record = {"global_step": metadata.get("global_step"), "weights_file": str(weights),
              "weights_sha256": file_sha256(weights)}
    return Provenance(record, stamps)


HF_WEIGHTS_SUFFIXES = (".safetensors", ".bin")


def pretrained_provenance(pretrained: Optional[str]) -> Provenance:
    """A tag (or random init) is recorded as given; a local file or export folder gets its hash (and step); a
    Hugging Face folder (`hf:DIR`) the hash of its weights files together."""
    if pretrained and pretrained.startswith("hf:"):
        return hf_folder_provenance(Path(pretrained[3:]))
    path = Path(pretrained) if pretrained else None
    if path is not None and path.is_dir():
        return export_provenance(path)
    if path is not None and path.is_file():
        if (path.parent / METADATA_FILE).is_file() and _names_weights(path.parent / METADATA_FILE, path.name):
            return export_provenance(path.parent)
        return Provenance({"weights_file": str(path), "weights_sha256": file_sha256(path)}, {path: _stamp(path)})
    return Provenance({"pretrained": pretrained})


def hf_folder_provenance(folder: Path) -> Provenance:
    """A `CLIPModel` folder: the sha256 over its weights files' own digests, in name order (one or several shards)."""
    files = sorted(path for path in folder.glob("*") if path.suffix in HF_WEIGHTS_SUFFIXES) if folder.is_dir() else []
    if not files:
        raise ProvenanceError(f"hf:{folder}: no Hugging Face weights (*.safetensors or *.bin) in that folder")
    digest = hashlib.sha256("".join(f"{path.name}:{file_sha256(path)}\n" for path in files).encode())
    return Provenance({"weights_folder": str(folder), "weights_sha256": digest.hexdigest()},
                      {path: _stamp(path) for path in files})


def _names_weights(metadata_path: Path, name: str) -> bool:
    return json.loads(metadata_path.read_text()).get("weights", WEIGHTS_FILE) == name


def weights_label(metadata: Mapping[str, object]) -> str:
    """Short form for tables: `step 1200, sha256 3fa9c0d1e2b4`, the tag, or `random init`."""
    parts = []
    if metadata.get("global_step") is not None:
        parts.append(f"step {metadata['global_step']}")
    if metadata.get("weights_sha256"):
        parts.append(f"sha256 {str(metadata['weights_sha256'])[:SHORT_HASH]}")
    if parts:
        return ", ".join(parts)
    if "pretrained" not in metadata:
        return "not recorded"
    return str(metadata["pretrained"]) if metadata["pretrained"] else "random init"


def weights_source(metadata: Mapping[str, object]) -> str:
    """What a researcher names the weights by (the run label): model and export, checkpoint or tag. For a run
    that is its export folder, as results recorded before hashes also name it."""
    if metadata.get("aligner") or metadata.get("pretrained"):
        source = metadata.get("aligner") or metadata.get("pretrained")
    else:
        source = "random init" if "pretrained" in metadata else "unrecorded weights"
    return f"{metadata.get('model', '?')} from {source}"


def mixed_weights(scored_by: Mapping[str, Mapping[str, object]]) -> Dict[str, Dict[str, List[str]]]:
    """Each weights source (run label) whose benchmarks in one results folder were scored from more than one
    set of weights: source -> {weights label -> benchmarks}. Weights compare by their full hash when recorded
    (a record without one, from before hashes were recorded, counts as its own weights)."""
    groups: Dict[str, Dict[str, Tuple[str, List[str]]]] = {}
    for name, meta in scored_by.items():
        key = str(meta.get("weights_sha256") or weights_label(meta))
        groups.setdefault(weights_source(meta), {}).setdefault(key, (weights_label(meta), []))[1].append(name)
    return {source: dict(weights.values()) for source, weights in groups.items() if len(weights) > 1}

"""The file contract between the study's results bundle and the sweep that skips the runs it holds.

The study writes the bundle (`study/records.py`, `study/bundle.py`); `slurm.sweep`, a layer below the study, reads
one part of it to skip a run whose results are kept, and must not import the study. This is that part, with the
standard library only:

    <bundle>/<sweep name>/runs/<run name>.json.gz    one run record: gzip-compressed JSON, one object

and the fields of a record the sweep checks against the run as configured now:

    config_digest        `lightning_modules.resume.config_digest` of the run's resolved config
    config               the keys that digest covers, with their values (to name what differs)
    backbone             {"path", "sha256", "numerics"?} of the weights the run started from, or null:
      path               the run's `model.pretrained`
      sha256             sha256 of the weights file it names (`backbone_weights`)
      numerics           what the export beside those weights records of how they were trained (`export_numerics`)

and the world the bundle was made on, in its study's `<bundle>/<sweep name>/sweep.json`:

    world                {"root", "files": {annotation file: sha256}} of the world the runs were scored on

`world_checksum` (one sha256 over those files' checksums) names a world in one line; a sweep and `study.restore`
refuse to continue a bundle from a world with another checksum (`world_problem`): its records would be skipped
as results of runs they are not.

`backbone_weights`, `file_sha256` and `export_numerics` define how a backbone is identified, for the writer and
the reader alike. The export's own names (`model.json`, its "weights" and "numerics", the default `open_clip.pt`)
are `modeling.export`'s, read here without importing torch.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence

RUNS_DIR = "runs"
RECORD_SUFFIX = ".json.gz"
SWEEP_DOCUMENT = "sweep.json"
WORLD = "world"
CONFIG_DIGEST = "config_digest"
CONFIG = "config"
BACKBONE = "backbone"
BACKBONE_PATH = "path"
BACKBONE_SHA256 = "sha256"
BACKBONE_NUMERICS = "numerics"
EXPORT_METADATA = "model.json"  # modeling.export.METADATA_FILE
DEFAULT_WEIGHTS = "open_clip.pt"  # modeling.export.WEIGHTS_FILE


def run_record_path(bundle: Path, sweep_name: str, run_name: str) -> Path:
    return Path(bundle) / sweep_name / RUNS_DIR / f"{run_name}{RECORD_SUFFIX}"


def read_json_gz(path: Path) -> Any:
    return json.loads(gzip.decompress(Path(path).read_bytes()).decode("utf-8"))


def read_run_record(bundle: Path, sweep_name: str, run_name: str) -> Optional[dict]:
    """The bundle's record of a run, or None when it holds none."""
    path = run_record_path(bundle, sweep_name, run_name)
    return read_json_gz(path) if path.is_file() else None


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


def backbone_weights(pretrained: Optional[str]) -> Optional[Path]:
    """The local weights file a run starts from (`model.pretrained`): an export folder's weights, or the file
    named; None for no weights or a hub tag such as `openai` (a name without a folder)."""
    if not pretrained:
        return None
    path = Path(pretrained)
    if path.is_dir():
        return export_weights(path)
    return path if path.suffix or len(path.parts) > 1 else None


def export_numerics(weights: Optional[Path]) -> Optional[dict]:
    """The `numerics` an export's model.json records beside `weights` (device, threads, processes, precision,
    torch: lightning_modules/callbacks.py), or None (no export folder, or one written before they were kept)."""
    metadata = Path(weights).parent / EXPORT_METADATA if weights is not None else None
    if metadata is None or not metadata.is_file():
        return None
    return json.loads(metadata.read_text()).get("numerics")


def config_differences(stored: Mapping[str, Any], now: Mapping[str, Any], limit: int = 8) -> List[str]:
    """`key: stored -> now` for each key of a record's `config` whose value differs from the run's now (a key on
    one side only reads `<absent>`)."""
    absent = "<absent>"
    keys = [key for key in sorted(set(stored) | set(now)) if stored.get(key, absent) != now.get(key, absent)]
    lines = [f"{key}: {stored.get(key, absent)!r} (bundle) -> {now.get(key, absent)!r} (now)" for key in keys[:limit]]
    return lines + ([f"... and {len(keys) - limit} more keys"] if len(keys) > limit else [])


# ----- the world a bundle was made on -----------------------------------------------------------------------------
def world_checksum(files: Mapping[str, str]) -> str:
    """One checksum for a world: sha256 of its annotation files' checksums as canonical JSON (sorted keys, no
    spaces). Two worlds with one checksum hold the same annotation files."""
    return hashlib.sha256(json.dumps(dict(files), sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def world_files(root: Path, names: Sequence[str]) -> dict:
    """{name: sha256} of the files `names` (paths relative to the world's root) that exist under `root`."""
    return {name: file_sha256(Path(root) / name) for name in names if (Path(root) / name).is_file()}


def bundle_world(bundle: Path) -> Optional[dict]:
    """The `world` a bundle's study records (its one sweep.json that has one), or None (no bundle, or a bundle
    written before worlds were recorded)."""
    for path in sorted(Path(bundle).glob(f"*/{SWEEP_DOCUMENT}")):
        world = json.loads(path.read_text()).get(WORLD)
        if world and world.get("files"):
            return world
    return None


def world_problem(bundle: Path, root: Path) -> Optional[str]:
    """A one-line refusal when the world at `root` is not the one `bundle` was made on (None when it is, or when the
    bundle records no world), naming both world checksums: the same files are checksummed here as there."""
    world = bundle_world(bundle)
    if world is None:
        return None
    stored = world_checksum(world["files"])
    here = world_checksum(world_files(root, sorted(world["files"])))
    if here == stored:
        return None
    state = "is not there" if not Path(root).is_dir() else f"has world checksum {here}"
    return (f"the world {root} {state}, and the bundle {bundle} was made on the world {world.get('root')} with "
            f"checksum {stored}: another world. Generate the bundle's world (its seed), or study this world in a "
            "bundle of its own (make study STUDY_SEED=N writes results/study-world-N)")

"""The exported model: `export/open_clip.pt` (CLIP weights only), `export/hf/` and `export/model.json`.

`open_clip.create_model_and_transforms(model_json["model"], pretrained=".../open_clip.pt")` rebuilds the
fine-tuned model unchanged. Tiny models that open_clip does not ship have their config copied to
`export/model_configs/`, so `load_export` can register it first. `export/hf/` holds the same weights as a
Hugging Face `transformers.CLIPModel` folder with its CLIPProcessor files (`modeling.hf_clip`), for the models
HF's CLIP expresses exactly; model.json's "hf" names it when it was written.
"""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import open_clip
import torch
from torch import nn

from modeling.encoders import MODEL_CONFIGS_DIR, BuiltModel, build_model
from core.files import atomic_write_bytes, atomic_write_text
from modeling.hf_clip import UnsupportedModel, open_clip_to_hf

log = logging.getLogger(__name__)

WEIGHTS_FILE = "open_clip.pt"
METADATA_FILE = "model.json"
HF_DIR = "hf"


def export_model(model: nn.Module, model_name: str, export_dir: Path, extra: Optional[dict] = None,
                 model_config: Optional[dict] = None) -> Path:
    """Write the CLIP state dict (fp32), its Hugging Face folder and its metadata atomically; return the weights
    path.

    `model_config` is the open_clip config the model was built with (default: the registered config of
    `model_name`); a stretched text context (`modeling.long_context`) exports its own, under its own
    name, so that plain open_clip builds the model and its tokenizer with the longer context.
    """
    export_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu() if v.is_floating_point() else v.cpu()
             for k, v in model.state_dict().items()}
    weights = export_dir / WEIGHTS_FILE
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(weights, buffer.getvalue())
    config = model_config if model_config is not None else open_clip.get_model_config(model_name)
    _write_model_config(model_name, export_dir, config)
    metadata = {"model": model_name, "weights": WEIGHTS_FILE, **(extra or {})}
    if _write_hf_folder(model, config, export_dir):
        metadata["hf"] = HF_DIR
    atomic_write_text(export_dir / METADATA_FILE, json.dumps(metadata, indent=2, sort_keys=True))
    return weights


def _write_model_config(model_name: str, export_dir: Path, config: Optional[dict] = None) -> None:
    config_dir = export_dir / MODEL_CONFIGS_DIR
    config_dir.mkdir(exist_ok=True)
    config = config if config is not None else open_clip.get_model_config(model_name)
    atomic_write_text(config_dir / f"{model_name}.json", json.dumps(config, indent=2, sort_keys=True))


def _write_hf_folder(model: nn.Module, model_config: dict, export_dir: Path) -> bool:
    """Write `export_dir/hf` (safetensors, fp32) into a temporary folder beside it, then rename it over the old
    one; False, with a warning and no folder, for a model HF's CLIPModel cannot express."""
    target = export_dir / HF_DIR
    staging = export_dir / f".{HF_DIR}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        open_clip_to_hf(model, model_config, staging, dtype=torch.float32)
    except UnsupportedModel as error:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)  # an older export's folder would not hold these weights
        log.warning("export without a Hugging Face folder: %s", error)
        return False
    # A folder cannot be renamed over a non-empty one: move the old one aside first, then drop it.
    retired = export_dir / f".{HF_DIR}.{os.getpid()}.old"
    if target.exists():
        os.replace(target, retired)
    os.replace(staging, target)
    shutil.rmtree(retired, ignore_errors=True)
    return True


def read_export_metadata(export_dir: Path) -> dict:
    path = Path(export_dir) / METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METADATA_FILE} in {export_dir}: not a model export (fit writes "
                                f"runs/<experiment>/export/ when training ends)")
    return json.loads(path.read_text())


def load_export(export_dir: Path) -> BuiltModel:
    """Rebuild an exported model (weights, transforms, tokenizer) with plain open_clip."""
    export_dir = Path(export_dir)
    metadata = read_export_metadata(export_dir)
    return build_model(metadata["model"], str(export_dir / metadata["weights"]),
                       str(export_dir / MODEL_CONFIGS_DIR))

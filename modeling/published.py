"""Published checkpoints as open_clip models: zoo entries (`core/zoo.py`) and Hugging Face `CLIPModel` folders.

`modeling.encoders.build_model` hands these over: `name="zoo:NAME"` with `pretrained=FILE`, `pretrained="zoo:NAME:FILE"`
(a training config's form) and `pretrained="hf:DIR"`. Each file is read by its format (`modeling/checkpoints.py`) and
loaded strictly into its architecture, built with the entry's text context (CLoVe's 64 tokens get their own model
name, so an export never reuses the 77-token model's).
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Tuple

import open_clip
from open_clip.transform import PreprocessCfg, image_transform_v2
from torch import nn

from modeling import checkpoints, hf_clip
from modeling.encoders import QUICKGELU_SUFFIX, ZOO_PREFIX, BuiltModel, register_model_configs
from core.zoo import ZooEntry, zoo_entry


def zoo_spec(name: str, pretrained: Optional[str]) -> Tuple[str, str]:
    """(zoo entry name, weights file) of `name="zoo:NAME", pretrained=FILE` or `pretrained="zoo:NAME:FILE"`."""
    if name.startswith(ZOO_PREFIX):
        if not pretrained or pretrained.startswith(ZOO_PREFIX):
            raise ValueError(f"{name}: give the downloaded weights file as pretrained (--pretrained FILE)")
        return name[len(ZOO_PREFIX):], pretrained
    entry_name, colon, weights = pretrained[len(ZOO_PREFIX):].partition(":")
    if not colon or not weights:
        raise ValueError(f"model.pretrained={pretrained!r}: expected zoo:NAME:FILE (the zoo entry and its file)")
    return entry_name, weights


def context_model_name(architecture: str, context_length: int, default: int) -> str:
    """The name of `architecture` with another text context (`ViT-B-32-quickgelu` with 64 tokens ->
    `ViT-B-32-ctx64-quickgelu`), so that an export never reuses the name of the 77-token model."""
    if context_length == default:
        return architecture
    if architecture.endswith(QUICKGELU_SUFFIX):
        return f"{architecture[: -len(QUICKGELU_SUFFIX)]}-ctx{context_length}{QUICKGELU_SUFFIX}"
    return f"{architecture}-ctx{context_length}"


def build_from_zoo(name: str, pretrained: Optional[str], config_dir: Optional[str]) -> BuiltModel:
    entry_name, weights = zoo_spec(name, pretrained)
    entry = zoo_entry(entry_name)
    expected = (entry.architecture, context_model_name(entry.architecture, entry.context_length, 77))
    if not name.startswith(ZOO_PREFIX) and name not in expected:
        raise ValueError(f"zoo:{entry.name} loads into {expected[-1]}, but the model name is {name!r}: set "
                         f"model.name={expected[-1]}")
    return load_zoo_model(entry, weights, config_dir=config_dir)


def load_zoo_model(entry: ZooEntry, weights: str, base_state: Optional[dict] = None,
                   config_dir: Optional[str] = None) -> BuiltModel:
    """A zoo checkpoint (`core.zoo.ZooEntry`) read by its format into its architecture, strictly.

    `base_state` is the state dict a WiSE-FT patch (CLoVe) or a LoRA file holding the factors alone is applied to
    (and, for a LoRA file that carries its base, the base it must equal); by default the entry's base, an open_clip
    tag that open_clip downloads (or reads from the hub's cache), fetched only when needed."""
    if not Path(weights).exists():
        raise FileNotFoundError(f"zoo:{entry.name}: no weights file {weights}; download it from {entry.weights}")
    register_model_configs(config_dir)
    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        entry.architecture, pretrained=None, force_context_length=entry.context_length)
    state = _read_zoo_weights(entry, weights, model, base_state)
    if entry.wise_ft is not None:
        base = base_state if base_state is not None else _base_state(entry)
        state = checkpoints.wise_ft(checkpoints.truncate_context(base, entry.context_length), state, entry.wise_ft)
    checkpoints.load_strict(model, state)
    default_context = open_clip.get_model_config(entry.architecture)["text_cfg"].get("context_length", 77)
    return BuiltModel(model, context_model_name(entry.architecture, entry.context_length, default_context),
                      preprocess_train, preprocess_val,
                      open_clip.get_tokenizer(entry.architecture, context_length=entry.context_length),
                      copy_config(open_clip.get_model_config(entry.architecture), entry.context_length))


def _read_zoo_weights(entry: ZooEntry, weights: str, model: nn.Module, base_state: Optional[dict]) -> dict:
    """The entry's file read by its format; a LoRA file of factors alone is applied to the entry's base."""
    options = {"trust_pickle": entry.trust_pickle}
    if entry.format != "lora":
        return checkpoints.read_checkpoint(weights, entry.format, model, **options)
    options["lora_scale"] = entry.lora_scale
    try:
        return checkpoints.read_checkpoint(weights, "lora", model, base=base_state, **options)
    except checkpoints.BaseRequired:
        return checkpoints.read_checkpoint(weights, "lora", model, base=_base_state(entry), **options)


def _base_state(entry: ZooEntry, base: Optional[str] = None) -> dict:
    """The state dict (its own text context) of the model a zoo entry was fine-tuned from: `base` (an open_clip
    tag, an export folder or an open_clip checkpoint file), by default the entry's base tag (downloaded by open_clip,
    or read from the cache the hub fills)."""
    source = base or entry.base
    path = Path(source)
    if not path.exists():  # a tag
        model = open_clip.create_model(entry.architecture, pretrained=source)
        return {key: value.detach().float() for key, value in model.state_dict().items()}
    model = open_clip.create_model(entry.architecture, pretrained=None)
    weights = path / "open_clip.pt" if path.is_dir() else path
    return checkpoints.read_checkpoint(str(weights), "open_clip", model)


def load_zoo_base(entry: ZooEntry, base: Optional[str] = None) -> BuiltModel:
    """The model a zoo entry was fine-tuned from, built as the entry's model is (same name, config and text
    context, the base's positions cut to it): the start of the entry's weight interpolation."""
    model, preprocess_train, preprocess_val = open_clip.create_model_and_transforms(
        entry.architecture, pretrained=None, force_context_length=entry.context_length)
    checkpoints.load_strict(model, checkpoints.truncate_context(_base_state(entry, base), entry.context_length))
    default_context = open_clip.get_model_config(entry.architecture)["text_cfg"].get("context_length", 77)
    return BuiltModel(model, context_model_name(entry.architecture, entry.context_length, default_context),
                      preprocess_train, preprocess_val,
                      open_clip.get_tokenizer(entry.architecture, context_length=entry.context_length),
                      copy_config(open_clip.get_model_config(entry.architecture), entry.context_length))


def copy_config(config: dict, context_length: int) -> dict:
    """An open_clip model config with its text context set to `context_length`."""
    config = json.loads(json.dumps(config))
    config["text_cfg"]["context_length"] = context_length
    return config


def build_from_hf(folder: str, name: Optional[str] = None, config_dir: Optional[str] = None) -> BuiltModel:
    """A Hugging Face `CLIPModel` folder as an open_clip model. Given `name` (an open_clip model), the folder's
    architecture must be that model's; without one, the model is named after the folder's shape."""
    register_model_configs(config_dir)
    config, state = hf_clip.hf_to_open_clip(folder)
    if name and name != "hf":
        known = open_clip.get_model_config(name)
        if known is None:
            raise ValueError(f"unknown open_clip model {name!r} for hf:{folder}")
        different = hf_clip.config_differences(known, config)
        if different:
            raise ValueError(f"hf:{folder} is not a {name}: {'; '.join(different)}")
        config = known
    else:
        name = hf_clip.derived_model_name(config)
    model = open_clip.CLIP(**config)
    checkpoints.load_strict(model, state)
    preprocess = PreprocessCfg(**(hf_clip.hf_preprocess_cfg(folder) or {"size": config["vision_cfg"]["image_size"]}))
    model.visual.preprocess_cfg = asdict(preprocess)
    preprocess_train = image_transform_v2(preprocess, is_train=True)
    preprocess_val = image_transform_v2(preprocess, is_train=False)
    tokenizer = functools.partial(open_clip.tokenize, context_length=config["text_cfg"].get("context_length", 77))
    return BuiltModel(model, name, preprocess_train, preprocess_val, tokenizer, config)

"""What GroundingDINO needs on disk, checked without importing torch or building anything.

A job that grounds 118k images must not find out after model construction (tens of seconds, or a hub
download that hangs offline) that its checkpoint path is wrong, nor run to the end with random detector weights
and write a cache of meaningless boxes. `groundingdino_input_problems` lists every problem at once; the
grounder calls it in its constructor and the preprocessing CLI calls it with the config keys' names before
anything is imported or built.
"""
from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path
from typing import Dict, List, Mapping, Optional

# How each input is named in messages: the grounder's constructor arguments (a CLI passes its config keys).
ARGUMENT_NAMES = {"config_file": "config_file", "checkpoint": "checkpoint", "text_encoder": "text_encoder",
                  "allow_random_weights": "allow_random_weights=True"}
_TRUE = ("1", "on", "yes", "true")


class GrounderInputError(ValueError):
    """A grounder asked for with inputs it cannot use (a missing file, no checkpoint, a checkpoint that does
    not fit the model); the message lists every problem."""


def default_groundingdino_config() -> str:
    """The SwinT OGC config file shipped inside the groundingdino package (found without importing it)."""
    spec = find_spec("groundingdino")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("groundingdino-py is not installed")
    package_dir = next(iter(spec.submodule_search_locations))
    return str(Path(package_dir) / "config" / "GroundingDINO_SwinT_OGC.py")


def hub_is_offline() -> bool:
    """Whether Hugging Face downloads are switched off (as the hub client reads its environment)."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def in_hub_cache(name: str) -> bool:
    """Whether the hub model `name` has its config in the local hub cache (no network access)."""
    from huggingface_hub import try_to_load_from_cache  # a light import; only hub names need it

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def looks_like_path(text: str) -> bool:
    """A hub id is "name" or "org/name"; anything else (absolute, ./, ~, deeper) is meant as a local path."""
    return os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") > 1 or "\\" in text


def text_encoder_problem(text_encoder: Optional[str]) -> Optional[str]:
    """Why the BERT text encoder (hub name or saved directory) cannot be loaded here, or None."""
    if not text_encoder:
        return "is not set: a hub name (bert-base-uncased) or a directory saved with save_pretrained"
    if os.path.isdir(text_encoder):
        if not os.path.isfile(os.path.join(text_encoder, "config.json")):
            return f"the directory {text_encoder} has no config.json (save the BERT with save_pretrained)"
        if not any(os.path.isfile(os.path.join(text_encoder, f)) for f in ("vocab.txt", "tokenizer.json")):
            return f"the directory {text_encoder} has no tokenizer (vocab.txt or tokenizer.json)"
        return None
    if looks_like_path(text_encoder):
        return f"no such directory: {text_encoder}"
    if hub_is_offline() and not in_hub_cache(text_encoder):
        return (f"{text_encoder!r} is a hub name, the hub is offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE) and "
                f"it is not in the local hub cache: give a local directory instead")
    return None


def config_file_problem(config_file: Optional[str]) -> Optional[str]:
    if config_file is None:
        try:
            default_groundingdino_config()
        except ImportError as err:
            return f"is not set and the default cannot be found: {err}"
        return None
    return None if os.path.isfile(config_file) else f"no such file: {config_file}"


def checkpoint_problem(checkpoint: Optional[str], allow_random_weights: bool, allow_name: str) -> Optional[str]:
    if checkpoint is None:
        if allow_random_weights:
            return None
        return (f"is not set: GroundingDINO would ground with random weights and write meaningless boxes. Give "
                f"the path of a checkpoint (groundingdino_swint_ogc.pth), or set {allow_name} in a test")
    return None if os.path.isfile(checkpoint) else f"no such file: {checkpoint}"


def groundingdino_input_problems(config_file: Optional[str], checkpoint: Optional[str], text_encoder: Optional[str],
                                 allow_random_weights: bool = False,
                                 names: Mapping[str, str] = ARGUMENT_NAMES) -> List[str]:
    """Every reason GroundingDINO cannot be built as asked, each naming its input ("name=value: why").

    Args:
        config_file: GroundingDINO config file, None for the one shipped with groundingdino-py.
        checkpoint: detector checkpoint; None is refused unless `allow_random_weights` (tests only).
        text_encoder: hub name or local directory of the BERT text encoder.
        allow_random_weights: accept `checkpoint=None` (random, seeded weights).
        names: how to name each input in the messages (keys of `ARGUMENT_NAMES`).
    """
    values: Dict[str, Optional[str]] = {"config_file": config_file, "checkpoint": checkpoint,
                                        "text_encoder": text_encoder}
    problems = {"config_file": config_file_problem(config_file),
                "checkpoint": checkpoint_problem(checkpoint, allow_random_weights, names["allow_random_weights"]),
                "text_encoder": text_encoder_problem(text_encoder)}
    return [f"{names[key]}={values[key]}: {problem}" for key, problem in problems.items() if problem]

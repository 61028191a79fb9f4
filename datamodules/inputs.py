"""Checks of a job's input files and options, run before any model is built or anything is written.

Each CLI (fit, preprocess, features) calls its check first, so a wrong path fails in a second with a message
that names the config key to fix, instead of after minutes of model building, or never (a detector without
weights that writes a cache of meaningless boxes). Every problem is reported at once. Plain filesystem tests:
nothing here imports torch.
"""
from __future__ import annotations

from pathlib import Path
from typing import List

from parsers.grounding_inputs import groundingdino_input_problems

SPLITS = ("train", "val")
# The `preprocess` keys that name GroundingDINO's inputs (see core/config.py).
GROUNDINGDINO_KEYS = {"config_file": "preprocess.groundingdino_config",
                      "checkpoint": "preprocess.groundingdino_checkpoint",
                      "text_encoder": "preprocess.text_encoder",
                      "allow_random_weights": "preprocess.allow_random_detector=true"}


class InputError(ValueError):
    """Inputs that are missing or unusable; the message lists every problem with its config key."""


def raise_if_any(problems: List[str], job: str) -> None:
    """An `InputError` naming every problem: one line for one problem, a list for several."""
    if len(problems) == 1:
        raise InputError(f"{job} cannot start: {problems[0]}")
    if problems:
        raise InputError(f"{job} cannot start:\n  - " + "\n  - ".join(problems))


def configured_splits(data) -> List[str]:
    """The splits with an annotation file (an empty or null `<split>_annotations` switches a split off)."""
    return [split for split in SPLITS if data[f"{split}_annotations"]]


def data_input_problems(data, need_train: bool = True, need_images: bool = True) -> List[str]:
    """What is missing of the `data` section: the root, each configured split's annotation file and image
    folder, the excluded-ids file.

    Args:
        data: the `data` config section.
        need_train: training needs the train split (preprocessing and feature caching take any split).
        need_images: whether the job reads the image folders.
    """
    root = Path(data.root)
    if not root.is_dir():
        return [f"data.root={data.root}: no such directory"]
    splits = configured_splits(data)
    problems = []
    if need_train and "train" not in splits:
        problems.append("data.train_annotations is not set: training needs a train split")
    if not splits:
        problems.append("no split is configured: set data.train_annotations and/or data.val_annotations")
    for split in splits:
        annotations = data[f"{split}_annotations"]
        if not (root / annotations).is_file():
            problems.append(f"data.{split}_annotations={annotations}: no file {root / annotations}")
        images = data[f"{split}_images"]
        if need_images and not (root / images).is_dir():
            problems.append(f"data.{split}_images={images}: no directory {root / images}")
    if data.exclude_image_ids and not Path(data.exclude_image_ids).is_file():
        problems.append(f"data.exclude_image_ids={data.exclude_image_ids}: no such file")
    return problems


def check_data_inputs(cfg, need_images: bool = True) -> None:
    """fit's check: the data root, the train (and, when configured, val) annotation file and image folder.

    Args:
        cfg: the experiment config.
        need_images: False for a method that trains on cached features only (it reads no image).

    Raises:
        InputError: listing every missing input with its config key.
    """
    raise_if_any(data_input_problems(cfg.data, need_train=True, need_images=need_images), "training")


def grounder_input_problems(cfg) -> List[str]:
    """What the configured grounder lacks: GroundingDINO's files and weights, or the ground-truth files."""
    prep, root = cfg.preprocess, Path(cfg.data.root)
    if prep.grounder == "groundingdino":
        return groundingdino_input_problems(prep.groundingdino_config, prep.groundingdino_checkpoint,
                                            prep.text_encoder, prep.allow_random_detector, GROUNDINGDINO_KEYS)
    if prep.grounder == "annotations" and prep.instances and not (root / prep.instances).is_file():
        return [f"preprocess.instances={prep.instances}: no file {root / prep.instances}"]
    return []


def check_preprocess_inputs(cfg) -> None:
    """`python -m datamodules.preprocess`'s check: data, ground-truth scene graphs, grounder inputs, shards.

    Raises:
        InputError: listing every problem with its config key.
    """
    problems = data_input_problems(cfg.data, need_train=False)
    root = Path(cfg.data.root)
    for split in configured_splits(cfg.data) if root.is_dir() else []:
        graphs = cfg.preprocess[f"{split}_scene_graphs"]
        if graphs and not (root / graphs).is_file():
            problems.append(f"preprocess.{split}_scene_graphs={graphs}: no file {root / graphs}")
    if cfg.preprocess.shard_size < 1:
        problems.append(f"preprocess.shard_size={cfg.preprocess.shard_size}: must be positive")
    raise_if_any(problems + grounder_input_problems(cfg), "preprocessing")


def check_feature_inputs(cfg) -> None:
    """`python -m datamodules.features`'s check: data (every configured split), the cache folder, shards.

    Raises:
        InputError: listing every problem with its config key.
    """
    problems = data_input_problems(cfg.data, need_train=False)
    if not cfg.data.features_cache:
        problems.append("data.features_cache is not set: the folder the features are written to")
    if cfg.preprocess.shard_size < 1:
        problems.append(f"preprocess.shard_size={cfg.preprocess.shard_size}: must be positive")
    raise_if_any(problems, "feature caching")

